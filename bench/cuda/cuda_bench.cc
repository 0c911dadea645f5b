// CUDA throughput in bf16 (fp32 accumulation), in ms, TFLOP/s and MFU against the device's dense
// bf16 peak (PeakBf16Tflops of the device name, or --peak). Prints "no CUDA device" and exits 0
// without a GPU. Four sections (--sections picks some):
//
//   layer      the training runtime's real transformer passes: F, B (BackwardInput) and W
//              (BackwardWeight) of a DeviceLayerStack<bf16> of --layers layers, each timed on
//              its own (one microbatch of --batch sequences of --seq tokens, one chunk).
//   output     the output layer's S, C1 and T passes of a DeviceOutputLayerShard<bf16> of --rows
//              vocabulary rows (one shard of V = rows·p over p ranks), n = batch·seq tokens, under
//              Algorithm 2 and Algorithm 1 (--algorithm); C1 through a 1-rank self communicator
//              (identity collectives), so it measures the barrier's local kernels only; under
//              Algorithm 1 also its C2 barrier.
//   gemm       the layer's four forward linear GEMMs as bare kernels (no LayerNorm, GELU, ...).
//   attention  the flash attention forward/backward kernels over whole causal sequences.
//
// The layer and output sections call the public pass methods the runtime calls; each returns
// after its stream is idle (device.h: Finish), so the host wall time of one call is what the
// runtime's schedule sees: the device time plus launch and synchronisation overhead.
//
// Build and run on a GPU machine (see bench/cuda/README.md):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
//   cmake --build build --target cuda_bench
//   build/bench/cuda/cuda_bench [--hidden=768] [--heads=12] [--ffn=3072] [--seq=1024]
//       [--batch=4] [--layers=1] [--rows=32768] [--iters=20] [--warmup=3] [--peak=TFLOPS]
//       [--algorithm=both|1|2] [--sections=layer,output,gemm,attention]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "worker/comm/communicator.h"
#include "worker/engine/config.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"
#include "worker/engine/transformer/cuda/transformer.h"
#include "worker/engine/transformer/transformer.h"
#include "worker/engine/vocab/cuda/vocab_shards.h"
#include "worker/engine/vocab/partition.h"
#include "worker/launch/cuda_environment.h"

namespace vp::engine::cuda {
namespace {

#define VP_BENCH_ASSIGN(lhs, expr)              \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

#define VP_BENCH_RETURN_IF_ERROR(expr)                          \
  do {                                                          \
    if (absl::Status vp_bench_s_ = (expr); !vp_bench_s_.ok()) { \
      return vp_bench_s_;                                       \
    }                                                           \
  } while (0)

constexpr const char* kUsage =
    "usage: cuda_bench [--hidden=768] [--heads=12] [--ffn=3072] [--seq=1024] [--batch=4]\n"
    "                  [--layers=1] [--rows=32768] [--iters=20] [--warmup=3] [--peak=TFLOPS]\n"
    "                  [--algorithm=both|1|2] [--sections=layer,output,gemm,attention]\n";

struct Options {
  int hidden = 768;            // h (GPT-2 small)
  int heads = 12;              // h % heads == 0
  int ffn = 3072;              // f = 4h
  int seq = 1024;              // s
  int batch = 4;               // b, sequences per microbatch
  int layers = 1;              // layers in the timed stack
  int rows = 32768;            // output-layer shard rows (V = 128k over p = 4)
  int iters = 20;              // timed iterations per pass
  int warmup = 3;              // untimed iterations first (cuBLASLt plans, allocator cache)
  std::optional<double> peak;  // --peak overrides the device table
  bool layer = true, output = true, gemm = true, attention = true;
  std::vector<OutputAlgorithm> algorithms = {OutputAlgorithm::kAlgorithm2,
                                             OutputAlgorithm::kAlgorithm1};

  int tokens() const { return batch * seq; }  // n, tokens of one microbatch
};

// absl::string_view here: this absl build has its own string_view type, which StrCat,
// SimpleAtoi and StrSplit take.
absl::StatusOr<Options> ParseFlags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.substr(0, 2) != "--" || eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("argument '", arg, "': expected --name=value"));
    }
    const absl::string_view name = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    auto int_flag = [&](int& out, int min) -> absl::Status {
      if (!absl::SimpleAtoi(value, &out) || out < min) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, "=", value, ": must be an integer >= ", min));
      }
      return absl::OkStatus();
    };
    absl::Status s;
    if (name == "hidden") {
      s = int_flag(o.hidden, 8);
    } else if (name == "heads") {
      s = int_flag(o.heads, 1);
    } else if (name == "ffn") {
      s = int_flag(o.ffn, 8);
    } else if (name == "seq") {
      s = int_flag(o.seq, 1);
    } else if (name == "batch") {
      s = int_flag(o.batch, 1);
    } else if (name == "layers") {
      s = int_flag(o.layers, 1);
    } else if (name == "rows") {
      s = int_flag(o.rows, 8);
    } else if (name == "iters") {
      s = int_flag(o.iters, 1);
    } else if (name == "warmup") {
      s = int_flag(o.warmup, 0);
    } else if (name == "peak") {
      double peak = 0;
      if (!absl::SimpleAtod(value, &peak) || !(peak > 0)) {
        return absl::InvalidArgumentError(absl::StrCat("--peak=", value, ": must be > 0 TFLOP/s"));
      }
      o.peak = peak;
    } else if (name == "algorithm") {
      if (value == "both") {
        o.algorithms = {OutputAlgorithm::kAlgorithm2, OutputAlgorithm::kAlgorithm1};
      } else if (value == "1") {
        o.algorithms = {OutputAlgorithm::kAlgorithm1};
      } else if (value == "2") {
        o.algorithms = {OutputAlgorithm::kAlgorithm2};
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--algorithm=", value, ": must be 1, 2 or both"));
      }
    } else if (name == "sections") {
      o.layer = o.output = o.gemm = o.attention = false;
      for (absl::string_view section : absl::StrSplit(value, ',')) {
        if (section == "layer") {
          o.layer = true;
        } else if (section == "output") {
          o.output = true;
        } else if (section == "gemm") {
          o.gemm = true;
        } else if (section == "attention") {
          o.attention = true;
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              "--sections: '", section, "' is not one of layer, output, gemm, attention"));
        }
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!s.ok()) return s;
  }
  // The rules DeviceLayerStack / DeviceOutputLayerShard::Create enforce, checked up front so a
  // bad shape fails before any device work.
  if (o.hidden % o.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hidden ", o.hidden, " % --heads ", o.heads, " must be 0"));
  }
  if (o.hidden % 8 != 0 || o.ffn % 8 != 0 || o.rows % 8 != 0) {
    return absl::InvalidArgumentError(
        "--hidden, --ffn and --rows must be multiples of 8 (cuBLASLt 16-byte alignment)");
  }
  return o;
}

// Formats one result line: pass, ms, TFLOP/s and MFU against the dense bf16 peak.
class Reporter {
 public:
  explicit Reporter(std::optional<double> peak_tflops) : peak_(peak_tflops) {}

  void Line(std::string_view what, double flops, double seconds) const {
    if (flops <= 0) {  // barriers: no model FLOPs
      std::printf("  %-30.*s %9.3f ms  (barrier, no FLOPs counted)\n",
                  static_cast<int>(what.size()), what.data(), seconds * 1e3);
      return;
    }
    const std::optional<double> mfu = Mfu(flops, seconds, peak_);
    const std::string mfu_text =
        mfu ? absl::StrCat(std::round(*mfu * 1000) / 10, "%") : "n/a (unknown peak; --peak)";
    std::printf("  %-30.*s %9.3f ms  %8.1f TFLOP/s  MFU %s\n", static_cast<int>(what.size()),
                what.data(), seconds * 1e3, flops / seconds / 1e12, mfu_text.c_str());
  }

 private:
  std::optional<double> peak_;
};

// Seconds of one call of a pass (host wall time; the pass returns with its stream idle).
template <typename Pass>
absl::StatusOr<double> Seconds(Pass&& pass) {
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = pass(); !s.ok()) return s;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `count` bf16 values drawn uniformly from [-scale, scale] on the host and rounded on the device
// (FloatToBf16): the values do not matter for timing but must be finite.
absl::StatusOr<DeviceArray<bf16>> RandomBf16(const DeviceContext& ctx, MemoryCategory category,
                                             size_t count, uint32_t seed, float scale) {
  std::vector<float> host(count);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (float& v : host) v = dist(rng);
  VP_BENCH_ASSIGN(staging, DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, count,
                                                      /*zero=*/false));
  VP_BENCH_ASSIGN(out, DeviceArray<bf16>::Create(ctx, category, count, /*zero=*/false));
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data(), host.data(), count * sizeof(float),
                                          cudaMemcpyHostToDevice, ctx.stream));
  VP_CUDA_RETURN_IF_ERROR(
      FloatToBf16(out.data(), staging.data(), static_cast<long>(count), ctx.stream));
  // The host vector and the staging block must outlive the copy and the conversion.
  VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
  return out;
}

// True if every element of the device array is finite (a sanity check that the timed passes
// computed on real numbers).
template <typename E>
absl::StatusOr<bool> AllFinite(const E* dev, size_t count) {
  std::vector<E> host(count);
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpy(host.data(), dev, count * sizeof(E), cudaMemcpyDeviceToHost));
  for (const E& v : host) {
    float f;
    if constexpr (std::is_same_v<E, bf16>) {
      f = __bfloat162float(v);
    } else {
      f = static_cast<float>(v);
    }
    if (!std::isfinite(f)) return false;
  }
  return true;
}

// One rank's device as the runtime sets it up: a caching allocator reusing blocks after the
// stream synchronises, shared by a compute context and a (high-priority) communication context.
// Declared before, so destroyed after, every DeviceArray taken from it.
struct BenchDevice {
  MemoryTracker tracker;
  CachingAllocator alloc{MakeCudaMemoryBackend(), &tracker, CachingAllocator::Reuse::kAfterSync};
  CudaStream compute_stream, comm_stream;
  std::unique_ptr<GemmRunner> compute_gemm, comm_gemm;
  DeviceContext compute, comm;

  absl::Status Init() {
    VP_BENCH_ASSIGN(cs, CudaStream::Create());
    VP_BENCH_ASSIGN(ms, CudaStream::Create(CudaStream::Priority::kHigh));
    VP_BENCH_ASSIGN(cg, GemmRunner::Create());
    VP_BENCH_ASSIGN(mg, GemmRunner::Create());
    compute_stream = std::move(cs);
    comm_stream = std::move(ms);
    compute_gemm = std::move(cg);
    comm_gemm = std::move(mg);
    compute = DeviceContext{compute_stream.get(), compute_gemm.get(), &alloc};
    comm = DeviceContext{comm_stream.get(), comm_gemm.get(), &alloc};
    return absl::OkStatus();
  }
};

// ---------------------------------------------------------------------------------------------
// Transformer layer passes F, B, W through DeviceLayerStack<bf16>.

// FLOP convention: worker/runtime/flops.cc's TransformerLayerFlops (the paper's Table 4) for one
// layer and one microbatch of b sequences, forward + backward:
//   6·b·s·(4h² + 2·h·f) + 12·b·s²·h
// (the attention term counts the full s×s score matrix, Megatron's convention, although the
// kernel skips the causal upper triangle). Each of F, B and W is credited with one third of it,
// 2·b·s·(4h² + 2·h·f) + 4·b·s²·h, so F + B + W is exactly the runtime's per-layer model FLOPs
// and the "F+B+W" MFU line is the runtime's MFU definition. (Really B also carries the attention
// backward and W none of it; the split only moves credit between the B and W lines.)
double LayerPassFlops(const Options& o) {
  const double bs = static_cast<double>(o.batch) * o.seq, h = o.hidden, f = o.ffn;
  return o.layers * (2.0 * bs * (4.0 * h * h + 2.0 * h * f) + 4.0 * bs * o.seq * h);
}

absl::Status RunLayerPasses(const Options& o, const Reporter& report) {
  ModelConfig cfg;
  cfg.layers = o.layers;
  cfg.hidden = o.hidden;
  cfg.heads = o.heads;
  cfg.vocab = o.rows;  // unused by the layer stack
  cfg.seq_len = o.seq;
  cfg.ffn_hidden = o.ffn;
  BenchDevice dev;
  VP_BENCH_RETURN_IF_ERROR(dev.Init());
  const DeviceContext& ctx = dev.compute;
  const size_t param_count = static_cast<size_t>(o.layers) * LayerParamCount(cfg);
  const size_t act_count = static_cast<size_t>(o.tokens()) * o.hidden;  // (b, s, h)

  VP_BENCH_ASSIGN(params,
                  RandomBf16(ctx, MemoryCategory::kParameters, param_count, 1, 0.02f));  // (P)
  VP_BENCH_ASSIGN(grads, DeviceArray<float>::Create(ctx, MemoryCategory::kGradients,
                                                    param_count));  // (P) fp32
  VP_BENCH_ASSIGN(x, RandomBf16(ctx, MemoryCategory::kActivations, act_count, 2, 1.0f));  // (b,s,h)
  VP_BENCH_ASSIGN(dout,
                  RandomBf16(ctx, MemoryCategory::kActivations, act_count, 3, 0.01f));  // (b,s,h)
  VP_BENCH_ASSIGN(out, DeviceArray<bf16>::Create(ctx, MemoryCategory::kActivations, act_count,
                                                 false));  // (b, s, h)
  VP_BENCH_ASSIGN(dx, DeviceArray<bf16>::Create(ctx, MemoryCategory::kActivations, act_count,
                                                false));  // (b, s, h)
  VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
  // One chunk per microbatch: slot {mb, 0} covers positions [0, s).
  VP_BENCH_ASSIGN(stack, DeviceLayerStack<bf16>::Create(cfg, 0, o.layers, o.batch, {0, o.seq},
                                                        params.data(), grads.data(), ctx));

  // Each iteration is a fresh microbatch id: F, then its B, then its W (which frees the slot),
  // so one microbatch's activations are live at a time.
  double f_s = 0, b_s = 0, w_s = 0;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    const SlotKey slot{i, 0};
    VP_BENCH_ASSIGN(f, Seconds([&] { return stack->Forward(slot, x.data(), out.data()); }));
    VP_BENCH_ASSIGN(b, Seconds([&] { return stack->BackwardInput(slot, dout.data(), dx.data()); }));
    VP_BENCH_ASSIGN(w, Seconds([&] { return stack->BackwardWeight(slot); }));
    if (i >= o.warmup) {
      f_s += f / o.iters;
      b_s += b / o.iters;
      w_s += w / o.iters;
    }
  }
  VP_BENCH_ASSIGN(out_finite, AllFinite(out.data(), act_count));
  VP_BENCH_ASSIGN(dx_finite, AllFinite(dx.data(), act_count));
  VP_BENCH_ASSIGN(grads_finite, AllFinite(grads.data(), param_count));

  std::printf(
      "layer passes (DeviceLayerStack<bf16>): %d layer(s), h %d, heads %d, ffn %d, b %d, s %d, "
      "%d iters after %d warm-up\n",
      o.layers, o.hidden, o.heads, o.ffn, o.batch, o.seq, o.iters, o.warmup);
  const double flops = LayerPassFlops(o);
  report.Line("F (Forward)", flops, f_s);
  report.Line("B (BackwardInput)", flops, b_s);
  report.Line("W (BackwardWeight)", flops, w_s);
  report.Line("F+B+W", 3 * flops, f_s + b_s + w_s);
  std::printf("  outputs, input gradients and weight gradients finite: %s\n",
              out_finite && dx_finite && grads_finite ? "yes" : "NO");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Output layer passes S, C1, T through DeviceOutputLayerShard<bf16>.

// FLOP convention (the GEMMs only; softmax statistics and C1 count 0), n tokens, `rows` shard
// rows, hidden h:
//   S  Y = X·W_rᵀ                                     2·n·rows·h
//      + Algorithm 2's A = P'·W_r                     2·n·rows·h
//   T  ∇W_r += gradᵀ·X                                2·n·rows·h
//      + Algorithm 1's ∇X' = grad·W_r                 2·n·rows·h
// S + T = 6·n·rows·h under either algorithm: one shard's share of flops.cc's OutputLayerFlops.
struct OutputFlops {
  double s = 0, t = 0;
};
OutputFlops OutputPassFlops(const Options& o, OutputAlgorithm algorithm) {
  const double gemm = 2.0 * o.tokens() * static_cast<double>(o.rows) * o.hidden;
  const bool alg2 = algorithm == OutputAlgorithm::kAlgorithm2;
  return {.s = alg2 ? 2 * gemm : gemm, .t = alg2 ? gemm : 2 * gemm};
}

absl::Status RunOutputLayer(const Options& o, OutputAlgorithm algorithm, const Reporter& report) {
  const int n = o.tokens(), h = o.hidden;
  // One rank owning all `rows` rows of a V = rows vocabulary: the same shard shape (and the same
  // S/T work) as one of p ranks of a V = p·rows vocabulary; C1's collectives are the identity.
  VP_BENCH_ASSIGN(partition, vocab::MakeVocabPartition(o.rows, /*world=*/1, /*rank=*/0));
  std::unique_ptr<comm::Communicator> self = comm::MakeSelfCommunicator();
  BenchDevice dev;
  VP_BENCH_RETURN_IF_ERROR(dev.Init());
  const DeviceContext& ctx = dev.compute;
  const size_t weight_count = static_cast<size_t>(partition.rows) * h;

  VP_BENCH_ASSIGN(
      weight, RandomBf16(ctx, MemoryCategory::kParameters, weight_count, 4, 0.02f));  // (rows,h)
  VP_BENCH_ASSIGN(weight_grad, DeviceArray<float>::Create(ctx, MemoryCategory::kGradients,
                                                          weight_count));  // (rows, h) fp32
  VP_BENCH_ASSIGN(x, RandomBf16(ctx, MemoryCategory::kActivations, static_cast<size_t>(n) * h, 5,
                                1.0f));  // (n, h)
  VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
  std::vector<int32_t> labels(n);  // (n) host, global ids in [0, V)
  std::mt19937 rng(6);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(partition.vocab - 1));
  for (int32_t& l : labels) l = token(rng);
  VP_BENCH_ASSIGN(shard,
                  DeviceOutputLayerShard<bf16>::Create(partition, h, algorithm, weight.data(),
                                                       weight_grad.data(), dev.compute, dev.comm));

  const float d = 1.0f / n;  // mean loss over the microbatch's tokens
  const bool alg2 = algorithm == OutputAlgorithm::kAlgorithm2;
  double s_s = 0, c1_s = 0, t_s = 0, c2_s = 0, mean_loss = 0;
  bool finite = true;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    DeviceOutputLayerState<bf16> state;
    VP_BENCH_ASSIGN(s, Seconds([&]() -> absl::Status {
                      auto st = shard->S(x.data(), labels.data(), n, d);
                      if (!st.ok()) return st.status();
                      state = std::move(*st);
                      return absl::OkStatus();
                    }));
    VP_BENCH_ASSIGN(c1, Seconds([&] { return shard->C1(state, *self); }));
    VP_BENCH_ASSIGN(t, Seconds([&] { return shard->T(state, x.data()); }));
    double c2 = 0;  // Algorithm 1's ∇X barrier (identity all-reduce on 1 rank)
    if (!alg2) {
      VP_BENCH_ASSIGN(c2_sec, Seconds([&] { return shard->C2(state, *self); }));
      c2 = c2_sec;
    }
    if (i >= o.warmup) {
      s_s += s / o.iters;
      c1_s += c1 / o.iters;
      t_s += t / o.iters;
      c2_s += c2 / o.iters;
    }
    if (i == o.warmup + o.iters - 1) {  // sanity check on the last iteration
      double sum = 0;
      for (int j = 0; j < n; ++j) {
        finite = finite && std::isfinite(state.losses()[j]);
        sum += state.losses()[j];
      }
      mean_loss = sum / n;
      const float* grad_x = state.grad_input();  // (n, h) fp32, after C1 (Alg. 2) or C2 (Alg. 1)
      if (grad_x == nullptr) return absl::InternalError("output layer: grad X not ready");
      VP_BENCH_ASSIGN(gx_finite, AllFinite(grad_x, static_cast<size_t>(n) * h));
      finite = finite && gx_finite;
    }
  }
  VP_BENCH_ASSIGN(wg_finite, AllFinite(weight_grad.data(), weight_count));

  std::printf(
      "output layer passes (DeviceOutputLayerShard<bf16>, Algorithm %d): n %d tokens, %lld "
      "rows, h %d, 1-rank C1, %d iters after %d warm-up\n",
      alg2 ? 2 : 1, n, static_cast<long long>(partition.rows), h, o.iters, o.warmup);
  const OutputFlops flops = OutputPassFlops(o, algorithm);
  report.Line(alg2 ? "S (logits + A)" : "S (logits)", flops.s, s_s);
  report.Line("C1 (1-rank)", 0, c1_s);
  report.Line(alg2 ? "T (grad W)" : "T (grad W + grad X')", flops.t, t_s);
  if (alg2) {
    report.Line("S+C1+T", flops.s + flops.t, s_s + c1_s + t_s);
  } else {
    report.Line("C2 (1-rank)", 0, c2_s);
    report.Line("S+C1+T+C2", flops.s + flops.t, s_s + c1_s + t_s + c2_s);
  }
  std::printf("  losses, grad X and grad W finite: %s; mean loss %.3f (ln rows = %.3f)\n",
              finite && wg_finite ? "yes" : "NO", mean_loss, std::log(double(partition.rows)));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Bare kernels: the layer's forward linear GEMMs and flash attention.

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceMemory = std::unique_ptr<void, CudaFree>;

absl::StatusOr<DeviceMemory> Zeroed(size_t bytes) {
  void* p = nullptr;
  VP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  DeviceMemory mem(p);
  VP_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes));
  return mem;
}

// Mean seconds of `body` over 10 calls after one warm-up call, on the legacy default stream.
template <typename Body>
absl::StatusOr<double> TimeKernels(Body&& body) {
  VP_BENCH_RETURN_IF_ERROR(body());
  VP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  constexpr int kReps = 10;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kReps; ++i) VP_BENCH_RETURN_IF_ERROR(body());
  VP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kReps;
}

absl::Status RunGemms(const Options& o, const Reporter& report) {
  const int n = o.tokens(), h = o.hidden, f = o.ffn;
  const int wide = std::max(3 * h, f);
  VP_BENCH_ASSIGN(gemm, GemmRunner::Create());
  VP_BENCH_ASSIGN(x_mem, Zeroed(size_t(n) * wide * sizeof(bf16)));
  VP_BENCH_ASSIGN(w_mem, Zeroed(size_t(wide) * wide * sizeof(bf16)));
  VP_BENCH_ASSIGN(y_mem, Zeroed(size_t(n) * wide * sizeof(bf16)));
  auto* x = static_cast<bf16*>(x_mem.get());  // (n, max(3h, f))
  auto* w = static_cast<bf16*>(w_mem.get());  // (max(3h, f), max(3h, f))
  auto* y = static_cast<bf16*>(y_mem.get());  // (n, max(3h, f))
  // qkv (h→3h), attention proj (h→h), fc (h→f), fc proj (f→h).
  VP_BENCH_ASSIGN(
      sec, TimeKernels([&]() -> absl::Status {
        VP_BENCH_RETURN_IF_ERROR(
            LinearForward<bf16>(*gemm, y, x, w, nullptr, n, h, 3 * h, nullptr));
        VP_BENCH_RETURN_IF_ERROR(LinearForward<bf16>(*gemm, y, x, w, nullptr, n, h, h, nullptr));
        VP_BENCH_RETURN_IF_ERROR(LinearForward<bf16>(*gemm, y, x, w, nullptr, n, h, f, nullptr));
        return LinearForward<bf16>(*gemm, y, x, w, nullptr, n, f, h, nullptr);
      }));
  std::printf("kernels: layer linear GEMMs, n %d, h %d, ffn %d\n", n, h, f);
  report.Line("linear GEMMs (fwd)", 2.0 * n * (4.0 * h * h + 2.0 * h * f), sec);
  return absl::OkStatus();
}

absl::Status RunAttention(const Options& o, const Reporter& report) {
  const int batch = o.batch, seq = o.seq, h = o.hidden, heads = o.heads;
  const int head_dim = h / heads;
  // q inside a (b, seq, 3h) qkv buffer as in the model, k/v in their own (b, seq, h) cache.
  const AttentionShape att{.batch = batch,
                           .heads = heads,
                           .head_dim = head_dim,
                           .q_begin = 0,
                           .q_end = seq,
                           .kv_rows = seq};
  const size_t rows = size_t(batch) * seq;
  VP_BENCH_ASSIGN(qkv_mem, Zeroed(rows * 3 * h * sizeof(bf16)));
  VP_BENCH_ASSIGN(dqkv_mem, Zeroed(rows * 3 * h * sizeof(bf16)));
  VP_BENCH_ASSIGN(kv_mem, Zeroed(rows * h * sizeof(bf16) * 4));          // k, v, dk, dv
  VP_BENCH_ASSIGN(out_mem, Zeroed(rows * h * sizeof(bf16) * 2));         // out, dout
  VP_BENCH_ASSIGN(stats_mem, Zeroed(rows * heads * sizeof(float) * 2));  // lse, delta
  auto* qkv = static_cast<bf16*>(qkv_mem.get());                         // (b, seq, 3h)
  auto* dqkv = static_cast<bf16*>(dqkv_mem.get());                       // (b, seq, 3h)
  bf16* k = static_cast<bf16*>(kv_mem.get());                            // (b, seq, h) each
  bf16 *v = k + rows * h, *dk = k + 2 * rows * h, *dv = k + 3 * rows * h;
  bf16* out = static_cast<bf16*>(out_mem.get());  // (b, seq, h) each
  bf16* dout = out + rows * h;
  float* lse = static_cast<float*>(stats_mem.get());  // (b, heads, seq) each
  float* delta = lse + rows * heads;
  VP_BENCH_ASSIGN(
      fwd_s, TimeKernels([&]() -> absl::Status {
        VP_CUDA_RETURN_IF_ERROR(AttentionForward<bf16>(out, lse, qkv, 3 * h, k, v, att, nullptr));
        return absl::OkStatus();
      }));
  VP_BENCH_ASSIGN(bwd_s, TimeKernels([&]() -> absl::Status {
                    VP_CUDA_RETURN_IF_ERROR(AttentionBackward<bf16>(
                        dqkv, dk, dv, delta, dout, out, lse, qkv, 3 * h, k, v, att, nullptr));
                    return absl::OkStatus();
                  }));
  // FLOP convention (causal, counting only the visible scores): the forward's two matmuls Q·Kᵀ
  // and P·V cost 2·len_i·head_dim each per query row i, so 4·b·heads·Σ_i len_i·head_dim with
  // len_i = i + 1; the backward (recomputed Q·Kᵀ, dP = dO·Vᵀ, dV, dK, dQ) is counted as 2.5×
  // the forward, the usual FlashAttention convention.
  const double fwd_flops = 4.0 * batch * heads * (0.5 * seq * (seq + 1.0)) * head_dim;
  const double bwd_flops = 2.5 * fwd_flops;
  std::printf("kernels: attention, batch %d, seq %d, heads %d, head_dim %d (causal)\n", batch, seq,
              heads, head_dim);
  report.Line("attention fwd", fwd_flops, fwd_s);
  report.Line("attention bwd", bwd_flops, bwd_s);
  report.Line("attention fwd+bwd", fwd_flops + bwd_flops, fwd_s + bwd_s);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
  }
  absl::StatusOr<Options> opts = ParseFlags(argc, argv);
  if (!opts.ok()) {
    std::fprintf(stderr, "%s\n%s", std::string(opts.status().message()).c_str(), kUsage);
    return 2;
  }
  if (DeviceCount() == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const Options& o = *opts;
  const std::string name = DeviceName(0).value_or("unknown");
  const std::optional<double> peak = o.peak ? o.peak : PeakBf16Tflops(name);
  std::printf("GPU %s, dense bf16 peak %s TFLOP/s%s\n", name.c_str(),
              peak ? absl::StrCat(*peak).c_str() : "unknown",
              o.peak ? " (--peak)" : (peak ? " (table)" : ""));
  const Reporter report(peak);
  int failures = 0;
  auto run = [&](const char* section, const absl::Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", section, s.ToString().c_str());
      ++failures;
    }
  };
  if (o.layer) run("layer", RunLayerPasses(o, report));
  if (o.output) {
    for (OutputAlgorithm a : o.algorithms) run("output", RunOutputLayer(o, a, report));
  }
  if (o.gemm) run("gemm", RunGemms(o, report));
  if (o.attention) run("attention", RunAttention(o, report));
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace vp::engine::cuda

int main(int argc, char** argv) {
  if (const std::string note = vp::launch::PrepareCudaEnvironment(); !note.empty()) {
    std::fprintf(stderr, "cuda_bench: %s\n", note.c_str());
  }
  return vp::engine::cuda::Main(argc, argv);
}
