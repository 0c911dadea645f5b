// CUDA throughput: the transformer layer's four linear GEMMs (forward), the output layer's S+T
// passes and the flash attention forward/backward, bf16 with fp32 accumulation, in TFLOP/s and
// MFU against the device's dense bf16 peak. Prints "no CUDA device" and exits 0 without a GPU.
//   cuda_bench [n_tokens=8192] [hidden=2048] [vocab_rows=32768] [peak_tflops=table]
//              [seq_len=1024] [head_dim=64]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/runtime.h"

using namespace vp::engine::cuda;

int main(int argc, char** argv) {
  if (DeviceCount() == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const int n = argc > 1 ? std::atoi(argv[1]) : 8192, h = argc > 2 ? std::atoi(argv[2]) : 2048;
  const int rows = argc > 3 ? std::atoi(argv[3]) : 32768;
  const std::string name = DeviceName(0).value_or("unknown");
  std::optional<double> peak = PeakBf16Tflops(name);
  if (argc > 4 && std::strcmp(argv[4], "table") != 0) peak = std::atof(argv[4]);
  const int seq = argc > 5 ? std::atoi(argv[5]) : 1024,
            head_dim = argc > 6 ? std::atoi(argv[6]) : 64;
  auto gemm = GemmRunner::Create();
  if (!gemm.ok()) return std::fprintf(stderr, "%s\n", gemm.status().ToString().c_str()), 1;
  auto alloc = [](size_t bytes) {
    void* p = nullptr;
    cudaMalloc(&p, bytes);
    cudaMemset(p, 0, bytes);
    return p;
  };
  auto* x = static_cast<bf16*>(alloc(size_t(n) * 4 * h * 2));
  auto* w = static_cast<bf16*>(alloc(size_t(4 * h) * 4 * h * 2));
  auto* y = static_cast<bf16*>(alloc(size_t(n) * 4 * h * 2));
  auto* probs = static_cast<bf16*>(alloc(size_t(n) * rows * 2));
  auto* wv = static_cast<bf16*>(alloc(size_t(rows) * h * 2));
  auto* dwv = static_cast<float*>(alloc(size_t(rows) * h * 4));
  auto* stats = static_cast<float*>(alloc(size_t(n) * 4 * 4));
  auto* labels = static_cast<int32_t*>(alloc(size_t(n) * 4));
  auto time = [&](auto&& body) {
    body();
    cudaDeviceSynchronize();
    const int reps = 10;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) body();
    cudaDeviceSynchronize();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  // Layer forward GEMMs: qkv (h→3h), proj (h→h), fc (h→4h), fc_proj (4h→h).
  const double layer_s = time([&] {
    (void)LinearForward<bf16>(**gemm, y, x, w, nullptr, n, h, 3 * h, nullptr);
    (void)LinearForward<bf16>(**gemm, y, x, w, nullptr, n, h, h, nullptr);
    (void)LinearForward<bf16>(**gemm, y, x, w, nullptr, n, h, 4 * h, nullptr);
    (void)LinearForward<bf16>(**gemm, y, x, w, nullptr, n, 4 * h, h, nullptr);
  });
  const double layer_flops = 2.0 * n * h * h * (3 + 1 + 4 + 4);
  const double st_s = time([&] {
    (void)OutputLayerS<bf16>(**gemm, probs, stats, stats + n, stats + 2 * n, nullptr, x, wv, labels,
                             n, h, rows, rows, nullptr);
    (void)OutputLayerT<bf16>(**gemm, probs, dwv, nullptr, x, wv, stats + 3 * n, labels, 1.0f / n, n,
                             h, rows, rows, nullptr);
  });
  const double st_flops = 2.0 * 2.0 * n * h * rows;
  // Attention over whole sequences of seq tokens (n / seq of them), q inside a (b, seq, 3h) qkv
  // buffer as in the model, k/v in their own (b, seq, h) cache.
  const int batch = n / seq > 0 ? n / seq : 1, heads = h / head_dim;
  const AttentionShape att{.batch = batch,
                           .heads = heads,
                           .head_dim = head_dim,
                           .q_begin = 0,
                           .q_end = seq,
                           .kv_rows = seq};
  const size_t att_rows = size_t(batch) * seq;
  auto* qkv = static_cast<bf16*>(alloc(att_rows * 3 * h * 2));
  auto* dqkv = static_cast<bf16*>(alloc(att_rows * 3 * h * 2));
  auto* kv = static_cast<bf16*>(alloc(att_rows * h * 2 * 4));              // k, v, dk, dv
  auto* att_out = static_cast<bf16*>(alloc(att_rows * h * 2 * 2));         // out, dout
  auto* att_stats = static_cast<float*>(alloc(att_rows * heads * 4 * 2));  // lse, delta
  bf16 *k = kv, *v = kv + att_rows * h, *dk = kv + 2 * att_rows * h, *dv = kv + 3 * att_rows * h;
  bf16 *out = att_out, *dout = att_out + att_rows * h;
  float *lse = att_stats, *delta = att_stats + att_rows * heads;
  if (cudaError_t e = AttentionForward<bf16>(out, lse, qkv, 3 * h, k, v, att, nullptr);
      e != cudaSuccess) {
    return std::fprintf(stderr, "attention: %s\n", cudaGetErrorString(e)), 1;
  }
  const double att_fwd_s =
      time([&] { (void)AttentionForward<bf16>(out, lse, qkv, 3 * h, k, v, att, nullptr); });
  const double att_bwd_s = time([&] {
    (void)AttentionBackward<bf16>(dqkv, dk, dv, delta, dout, out, lse, qkv, 3 * h, k, v, att,
                                  nullptr);
  });
  // FLOP convention (causal, counting only the visible scores): the forward's two matmuls
  // Q·Kᵀ and P·V cost 2·len_i·head_dim each per query row i, so 4·b·heads·Σ_i len_i·head_dim with
  // len_i = i + 1; the backward (recomputed Q·Kᵀ, dP = dO·Vᵀ, dV, dK, dQ) is counted as 2.5× the
  // forward, the usual FlashAttention convention.
  const double att_fwd_flops = 4.0 * batch * heads * (0.5 * seq * (seq + 1.0)) * head_dim;
  const double att_bwd_flops = 2.5 * att_fwd_flops;
  auto report = [&](const char* what, double flops, double s) {
    const std::optional<double> mfu = Mfu(flops, s, peak);
    std::printf("%-28s %8.3f ms  %7.1f TFLOP/s  MFU %s\n", what, s * 1e3, flops / s / 1e12,
                mfu ? (std::to_string(*mfu * 100) + "%").c_str() : "n/a (unknown peak)");
  };
  std::printf("device %s, peak %s TFLOP/s, n %d, h %d, vocab rows %d\n", name.c_str(),
              peak ? std::to_string(*peak).c_str() : "unknown", n, h, rows);
  report("layer linear GEMMs (fwd)", layer_flops, layer_s);
  report("output layer S+T", st_flops, st_s);
  std::printf("attention: batch %d, seq %d, heads %d, head_dim %d (whole sequences, causal)\n",
              batch, seq, heads, head_dim);
  report("attention fwd", att_fwd_flops, att_fwd_s);
  report("attention bwd", att_bwd_flops, att_bwd_s);
  report("attention fwd+bwd", att_fwd_flops + att_bwd_flops, att_fwd_s + att_bwd_s);
  for (void* p :
       {(void*)x, (void*)w, (void*)y, (void*)probs, (void*)wv, (void*)dwv, (void*)stats,
        (void*)labels, (void*)qkv, (void*)dqkv, (void*)kv, (void*)att_out, (void*)att_stats}) {
    cudaFree(p);
  }
  return 0;
}
