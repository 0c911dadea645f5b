// 1F1B family: 1F1B, Megatron's interleaved 1F1B, Seq1F1B and Seq1F1B-interleaved. Warm-up
// forwards, then one forward and one fused backward (BW) alternately, then the drain.
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

std::vector<Action> WarmupThenAlternate(const std::vector<Action>& fwd,
                                        const std::vector<Action>& bwd, int warmup) {
  std::vector<Action> out;
  const size_t w = std::min<size_t>(std::max(warmup, 0), fwd.size());
  size_t i = 0, j = 0;
  while (i < w) out.push_back(fwd[i++]);
  while (i < fwd.size()) {
    out.push_back(fwd[i++]);
    if (j < bwd.size()) out.push_back(bwd[j++]);
  }
  while (j < bwd.size()) out.push_back(bwd[j++]);
  return out;
}

std::vector<RankGen> OneFOneBFamilyOrders(const Ctx& c, int extra_warmup) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, k = l.k, v = c.v, d = c.d;
  std::vector<RankGen> gens(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Action> fwd, bwd;
    for (int start = 0; start < m; start += p) {  // blocks of p microbatches
      const int end = std::min(m, start + p);
      for (int ch = 0; ch < v; ++ch)
        for (int mb = start; mb < end; ++mb)
          for (int q = 0; q < k; ++q) fwd.push_back(MakeAction(ActionKind::kF, mb, ch, q));
      for (int ch = v - 1; ch >= 0; --ch)
        for (int mb = start; mb < end; ++mb)
          for (int q = k - 1; q >= 0; --q) bwd.push_back(MakeAction(ActionKind::kBW, mb, ch, q));
    }
    // Seq1F1B warm-up p-r-2+k (0-based r) is 1F1B's p-r-1 for k = 1; interleaving adds
    // (v-1) blocks of chunk-0 units and one more forward per rank of distance.
    const int b0 = std::min(p, m);
    int w = (v - 1) * b0 * k + (v > 1 ? 2 : 1) * (p - r - 1) + k - 1 + d + extra_warmup;
    gens[r].streams.push_back({WarmupThenAlternate(fwd, bwd, w), 0, false});
  }
  return gens;
}

}  // namespace vp::planner::internal
