// Interlaced 1F1B (nnScaler's interlaced pipeline as the Vocabulary Parallelism paper runs it):
// the output layer is tensor-parallel over all ranks, so one microbatch's vocabulary slot
// V(u) = S(u) C1 T(u) C2 runs on every rank at the same moment. The block lines these slots
// up across ranks: every steady step of every rank is one F, one fused BW and one V, ordered
// F-BW-V on ranks with r ≡ p (mod 2) and BW-F-V on the others, so an activation crosses two
// ranks per step (the F-first rank hands it to the F-second rank within the step) and a
// gradient one. The slots then fall at the same point of every rank's step and no rank waits
// for another at C1/C2; the price is the longer lifespan (≈4.5p instead of 1F1B's 3p, the
// paper's Appendix B.1): rank r runs ⌊1.5p⌋−r warm-up forwards.
//
// Rank r, with W = ⌊1.5p⌋−r warm-up forwards, C = p−r slots before its first backward and
// H = ⌊p/2⌋ − ⌊(p−r−1)/2⌋ backward+slot pairs before its first steady step:
//   F(0..W−1) | V(0..C−1) | [BW(i) V(C+i)] for i < H | steady [F BW V] or [BW F V] |
//   [BW V] until every V ran | BW of the last C microbatches.
// In global steps (counted by V): F(j) on rank r in step j − ⌊(p−r−1)/2⌋, V(j) in step j,
// BW(j) on rank r in step j + p − r.
//
// The block needs M = ⌊1.5p⌋+1 microbatches to reach its steady step; for m < M it is built
// for M and the passes of microbatches ≥ m are dropped (every dependency stays inside one
// microbatch, so the remaining orders still run; the plan is just bubblier).
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <vector>

#include "coordinator/planner/generator.h"

namespace vp::planner::internal {

std::vector<RankGen> InterlacedOrders(const Ctx& c) {
  const int p = c.l.p, m = c.l.m;
  const int M = std::max(m, 3 * p / 2 + 1);
  std::vector<RankGen> gens(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Action>& out = gens[r].streams.emplace_back().acts;
    auto f = [&](int mb) {
      if (mb < m) out.push_back(MakeAction(ActionKind::kF, mb));
    };
    auto bw = [&](int mb) {
      if (mb < m) out.push_back(MakeAction(ActionKind::kBW, mb));
    };
    auto slot = [&](int mb) {
      if (mb >= m) return;
      out.push_back(MakeAction(ActionKind::kS, mb));
      out.push_back(MakeAction(ActionKind::kT, mb));
    };
    const int W = 3 * p / 2 - r, C = p - r, H = p / 2 - (p - r - 1) / 2, rest = M - W;
    const bool f_first = r % 2 == p % 2;
    for (int i = 0; i < W; ++i) f(i);
    for (int i = 0; i < C; ++i) slot(i);
    for (int i = 0; i < H; ++i) {
      bw(i);
      slot(C + i);
    }
    for (int i = 0; i < rest; ++i) {
      if (f_first) {
        f(W + i);
        bw(H + i);
      } else {
        bw(H + i);
        f(W + i);
      }
      slot(C + H + i);
    }
    for (int i = 0; i < W - C - H; ++i) {
      bw(H + rest + i);
      slot(C + H + rest + i);
    }
    for (int i = 0; i < C; ++i) bw(M - C + i);
  }
  return gens;
}

}  // namespace vp::planner::internal
