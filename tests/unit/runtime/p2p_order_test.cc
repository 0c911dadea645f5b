// The untagged-transport check (NCCL matches Send/Recv between a pair in issue order): every
// plan the planner generates must pass it, and a plan whose receiver order differs must not.
#include <gtest/gtest.h>

#include <utility>

#include "coordinator/planner/planner.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::runtime {
namespace {

planner::PlannerInput Input(int p, planner::Schedule schedule, planner::VocabMethod vocab) {
  planner::PlannerInput in;
  in.pipeline = p;
  in.microbatches = 2 * p;
  in.layers = 2 * p;
  in.seq_chunks = (schedule == planner::Schedule::kSeq1F1B ||
                   schedule == planner::Schedule::kSeq1F1BInterleaved)
                      ? 2
                      : 1;
  in.schedule = schedule;
  in.vocab = vocab;
  in.costs = {.f = 1, .b = 1, .w = 1, .s = 0.5, .t = 0.5, .input_f = 0.1, .input_b = 0.1};
  in.model = {.hidden = 64,
              .heads = 4,
              .seq_len = 32,
              .vocab = 1000,
              .ffn = 256,
              .microbatch_size = 1,
              .tie_embeddings = true};
  return in;
}

TEST(P2POrder, EveryGeneratedPlanMatchesInIssueOrder) {
  int checked = 0;
  for (int p : {2, 4}) {
    for (planner::Schedule s : planner::AllSchedules()) {
      for (planner::VocabMethod v : planner::AllVocabMethods()) {
        auto plan = planner::BuildPlan(Input(p, s, v));
        if (!plan.ok()) continue;  // a combination the planner does not offer
        EXPECT_TRUE(CheckP2POrderMatches(*plan).ok())
            << planner::ScheduleName(s) << " " << planner::VocabName(v) << " p=" << p << ": "
            << CheckP2POrderMatches(*plan);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(P2POrder, SwappedReceivesAreRejected) {
  auto plan = planner::BuildPlan(Input(2, planner::Schedule::k1F1B, planner::VocabMethod::kVocab1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Swap the first two activation receives of rank 1.
  auto& actions = plan->ranks[1].actions;
  int first = -1;
  for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
    if (actions[i].kind != planner::ActionKind::kRecvAct) continue;
    if (first < 0) {
      first = i;
    } else {
      std::swap(actions[first].mb, actions[i].mb);
      break;
    }
  }
  ASSERT_GE(first, 0);
  const absl::Status st = CheckP2POrderMatches(*plan);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("from rank 0 to rank 1"), std::string::npos) << st;
}

// What the coordinator sends each rank (planner::RankSlice): the layout of every rank and the
// rank's own actions only; it survives the text form and a rank can be set up from it.
TEST(RankSlice, HoldsTheLayoutAndOnlyItsOwnActions) {
  auto plan =
      planner::BuildPlan(Input(4, planner::Schedule::kInterleaved, planner::VocabMethod::kVocab2));
  if (!plan.ok()) {
    plan = planner::BuildPlan(Input(4, planner::Schedule::k1F1B, planner::VocabMethod::kVocab2));
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int r = 0; r < plan->pipeline; ++r) {
    auto slice = planner::PlanFromText(planner::PlanToText(planner::RankSlice(*plan, r)));
    ASSERT_TRUE(slice.ok()) << slice.status();
    EXPECT_FALSE(planner::HasOtherRanksActions(*slice, r));
    EXPECT_TRUE(planner::HasOtherRanksActions(*plan, r));
    ASSERT_EQ(slice->ranks.size(), plan->ranks.size());
    for (int q = 0; q < plan->pipeline; ++q) {
      EXPECT_EQ(slice->ranks[q].chunks, plan->ranks[q].chunks);
      EXPECT_EQ(slice->ranks[q].actions.size(), q == r ? plan->ranks[q].actions.size() : 0u);
    }
    EXPECT_EQ(slice->ranks[r].actions, plan->ranks[r].actions);
    EXPECT_EQ(slice->groups(), plan->groups());
    EXPECT_EQ(slice->x_owner, plan->x_owner);
    // The untagged-transport check compares only pairs it can see.
    EXPECT_TRUE(CheckP2POrderMatches(*slice).ok()) << CheckP2POrderMatches(*slice);
  }
}

}  // namespace
}  // namespace vp::runtime
