// Shared by the planner's .cc files: layer placement and per-action costs of one plan.
#pragma once

#include <vector>

#include "coordinator/planner/planner.h"
#include "proto/plan/plan.h"

namespace vp::planner::internal {

struct Layout {
  int p = 1, m = 1, k = 1, groups = 1, layers = 1;
  std::vector<int> owner_rank, owner_chunk, group_layers;  // per group
  std::vector<std::vector<int>> group_of;                  // [rank][chunk]
  std::vector<double> seq_cost_share, seq_mem_share;       // per sequence chunk
  bool sharded = false;
  int barrier = 0;  // 0, 1 (C1), 2 (C1 + C2)
  int x_owner() const { return owner_rank[groups - 1]; }
};

// Reads placement and sequence shares from a plan (checked: every layer once, groups once).
absl::StatusOr<Layout> LayoutFromPlan(const Plan& plan);

// Cost of one compute action on `rank` and its activation units (+ for F, - for W/BW).
double ActionCost(const Layout& l, const Costs& c, int rank, const Action& a);
double ActivationUnits(const Layout& l, int rank, const Action& a);

// Seconds of one communication action of `kind` on sequence chunk q (0 for compute kinds):
// the fixed costs.comm / costs.collective plus the link model for the calls the runtime makes
// (n = b·s_q tokens of the chunk, e = activation bytes per element, vocabulary buffers fp32):
//   SEND/RECV_ACT/GRAD  one P2P of n·h·e bytes        BCAST_X    one broadcast of n·h·e
//   C1  all-reduces of n·4 and 2n·4 bytes, plus n·h·4 in Algorithm 2 (barrier 1)
//   C2  one all-reduce of n·h·4                        IF_REDUCE  one all-reduce of b·s·h·4
//   IB_BCAST  one broadcast of b·s·h·4
// Sizes are 0 when the shape is unknown (then only latencies count).
double CommSeconds(const Layout& l, const PlannerInput& in, ActionKind kind, int q);

// The ranks a list machine must look at again, each queued at most once; it starts with every
// rank and hands out the most recently woken first (the validator's abstract machine and the
// list scheduler both advance one rank until it blocks, then wake the ranks it unblocked).
class RankWorklist {
 public:
  explicit RankWorklist(int p) : queued_(p, 1) {
    for (int r = p - 1; r >= 0; --r) work_.push_back(r);
  }
  bool empty() const { return work_.empty(); }
  int Pop() {
    const int r = work_.back();
    work_.pop_back();
    queued_[r] = 0;
    return r;
  }
  void Wake(int r) {
    if (!queued_[r]) {
      queued_[r] = 1;
      work_.push_back(r);
    }
  }

 private:
  std::vector<int> work_;
  std::vector<char> queued_;
};

}  // namespace vp::planner::internal
