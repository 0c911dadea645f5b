// Causal attention for a query chunk [q_begin, q_end) against keys/values [0, q_end), in tiles
// with an online softmax (flash-attention 2), so memory stays linear in the sequence length:
// the forward keeps only the output and one log-sum-exp per query row, and the backward
// recomputes each tile's probabilities from them. The (q_len, q_end) score block, which took
// 2.9 GiB per layer at s = 8192 and would take 32 GiB at s = 32768, never exists.
//
// Tiles: kQueryTile queries against kKeyTile keys. Each tile is two sgemms (scores Q·Kᵀ, then
// P·V) with the softmax's row loops between them; a query tile reads the key tiles up to its
// last query's position, and the row loops mask the keys past each query's own position. The
// tile of keys past the diagonal is computed and masked, as the bsh·12s FLOP count of
// docs/engine.md ("FLOPs and memory") assumes for the whole block.
//
// Threads: the forward splits (batch, head, query tile) units over the calling thread's OpenMP
// team, each unit with its GEMMs on one thread (a GEMM inside a parallel region runs on its
// caller; blas.h, "Threads"). Every unit writes its own output rows and lse entries, so the
// split does not change a bit. The backward splits by (batch, key/value head): the query heads
// of one group and all its query tiles add into the same dK, dV rows, so one thread runs the
// whole group in a fixed order (head, query tile, key tile) and the sums come out as on one
// thread, bit for bit.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/fast_exp.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {

namespace {

// 64 queries x 256 keys: the score tile (64 KiB) and a head's K/V tiles stay in L2, and the
// GEMMs are big enough for OpenBLAS's kernels (64x256x64 for the scores at head_dim 64).
constexpr int kQueryTile = 64;
constexpr int kKeyTile = 256;

// Threads for `units` independent units with `work` scores in all: never more than units, so
// a team has no idle member that would hold a scratch slice for nothing, and one thread when
// the scores are fewer than kParallelMinWork floats (the tiny models of tests and demos).
int UnitThreads(long units, long work) {
  if (work < kParallelMinWork) return 1;
  return static_cast<int>(std::max(1L, std::min<long>(units, omp_get_max_threads())));
}

// Scores of the causal part: sum over queries of (position + 1), what the tiles touch.
long CausalScores(const AttentionShape& shape) {
  const long tq = shape.q_len();
  return tq * shape.q_begin + tq * (tq + 1) / 2;
}

int QueryTiles(const AttentionShape& shape) {
  return (shape.q_len() + kQueryTile - 1) / kQueryTile;
}

// Keys of the tile starting at j0 that the query at absolute position `pos` sees (<= 0: none).
int VisibleKeys(int pos, int j0, int nk) { return std::min(nk, pos + 1 - j0); }

// One query's row of a score tile: the online softmax step. On entry row holds the scaled scores
// of keys [0, nk) of the tile, of which [0, visible) are unmasked (visible >= 1); m and l are
// the row's running max and sum of exps (m = -inf before the first tile). On exit row holds
// exp(score - m_new) with zeros in [visible, nk), m and l are updated, and the return value is
// the factor exp(m_old - m_new) by which the row's output accumulator must be rescaled. The
// exps have a loop of their own so it vectorizes (parallel.h: VP_ALSO_AVX512); the max and the
// sum run in order, so the row's bits do not depend on the vector width.
VP_ALSO_AVX512 float OnlineSoftmaxRow(float* row,  // (nk)
                                      int visible, int nk, float* m, float* l) {
  float maxv = *m;
  for (int j = 0; j < visible; ++j) maxv = row[j] > maxv ? row[j] : maxv;
  for (int j = 0; j < visible; ++j) row[j] = ExpNonPositive(row[j] - maxv);
  for (int j = visible; j < nk; ++j) row[j] = 0.0f;
  float sum = 0.0f;
  for (int j = 0; j < visible; ++j) sum += row[j];
  const float correction =
      *m == -std::numeric_limits<float>::infinity() ? 0.0f : ExpNonPositive(*m - maxv);
  *l = *l * correction + sum;
  *m = maxv;
  return correction;
}

// A score row back to probabilities in the backward: p = exp(score - lse) for the visible keys,
// 0 past them. score <= lse up to rounding (lse is the log of a sum that includes exp(score)),
// and ExpNonPositive is exact enough just above 0.
VP_ALSO_AVX512 void ProbabilityRow(float* row,  // (nk)
                                   int visible, int nk, float lse) {
  for (int j = 0; j < visible; ++j) row[j] = ExpNonPositive(row[j] - lse);
  for (int j = std::max(visible, 0); j < nk; ++j) row[j] = 0.0f;
}

// dS = P ⊙ (dP − D) in place over dP (masked entries have P = 0).
VP_ALSO_AVX512 void SoftmaxBackwardRow(float* dp,       // (nk)
                                       const float* p,  // (nk)
                                       int nk, float delta) {
  for (int j = 0; j < nk; ++j) dp[j] = p[j] * (dp[j] - delta);
}

// Forward of one (batch, head, query tile) unit: out rows [i0, i1) of head h and their lse.
void ForwardTile(float* ob,        // (q_len, width) this sequence's output
                 float* lse,       // (q_len) this (sequence, head)'s lse
                 float* scores,    // (kQueryTile, kKeyTile) workspace
                 const float* qh,  // (q_len, ldq) this sequence's queries, at head h's columns
                 int ldq,
                 const float* kh,  // (kv_rows, kvw) this sequence's keys, at the head's columns
                 const float* vh,  // (kv_rows, kvw) likewise values
                 int i0, int i1, const AttentionShape& shape) {
  const int hd = shape.head_dim, width = shape.width(), kvw = shape.kv_width();
  const int nq = i1 - i0;
  const int kend = shape.q_begin + i1;  // the tile's last query sees keys [0, kend)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float m[kQueryTile], l[kQueryTile];
  std::fill(m, m + nq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nq, 0.0f);
  float* o = ob + static_cast<long>(i0) * width;  // (nq, width), the head's hd columns
  for (int j0 = 0; j0 < kend; j0 += kKeyTile) {
    const int nk = std::min(kKeyTile, kend - j0);
    // S = scale · Q_tile · K_tileᵀ.
    Gemm(false, true, nq, nk, hd, scale, qh + static_cast<long>(i0) * ldq, ldq,
         kh + static_cast<long>(j0) * kvw, kvw, 0.0f, scores, kKeyTile);
    for (int r = 0; r < nq; ++r) {
      float* row = scores + static_cast<long>(r) * kKeyTile;
      const int visible = VisibleKeys(shape.q_begin + i0 + r, j0, nk);
      if (visible <= 0) {  // every key of this tile is in the row's future
        std::fill(row, row + nk, 0.0f);
        continue;
      }
      const float correction = OnlineSoftmaxRow(row, visible, nk, &m[r], &l[r]);
      // The first tile's GEMM overwrites the accumulator (beta 0); later ones rescale it.
      if (j0 > 0) {
        float* orow = o + static_cast<long>(r) * width;
        for (int d = 0; d < hd; ++d) orow[d] *= correction;
      }
    }
    // O_tile += P · V_tile (unnormalised).
    Gemm(false, false, nq, hd, nk, 1.0f, scores, kKeyTile, vh + static_cast<long>(j0) * kvw, kvw,
         j0 == 0 ? 0.0f : 1.0f, o, width);
  }
  for (int r = 0; r < nq; ++r) {
    float* orow = o + static_cast<long>(r) * width;
    const float inv = 1.0f / l[r];
    for (int d = 0; d < hd; ++d) orow[d] *= inv;
    lse[i0 + r] = m[r] + std::log(l[r]);
  }
}

}  // namespace

long AttentionBackwardScratch(const AttentionShape& shape) {
  const long units = static_cast<long>(shape.batch) * shape.num_kv_heads();
  const long work = static_cast<long>(shape.batch) * shape.heads * CausalScores(shape);
  // Per thread: the probability and dS tiles and one tile's D.
  return UnitThreads(units, work) * (2L * kQueryTile * kKeyTile + kQueryTile);
}

void AttentionForward(float* out, float* lse, const float* q, int ldq, const float* k,
                      const float* v, const AttentionShape& shape) {
  const int tq = shape.q_len();
  const int hd = shape.head_dim;
  const int width = shape.width();
  const int kvw = shape.kv_width();
  const int group = shape.heads / shape.num_kv_heads();  // query heads per key/value head
  const int tiles = QueryTiles(shape);
  const long units = static_cast<long>(shape.batch) * shape.heads * tiles;
  const int threads =
      UnitThreads(units, static_cast<long>(shape.batch) * shape.heads * CausalScores(shape));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scores(static_cast<size_t>(kQueryTile) * kKeyTile);
    // Later query tiles read more keys: hand them out first, one at a time, so the threads
    // finish together. Which thread runs a unit does not change its bits.
#pragma omp for schedule(dynamic, 1)
    for (long u = 0; u < units; ++u) {
      const long blocks = static_cast<long>(shape.batch) * shape.heads;
      const int tile = tiles - 1 - static_cast<int>(u / blocks);
      const long bh = u % blocks;
      const int b = static_cast<int>(bh / shape.heads), h = static_cast<int>(bh % shape.heads);
      const int kvc = (h / group) * hd;  // this head's key/value columns
      const int i0 = tile * kQueryTile, i1 = std::min(tq, i0 + kQueryTile);
      ForwardTile(out + static_cast<long>(b) * tq * width + h * hd, lse + bh * tq, scores.data(),
                  q + static_cast<long>(b) * tq * ldq + h * hd, ldq,
                  k + static_cast<long>(b) * shape.kv_rows * kvw + kvc,
                  v + static_cast<long>(b) * shape.kv_rows * kvw + kvc, i0, i1, shape);
    }
  }
}

void AttentionBackward(float* dq, int lddq, float* dk, float* dv, float* scratch, const float* dout,
                       const float* out, const float* lse, const float* q, int ldq, const float* k,
                       const float* v, const AttentionShape& shape) {
  const int tq = shape.q_len();
  const int hd = shape.head_dim;
  const int width = shape.width();
  const int kvw = shape.kv_width();
  const int kv_heads = shape.num_kv_heads();
  const int group = shape.heads / kv_heads;
  const int tiles = QueryTiles(shape);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const long units = static_cast<long>(shape.batch) * kv_heads;
  const int threads = UnitThreads(  // AttentionBackwardScratch's count
      units, static_cast<long>(shape.batch) * shape.heads * CausalScores(shape));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long u = 0; u < units; ++u) {
    const int b = static_cast<int>(u / kv_heads), kvh = static_cast<int>(u % kv_heads);
    const int kvc = kvh * hd;  // the group's key/value columns
    const long kv0 = static_cast<long>(b) * shape.kv_rows * kvw + kvc;
    const float* kb = k + kv0;  // (kv_rows, kvw) at the group's columns; likewise below
    const float* vb = v + kv0;
    float* dkb = dk + kv0;
    float* dvb = dv + kv0;
    float* p = scratch + static_cast<long>(omp_get_thread_num()) *
                             (2L * kQueryTile * kKeyTile + kQueryTile);  // (kQueryTile, kKeyTile)
    float* ds = p + static_cast<long>(kQueryTile) * kKeyTile;            // (kQueryTile, kKeyTile)
    float* delta = ds + static_cast<long>(kQueryTile) * kKeyTile;        // (kQueryTile)
    // The group's query heads all add into their shared key/value head's dK, dV, in order.
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      const float* qh = q + static_cast<long>(b) * tq * ldq + h * hd;           // (tq, ldq)
      float* dqh = dq + static_cast<long>(b) * tq * lddq + h * hd;              // (tq, lddq)
      const float* oh = out + static_cast<long>(b) * tq * width + h * hd;       // (tq, width)
      const float* doh = dout + static_cast<long>(b) * tq * width + h * hd;     // (tq, width)
      const float* lseh = lse + (static_cast<long>(b) * shape.heads + h) * tq;  // (tq)
      for (int tile = 0; tile < tiles; ++tile) {
        const int i0 = tile * kQueryTile, i1 = std::min(tq, i0 + kQueryTile), nq = i1 - i0;
        const int kend = shape.q_begin + i1;
        const float* qt = qh + static_cast<long>(i0) * ldq;
        const float* dot = doh + static_cast<long>(i0) * width;
        float* dqt = dqh + static_cast<long>(i0) * lddq;
        // D = rowsum(dO ⊙ O): the softmax backward's rowsum(P ⊙ dP) without the full row of P.
        for (int r = 0; r < nq; ++r) {
          const float* orow = oh + static_cast<long>(i0 + r) * width;
          const float* drow = dot + static_cast<long>(r) * width;
          float sum = 0.0f;
          for (int d = 0; d < hd; ++d) sum += drow[d] * orow[d];
          delta[r] = sum;
        }
        for (int j0 = 0; j0 < kend; j0 += kKeyTile) {
          const int nk = std::min(kKeyTile, kend - j0);
          const float* kt = kb + static_cast<long>(j0) * kvw;
          const float* vt = vb + static_cast<long>(j0) * kvw;
          // P = exp(scale · Q Kᵀ − lse), recomputed.
          Gemm(false, true, nq, nk, hd, scale, qt, ldq, kt, kvw, 0.0f, p, kKeyTile);
          for (int r = 0; r < nq; ++r)
            ProbabilityRow(p + static_cast<long>(r) * kKeyTile,
                           VisibleKeys(shape.q_begin + i0 + r, j0, nk), nk, lseh[i0 + r]);
          // dP = dO · Vᵀ;  dV += Pᵀ · dO.
          Gemm(false, true, nq, nk, hd, 1.0f, dot, width, vt, kvw, 0.0f, ds, kKeyTile);
          Gemm(true, false, nk, hd, nq, 1.0f, p, kKeyTile, dot, width, 1.0f,
               dvb + static_cast<long>(j0) * kvw, kvw);
          for (int r = 0; r < nq; ++r)
            SoftmaxBackwardRow(ds + static_cast<long>(r) * kKeyTile,
                               p + static_cast<long>(r) * kKeyTile, nk, delta[r]);
          // dQ (+)= scale · dS · K (the first key tile overwrites);  dK += scale · dSᵀ · Q.
          Gemm(false, false, nq, hd, nk, scale, ds, kKeyTile, kt, kvw, j0 == 0 ? 0.0f : 1.0f, dqt,
               lddq);
          Gemm(true, false, nk, hd, nq, scale, ds, kKeyTile, qt, ldq, 1.0f,
               dkb + static_cast<long>(j0) * kvw, kvw);
        }
      }
    }
  }
}

}  // namespace vp::engine::cpu
