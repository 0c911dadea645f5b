// The untagged-transport check (NCCL matches Send/Recv between a pair in issue order): every
// plan the planner generates must pass it, and a plan whose receiver order differs must not.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "coordinator/planner/planner.h"
#include "tests/support/planner_fixtures.h"
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
  in.costs = planner::fixtures::UnitCosts();
  in.model.hidden = 64;
  in.model.heads = 4;
  in.model.seq_len = 32;
  in.model.vocab = 1000;
  in.model.ffn = 256;
  in.model.microbatch_size = 1;
  in.model.tie_embeddings = true;
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

// The slices a control-plane run leaves (one per rank) give the whole plan back; a missing
// slice, a slice of another layout or one with another rank's actions are refused.
TEST(RankSlice, EverySliceTogetherIsTheWholePlan) {
  auto plan = planner::BuildPlan(Input(4, planner::Schedule::k1F1B, planner::VocabMethod::kVocab1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<planner::Plan> slices;
  for (int r = 0; r < plan->pipeline; ++r) slices.push_back(planner::RankSlice(*plan, r));
  auto whole = planner::MergeRankSlices(slices);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, *plan);

  std::vector<planner::Plan> three(slices.begin(), slices.end() - 1);
  EXPECT_FALSE(planner::MergeRankSlices(three).ok());
  std::vector<planner::Plan> twice = slices;
  twice[2] = slices[1];
  EXPECT_FALSE(planner::MergeRankSlices(twice).ok());
  std::vector<planner::Plan> other = slices;
  other[3].x_owner = (other[3].x_owner + 1) % plan->pipeline;
  EXPECT_FALSE(planner::MergeRankSlices(other).ok());
}

// A rank refuses a plan whose own actions name a chunk, microbatch or sequence chunk it does not
// have (the executor indexes by them), before it builds anything.
TEST(PipelineRankSetup, ActionsOutsideTheRanksChunksAreRefused) {
  auto plan = planner::BuildPlan(Input(1, planner::Schedule::k1F1B, planner::VocabMethod::kVocab1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  TrainerOptions options;
  options.model.layers = plan->layers;
  options.model.hidden = 64;
  options.model.heads = 4;
  options.model.seq_len = 32;
  options.model.vocab = 1000;
  options.model.ffn_hidden = 256;
  options.microbatches = plan->microbatches;
  std::unique_ptr<comm::Communicator> self = comm::MakeSelfCommunicator();
  {
    const auto good = PipelineRank::Create(*plan, 0, options, self.get());
    ASSERT_TRUE(good.ok()) << good.status();
  }
  for (auto field : {&planner::Action::chunk, &planner::Action::seq}) {
    planner::Plan bad = *plan;
    for (planner::Action& a : bad.ranks[0].actions) {
      if (a.kind == planner::ActionKind::kW || a.kind == planner::ActionKind::kBW) {
        a.*field = 5;
        break;
      }
    }
    const auto rank = PipelineRank::Create(bad, 0, options, self.get());
    ASSERT_FALSE(rank.ok());
    EXPECT_EQ(rank.status().code(), absl::StatusCode::kInvalidArgument) << rank.status();
    EXPECT_NE(rank.status().message().find("does not have"), std::string::npos) << rank.status();
  }
  planner::Plan bad = *plan;
  bad.ranks[0].actions[0].mb = plan->microbatches;
  EXPECT_FALSE(PipelineRank::Create(bad, 0, options, self.get()).ok());
}

}  // namespace
}  // namespace vp::runtime
