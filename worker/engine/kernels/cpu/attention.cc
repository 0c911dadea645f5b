// Causal attention for a query chunk [q_begin, q_end) against keys/values [0, q_end).
// One sgemm per (batch, head) for Q·Kᵀ and one for P·V; the softmax and its backward are
// row loops in between. The full q_len x q_end score block is computed and the part above the
// causal diagonal is zeroed, matching the bsh·12s FLOP count of docs/engine.md
// ("FLOPs and memory").
//
// Threads: the (batch, head) blocks are split over the calling thread's OpenMP team, each block
// with its GEMMs and softmax on one thread (a GEMM inside a parallel region runs on its caller;
// blas.h, "Threads"). Per-head GEMMs of 256x256x64 are too small for BLAS to split well, and
// this way the softmax runs on every thread too. The backward splits by (batch, key/value
// head): the query heads of one group add into the same dK, dV columns, so one thread runs the
// whole group in head order, and the sums come out as on one thread, bit for bit.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/fast_exp.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {

namespace {

// Threads for `units` independent blocks of (tq, tk) scores: never more than blocks, so a team
// has no idle member that would hold a scratch slice for nothing, and one thread when all the
// scores are fewer than kParallelMinWork floats (the tiny models of tests and demos).
int BlockThreads(long units, int tq, int tk) {
  if (units * tq * tk < kParallelMinWork) return 1;
  return static_cast<int>(std::max(1L, std::min<long>(units, omp_get_max_threads())));
}

// One query's row of scores → probabilities in place: softmax over keys [0, visible), zeros in
// [visible, tk) (the causal mask). The exps have a loop of their own so it vectorizes
// (parallel.h: VP_ALSO_AVX512); the max and the sum run in order, so the row's bits do not
// depend on the vector width.
VP_ALSO_AVX512 void CausalSoftmaxRow(float* row,  // (tk)
                                     int visible, int tk) {
  float maxv = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < visible; ++j) maxv = row[j] > maxv ? row[j] : maxv;
  for (int j = 0; j < visible; ++j) row[j] = ExpNonPositive(row[j] - maxv);
  float sum = 0.0f;
  for (int j = 0; j < visible; ++j) sum += row[j];
  const float inv = 1.0f / sum;
  for (int j = 0; j < visible; ++j) row[j] *= inv;
  for (int j = visible; j < tk; ++j) row[j] = 0.0f;
}
}  // namespace

long AttentionBackwardScratch(const AttentionShape& shape) {
  const long units = static_cast<long>(shape.batch) * shape.num_kv_heads();
  return BlockThreads(units, shape.q_len(), shape.q_end) * static_cast<long>(shape.q_len()) *
         shape.q_end;
}

void AttentionForward(float* out, float* att, const float* q, int ldq, const float* k,
                      const float* v, const AttentionShape& shape) {
  const int tq = shape.q_len();
  const int tk = shape.q_end;
  const int hd = shape.head_dim;
  const int width = shape.width();
  const int kvw = shape.kv_width();
  const int group = shape.heads / shape.num_kv_heads();  // query heads per key/value head
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const long units = static_cast<long>(shape.batch) * shape.heads;
  const int threads = BlockThreads(units, tq, tk);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long u = 0; u < units; ++u) {
    const int b = static_cast<int>(u / shape.heads), h = static_cast<int>(u % shape.heads);
    const float* qb = q + static_cast<long>(b) * tq * ldq;
    const float* kb = k + static_cast<long>(b) * shape.kv_rows * kvw;
    const float* vb = v + static_cast<long>(b) * shape.kv_rows * kvw;
    float* ob = out + static_cast<long>(b) * tq * width;
    const int kvc = (h / group) * hd;  // this head's key/value columns
    float* a = att + (static_cast<long>(b) * shape.heads + h) * tq * tk;  // (tq, tk)
    // Scores: a = scale * Q_h · K_hᵀ.
    Gemm(false, true, tq, tk, hd, scale, qb + h * hd, ldq, kb + kvc, kvw, 0.0f, a, tk);
    for (int i = 0; i < tq; ++i) {
      float* row = a + static_cast<long>(i) * tk;
      const int visible = shape.q_begin + i + 1;  // keys 0..q_begin+i
      CausalSoftmaxRow(row, visible, tk);
    }
    // out_h = P · V_h.
    Gemm(false, false, tq, hd, tk, 1.0f, a, tk, vb + kvc, kvw, 0.0f, ob + h * hd, width);
  }
}

void AttentionBackward(float* dq, float* dk, float* dv, float* scratch, const float* dout,
                       const float* att, const float* q, int ldq, const float* k, const float* v,
                       const AttentionShape& shape) {
  const int tq = shape.q_len();
  const int tk = shape.q_end;
  const int hd = shape.head_dim;
  const int width = shape.width();
  const int kvw = shape.kv_width();
  const int kv_heads = shape.num_kv_heads();
  const int group = shape.heads / kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const long units = static_cast<long>(shape.batch) * kv_heads;
  const int threads = BlockThreads(units, tq, tk);  // AttentionBackwardScratch's count
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long u = 0; u < units; ++u) {
    const int b = static_cast<int>(u / kv_heads), kvh = static_cast<int>(u % kv_heads);
    const float* qb = q + static_cast<long>(b) * tq * ldq;
    const float* kb = k + static_cast<long>(b) * shape.kv_rows * kvw;
    const float* vb = v + static_cast<long>(b) * shape.kv_rows * kvw;
    const float* dob = dout + static_cast<long>(b) * tq * width;
    float* dqb = dq + static_cast<long>(b) * tq * ldq;
    float* dkb = dk + static_cast<long>(b) * shape.kv_rows * kvw;
    float* dvb = dv + static_cast<long>(b) * shape.kv_rows * kvw;
    const int kvc = kvh * hd;  // the group's key/value columns
    float* da = scratch + static_cast<long>(omp_get_thread_num()) * tq * tk;  // (tq, tk)
    // The group's query heads all add into their shared key/value head's dK, dV, in order.
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      const float* a = att + (static_cast<long>(b) * shape.heads + h) * tq * tk;  // (tq, tk)
      // dP = dO_h · V_hᵀ;  dV_h += Pᵀ · dO_h.
      Gemm(false, true, tq, tk, hd, 1.0f, dob + h * hd, width, vb + kvc, kvw, 0.0f, da, tk);
      Gemm(true, false, tk, hd, tq, 1.0f, a, tk, dob + h * hd, width, 1.0f, dvb + kvc, kvw);
      // Softmax backward in place: dS = P ⊙ (dP − rowsum(P ⊙ dP)). Masked entries have P = 0.
      for (int i = 0; i < tq; ++i) {
        const float* p = a + static_cast<long>(i) * tk;
        float* d = da + static_cast<long>(i) * tk;
        const int visible = shape.q_begin + i + 1;
        float dot = 0.0f;
        for (int j = 0; j < visible; ++j) dot += p[j] * d[j];
        for (int j = 0; j < visible; ++j) d[j] = p[j] * (d[j] - dot);
        for (int j = visible; j < tk; ++j) d[j] = 0.0f;
      }
      // dQ_h = scale · dS · K_h;  dK_h += scale · dSᵀ · Q_h.
      Gemm(false, false, tq, hd, tk, scale, da, tk, kb + kvc, kvw, 0.0f, dqb + h * hd, ldq);
      Gemm(true, false, tk, hd, tq, scale, da, tk, qb + h * hd, ldq, 1.0f, dkb + kvc, kvw);
    }
  }
}

}  // namespace vp::engine::cpu
