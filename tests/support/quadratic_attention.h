// The CPU engine's attention before it went flash-style (issue 32), kept as a test reference:
// one sgemm per (batch, head) for the full (q_len, q_end) score block, an exact row softmax
// with the causal mask, and the backward from those stored probabilities. Memory is quadratic
// in the sequence length, so tests run it at small shapes only; the tiled kernels of
// worker/engine/kernels/cpu/attention.cc must give the same outputs and gradients to 1e-5.
// Single-threaded: a reference has no reason to be fast.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::engine::testing {

// Forward; att gets the probabilities, zeros above the causal diagonal.
inline void QuadraticAttentionForward(float* out,      // (batch, q_len, width)
                                      float* att,      // (batch, heads, q_len, q_end)
                                      const float* q,  // (batch, q_len, ldq)
                                      int ldq,
                                      const float* k,  // (batch, kv_rows, kv_width)
                                      const float* v,  // (batch, kv_rows, kv_width)
                                      const cpu::AttentionShape& shape) {
  const int tq = shape.q_len(), tk = shape.q_end, hd = shape.head_dim;
  const int width = shape.width(), kvw = shape.kv_width();
  const int group = shape.heads / shape.num_kv_heads();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int b = 0; b < shape.batch; ++b)
    for (int h = 0; h < shape.heads; ++h) {
      const float* qb = q + static_cast<long>(b) * tq * ldq;
      const float* kb = k + static_cast<long>(b) * shape.kv_rows * kvw;
      const float* vb = v + static_cast<long>(b) * shape.kv_rows * kvw;
      float* ob = out + static_cast<long>(b) * tq * width;
      const int kvc = (h / group) * hd;
      float* a = att + (static_cast<long>(b) * shape.heads + h) * tq * tk;  // (tq, tk)
      cpu::Gemm(false, true, tq, tk, hd, scale, qb + h * hd, ldq, kb + kvc, kvw, 0.0f, a, tk);
      for (int i = 0; i < tq; ++i) {
        float* row = a + static_cast<long>(i) * tk;
        const int visible = shape.q_begin + i + 1;
        float maxv = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < visible; ++j) maxv = std::max(maxv, row[j]);
        float sum = 0.0f;
        for (int j = 0; j < visible; ++j) sum += (row[j] = std::exp(row[j] - maxv));
        for (int j = 0; j < visible; ++j) row[j] /= sum;
        for (int j = visible; j < tk; ++j) row[j] = 0.0f;
      }
      cpu::Gemm(false, false, tq, hd, tk, 1.0f, a, tk, vb + kvc, kvw, 0.0f, ob + h * hd, width);
    }
}

// Backward from the stored probabilities: dq overwritten, dk and dv accumulated.
inline void QuadraticAttentionBackward(float* dq,          // (batch, q_len, ldq)
                                       float* dk,          // (batch, kv_rows, kv_width)
                                       float* dv,          // (batch, kv_rows, kv_width)
                                       const float* dout,  // (batch, q_len, width)
                                       const float* att,   // (batch, heads, q_len, q_end)
                                       const float* q, int ldq, const float* k, const float* v,
                                       const cpu::AttentionShape& shape) {
  const int tq = shape.q_len(), tk = shape.q_end, hd = shape.head_dim;
  const int width = shape.width(), kvw = shape.kv_width();
  const int group = shape.heads / shape.num_kv_heads();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> da(static_cast<size_t>(tq) * tk);  // (tq, tk)
  for (int b = 0; b < shape.batch; ++b)
    for (int h = 0; h < shape.heads; ++h) {
      const float* qb = q + static_cast<long>(b) * tq * ldq;
      const float* kb = k + static_cast<long>(b) * shape.kv_rows * kvw;
      const float* vb = v + static_cast<long>(b) * shape.kv_rows * kvw;
      const float* dob = dout + static_cast<long>(b) * tq * width;
      float* dqb = dq + static_cast<long>(b) * tq * ldq;
      float* dkb = dk + static_cast<long>(b) * shape.kv_rows * kvw;
      float* dvb = dv + static_cast<long>(b) * shape.kv_rows * kvw;
      const int kvc = (h / group) * hd;
      const float* a = att + (static_cast<long>(b) * shape.heads + h) * tq * tk;
      cpu::Gemm(false, true, tq, tk, hd, 1.0f, dob + h * hd, width, vb + kvc, kvw, 0.0f, da.data(),
                tk);
      cpu::Gemm(true, false, tk, hd, tq, 1.0f, a, tk, dob + h * hd, width, 1.0f, dvb + kvc, kvw);
      for (int i = 0; i < tq; ++i) {
        const float* p = a + static_cast<long>(i) * tk;
        float* d = da.data() + static_cast<long>(i) * tk;
        float dot = 0.0f;
        for (int j = 0; j < tk; ++j) dot += p[j] * d[j];
        for (int j = 0; j < tk; ++j) d[j] = p[j] * (d[j] - dot);
      }
      cpu::Gemm(false, false, tq, hd, tk, scale, da.data(), tk, kb + kvc, kvw, 0.0f, dqb + h * hd,
                ldq);
      cpu::Gemm(true, false, tk, hd, tq, scale, da.data(), tk, qb + h * hd, ldq, 1.0f, dkb + kvc,
                kvw);
    }
}

}  // namespace vp::engine::testing
