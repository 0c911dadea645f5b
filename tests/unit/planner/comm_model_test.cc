// The simulator's communication model (docs/planner.md, "Simulator"): each communication action
// costs its fixed seconds plus latency + bytes / bandwidth of the calls the runtime makes, and
// runs on the rank's communication lane. Checked by hand on p = 2, m = 1, where every pass and
// every transfer or collective lies on one chain, so the step grows by exactly the modelled
// communication; and on m = 4, where transfers overlap compute.
//
// Shape: b = 1, s = 8, h = 4, 2-byte activations, so one slot's activation is n·h·e = 64 bytes,
// the vocabulary collectives' n-vectors 32 bytes (fp32), ∇X and the embedding n·h·4 = 128 bytes.
#include <map>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "gtest/gtest.h"

namespace vp::planner {
namespace {

PlannerInput SmallInput(int m, VocabMethod v) {
  PlannerInput in;
  in.pipeline = 2;
  in.microbatches = m;
  in.layers = 8;
  in.schedule = Schedule::k1F1B;
  in.vocab = v;
  in.costs.f = 1;
  in.costs.b = 1;
  in.costs.w = 1;
  in.costs.s = 0.5;
  in.costs.t = 0.5;
  in.costs.input_f = 0.25;
  in.costs.input_b = 0.25;
  in.costs.opt = 0.25;
  in.model.microbatch_size = 1;
  in.model.seq_len = 8;
  in.model.hidden = 4;
  in.model.heads = 1;
  in.model.activation_bytes_per_element = 2;
  return in;
}

struct Timed {
  Plan plan;
  SimResult base, with_comm;
};

// Builds the plan once with free communication, then times the same plan with and without
// the communication costs of `comm_in`.
Timed TimeBoth(const PlannerInput& free_in, const PlannerInput& comm_in) {
  Timed t;
  absl::StatusOr<Plan> plan = BuildPlan(free_in);
  EXPECT_TRUE(plan.ok()) << plan.status();
  t.plan = *plan;
  absl::StatusOr<SimResult> base = Simulate(t.plan, free_in);
  EXPECT_TRUE(base.ok()) << base.status();
  absl::StatusOr<SimResult> with = Simulate(t.plan, comm_in);
  EXPECT_TRUE(with.ok()) << with.status();
  t.base = *base;
  t.with_comm = *with;
  return t;
}

// Every communication action's simulated duration, checked against `want` (per kind, seconds);
// returns how many actions of each kind rank 0 has.
std::map<ActionKind, int> ExpectDurations(const Timed& t,
                                          const std::map<ActionKind, double>& want) {
  std::map<ActionKind, int> count;
  for (int r = 0; r < 2; ++r) {
    const auto& acts = t.plan.ranks[r].actions;
    for (size_t i = 0; i < acts.size(); ++i) {
      if (IsCompute(acts[i].kind)) continue;
      if (r == 0) ++count[acts[i].kind];
      auto it = want.find(acts[i].kind);
      const double expected = it == want.end() ? 0 : it->second;
      const TimedAction& ta = t.with_comm.times[r][i];
      EXPECT_DOUBLE_EQ(ta.end - ta.start, expected) << "rank " << r << " " << ToString(acts[i]);
    }
  }
  return count;
}

TEST(CommModel, PointToPointTransfersAddTheirTimeOnTheChain) {
  for (VocabMethod v : {VocabMethod::kBaseline, VocabMethod::kVocab2}) {
    const PlannerInput free_in = SmallInput(1, v);
    PlannerInput in = free_in;
    in.costs.p2p = {.latency = 0.25, .bandwidth = 64};  // 64 bytes: 0.25 + 1 = 1.25 s
    Timed t = TimeBoth(free_in, in);
    auto count = ExpectDurations(t, {{ActionKind::kSendAct, 1.25},
                                     {ActionKind::kRecvAct, 1.25},
                                     {ActionKind::kSendGrad, 1.25},
                                     {ActionKind::kRecvGrad, 1.25}});
    EXPECT_EQ(count[ActionKind::kSendAct], 1);
    EXPECT_EQ(count[ActionKind::kRecvGrad], 1);
    // The activation and the gradient: two transfers on the chain.
    EXPECT_DOUBLE_EQ(t.with_comm.step_time, t.base.step_time + 2 * 1.25) << VocabName(v);
    EXPECT_DOUBLE_EQ(t.with_comm.ranks[0].comm, 2 * 1.25);
    // The fixed per-transfer seconds (`comm=` of --costs) add the same way.
    in = free_in;
    in.costs.comm = 0.5;
    in.costs.collective = 0;
    t = TimeBoth(free_in, in);
    EXPECT_DOUBLE_EQ(t.with_comm.step_time, t.base.step_time + 2 * 0.5) << VocabName(v);
  }
}

TEST(CommModel, BroadcastsOfXAndTheEmbeddingGradient) {
  for (VocabMethod v : {VocabMethod::kVocab1, VocabMethod::kVocab2}) {
    const PlannerInput free_in = SmallInput(1, v);
    PlannerInput in = free_in;
    in.costs.broadcast = {.latency = 0.5, .bandwidth = 32};
    Timed t = TimeBoth(free_in, in);
    // BCAST_X: X of the slot, n·h·e = 64 bytes: 0.5 + 2. IB_BCAST: the embedding-output
    // gradient, b·s·h fp32 = 128 bytes: 0.5 + 4.
    auto count = ExpectDurations(t, {{ActionKind::kBcastX, 2.5}, {ActionKind::kIbBcast, 4.5}});
    EXPECT_EQ(count[ActionKind::kBcastX], 1);
    EXPECT_EQ(count[ActionKind::kIbBcast], 1);
    EXPECT_DOUBLE_EQ(t.with_comm.step_time, t.base.step_time + 2.5 + 4.5) << VocabName(v);
  }
}

TEST(CommModel, AllReducesOfTheBarriersAndTheInputLayer) {
  // All-reduce 0.125 s + bytes / 128 B/s. IF_REDUCE: the embedding output, 128 bytes: 1.125.
  // C1: the max (32 bytes: 0.375) and the [sum | label logit] (64 bytes: 0.625) all-reduces;
  // Algorithm 2 (vocab2) adds ∇X (128 bytes: 1.125) there. C2 (vocab1): ∇X, 1.125.
  struct Case {
    VocabMethod v;
    double c1, c2;
  };
  for (const Case& c : {Case{VocabMethod::kVocab2, 0.375 + 0.625 + 1.125, 0},
                        Case{VocabMethod::kVocab1, 0.375 + 0.625, 1.125}}) {
    const PlannerInput free_in = SmallInput(1, c.v);
    PlannerInput in = free_in;
    in.costs.allreduce = {.latency = 0.125, .bandwidth = 128};
    Timed t = TimeBoth(free_in, in);
    auto count = ExpectDurations(
        t, {{ActionKind::kIfReduce, 1.125}, {ActionKind::kC1, c.c1}, {ActionKind::kC2, c.c2}});
    EXPECT_EQ(count[ActionKind::kIfReduce], 1);
    EXPECT_EQ(count[ActionKind::kC1], 1);
    EXPECT_EQ(count[ActionKind::kC2], c.v == VocabMethod::kVocab1 ? 1 : 0);
    EXPECT_DOUBLE_EQ(t.with_comm.step_time, t.base.step_time + 1.125 + c.c1 + c.c2)
        << VocabName(c.v);
  }
}

TEST(CommModel, FixedCollectiveSecondsAddPerCollective) {
  // `coll=` of --costs: every vocabulary collective of vocab2 (IF_REDUCE, BCAST_X, C1,
  // IB_BCAST) lies on the chain at m = 1.
  const PlannerInput free_in = SmallInput(1, VocabMethod::kVocab2);
  PlannerInput in = free_in;
  in.costs.collective = 0.25;
  Timed t = TimeBoth(free_in, in);
  auto count = ExpectDurations(t, {{ActionKind::kIfReduce, 0.25},
                                   {ActionKind::kBcastX, 0.25},
                                   {ActionKind::kC1, 0.25},
                                   {ActionKind::kIbBcast, 0.25}});
  EXPECT_EQ(count.size(), 6u);  // the four collectives and the two transfers
  EXPECT_DOUBLE_EQ(t.with_comm.step_time, t.base.step_time + 4 * 0.25);
}

TEST(CommModel, TransfersOverlapComputeOnTheCommunicationLane) {
  // m = 4: the first activation and the last gradient are on the critical path; the others
  // run on the communication lane while the compute lane goes on (no compute waits for a send).
  const PlannerInput free_in = SmallInput(4, VocabMethod::kBaseline);
  PlannerInput in = free_in;
  in.costs.p2p = {.latency = 0.25, .bandwidth = 0};
  Timed t = TimeBoth(free_in, in);
  const auto& acts = t.plan.ranks[0].actions;
  // Rank 0's warm-up (IF and F passes, each F followed by a send) runs back to back: the
  // sends do not hold the compute lane.
  double last_end = 0;
  for (size_t i = 0; i < acts.size() && acts[i].kind != ActionKind::kBW; ++i) {
    if (!IsCompute(acts[i].kind)) continue;
    EXPECT_DOUBLE_EQ(t.with_comm.times[0][i].start, last_end) << ToString(acts[i]);
    last_end = t.with_comm.times[0][i].end;
  }
  EXPECT_GT(last_end, 2.0);                               // at least two forwards ran
  EXPECT_DOUBLE_EQ(t.with_comm.ranks[0].comm, 8 * 0.25);  // 4 activations, 4 gradients
  EXPECT_LT(t.with_comm.step_time, t.base.step_time + 8 * 0.25);
  EXPECT_GE(t.with_comm.step_time, t.base.step_time + 2 * 0.25);
}

TEST(CommModel, OneLaneSerializesWhatTwoLanesOverlap) {
  // vocab2 at m = 4: with one communication thread (Gloo) a rank's transfers wait for its
  // collectives and the other way round; with two (NCCL) they do not. Every action's duration
  // is the same; only the waiting differs: here two lanes finish sooner.
  PlannerInput free_in = SmallInput(4, VocabMethod::kVocab2);
  PlannerInput in = free_in;
  in.costs.p2p = {.latency = 0.75, .bandwidth = 0};
  in.costs.allreduce = {.latency = 0.5, .bandwidth = 0};
  in.costs.broadcast = {.latency = 0.5, .bandwidth = 0};
  Timed one = TimeBoth(free_in, in);
  in.comm_lanes = 2;
  Timed two = TimeBoth(free_in, in);
  EXPECT_LT(two.with_comm.step_time, one.with_comm.step_time);
  EXPECT_DOUBLE_EQ(two.with_comm.ranks[0].comm, one.with_comm.ranks[0].comm);
  in.comm_lanes = 3;
  EXPECT_FALSE(BuildPlan(in).ok());
}

TEST(CommModel, NegativeLinkCostsAreRefused) {
  PlannerInput in = SmallInput(1, VocabMethod::kVocab2);
  in.costs.allreduce.bandwidth = -1;
  absl::StatusOr<Plan> plan = BuildPlan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("costs"), std::string::npos) << plan.status();
}

}  // namespace
}  // namespace vp::planner
