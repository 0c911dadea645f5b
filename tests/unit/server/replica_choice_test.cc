// ChooseReplicas (coordinator/server/elastic.h): the replicas an elastic job runs at keep its
// global batch, never exceed what the user asked for, and wait (saying why) rather than split
// the batch unevenly.
#include <gtest/gtest.h>

#include "coordinator/server/elastic.h"

namespace vp::server {
namespace {

TEST(ChooseReplicas, EnoughFreeWorkersRunsTheRequestedReplicasNeverMore) {
  // D = 2 replicas of a 2-stage pipeline: 4 workers are the full shape, 9 still give 2.
  EXPECT_EQ(ChooseReplicas(2, 4, 2, 4, false, "cpu").data, 2);
  EXPECT_EQ(ChooseReplicas(2, 4, 2, 9, true, "cpu").data, 2);
}

TEST(ChooseReplicas, BeforeTheGraceRunsOutItWaitsSilently) {
  const ReplicaChoice c = ChooseReplicas(2, 4, 2, 3, false, "cpu");
  EXPECT_EQ(c.data, 0);
  EXPECT_EQ(c.wait, "");
}

TEST(ChooseReplicas, ShrinksToTheMostReplicasTheFreeWorkersHold) {
  EXPECT_EQ(ChooseReplicas(2, 4, 2, 3, true, "cpu").data, 1);  // m' = 8
  EXPECT_EQ(ChooseReplicas(4, 3, 2, 7, true, "cpu").data, 3);  // 12 / 3 = 4
  EXPECT_EQ(ChooseReplicas(4, 3, 2, 5, true, "cpu").data, 2);  // 12 / 2 = 6
  EXPECT_EQ(ChooseReplicas(4, 3, 2, 3, true, "cpu").data, 1);
}

TEST(ChooseReplicas, AGlobalBatchThatDoesNotSplitWaitsAndSaysWhy) {
  // d = 3, m = 1: 3 microbatches do not split over 2 replicas; it does not fall to 1 replica
  // while 2 replicas' workers are free.
  const ReplicaChoice c = ChooseReplicas(3, 1, 1, 2, true, "cpu");
  EXPECT_EQ(c.data, 0);
  EXPECT_EQ(c.wait,
            "elastic: cannot keep the global batch at 2 replicas (3 × 1 = 3 microbatches do not "
            "split over 2); waiting for 3 free cpu workers (2 free)");
  // d = 4, m = 1 with 3 replicas' workers free: 4 does not split over 3.
  EXPECT_NE(ChooseReplicas(4, 1, 2, 6, true, "cuda")
                .wait.find("4 × 1 = 4 microbatches do not "
                           "split over 3"),
            std::string::npos);
}

TEST(ChooseReplicas, FewerWorkersThanOneReplicaWaits) {
  const ReplicaChoice c = ChooseReplicas(2, 4, 3, 2, true, "cpu");
  EXPECT_EQ(c.data, 0);
  EXPECT_EQ(c.wait, "elastic: waiting for 3 free cpu workers for one replica (2 free)");
}

TEST(ReplicaShape, NamesTheReplicasAndTheirMicrobatches) {
  EXPECT_EQ(ReplicaShape(1, 8), "1 replica (m 8)");
  EXPECT_EQ(ReplicaShape(2, 4), "2 replicas (m 4)");
}

}  // namespace
}  // namespace vp::server
