#include "worker/runtime/flops.h"

#include <algorithm>
#include <chrono>

#include "proto/plan/flops.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/memory.h"

namespace vp::runtime {

// The formulas are proto/plan/flops.h, shared with the planner's predicted MFU.
double TransformerLayerFlops(const engine::ModelConfig& c, int b) {
  if (c.llama()) return flops::LlamaLayer(b, c.seq_len, c.hidden, c.ffn_hidden, c.kv_dim());
  return flops::TransformerLayer(b, c.seq_len, c.hidden, c.ffn_hidden);
}

double OutputLayerFlops(const engine::ModelConfig& c, int b) {
  return flops::OutputLayer(b, c.seq_len, c.hidden, static_cast<double>(c.vocab));
}

double InputLayerFlops(const engine::ModelConfig& c, int b) {
  return flops::InputLayer(b, c.seq_len, c.hidden);
}

double ModelFlopsPerMicrobatch(const engine::ModelConfig& c, int b) {
  return c.layers * TransformerLayerFlops(c, b) + OutputLayerFlops(c, b) + InputLayerFlops(c, b);
}

double MeasureCpuPeakFlops() {
  constexpr int n = 1024;
  engine::Buffer a(nullptr, engine::MemoryCategory::kActivations, n * n);
  engine::Buffer b(nullptr, engine::MemoryCategory::kActivations, n * n);
  engine::Buffer c(nullptr, engine::MemoryCategory::kActivations, n * n);
  for (size_t i = 0; i < a.size(); ++i) {
    a.data()[i] = static_cast<float>(i % 7) * 0.01f;
    b.data()[i] = static_cast<float>(i % 5) * 0.01f;
  }
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    engine::cpu::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::max(best, 2.0 * n * n * n / s);  // rep 0 warms caches and threads
  }
  return best;
}

}  // namespace vp::runtime
