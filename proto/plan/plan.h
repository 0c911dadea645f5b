// Plan IR: per rank, an ordered list of compute and communication actions.
//
// Library vp_plan (ground floor, beside proto/spec and proto/runlog): the planner writes it,
// the coordinator ships it, the worker runtime executes it; none of them depends on another
// for it. The text form below is the one wire form (RunTask.plan_text and friends carry it;
// there is no typed protobuf twin to keep in step).
//
// The plan is the contract with the worker runtime. It carries everything a worker needs:
// which global layers each local model chunk holds, which rank owns the last layer group
// (the output layer's input X), the sequence chunk boundaries, and the actions in an order
// that cannot deadlock when point-to-point sends block until matched and collectives run in
// plan order on a separate communication thread (docs/planner.md, "Execution model").
//
// Text form (one rank per line, like torch.distributed.pipelining's CSV):
//   # vocabpipe plan v1
//   schedule 1f1b
//   vocab vocab2
//   pipeline 2
//   microbatches 2
//   seq_chunks 1
//   layers 4
//   seq_bounds 0 1024
//   x_owner 1
//   vocab_sharded 1
//   barrier 1
//   chunk 0 0 group 0 layers 0 2          (rank, chunk, group, first layer, count)
//   rank 0: IF(0) IF_REDUCE(0) F(0) SEND_ACT(0,>1) ...
// Action tokens: KIND(mb[,cC][,sQ][,>R|<R]); c = local chunk, s = sequence chunk, >R send to
// rank R, <R receive from rank R; zero chunk/seq are left out. OPT has no arguments;
// GRAD_SYNC(cC) names only its chunk (it covers every microbatch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vp::planner {

enum class ActionKind : uint8_t {
  kF,
  kB,
  kW,
  kBW,
  kIF,
  kIB,
  kS,
  kT,
  kOpt,
  kSendAct,
  kRecvAct,
  kSendGrad,
  kRecvGrad,
  kBcastX,
  kC1,
  kC2,
  kIfReduce,
  kIbBcast,
  kGradSync,
};
inline constexpr int kNumActionKinds = 19;

absl::string_view ActionKindName(ActionKind kind);
bool IsCompute(ActionKind kind);
bool IsP2P(ActionKind kind);
// A collective over the pipeline's ranks (BCAST_X, C1, C2, IF_REDUCE, IB_BCAST).
bool IsCollective(ActionKind kind);
// GRAD_SYNC(cC): local model chunk C's weight gradients summed over the data-parallel group (the
// replicas of this rank), issued once per step right after the chunk's last W (or BW), so the
// reduction overlaps the rest of the rank's backward. Only in plans for d > 1 without ZeRO;
// the data group's members run the same rank plan, so they issue them in the same order.
bool IsDataSync(ActionKind kind);

struct Action {  // 12 bytes: plans of p = 64, m = 1024 hold over a million of them
  ActionKind kind = ActionKind::kF;
  int16_t chunk = 0;  // local model chunk
  int16_t seq = 0;    // sequence chunk
  int16_t peer = -1;  // P2P peer rank
  int32_t mb = 0;     // microbatch, -1 for OPT, 0 for GRAD_SYNC

  bool operator==(const Action&) const = default;
};

// "F(3,c1)", "SEND_ACT(0,>1)", "OPT".
std::string ToString(const Action& a);
absl::StatusOr<Action> ParseAction(absl::string_view token);

struct ModelChunk {
  int group = 0;        // layer group index along the model
  int first_layer = 0;  // global index of the chunk's first transformer layer
  int num_layers = 0;
  bool operator==(const ModelChunk&) const = default;
};

struct RankPlan {
  std::vector<ModelChunk> chunks;  // indexed by local chunk
  std::vector<Action> actions;
  bool operator==(const RankPlan&) const = default;
};

struct Plan {
  std::string schedule;
  std::string vocab;
  int pipeline = 1;
  int microbatches = 1;
  int seq_chunks = 1;
  int layers = 1;
  std::vector<int> seq_bounds = {0, 1};  // seq_chunks+1 token offsets
  int x_owner = 0;                       // rank holding the last layer group
  bool vocab_sharded = false;            // input/output layers split over all ranks
  int barrier = 0;                       // 0 local loss, 1 C1 (Alg. 2), 2 C1+C2 (Alg. 1)
  std::vector<RankPlan> ranks;

  int groups() const;  // number of layer groups (sum of chunks over ranks)
  bool operator==(const Plan&) const = default;
};

std::string PlanToText(const Plan& plan);
absl::StatusOr<Plan> PlanFromText(absl::string_view text);

// What one rank is sent to run (RunTask.plan_text): the header and every rank's model chunks
// (the layer layout: which rank holds which groups, needed to place the input layer, the loss
// and the tied copy), but only `rank`'s actions; every other rank's action list is empty. A
// worker so learns nothing of another rank's schedule beyond the layout. rank must be in
// [0, plan.pipeline).
Plan RankSlice(const Plan& plan, int rank);
// The whole plan again from every rank's slice (slices[r] = RankSlice(plan, r) for r in
// [0, p)): the layout of slice 0 with rank r's actions from slices[r]. InvalidArgument when
// the count is not the plans' p, two slices differ in anything but actions, or a slice holds
// another rank's actions.
absl::StatusOr<Plan> MergeRankSlices(const std::vector<Plan>& slices);
// Whether some rank other than `rank` has actions (the plan is not a slice for `rank`).
bool HasOtherRanksActions(const Plan& plan, int rank);

}  // namespace vp::planner
