// ZB-V: a timed greedy list schedule over the V placement (chunk 0 on group r, chunk 1 on
// group 2p-1-r): backward before forward when ready, W deferred into idle time or forced by
// the memory cap of p (+ barriers) microbatches.
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"

namespace vp::planner::internal {

std::vector<RankGen> ZBVOrders(const Ctx& c) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, d = c.d;
  std::vector<RankGen> gens(p);
  for (int r = 0; r < p; ++r) {
    RankGen& g = gens[r];
    g.greedy = true;
    g.cap = (p + d) *
            std::max(1e-9, internal::ActivationUnits(l, r, MakeAction(ActionKind::kF, 0)) +
                               internal::ActivationUnits(l, r, MakeAction(ActionKind::kF, 0, 1)));
    Stream b1, b0, f1, f0;
    f1.forward = f0.forward = true;
    for (int mb = 0; mb < m; ++mb) {
      b1.acts.push_back(MakeAction(ActionKind::kB, mb, 1));
      b0.acts.push_back(MakeAction(ActionKind::kB, mb, 0));
      f1.acts.push_back(MakeAction(ActionKind::kF, mb, 1));
      f0.acts.push_back(MakeAction(ActionKind::kF, mb, 0));
    }
    g.streams = {std::move(b1), std::move(b0), std::move(f1), std::move(f0)};
  }
  return gens;
}

}  // namespace vp::planner::internal
