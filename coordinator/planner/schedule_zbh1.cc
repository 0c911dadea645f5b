// ZB-H1: the zero-bubble paper's handcrafted schedule at 1F1B's memory.
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

std::vector<RankGen> ZBH1Orders(const Ctx& c) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, d = c.d;
  std::vector<RankGen> gens(p);
  // ZB-H1 (zero-bubble paper, handcrafted): 1F1B's F/B order, and rank r runs W(i) right
  // after B(i + r). Deferring r weight passes fills the cool-down bubble that 1F1B leaves
  // on early ranks, while the activations held stay at p (+ barriers): rank r holds
  // p - r (+ d) forwards like 1F1B plus the r whose W waits.
  for (int r = 0; r < p; ++r) {
    std::vector<Action> fwd, bwd;
    for (int mb = 0; mb < m; ++mb) {
      fwd.push_back(MakeAction(ActionKind::kF, mb));
      bwd.push_back(MakeAction(ActionKind::kB, mb));
    }
    Stream st;
    for (const Action& a : WarmupThenAlternate(fwd, bwd, p - r - 1 + d)) {
      st.acts.push_back(a);
      if (a.kind == ActionKind::kB && a.mb - r >= 0)
        st.acts.push_back(MakeAction(ActionKind::kW, a.mb - r));
    }
    for (int mb = std::max(0, m - r); mb < m; ++mb)
      st.acts.push_back(MakeAction(ActionKind::kW, mb));
    gens[r].streams.push_back(std::move(st));
  }
  return gens;
}

}  // namespace vp::planner::internal
