// Attention at long sequences (issue 32): the tiled CPU kernels' time, their share of one
// GPT-2 layer's F+B+W, and their FLOP rate against sgemm on the same threads.
//
//   engine_attention_bench [--threads=N] [--iters=N] [--seq=S[,S...]] [--hidden=H] [--heads=A]
//
// b = 1. Two FLOP rates: "model" counts attention as docs/engine.md ("FLOPs and memory") does,
// 12·s²·h for F+B (the whole s × s block, no recompute); "executed" counts what the kernels run:
// 2·head_dim FLOPs per score for each GEMM over the causal half (s²/2 per head), 2 GEMMs in
// the forward and 5 in the backward (the scores are recomputed). The sgemm reference is the
// layer's largest GEMM, (s × h)·(h × 4h), on the same threads. The layer is timed through a
// one-layer LayerStack, as engine_layer_bench does.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/kernels.h"
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

std::vector<float> Filled(size_t n, int mod, float step) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = step * float(int(i % mod) - mod / 2);
  return v;
}

double SgemmGflops(int m, int n, int k, int iters) {
  const std::vector<float> a = Filled(size_t(m) * k, 97, 1e-3f),
                           b = Filled(size_t(k) * n, 89, 1e-3f);
  std::vector<float> c(size_t(m) * n);
  const double sec = BestSeconds(iters, [&] {
    vp::engine::cpu::Gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  });
  return 2.0 * m * n * k / sec / 1e9;
}

// Seconds of one layer's F+B+W (best of iters).
double LayerSeconds(int hidden, int heads, int seq, int iters) {
  vp::engine::ModelConfig cfg;
  cfg.layers = 1;
  cfg.hidden = hidden;
  cfg.heads = heads;
  cfg.ffn_hidden = 4 * hidden;
  cfg.seq_len = seq;
  cfg.vocab = 1;
  const size_t np = vp::engine::LayerParamCount(cfg);
  std::vector<float> params(np), grads(np);
  auto stack =
      vp::engine::LayerStack::Create(cfg, 0, 1, 1, {0, seq}, params.data(), grads.data(), nullptr);
  if (!stack.ok()) {
    std::fprintf(stderr, "%s\n", std::string(stack.status().message()).c_str());
    std::exit(1);
  }
  stack->InitParams(1);
  const size_t nh = size_t(seq) * hidden;
  const std::vector<float> x = Filled(nh, 101, 0.01f), dy = Filled(nh, 37, 1e-3f);
  std::vector<float> y(nh), dx(nh);
  return BestSeconds(iters, [&] {
    (void)stack->Forward({0, 0}, x.data(), y.data());
    (void)stack->Backward({0, 0}, dy.data(), dx.data());
  });
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, iters = 3, hidden = 128, heads = 4;
  std::vector<int> seqs = {2048, 8192, 32768};
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      threads = std::atoi(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--iters=", 8) == 0) {
      iters = std::atoi(argv[i] + 8);
    } else if (std::strncmp(argv[i], "--hidden=", 9) == 0) {
      hidden = std::atoi(argv[i] + 9);
    } else if (std::strncmp(argv[i], "--heads=", 8) == 0) {
      heads = std::atoi(argv[i] + 8);
    } else if (std::strncmp(argv[i], "--seq=", 6) == 0) {
      seqs.clear();
      for (const char* p = argv[i] + 6; *p != '\0';) {
        seqs.push_back(std::atoi(p));
        while (*p != '\0' && *p != ',') ++p;
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads=N] [--iters=N] [--seq=S,...] [--hidden=H] [--heads=A]\n",
                   argv[0]);
      return 2;
    }
  }
  vp::engine::cpu::SetBlasThreads(threads);
  const int hd = hidden / heads;
  std::printf("threads=%d h=%d heads=%d head_dim=%d b=1, best of %d\n", threads, hidden, heads, hd,
              iters);
  std::printf("%7s %9s %9s %9s %8s %11s %14s %11s\n", "s", "F ms", "B ms", "layer ms", "share",
              "model GF/s", "executed GF/s", "sgemm GF/s");
  for (const int s : seqs) {
    const vp::engine::cpu::AttentionShape shape{1, heads, hd, 0, s, s};
    const size_t n = size_t(s) * hidden;
    const std::vector<float> qkv = Filled(3 * n, 101, 0.02f), dout = Filled(n, 37, 1e-3f);
    const std::vector<float> k(qkv.begin() + n, qkv.begin() + 2 * n),
        v(qkv.begin() + 2 * n, qkv.end());  // packed (s, h) caches, as the layer keeps them
    std::vector<float> out(n), lse(size_t(heads) * s), dq(3 * n), dk(n), dv(n),
        scratch(vp::engine::cpu::AttentionBackwardScratch(shape));
    const double f = BestSeconds(iters, [&] {
      vp::engine::cpu::AttentionForward(out.data(), lse.data(), qkv.data(), 3 * hidden, k.data(),
                                        v.data(), shape);
    });
    const double b = BestSeconds(iters, [&] {
      vp::engine::cpu::AttentionBackward(dq.data(), 3 * hidden, dk.data(), dv.data(),
                                         scratch.data(), dout.data(), out.data(), lse.data(),
                                         qkv.data(), 3 * hidden, k.data(), v.data(), shape);
    });
    const double layer = LayerSeconds(hidden, heads, s, std::max(1, iters - 1));
    const double model = 12.0 * s * double(s) * hidden;
    const double executed = 7.0 * 2.0 * hd * heads * (double(s) * (s + 1) / 2);
    const double gemm = SgemmGflops(std::min(s, 8192), 4 * hidden, hidden, iters);
    std::printf("%7d %9.1f %9.1f %9.1f %7.0f%% %11.1f %14.1f %11.1f\n", s, f * 1e3, b * 1e3,
                layer * 1e3, 100.0 * (f + b) / layer, model / (f + b) / 1e9,
                executed / (f + b) / 1e9, gemm);
  }
  return 0;
}
