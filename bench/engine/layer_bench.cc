// Transformer layer F+B+W throughput against a plain sgemm of comparable size.
//
//   engine_layer_bench [--threads=N] [--iters=N] [--arch=gpt2|llama]
//
// --arch=llama: a Llama layer (RMSNorm, RoPE, SwiGLU with f = 8h/3 rounded up to 8, GQA with
// heads/4 key/value heads), FLOPs from proto/plan/flops.h's LlamaLayer, sgemm reference its
// largest GEMM (b·s) x h times h x 2f (gate|up).
//
// Layer FLOPs per microbatch as docs/engine.md ("FLOPs and memory") counts them: b·s·h·(72h + 12s)
// for the forward and backward of one GPT-2 layer (FFN 4h). The sgemm reference is the layer's
// largest GEMM, (b·s) x h times h x 4h, timed on the same thread count; the ratio is layer
// GFLOP/s over sgemm GFLOP/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "proto/plan/flops.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/memory.h"
#include "worker/engine/transformer/transformer.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double BestSeconds(int iters, Fn fn) {
  fn();  // warm-up: first-touch of buffers, BLAS thread start
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

double SgemmGflops(int m, int n, int k, int iters) {
  vp::engine::Buffer a(nullptr, vp::engine::MemoryCategory::kActivations, size_t(m) * k);
  vp::engine::Buffer b(nullptr, vp::engine::MemoryCategory::kActivations, size_t(k) * n);
  vp::engine::Buffer c(nullptr, vp::engine::MemoryCategory::kActivations, size_t(m) * n);
  for (size_t i = 0; i < a.size(); ++i) a.data()[i] = 0.001f * (i % 97);
  for (size_t i = 0; i < b.size(); ++i) b.data()[i] = 0.001f * (i % 89);
  const double sec = BestSeconds(iters, [&] {
    vp::engine::cpu::Gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  });
  return 2.0 * m * n * k / sec / 1e9;
}

struct LayerResult {
  double seconds[3];  // F, B, W
  double gflops;
};

int LlamaFfn(int hidden) { return ((8 * hidden + 2) / 3 + 7) / 8 * 8; }

LayerResult LayerGflops(int hidden, int heads, int seq, int batch, int iters, bool llama) {
  vp::engine::ModelConfig cfg;
  cfg.layers = 1;
  cfg.hidden = hidden;
  cfg.heads = heads;
  cfg.ffn_hidden = 4 * hidden;
  if (llama) {
    cfg.architecture = vp::engine::Architecture::kLlama;
    cfg.kv_heads = std::max(1, heads / 4);
    cfg.ffn_hidden = LlamaFfn(hidden);
  }
  cfg.seq_len = seq;
  cfg.vocab = 1;
  const size_t np = vp::engine::LayerParamCount(cfg);
  std::vector<float> params(np), grads(np);
  auto stack = vp::engine::LayerStack::Create(cfg, 0, 1, batch, {0, seq}, params.data(),
                                              grads.data(), nullptr);
  if (!stack.ok()) {
    std::fprintf(stderr, "%s\n", std::string(stack.status().message()).c_str());
    std::exit(1);
  }
  stack->InitParams(1);
  const size_t nh = size_t(batch) * seq * hidden;
  std::vector<float> x(nh), y(nh), dy(nh), dx(nh);
  for (size_t i = 0; i < nh; ++i) {
    x[i] = 0.01f * float(i % 101) - 0.5f;
    dy[i] = 1e-3f * float(i % 37);
  }
  LayerResult r{{1e30, 1e30, 1e30}, 0};
  double best_total = 1e30;
  for (int i = 0; i <= iters; ++i) {  // iteration 0 is the warm-up
    const auto t0 = Clock::now();
    (void)stack->Forward({0, 0}, x.data(), y.data());
    const auto t1 = Clock::now();
    (void)stack->BackwardInput({0, 0}, dy.data(), dx.data());
    const auto t2 = Clock::now();
    (void)stack->BackwardWeight({0, 0});
    const auto t3 = Clock::now();
    if (i == 0) continue;
    const double f = std::chrono::duration<double>(t1 - t0).count();
    const double b = std::chrono::duration<double>(t2 - t1).count();
    const double w = std::chrono::duration<double>(t3 - t2).count();
    if (f + b + w < best_total) {
      best_total = f + b + w;
      r.seconds[0] = f;
      r.seconds[1] = b;
      r.seconds[2] = w;
    }
  }
  const double flops = llama
                           ? vp::flops::LlamaLayer(batch, seq, hidden, cfg.ffn_hidden, cfg.kv_dim())
                           : double(batch) * seq * hidden * (72.0 * hidden + 12.0 * seq);
  r.gflops = flops / best_total / 1e9;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, iters = 5;
  bool llama = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0)
      threads = std::atoi(argv[i] + 10);
    else if (std::strncmp(argv[i], "--iters=", 8) == 0)
      iters = std::atoi(argv[i] + 8);
    else if (std::strcmp(argv[i], "--arch=llama") == 0)
      llama = true;
    else if (std::strcmp(argv[i], "--arch=gpt2") == 0)
      llama = false;
    else {
      std::fprintf(stderr, "usage: %s [--threads=N] [--iters=N] [--arch=gpt2|llama]\n", argv[0]);
      return 2;
    }
  }
  vp::engine::cpu::SetBlasThreads(threads);
  const int seq = 256, batch = 4;
  std::printf("%s threads=%d (BLAS reports %d) s=%d b=%d L=1, best of %d\n",
              llama ? "llama" : "gpt2", threads, vp::engine::cpu::BlasThreads(), seq, batch, iters);
  std::printf("%6s %6s %9s %9s %9s %12s %12s %7s\n", "h", "heads", "F ms", "B ms", "W ms",
              "layer GF/s", "sgemm GF/s", "ratio");
  for (const int hidden : {256, 512}) {
    const int heads = hidden / 64;
    const LayerResult layer = LayerGflops(hidden, heads, seq, batch, iters, llama);
    const double gemm = llama ? SgemmGflops(batch * seq, 2 * LlamaFfn(hidden), hidden, iters)
                              : SgemmGflops(batch * seq, 4 * hidden, hidden, iters);
    std::printf("%6d %6d %9.2f %9.2f %9.2f %12.1f %12.1f %6.0f%%\n", hidden, heads,
                layer.seconds[0] * 1e3, layer.seconds[1] * 1e3, layer.seconds[2] * 1e3,
                layer.gflops, gemm, 100.0 * layer.gflops / gemm);
  }
  return 0;
}
