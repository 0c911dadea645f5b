// The job's rank grid: Megatron-LM's order (tensor innermost, then data, then pipeline) and
// the groups each rank belongs to.
#include "proto/plan/topology.h"

#include <map>
#include <set>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vp::planner {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Topology, TwoReplicasOfTwoStagesNumberReplicasInsideStages) {
  auto t = Topology::Create(/*pipeline=*/2, /*data=*/2);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->world(), 4);
  EXPECT_EQ(t->CoordOf(0), (RankCoord{.stage = 0, .replica = 0}));
  EXPECT_EQ(t->CoordOf(1), (RankCoord{.stage = 0, .replica = 1}));
  EXPECT_EQ(t->CoordOf(2), (RankCoord{.stage = 1, .replica = 0}));
  EXPECT_EQ(t->CoordOf(3), (RankCoord{.stage = 1, .replica = 1}));
  EXPECT_THAT(t->PipelineGroup(1), ElementsAre(1, 3));
  EXPECT_THAT(t->DataGroup(3), ElementsAre(2, 3));
  EXPECT_THAT(t->TensorGroup(3), ElementsAre(3));
  EXPECT_EQ(t->Describe(3), "replica 1 stage 1");
}

TEST(Topology, ThreeAxesRoundTripAndPartitionTheRanks) {
  auto t = Topology::Create(/*pipeline=*/3, /*data=*/4, /*tensor=*/2);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->world(), 24);
  // Tensor innermost: ranks 0 and 1 are one tensor group; data next: rank 2 is replica 1.
  EXPECT_THAT(t->TensorGroup(0), ElementsAre(0, 1));
  EXPECT_EQ(t->CoordOf(2), (RankCoord{.stage = 0, .replica = 1, .tensor = 0}));
  EXPECT_EQ(t->CoordOf(8), (RankCoord{.stage = 1, .replica = 0, .tensor = 0}));
  std::set<std::vector<int>> pipelines, datas, tensors;
  for (int r = 0; r < t->world(); ++r) {
    EXPECT_EQ(t->RankOf(t->CoordOf(r)), r);
    const std::vector<int> pg = t->PipelineGroup(r), dg = t->DataGroup(r), tg = t->TensorGroup(r);
    ASSERT_EQ(pg.size(), 3u);
    ASSERT_EQ(dg.size(), 4u);
    ASSERT_EQ(tg.size(), 2u);
    // A rank's index in each group is its coordinate on that axis.
    EXPECT_EQ(pg[t->CoordOf(r).stage], r);
    EXPECT_EQ(dg[t->CoordOf(r).replica], r);
    EXPECT_EQ(tg[t->CoordOf(r).tensor], r);
    pipelines.insert(pg);
    datas.insert(dg);
    tensors.insert(tg);
  }
  // Every axis's groups partition the world: d·t pipelines, p·t data groups, p·d tensor groups.
  EXPECT_EQ(pipelines.size(), 8u);
  EXPECT_EQ(datas.size(), 6u);
  EXPECT_EQ(tensors.size(), 12u);
  EXPECT_EQ(t->Describe(23), "replica 3 stage 2 tensor 1");
}

// A split of the world communicator by (group id, axis coordinate) must form exactly the
// topology's groups, each member at its index: collect the members of every id, ordered by key.
TEST(Topology, GroupIdsSplitTheWorldIntoTheGroups) {
  auto t = Topology::Create(/*pipeline=*/3, /*data=*/4, /*tensor=*/2);
  ASSERT_TRUE(t.ok()) << t.status();
  using Split = std::map<int, std::map<int, int>>;  // color → key → rank
  Split pipe, data, tensor;
  for (int r = 0; r < t->world(); ++r) {
    const RankCoord c = t->CoordOf(r);
    for (auto [split, id, key] : {std::tuple{&pipe, t->PipelineGroupId(r), c.stage},
                                  std::tuple{&data, t->DataGroupId(r), c.replica},
                                  std::tuple{&tensor, t->TensorGroupId(r), c.tensor}}) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, t->world());
      ASSERT_EQ((*split)[id].count(key), 0u) << "rank " << r << ": key " << key << " taken";
      (*split)[id][key] = r;
    }
  }
  EXPECT_EQ(pipe.size(), 8u);
  EXPECT_EQ(data.size(), 6u);
  EXPECT_EQ(tensor.size(), 12u);
  for (int r = 0; r < t->world(); ++r) {
    for (auto [split, id, want] : {std::tuple{&pipe, t->PipelineGroupId(r), t->PipelineGroup(r)},
                                   std::tuple{&data, t->DataGroupId(r), t->DataGroup(r)},
                                   std::tuple{&tensor, t->TensorGroupId(r), t->TensorGroup(r)}}) {
      std::vector<int> members;
      for (const auto& [key, rank] : split->at(id)) members.push_back(rank);
      EXPECT_EQ(members, want) << "rank " << r;
    }
  }
}

TEST(Topology, RefusesEmptyAxesAndOversizedWorlds) {
  EXPECT_THAT(Topology::Create(0, 1).status().message(), HasSubstr("parallel.pipeline"));
  EXPECT_THAT(Topology::Create(2, 0).status().message(), HasSubstr("parallel.data"));
  EXPECT_THAT(Topology::Create(2, 1, 0).status().message(), HasSubstr("parallel.tensor"));
  const auto big = Topology::Create(64, 64, 1, /*max_world=*/4096);
  EXPECT_TRUE(big.ok());
  EXPECT_THAT(Topology::Create(64, 65, 1, 4096).status().message(),
              HasSubstr("must be <= 4096 ranks (got 4160)"));
}

}  // namespace
}  // namespace vp::planner
