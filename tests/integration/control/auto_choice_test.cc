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

// The task the coordinator sends: the job and the planner's 1-rank profiling plan.
v1::ProfileTask Task(const v1::JobSpec& spec) {
  auto task = vp::server::MakeProfileTask("job-1", spec);
  EXPECT_TRUE(task.ok()) << task.status();
  return *task;
}

std::string Chosen(const vp::server::JobPlan& plan) {
  int chosen = 0;
  for (const auto& c : plan.candidates) chosen += c.chosen();
  EXPECT_EQ(chosen, 1);
  return plan.summary.vocab();
}

TEST(AutoChoiceTest, ProfiledCostsPickVocabParallelOnlyForALargeVocabulary) {
  const v1::JobSpec large = Spec(32000), tiny = Spec(64);
  auto large_costs = vp::daemon::ProfilePasses(Task(large));
  ASSERT_TRUE(large_costs.ok()) << large_costs.status();
  // S and T do the same work (one GEMM over the shard each), so a T several times S means the
  // timed passes were preempted on this shared host (ctest runs tests side by side): profile
  // again, as an operator would, rather than judge the choice on costs that are noise.
  auto tiny_costs = vp::daemon::ProfilePasses(Task(tiny));
  ASSERT_TRUE(tiny_costs.ok()) << tiny_costs.status();
  for (int retry = 0; retry < 3 && tiny_costs->t() > 4 * tiny_costs->s(); ++retry) {
    tiny_costs = vp::daemon::ProfilePasses(Task(tiny));
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

// The worker runs the coordinator's plan and checks it is one: a task whose plan text does not
// parse, or plans more than one rank, is refused naming the field, before anything is timed.
TEST(ProfileTaskTest, AMalformedPlanIsRefusedNamingTheField) {
  v1::ProfileTask garbled = Task(Spec(64));
  garbled.set_plan_text("not a plan");
  auto r = vp::daemon::ProfilePasses(garbled);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("plan_text"), std::string::npos) << r.status();

  v1::ProfileTask two_ranks = Task(Spec(64));
  auto full = vp::server::PlanForJob(Spec(64), nullptr, 1e11);
  ASSERT_TRUE(full.ok()) << full.status();
  two_ranks.set_plan_text(vp::planner::PlanToText(full->plan));
  r = vp::daemon::ProfilePasses(two_ranks);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("1 rank"), std::string::npos) << r.status();
}

}  // namespace
