// The coordinator's auto choice with costs profiled on this machine (worker/daemon/profile.h):
// a large vocabulary makes the unsharded output layer the bottleneck, so a vocabulary-parallel
// method wins; a tiny one makes the vocabulary collectives pure overhead, so the plain
// (unsharded) output layer wins. The candidate table lists what was weighed.
#include <gtest/gtest.h>

#include "coordinator/server/job_plan.h"
#include "proto/spec/job_spec.h"
#include "worker/daemon/profile.h"

namespace {

namespace v1 = vocabpipe::v1;

v1::JobSpec Spec(int vocab) {
  auto spec = vp::spec::ParseJobSpec(
      absl::StrCat("model: {layers: 2, hidden: 64, heads: 2, vocab_size: ", vocab,
                   ", seq_len: 64}\n"
                   "parallel: {pipeline: 2, microbatch_size: 2, microbatches: 4, "
                   "schedule: 1f1b, vocab: auto}\n"
                   "train: {steps: 1, threads: 1}\n"
                   "data: {path: /unused.bin}\n"),
      "/tmp");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::string Chosen(const vp::server::JobPlan& plan) {
  int chosen = 0;
  for (const auto& c : plan.candidates) chosen += c.chosen();
  EXPECT_EQ(chosen, 1);
  return plan.summary.vocab();
}

TEST(AutoChoiceTest, ProfiledCostsPickVocabParallelOnlyForALargeVocabulary) {
  const v1::JobSpec large = Spec(32000), tiny = Spec(64);
  auto large_costs = vp::daemon::ProfilePasses(large);
  ASSERT_TRUE(large_costs.ok()) << large_costs.status();
  // S and T do the same work (one GEMM over the shard each), so a T several times S means the
  // timed passes were preempted on this shared host (ctest runs tests side by side): profile
  // again, as an operator would, rather than judge the choice on costs that are noise.
  auto tiny_costs = vp::daemon::ProfilePasses(tiny);
  ASSERT_TRUE(tiny_costs.ok()) << tiny_costs.status();
  for (int retry = 0; retry < 3 && tiny_costs->t() > 4 * tiny_costs->s(); ++retry) {
    tiny_costs = vp::daemon::ProfilePasses(tiny);
    ASSERT_TRUE(tiny_costs.ok()) << tiny_costs.status();
  }
  // Every pass was timed, and the output layer's passes scale with the vocabulary.
  EXPECT_GT(large_costs->f(), 0);
  EXPECT_GT(large_costs->b(), 0);
  EXPECT_GT(large_costs->w(), 0);
  EXPECT_GT(large_costs->input_f(), 0);
  EXPECT_GT(large_costs->collective(), 0);
  EXPECT_GT(large_costs->comm(), 0);
  EXPECT_GT(large_costs->t(), 10 * tiny_costs->t());

  auto large_plan = vp::server::PlanForJob(large, &*large_costs, 1e11);
  ASSERT_TRUE(large_plan.ok()) << large_plan.status();
  auto tiny_plan = vp::server::PlanForJob(tiny, &*tiny_costs, 1e11);
  ASSERT_TRUE(tiny_plan.ok()) << tiny_plan.status();
  EXPECT_EQ(large_plan->summary.costs_source(), "profiled");
  EXPECT_GE(large_plan->candidates.size(), 4u);  // every vocabulary method was weighed

  const std::string large_vocab = Chosen(*large_plan), tiny_vocab = Chosen(*tiny_plan);
  EXPECT_TRUE(large_vocab == "vocab1" || large_vocab == "vocab2" || large_vocab == "interlaced")
      << large_vocab;
  std::string tiny_table;
  for (const auto& c : tiny_plan->candidates) tiny_table += c.DebugString() + "\n";
  EXPECT_TRUE(tiny_vocab == "baseline" || tiny_vocab == "redis")
      << tiny_vocab << "\n" << tiny_costs->DebugString() << tiny_table;
  EXPECT_EQ(large_plan->summary.schedule(), "1f1b");
}

}  // namespace
