// CUDA throughput in bf16 (fp32 accumulation), in ms, TFLOP/s and MFU against the bf16 GEMM
// peak measured here (section peak), or --peak, or the device's datasheet figure
// (PeakBf16Tflops of the device name). Prints "no CUDA device" and exits 0 without a GPU. Seven
// sections (--sections picks some):
//
//   peak       the bf16 GEMM peak: a --peak-size³ GEMM (8192³) through the project's GemmRunner
//              (cuBLASLt), best of 5 timed with events after warm-up. Every later MFU uses it
//              (unless --peak is given).
//   layer      the training runtime's real transformer passes: F, B (BackwardInput) and W
//              (BackwardWeight) of a DeviceLayerStack<bf16> of --layers layers, each timed on
//              its own (one microbatch of --batch sequences of --seq tokens, one chunk).
//   output     the output layer's S, C1 and T passes of a DeviceOutputLayerShard<bf16> of --rows
//              vocabulary rows (one shard of V = rows·p over p ranks), n = batch·seq tokens, under
//              Algorithm 2 and Algorithm 1 (--algorithm); C1 through a 1-rank self communicator
//              (identity collectives), so it measures the barrier's local kernels only; under
//              Algorithm 1 also its C2 barrier.
//   gemm       the layer's forward linear GEMMs as bare kernels (no norms, activations, ...).
//   attention  the flash attention forward/backward kernels over whole causal sequences.
//   memory     the memory-bound kernels (norms, GELU or SwiGLU, bias, residual) alone, both
//              kernel sets, in TB/s against a device-to-device copy.
//   step       one whole p = 1 training step of a --layers-layer model with V = --rows
//              (untied), --microbatches microbatches of --batch sequences: the runtime's device
//              classes and kernels in the executor's p = 1 order (RunStep below), fp32 master
//              weights + AdamW, bf16 compute; tokens/s, MFU and the allocator's peak in-use and
//              reserved memory.
//
// --arch=llama --kv-heads=K switches every section to the Llama layer (RMSNorm, RoPE, grouped-
// query attention with K key/value heads, SwiGLU with --ffn hidden units, no biases).
//
// The layer, output and step sections call the public pass methods the runtime calls; each
// returns after its stream is idle (device.h: Finish), so the host wall time of one call is what
// the runtime's schedule sees: the device time plus launch and synchronisation overhead.
//
// Lines starting "PERF " carry the headline numbers as key=value pairs for bench/cuda/perf.sh.
//
// Build and run on a GPU machine (see bench/cuda/README.md):
//   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
//   cmake --build build --target cuda_bench
//   build/bench/cuda/cuda_bench [--arch=gpt2|llama] [--hidden=768] [--heads=12] [--kv-heads=0]
//       [--ffn=3072] [--seq=1024] [--batch=4] [--layers=1] [--rows=32768] [--microbatches=2]
//       [--iters=20] [--warmup=3] [--peak=TFLOPS] [--peak-size=8192] [--algorithm=both|1|2]
//       [--sections=peak,layer,output,gemm,attention,memory,step] [--print-flops]
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
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
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "proto/plan/flops.h"
#include "worker/comm/communicator.h"
#include "worker/engine/config.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernel_switches.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/phase_timer.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"
#include "worker/engine/model/cuda/model_kernels.h"
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
    "usage: cuda_bench [--arch=gpt2|llama] [--hidden=768] [--heads=12] [--kv-heads=0]\n"
    "                  [--ffn=3072] [--seq=1024] [--batch=4] [--layers=1] [--rows=32768]\n"
    "                  [--microbatches=2] [--iters=20] [--warmup=3] [--peak=TFLOPS]\n"
    "                  [--peak-size=8192] [--algorithm=both|1|2]\n"
    "                  [--sections=peak,layer,output,gemm,attention,memory,step] [--print-flops]\n";

struct Options {
  Architecture arch = Architecture::kGpt2;
  int hidden = 768;            // h (GPT-2 small)
  int heads = 12;              // h % heads == 0
  int kv_heads = 0;            // llama: key/value heads (0 = heads), divides heads
  int ffn = 3072;              // f = 4h (GPT-2); SwiGLU's hidden width (Llama)
  int seq = 1024;              // s
  int batch = 4;               // b, sequences per microbatch
  int layers = 1;              // layers in the timed stack (and in the step's model)
  int rows = 32768;            // output-layer shard rows (V = 128k over p = 4); step: V at p = 1
  int microbatches = 2;        // m, microbatches of the step section's step
  int iters = 20;              // timed iterations per pass
  int warmup = 3;              // untimed iterations first (cuBLASLt plans, allocator cache)
  int peak_size = 8192;        // the peak section's square GEMM
  std::optional<double> peak;  // --peak overrides the measured peak and the device table
  bool print_flops = false;    // print the step's FLOP count and parameter count, no device
  bool peak_section = true, layer = true, output = true, gemm = true, attention = true,
       memory = true, step = true;
  std::vector<OutputAlgorithm> algorithms = {OutputAlgorithm::kAlgorithm2,
                                             OutputAlgorithm::kAlgorithm1};

  int tokens() const { return batch * seq; }  // n, tokens of one microbatch
  bool llama() const { return arch == Architecture::kLlama; }
  int kv_dim() const { return (kv_heads > 0 && llama() ? kv_heads : heads) * (hidden / heads); }
};

// The engine's model shape for these options (V = rows).
ModelConfig Config(const Options& o) {
  ModelConfig cfg;
  cfg.layers = o.layers;
  cfg.hidden = o.hidden;
  cfg.heads = o.heads;
  cfg.vocab = o.rows;
  cfg.seq_len = o.seq;
  cfg.ffn_hidden = o.ffn;
  cfg.architecture = o.arch;
  cfg.kv_heads = o.llama() ? o.kv_heads : 0;
  return cfg;
}

// absl::string_view here: this absl build has its own string_view type, which StrCat,
// SimpleAtoi and StrSplit take.
absl::StatusOr<Options> ParseFlags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--print-flops") {
      o.print_flops = true;
      continue;
    }
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
    if (name == "arch") {
      if (value == "gpt2") {
        o.arch = Architecture::kGpt2;
      } else if (value == "llama") {
        o.arch = Architecture::kLlama;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--arch=", value, ": gpt2 or llama"));
      }
    } else if (name == "hidden") {
      s = int_flag(o.hidden, 8);
    } else if (name == "heads") {
      s = int_flag(o.heads, 1);
    } else if (name == "kv-heads") {
      s = int_flag(o.kv_heads, 0);
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
    } else if (name == "microbatches") {
      s = int_flag(o.microbatches, 1);
    } else if (name == "iters") {
      s = int_flag(o.iters, 1);
    } else if (name == "warmup") {
      s = int_flag(o.warmup, 0);
    } else if (name == "peak-size") {
      s = int_flag(o.peak_size, 64);
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
      o.peak_section = o.layer = o.output = o.gemm = o.attention = o.memory = o.step = false;
      for (absl::string_view section : absl::StrSplit(value, ',')) {
        if (section == "peak") {
          o.peak_section = true;
        } else if (section == "layer") {
          o.layer = true;
        } else if (section == "output") {
          o.output = true;
        } else if (section == "gemm") {
          o.gemm = true;
        } else if (section == "attention") {
          o.attention = true;
        } else if (section == "memory") {
          o.memory = true;
        } else if (section == "step") {
          o.step = true;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("--sections: '", section,
                           "' is not one of peak, layer, output, gemm, attention, memory, "
                           "step"));
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
  if (o.llama()) {
    if (o.kv_heads > 0 && o.heads % o.kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv-heads ", o.kv_heads, " must divide --heads ", o.heads));
    }
    if ((o.hidden / o.heads) % 2 != 0) {
      return absl::InvalidArgumentError("--arch=llama: head_dim must be even (RoPE)");
    }
  } else if (o.kv_heads != 0 && o.kv_heads != o.heads) {
    return absl::InvalidArgumentError("--kv-heads: only with --arch=llama");
  }
  return o;
}

// Formats one result line: pass, ms, TFLOP/s and MFU against the dense bf16 peak.
class Reporter {
 public:
  explicit Reporter(std::optional<double> peak_tflops) : peak_(peak_tflops) {}

  // MFU in percent with one decimal, or "n/a" without a peak (PERF lines).
  std::string MfuText(double flops, double seconds) const {
    const std::optional<double> mfu = Mfu(flops, seconds, peak_);
    return mfu ? absl::StrFormat("%.1f", *mfu * 100) : "n/a";
  }

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

// Fills dst (count elements of E, device) with uniform values in [-scale, scale]: one host
// block of at most kFillPeriod values drawn with mt19937, uploaded (and rounded on the device
// for bf16), then repeated by device-to-device copies that double the filled prefix, so that
// filling a 2.8B-parameter model costs milliseconds instead of minutes. The values do not
// matter for timing but must be finite and not constant (tensor-core power, and so clocks,
// depend on the data). The period is odd so that rows of any even width do not repeat exactly.
constexpr size_t kFillPeriod = (size_t{1} << 20) + 1;
template <typename E>
absl::Status FillRandom(const DeviceContext& ctx, E* dst, size_t count, uint32_t seed,
                        float scale) {
  const size_t block = std::min(count, kFillPeriod);
  if (block == 0) return absl::OkStatus();
  std::vector<float> host(block);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (float& v : host) v = dist(rng);
  VP_BENCH_ASSIGN(staging, DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, block,
                                                      /*zero=*/false));  // (block) fp32
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data(), host.data(), block * sizeof(float),
                                          cudaMemcpyHostToDevice, ctx.stream));
  if constexpr (std::is_same_v<E, float>) {
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, staging.data(), block * sizeof(float),
                                            cudaMemcpyDeviceToDevice, ctx.stream));
  } else {
    VP_CUDA_RETURN_IF_ERROR(FloatToBf16(dst, staging.data(), static_cast<long>(block), ctx.stream));
  }
  for (size_t done = block; done < count;) {
    const size_t k = std::min(done, count - done);
    VP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + done, dst, k * sizeof(E), cudaMemcpyDeviceToDevice, ctx.stream));
    done += k;
  }
  // The host vector and the staging block must outlive the copies.
  return Finish(ctx);
}

// `count` bf16 values from FillRandom in a new array charged to `category`.
absl::StatusOr<DeviceArray<bf16>> RandomBf16(const DeviceContext& ctx, MemoryCategory category,
                                             size_t count, uint32_t seed, float scale) {
  VP_BENCH_ASSIGN(out, DeviceArray<bf16>::Create(ctx, category, count, /*zero=*/false));
  VP_BENCH_RETURN_IF_ERROR(FillRandom(ctx, out.data(), count, seed, scale));
  return out;
}

// True if every element of the device array is finite (a sanity check that the timed passes
// computed on real numbers). Arrays over 4M elements are sampled: 4096 evenly spaced runs of
// 1024 elements (one strided copy), so a multi-GB gradient is not copied to the host.
template <typename E>
absl::StatusOr<bool> AllFinite(const E* dev, size_t count) {
  constexpr size_t kRun = 1024, kRuns = 4096;
  std::vector<E> host(std::min(count, kRun * kRuns));
  if (count <= kRun * kRuns) {
    VP_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(host.data(), dev, count * sizeof(E), cudaMemcpyDeviceToHost));
  } else {
    const size_t stride = count / kRuns;  // >= kRun
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(host.data(), kRun * sizeof(E), dev, stride * sizeof(E),
                                         kRun * sizeof(E), kRuns, cudaMemcpyDeviceToHost));
  }
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
  std::unique_ptr<CudnnAttention> attention;  // VOCABPIPE_ATTENTION=cudnn, as the runtime does
  DeviceContext compute, comm;

  // Shapes cuDNN found no engine for ran on the kernels: say so, or a cudnn row would be read as
  // cuDNN's.
  ~BenchDevice() {
    if (attention != nullptr && attention->refused_shapes() > 0) {
      std::printf("attention: cuDNN refused %d shape(s), which ran on the kernels; the last: %s\n",
                  attention->refused_shapes(), attention->last_refusal().c_str());
    }
  }

  absl::Status Init() {
    VP_BENCH_ASSIGN(cs, CudaStream::Create());
    VP_BENCH_ASSIGN(ms, CudaStream::Create(CudaStream::Priority::kHigh));
    VP_BENCH_ASSIGN(cg, GemmRunner::Create());
    VP_BENCH_ASSIGN(mg, GemmRunner::Create());
    compute_stream = std::move(cs);
    comm_stream = std::move(ms);
    compute_gemm = std::move(cg);
    comm_gemm = std::move(mg);
    VP_BENCH_ASSIGN(dnn, ChosenCudnnAttention(&alloc));
    attention = std::move(dnn);
    if (attention != nullptr) {
      std::printf("attention: cuDNN %ld\n", static_cast<long>(attention->version()));
    }
    compute = DeviceContext{compute_stream.get(), compute_gemm.get(), &alloc, attention.get()};
    comm = DeviceContext{comm_stream.get(), comm_gemm.get(), &alloc};
    return absl::OkStatus();
  }
};

// ---------------------------------------------------------------------------------------------
// Phase breakdowns (phase_timer.h): after a section's timed iterations, one more pass runs with
// a CUDA event at every phase mark, so the marks' launch cost never touches the timed numbers.
// Each becomes one "BREAKDOWN" line (perf.sh copies them into perf.txt):
//   BREAKDOWN <what> <device ms> ms: <phase> <share>% ...   (phases >= 0.5%, largest first)
// A phase's time runs from its mark to the next mark on the stream: its kernels plus any launch
// gap inside it; "idle" runs from a Finish (stream synchronisation) to the next mark: host work,
// synchronisation and other streams (C1's collectives) while the compute stream waits.
void PrintBreakdown(std::string_view what, const PhaseTimer::Breakdown& b, int dropped,
                    std::string_view suffix = "") {
  const double total = b.total_ms();
  std::vector<int> order;
  for (int i = 0; i < kPhaseCount; ++i) {
    if (total > 0 && b.ms[i] >= 0.005 * total) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](int a, int c) { return b.ms[a] > b.ms[c]; });
  std::string text = absl::StrFormat("BREAKDOWN %-8s %8.2f ms:", what, total);
  for (int i : order) {
    absl::StrAppendFormat(&text, " %s %.1f%%", PhaseName(static_cast<Phase>(i)),
                          100 * b.ms[i] / total);
  }
  const int idle = static_cast<int>(Phase::kIdle);
  if (b.marks[idle] > 0 && b.ms[idle] >= 0.001 * total) {
    absl::StrAppendFormat(&text, " (%d syncs, %.0f us each)", b.marks[idle],
                          1e3 * b.ms[idle] / b.marks[idle]);
  }
  if (dropped > 0) absl::StrAppendFormat(&text, " [%d marks dropped]", dropped);
  std::printf("%s%.*s\n", text.c_str(), static_cast<int>(suffix.size()), suffix.data());
}

// A breakdown that fails (say, the timer's events) prints one line and does not fail its
// section: the section's own numbers are already out.
absl::Status BreakdownStatus(std::string_view section, const absl::Status& s) {
  if (!s.ok()) {
    std::printf("BREAKDOWN %.*s FAIL %s\n", static_cast<int>(section.size()), section.data(),
                std::string(s.message()).c_str());
  }
  return absl::OkStatus();
}

// Runs `pass` between two Collects of `timer` and prints its breakdown as `what`.
template <typename Pass>
absl::Status Profile(PhaseTimer& timer, std::string_view what, Pass&& pass) {
  VP_BENCH_RETURN_IF_ERROR(timer.Collect().status());  // drop what came before
  VP_BENCH_RETURN_IF_ERROR(pass());
  VP_BENCH_ASSIGN(b, timer.Collect());
  PrintBreakdown(what, b, timer.dropped());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Transformer layer passes F, B, W through DeviceLayerStack<bf16>.

// FLOP convention: worker/runtime/flops.cc's TransformerLayerFlops (the paper's Table 4, the
// formulas of proto/plan/flops.h) for one layer and one microbatch of b sequences, forward +
// backward:
//   GPT-2  6·b·s·(4h² + 2·h·f) + 12·b·s²·h
//   Llama  6·b·s·(2h² + 2·h·kv + 3·h·f) + 12·b·s²·h      (kv = kv_heads·head_dim)
// (the attention term counts the full s×s score matrix, Megatron's convention, although the
// kernel skips the causal upper triangle). Each of F, B and W is credited with one third of it,
// so F + B + W is exactly the runtime's per-layer model FLOPs and the "F+B+W" MFU line is the
// runtime's MFU definition; "B+W" is the backward (twice the forward). (Really B also carries
// the attention backward and W none of it; the split only moves credit between B and W.)
double LayerFlops(const Options& o, int b) {  // one layer, forward + backward
  const double s = o.seq, h = o.hidden, f = o.ffn;
  return o.llama() ? flops::LlamaLayer(b, s, h, f, o.kv_dim())
                   : flops::TransformerLayer(b, s, h, f);
}
double LayerPassFlops(const Options& o) { return o.layers * LayerFlops(o, o.batch) / 3; }

absl::Status RunLayerPasses(const Options& o, const Reporter& report) {
  const ModelConfig cfg = Config(o);
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
  int64_t misses_before_timed = 0;  // the allocator's backend allocations before the timed passes
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    if (i == o.warmup) misses_before_timed = dev.alloc.stats().backend_allocs;
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
      "layer passes (DeviceLayerStack<bf16>, %s): %d layer(s), h %d, heads %d, kv heads %d, "
      "ffn %d, b %d, s %d, %d iters after %d warm-up\n",
      o.llama() ? "llama" : "gpt2", o.layers, o.hidden, o.heads, cfg.num_kv_heads(), o.ffn, o.batch,
      o.seq, o.iters, o.warmup);
  const double flops = LayerPassFlops(o);
  report.Line("F (Forward)", flops, f_s);
  report.Line("B (BackwardInput)", flops, b_s);
  report.Line("W (BackwardWeight)", flops, w_s);
  report.Line("B+W (backward)", 2 * flops, b_s + w_s);
  report.Line("F+B+W", 3 * flops, f_s + b_s + w_s);
  std::printf(
      "  attention kernels: %s; memory-bound kernels: %s; bias epilogue: %s; GELU epilogue: %s; "
      "residual add: %s\n",
      std::getenv("VOCABPIPE_ATTENTION") ? std::getenv("VOCABPIPE_ATTENTION") : "default",
      DefaultMemoryKernels() == MemoryKernels::kVector ? "vector" : "element",
      FusedBiasEpilogue() ? "cuBLASLt" : "separate kernel",
      FusedGeluEpilogue() ? "cuBLASLt" : "separate kernel",
      FusedResidualEpilogue() ? "cuBLASLt C matrix" : "separate kernel");
  std::printf("PERF section=layer f_ms=%.3f b_ms=%.3f w_ms=%.3f f_mfu=%s bw_mfu=%s fbw_mfu=%s\n",
              f_s * 1e3, b_s * 1e3, w_s * 1e3, report.MfuText(flops, f_s).c_str(),
              report.MfuText(2 * flops, b_s + w_s).c_str(),
              report.MfuText(3 * flops, f_s + b_s + w_s).c_str());
  std::printf("  outputs, input gradients and weight gradients finite: %s\n",
              out_finite && dx_finite && grads_finite ? "yes" : "NO");
  // A cudaMalloc inside a timed pass would stall the host and show as a gap in whatever phase
  // it follows in the breakdown; after the warm-up every block should come from the cache.
  std::printf("  allocator: %lld cudaMalloc calls in the timed passes (should be 0)\n",
              static_cast<long long>(dev.alloc.stats().backend_allocs - misses_before_timed));
  // Where F, B and W spend their device time (one more microbatch, profiled).
  return BreakdownStatus("layer", [&]() -> absl::Status {
    VP_BENCH_ASSIGN(timer, PhaseTimer::Start(ctx.stream));
    const SlotKey slot{o.warmup + o.iters, 0};
    VP_BENCH_RETURN_IF_ERROR(
        Profile(*timer, "layer.F", [&] { return stack->Forward(slot, x.data(), out.data()); }));
    VP_BENCH_RETURN_IF_ERROR(Profile(
        *timer, "layer.B", [&] { return stack->BackwardInput(slot, dout.data(), dx.data()); }));
    return Profile(*timer, "layer.W", [&] { return stack->BackwardWeight(slot); });
  }());
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
  const double st_s = s_s + c1_s + t_s + c2_s;
  std::printf("PERF section=output algorithm=%d s_ms=%.3f t_ms=%.3f st_ms=%.3f st_mfu=%s\n",
              alg2 ? 2 : 1, s_s * 1e3, t_s * 1e3, st_s * 1e3,
              report.MfuText(flops.s + flops.t, st_s).c_str());
  // Where S and T spend their device time: GEMMs vs the softmax passes over the logits.
  return BreakdownStatus("output", [&]() -> absl::Status {
    VP_BENCH_ASSIGN(timer, PhaseTimer::Start(ctx.stream));
    DeviceOutputLayerState<bf16> state;
    VP_BENCH_RETURN_IF_ERROR(Profile(*timer, "out.S", [&]() -> absl::Status {
      auto st = shard->S(x.data(), labels.data(), n, d);
      if (!st.ok()) return st.status();
      state = std::move(*st);
      return absl::OkStatus();
    }));
    VP_BENCH_RETURN_IF_ERROR(shard->C1(state, *self));
    VP_BENCH_RETURN_IF_ERROR(Profile(*timer, "out.T", [&] { return shard->T(state, x.data()); }));
    if (!alg2) VP_BENCH_RETURN_IF_ERROR(shard->C2(state, *self));
    return absl::OkStatus();
  }());
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
  const int n = o.tokens(), h = o.hidden, f = o.ffn, kv = o.kv_dim();
  // GPT-2: qkv (h→3h), attention proj (h→h), fc (h→f), fc proj (f→h).
  // Llama: q, k, v fused (h→h+2kv), o (h→h), gate and up fused (h→2f), down (f→h).
  struct Shape {
    int in, out;
  };
  const std::vector<Shape> shapes =
      o.llama() ? std::vector<Shape>{{h, h + 2 * kv}, {h, h}, {h, 2 * f}, {f, h}}
                : std::vector<Shape>{{h, 3 * h}, {h, h}, {h, f}, {f, h}};
  int wide = 0;
  double flops = 0;
  for (const Shape& sh : shapes) {
    wide = std::max({wide, sh.in, sh.out});
    flops += 2.0 * n * sh.in * sh.out;
  }
  VP_BENCH_ASSIGN(gemm, GemmRunner::Create());
  VP_BENCH_ASSIGN(x_mem, Zeroed(size_t(n) * wide * sizeof(bf16)));
  VP_BENCH_ASSIGN(w_mem, Zeroed(size_t(wide) * wide * sizeof(bf16)));
  VP_BENCH_ASSIGN(y_mem, Zeroed(size_t(n) * wide * sizeof(bf16)));
  auto* x = static_cast<bf16*>(x_mem.get());  // (n, wide)
  auto* w = static_cast<bf16*>(w_mem.get());  // (wide, wide)
  auto* y = static_cast<bf16*>(y_mem.get());  // (n, wide)
  VP_BENCH_ASSIGN(sec, TimeKernels([&]() -> absl::Status {
                    for (const Shape& sh : shapes) {
                      VP_BENCH_RETURN_IF_ERROR(
                          LinearForward<bf16>(*gemm, y, x, w, nullptr, n, sh.in, sh.out, nullptr));
                    }
                    return absl::OkStatus();
                  }));
  std::printf("kernels: layer linear GEMMs (%s), n %d, h %d, kv %d, ffn %d\n",
              o.llama() ? "llama" : "gpt2", n, h, kv, f);
  report.Line("linear GEMMs (fwd)", flops, sec);
  return absl::OkStatus();
}

absl::Status RunAttention(const Options& o, const Reporter& report) {
  const int batch = o.batch, seq = o.seq, h = o.hidden, heads = o.heads;
  const int head_dim = h / heads, kv = o.kv_dim(), ldq = h + 2 * kv;
  // q inside a (b, seq, h + 2kv) qkv buffer as in the model, k/v in their own (b, seq, kv)
  // cache (kv = h without grouping).
  const AttentionShape att{.batch = batch,
                           .heads = heads,
                           .head_dim = head_dim,
                           .q_begin = 0,
                           .q_end = seq,
                           .kv_rows = seq,
                           .kv_heads = kv / head_dim};
  const size_t rows = size_t(batch) * seq;
  VP_BENCH_ASSIGN(qkv_mem, Zeroed(rows * ldq * sizeof(bf16)));
  VP_BENCH_ASSIGN(dqkv_mem, Zeroed(rows * ldq * sizeof(bf16)));
  VP_BENCH_ASSIGN(kv_mem, Zeroed(rows * kv * sizeof(bf16) * 4));         // k, v, dk, dv
  VP_BENCH_ASSIGN(out_mem, Zeroed(rows * h * sizeof(bf16) * 2));         // out, dout
  VP_BENCH_ASSIGN(stats_mem, Zeroed(rows * heads * sizeof(float) * 2));  // lse, delta
  auto* qkv = static_cast<bf16*>(qkv_mem.get());                         // (b, seq, h + 2kv)
  auto* dqkv = static_cast<bf16*>(dqkv_mem.get());                       // (b, seq, h + 2kv)
  bf16* k = static_cast<bf16*>(kv_mem.get());                            // (b, seq, kv) each
  bf16 *v = k + rows * kv, *dk = k + 2 * rows * kv, *dv = k + 3 * rows * kv;
  bf16* out = static_cast<bf16*>(out_mem.get());  // (b, seq, h) each
  bf16* dout = out + rows * h;
  float* lse = static_cast<float*>(stats_mem.get());  // (b, heads, seq) each
  float* delta = lse + rows * heads;
  // The runtime's choice (RunAttention*): cuDNN under VOCABPIPE_ATTENTION=cudnn, else the kernels.
  BenchDevice dev;
  VP_BENCH_RETURN_IF_ERROR(dev.Init());
  VP_BENCH_ASSIGN(fwd_s, TimeKernels([&]() -> absl::Status {
                    return RunAttentionForward<bf16>(dev.compute, out, lse, qkv, ldq, k, v, att);
                  }));
  VP_BENCH_ASSIGN(bwd_s, TimeKernels([&]() -> absl::Status {
                    return RunAttentionBackward<bf16>(dev.compute, dqkv, dk, dv, delta, dout, out,
                                                      lse, qkv, ldq, k, v, att);
                  }));
  // FLOP convention (causal, counting only the visible scores): the forward's two matmuls Q·Kᵀ
  // and P·V cost 2·len_i·head_dim each per query row i, so 4·b·heads·Σ_i len_i·head_dim with
  // len_i = i + 1; the backward (recomputed Q·Kᵀ, dP = dO·Vᵀ, dV, dK, dQ) is counted as 2.5×
  // the forward, the usual FlashAttention convention.
  const double fwd_flops = 4.0 * batch * heads * (0.5 * seq * (seq + 1.0)) * head_dim;
  const double bwd_flops = 2.5 * fwd_flops;
  const std::string kernel_name(AttentionKernelsName(AttentionKernels::kDefault));
  std::printf(
      "kernels: attention (%s), batch %d, seq %d, heads %d, kv heads %d, head_dim %d (causal)\n",
      kernel_name.c_str(), batch, seq, heads, att.num_kv_heads(), head_dim);
  report.Line("attention fwd", fwd_flops, fwd_s);
  report.Line("attention bwd", bwd_flops, bwd_s);
  report.Line("attention fwd+bwd", fwd_flops + bwd_flops, fwd_s + bwd_s);
  // The line perf.sh sets beside PyTorch's SDPA on the same shape (torch_baseline.py's
  // TORCH_ATTENTION lines use the same FLOP convention).
  std::printf(
      "PERF section=attention kernels=%s fwd_ms=%.3f bwd_ms=%.3f fwd_tflops=%.1f "
      "bwd_tflops=%.1f\n",
      kernel_name.c_str(), fwd_s * 1e3, bwd_s * 1e3, fwd_flops / fwd_s / 1e12,
      bwd_flops / bwd_s / 1e12);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The memory-bound kernels alone at the layer's shapes (one microbatch, n = batch·seq rows), with
// both kernel sets (MemoryKernels), in microseconds and TB/s of the fewest bytes each must move
// (inputs read once, outputs written once; the norms' statistics and weight-gradient atomics
// not counted), against a device-to-device copy of an (n, ffn) bf16 matrix measured here. Beside
// the layer section's BREAKDOWN (whose phases also hold any launch gap inside them) this says
// which kernels run far below the memory's speed. One PERF line per kernel and set.
absl::Status RunMemory(const Options& o) {
  const long n = o.tokens(), h = o.hidden, f = o.ffn, nh = n * h, nf = n * f;
  const int rows = static_cast<int>(n), width = o.hidden, ffn = o.ffn;
  VP_BENCH_ASSIGN(act_mem, Zeroed(4 * nh * sizeof(bf16)));
  VP_BENCH_ASSIGN(wide_mem, Zeroed(5 * nf * sizeof(bf16)));
  VP_BENCH_ASSIGN(vec_mem, Zeroed((2 * h + f) * sizeof(bf16)));
  VP_BENCH_ASSIGN(stat_mem, Zeroed((2 * n + 2 * h + f) * sizeof(float)));
  bf16* x = static_cast<bf16*>(act_mem.get());  // (n, h) each: x, y, dy, dx
  bf16 *y = x + nh, *dy = x + 2 * nh, *dx = x + 3 * nh;
  bf16* wide = static_cast<bf16*>(wide_mem.get());  // (n, f) ×5: GELU's pre, out, dout; or
  bf16 *wide1 = wide + nf, *wide2 = wide + 2 * nf, *wide3 = wide + 3 * nf;  // SwiGLU's gu (n, 2f)
  bf16* w = static_cast<bf16*>(vec_mem.get());  // (h) norm weight, (h) norm bias, (f) bias
  bf16 *b = w + h, *fc_bias = w + 2 * h;
  float* mean = static_cast<float*>(stat_mem.get());  // (n) mean, rstd; (h) dw, db; (f) dbias
  float *rstd = mean + n, *dw = mean + 2 * n, *db = dw + h, *dbias = db + h;
  const double elem = sizeof(bf16);

  VP_BENCH_ASSIGN(copy_s, TimeKernels([&]() -> absl::Status {
                    VP_CUDA_RETURN_IF_ERROR(
                        cudaMemcpyAsync(wide1, wide, nf * sizeof(bf16), cudaMemcpyDeviceToDevice));
                    return absl::OkStatus();
                  }));
  const double copy_tbps = 2.0 * nf * elem / copy_s / 1e12;
  std::printf(
      "kernels: memory-bound, n %ld, h %ld, ffn %ld (%s); copy of (n, ffn) bf16: %.1f us, "
      "%.2f TB/s\n",
      n, h, f, o.llama() ? "llama" : "gpt2", copy_s * 1e6, copy_tbps);
  std::printf("PERF section=memory kernel=copy set=- us=%.1f tbps=%.2f of_copy=1.00\n",
              copy_s * 1e6, copy_tbps);
  struct Kernel {
    const char* name;
    double bytes;
    std::function<cudaError_t(MemoryKernels)> launch;
  };
  std::vector<Kernel> kernels;
  if (o.llama()) {
    kernels = {
        {"norm.fwd", 2 * nh * elem,
         [&](MemoryKernels k) {
           return RmsNormForward<bf16>(y, rstd, x, w, rows, width, 1e-5f, nullptr, k);
         }},
        {"norm.bwd_input", 4 * nh * elem,
         [&](MemoryKernels k) {
           return RmsNormBackwardInput<bf16>(dx, dx, dy, x, w, rstd, rows, width, nullptr, k);
         }},
        {"norm.bwd_weight", 2 * nh * elem,
         [&](MemoryKernels k) {
           return RmsNormBackwardWeight<bf16>(dw, dy, x, rstd, rows, width, nullptr, k);
         }},
        {"swiglu.fwd", 3 * nf * elem,
         [&](MemoryKernels k) { return SwigluForward<bf16>(wide, wide1, n, ffn, nullptr, k); }},
        {"swiglu.bwd", 5 * nf * elem,
         [&](MemoryKernels k) {
           return SwigluBackward<bf16>(wide3, wide1, wide, n, ffn, nullptr, k);
         }},
    };
  } else {
    kernels = {
        {"norm.fwd", 2 * nh * elem,
         [&](MemoryKernels k) {
           return LayerNormForward<bf16>(y, mean, rstd, x, w, b, rows, width, nullptr, k);
         }},
        {"norm.bwd_input", 4 * nh * elem,
         [&](MemoryKernels k) {
           return LayerNormBackwardInput<bf16>(dx, dx, dy, x, w, mean, rstd, rows, width, nullptr,
                                               k);
         }},
        {"norm.bwd_weight", 2 * nh * elem,
         [&](MemoryKernels k) {
           return LayerNormBackwardWeight<bf16>(dw, db, dy, x, mean, rstd, rows, width, nullptr, k);
         }},
        {"gelu.fwd", 2 * nf * elem,
         [&](MemoryKernels k) { return GeluForward<bf16>(wide1, wide, nf, nullptr, k); }},
        {"gelu.bwd", 3 * nf * elem,
         [&](MemoryKernels k) { return GeluBackward<bf16>(wide2, wide, wide1, nf, nullptr, k); }},
        {"bias.fwd", 2 * nf * elem,
         [&](MemoryKernels k) { return AddBias<bf16>(wide, fc_bias, rows, ffn, nullptr, k); }},
        {"bias.bwd", nf * elem,
         [&](MemoryKernels) { return BiasBackward<bf16>(dbias, wide, rows, ffn, nullptr); }},
    };
  }
  kernels.push_back({"residual.fwd", 3 * nh * elem, [&](MemoryKernels k) {
                       return ResidualForward<bf16>(y, x, dy, nh, nullptr, k);
                     }});
  for (const Kernel& kernel : kernels) {
    for (MemoryKernels set : {MemoryKernels::kElement, MemoryKernels::kVector}) {
      VP_BENCH_ASSIGN(sec, TimeKernels([&]() -> absl::Status {
                        VP_CUDA_RETURN_IF_ERROR(kernel.launch(set));
                        return absl::OkStatus();
                      }));
      const double tbps = kernel.bytes / sec / 1e12;
      const char* set_name = set == MemoryKernels::kVector ? "vector" : "element";
      std::printf("  %-16s %-8s %9.1f us  %5.2f TB/s  %3.0f%% of the copy's\n", kernel.name,
                  set_name, sec * 1e6, tbps, 100 * tbps / copy_tbps);
      std::printf("PERF section=memory kernel=%s set=%s us=%.1f tbps=%.2f of_copy=%.2f\n",
                  kernel.name, set_name, sec * 1e6, tbps, tbps / copy_tbps);
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The bf16 GEMM peak: Y = X·W with X, W, Y all (n, n) bf16 (fp32 accumulation) through the
// project's GemmRunner (cuBLASLt, the runtime's heuristic choice), 2 untimed calls, then 5
// timed groups of 3 calls each between CUDA events on one stream; the best group counts (the
// clocks' best, as a datasheet figure is). 2·n³ FLOPs per call.
absl::StatusOr<double> MeasurePeakTflops(const Options& o) {
  const int n = o.peak_size;
  const size_t count = static_cast<size_t>(n) * n;
  BenchDevice dev;
  VP_BENCH_RETURN_IF_ERROR(dev.Init());
  const DeviceContext& ctx = dev.compute;
  VP_BENCH_ASSIGN(x, RandomBf16(ctx, MemoryCategory::kActivations, count, 11, 1.0f));  // (n, n)
  VP_BENCH_ASSIGN(w, RandomBf16(ctx, MemoryCategory::kActivations, count, 12, 1.0f));  // (n, n)
  VP_BENCH_ASSIGN(y, DeviceArray<bf16>::Create(ctx, MemoryCategory::kActivations, count,
                                               /*zero=*/false));  // (n, n)
  auto gemm = [&]() {
    return LinearForward<bf16>(*ctx.gemm, y.data(), x.data(), w.data(), nullptr, n, n, n,
                               ctx.stream);
  };
  for (int i = 0; i < 2; ++i) VP_BENCH_RETURN_IF_ERROR(gemm());
  VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
  cudaEvent_t start = nullptr, stop = nullptr;
  VP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  VP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  constexpr int kGroups = 5, kCalls = 3;
  double best = 0;  // seconds per call
  absl::Status status;
  for (int g = 0; g < kGroups && status.ok(); ++g) {
    if (cudaError_t e = cudaEventRecord(start, ctx.stream); e != cudaSuccess) {
      status = absl::InternalError(cudaGetErrorString(e));
      break;
    }
    for (int c = 0; c < kCalls && status.ok(); ++c) status = gemm();
    if (!status.ok()) break;
    float ms = 0;
    if (cudaEventRecord(stop, ctx.stream) != cudaSuccess ||
        cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
      status = absl::InternalError(
          absl::StrCat("peak GEMM events: ", cudaGetErrorString(cudaGetLastError())));
      break;
    }
    const double sec = ms * 1e-3 / kCalls;
    if (best == 0 || sec < best) best = sec;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  VP_BENCH_RETURN_IF_ERROR(status);
  VP_BENCH_ASSIGN(finite, AllFinite(y.data(), count));
  const double tflops = 2.0 * n * static_cast<double>(n) * n / best / 1e12;
  const std::optional<double> table = PeakBf16Tflops(DeviceName(0).value_or(""));
  std::printf(
      "bf16 GEMM peak (GemmRunner/cuBLASLt, %d^3, best of %d groups of %d): %.3f ms, %.1f "
      "TFLOP/s%s; output finite: %s\n",
      n, kGroups, kCalls, best * 1e3, tflops,
      table ? absl::StrFormat(" = %.1f%% of the datasheet %.0f", 100 * tflops / *table, *table)
                  .c_str()
            : "",
      finite ? "yes" : "NO");
  std::printf("PERF section=peak peak_tflops=%.1f table_tflops=%s\n", tflops,
              table ? absl::StrCat(*table).c_str() : "n/a");
  if (!finite) return absl::InternalError("peak GEMM: non-finite output");
  return tflops;
}

// ---------------------------------------------------------------------------------------------
// One whole training step at p = 1.

// The step's model: one flat parameter vector in the runtime's layout order (rank_model.cc):
//   wte (rows, h) | wpe (s, h), GPT-2 only | layers (L · LayerParamCount) | final norm (h, +h
//   bias for GPT-2) | lm_head (rows, h), untied.
struct StepLayout {
  size_t wte = 0, wpe = 0, layers = 0, lnf = 0, head = 0, count = 0;
};
StepLayout MakeStepLayout(const Options& o, int64_t rows) {
  const ModelConfig cfg = Config(o);
  const size_t h = o.hidden, vh = static_cast<size_t>(rows) * h;
  StepLayout l;
  l.wte = 0;
  l.wpe = vh;
  l.layers = l.wpe + (o.llama() ? 0 : static_cast<size_t>(o.seq) * h);
  l.lnf = l.layers + static_cast<size_t>(o.layers) * LayerParamCount(cfg);
  l.head = l.lnf + (o.llama() ? h : 2 * h);
  l.count = l.head + vh;
  return l;
}

// Model FLOPs of one step, flops.cc's ModelFlopsPerMicrobatch × m: L layers + the output layer
// 6·b·s·h·V + the input layer 3·b·s·h (V the real vocabulary, rows at p = 1).
double StepFlops(const Options& o) {
  const double b = o.batch, s = o.seq, h = o.hidden;
  return o.microbatches * (o.layers * LayerFlops(o, o.batch) + flops::OutputLayer(b, s, h, o.rows) +
                           flops::InputLayer(b, s, h));
}

// Bytes the step holds from the start: fp32 master, bf16 copy, fp32 gradients, AdamW m and v
// (fp32) and the decay mask (1 byte) per parameter, as DeviceRankModel holds them.
constexpr int kStateBytesPerParam = 4 + 2 + 4 + 4 + 4 + 1;

double Gib(double bytes) { return bytes / (1024.0 * 1024.0 * 1024.0); }

// The p = 1 step as the plan executor runs it (rank_executor_actions.h; 1F1B at p = 1 is each
// microbatch's forward, then its backward): zero the gradients; per microbatch IF (+ its 1-rank
// IF_REDUCE), the chunk embedding, F of the L layers, the final norm, S, C1, T, the final norm's
// backward, B+W of the layers, the position gradient (GPT-2), IB_BCAST (1 rank) and IB; then the
// optimizer: the global gradient norm (SquaredNormPartials, summed on the host), clipping at
// 1.0, and AdamWStep on the fp32 master weights refreshing the bf16 copy. Every call below is
// the runtime's own (DeviceInputLayerShard, DeviceLayerStack, DeviceOutputLayerShard, the
// model kernels); what is not the runtime's is only the bookkeeping around them (no executor
// threads, no action keys: at p = 1 the executor's communication thread only runs the 1-rank
// barriers, which here run inline on their own stream). Parameters are filled with random
// values on the device (FillRandom) instead of the runtime's host initialisation, which takes
// minutes for a 2.8B-parameter model. Tokens are random, so the loss should stay near ln V.
absl::Status RunStep(const Options& o, const Reporter& report) {
  const ModelConfig cfg = Config(o);
  const int b = o.batch, s = o.seq, h = o.hidden, m = o.microbatches, n = o.tokens();
  VP_BENCH_ASSIGN(partition, vocab::MakeVocabPartition(o.rows, /*world=*/1, /*rank=*/0));
  const StepLayout lay = MakeStepLayout(o, partition.rows);
  const size_t count = lay.count;
  const double state_bytes = static_cast<double>(count) * kStateBytesPerParam;
  VP_BENCH_ASSIGN(device_bytes, DeviceMemoryBytes(0));
  std::printf(
      "step (p = 1, %s): %d layers, h %d, heads %d, kv heads %d, ffn %d, V %lld (untied), s %d, "
      "m %d x b %d = %d tokens per step, %d steps after %d warm-up; %.3fB parameters, state "
      "%.1f GiB (%d bytes/param) of %.1f GiB\n",
      o.llama() ? "llama" : "gpt2", o.layers, h, o.heads, cfg.num_kv_heads(), o.ffn,
      static_cast<long long>(partition.vocab), s, m, b, m * n, o.iters, o.warmup, count / 1e9,
      Gib(state_bytes), kStateBytesPerParam, Gib(static_cast<double>(device_bytes)));
  if (state_bytes > 0.9 * static_cast<double>(device_bytes)) {
    return absl::ResourceExhaustedError("step: the model state alone does not fit the device");
  }

  BenchDevice dev;
  VP_BENCH_RETURN_IF_ERROR(dev.Init());
  const DeviceContext& ctx = dev.compute;
  const cudaStream_t stream = ctx.stream;
  std::unique_ptr<comm::Communicator> self = comm::MakeSelfCommunicator();
  // The state, charged as DeviceRankModel charges it.
  VP_BENCH_ASSIGN(master, DeviceArray<float>::Create(ctx, MemoryCategory::kOptimizer, count,
                                                     /*zero=*/false));  // (P) fp32
  VP_BENCH_ASSIGN(params, DeviceArray<bf16>::Create(ctx, MemoryCategory::kParameters, count,
                                                    /*zero=*/false));  // (P) bf16
  VP_BENCH_ASSIGN(grads, DeviceArray<float>::Create(ctx, MemoryCategory::kGradients, count));
  VP_BENCH_ASSIGN(adam_m, DeviceArray<float>::Create(ctx, MemoryCategory::kOptimizer, count));
  VP_BENCH_ASSIGN(adam_v, DeviceArray<float>::Create(ctx, MemoryCategory::kOptimizer, count));
  VP_BENCH_ASSIGN(decay, DeviceArray<uint8_t>::Create(ctx, MemoryCategory::kOptimizer, count,
                                                      /*zero=*/false));  // (P) 1 = decay
  VP_BENCH_ASSIGN(partials,
                  DeviceArray<double>::Create(ctx, MemoryCategory::kOptimizer, kSquaredNormBlocks));
  VP_BENCH_RETURN_IF_ERROR(FillRandom(ctx, master.data(), count, 21, 0.02f));
  VP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(decay.data(), 1, count, stream));
  VP_CUDA_RETURN_IF_ERROR(
      FloatToBf16(params.data(), master.data(), static_cast<long>(count), stream));
  VP_BENCH_RETURN_IF_ERROR(Finish(ctx));

  bf16* p = params.data();
  float* g = grads.data();
  VP_BENCH_ASSIGN(stack, DeviceLayerStack<bf16>::Create(cfg, 0, o.layers, b, {0, s}, p + lay.layers,
                                                        g + lay.layers, ctx));
  VP_BENCH_ASSIGN(input, DeviceInputLayerShard<bf16>::Create(partition, h, p + lay.wte, g + lay.wte,
                                                             dev.compute, dev.comm));
  VP_BENCH_ASSIGN(output, DeviceOutputLayerShard<bf16>::Create(
                              partition, h, OutputAlgorithm::kAlgorithm2, p + lay.head,
                              g + lay.head, dev.compute, dev.comm));
  const bf16* wpe = o.llama() ? nullptr : p + lay.wpe;  // (s, h)
  const bf16* lnf_w = p + lay.lnf;                      // (h)
  const bf16* lnf_b = p + lay.lnf + h;                  // (h), GPT-2
  float* wpe_grad = g + lay.wpe;                        // (s, h) fp32, GPT-2
  float* lnf_wg = g + lay.lnf;                          // (h) fp32
  float* lnf_bg = g + lay.lnf + h;                      // (h) fp32, GPT-2

  // Random tokens (the same every step): inputs and targets (m, b·s) in [0, V).
  std::vector<std::vector<int32_t>> inputs(m), targets(m);
  std::mt19937 rng(31);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(partition.vocab - 1));
  for (int j = 0; j < m; ++j) {
    inputs[j].resize(n);
    targets[j].resize(n);
    for (int i = 0; i < n; ++i) inputs[j][i] = token(rng), targets[j][i] = token(rng);
  }
  const size_t nh = static_cast<size_t>(n) * h;
  const float loss_grad = 1.0f / static_cast<float>(m * n);  // mean over the step's tokens
  auto act = [&](bool zero) {
    return DeviceArray<bf16>::Create(ctx, MemoryCategory::kActivations, nh, zero);
  };

  auto microbatch = [&](int j, double* loss) -> absl::Status {
    // IF and its 1-rank IF_REDUCE; the chunk embedding (+ positions) rounded to bf16. (Work
    // enqueued outside the instrumented passes is marked "other" for the step's breakdown.)
    MarkPhase(stream, Phase::kOther);
    VP_BENCH_ASSIGN(in_state, input->Forward(inputs[j].data(), n));
    VP_BENCH_RETURN_IF_ERROR(input->ForwardReduce(in_state, *self));
    VP_BENCH_ASSIGN(x, act(false));  // (b, s, h)
    MarkPhase(stream, Phase::kOther);
    VP_CUDA_RETURN_IF_ERROR(
        EmbedSeqChunkForward<bf16>(x.data(), in_state.output(), wpe, b, s, s, h, 0, stream));
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    in_state.ReleaseOutput();
    // F of the layers, then the final norm: X = norm(y).
    VP_BENCH_ASSIGN(y, act(false));  // (b, s, h) the last layer's output
    VP_BENCH_RETURN_IF_ERROR(stack->Forward({j, 0}, x.data(), y.data()));
    x.Reset();
    VP_BENCH_ASSIGN(xn, act(false));  // (n, h) X, the output layer's input
    VP_BENCH_ASSIGN(mean, DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, n, false));
    VP_BENCH_ASSIGN(rstd, DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, n, false));
    MarkPhase(stream, Phase::kNorm);
    if (o.llama()) {
      VP_CUDA_RETURN_IF_ERROR(
          RmsNormForward<bf16>(xn.data(), rstd.data(), y.data(), lnf_w, n, h, cfg.rms_eps, stream));
    } else {
      VP_CUDA_RETURN_IF_ERROR(LayerNormForward<bf16>(xn.data(), mean.data(), rstd.data(), y.data(),
                                                     lnf_w, lnf_b, n, h, stream));
    }
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    // S, C1 (1 rank), T: the loss, ∇X (fp32) and the lm_head gradient.
    VP_BENCH_ASSIGN(out_state, output->S(xn.data(), targets[j].data(), n, loss_grad));
    VP_BENCH_RETURN_IF_ERROR(output->C1(out_state, *self));
    VP_BENCH_RETURN_IF_ERROR(output->T(out_state, xn.data()));
    for (int i = 0; i < n; ++i) *loss += out_state.losses()[i] * loss_grad;
    xn.Reset();
    // The final norm's backward: ∇y from ∇X (rounded to bf16, as the engine does).
    VP_BENCH_ASSIGN(dy, act(true));   // (n, h), accumulated into
    VP_BENCH_ASSIGN(gx, act(false));  // (n, h) ∇X in bf16
    MarkPhase(stream, Phase::kOther);
    VP_CUDA_RETURN_IF_ERROR(
        FloatToBf16(gx.data(), out_state.grad_input(), static_cast<long>(nh), stream));
    MarkPhase(stream, Phase::kNorm);
    if (o.llama()) {
      VP_CUDA_RETURN_IF_ERROR(RmsNormBackwardInput<bf16>(dy.data(), dy.data(), gx.data(), y.data(),
                                                         lnf_w, rstd.data(), n, h, stream));
      VP_CUDA_RETURN_IF_ERROR(
          RmsNormBackwardWeight<bf16>(lnf_wg, gx.data(), y.data(), rstd.data(), n, h, stream));
    } else {
      VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardInput<bf16>(dy.data(), dy.data(), gx.data(),
                                                           y.data(), lnf_w, mean.data(),
                                                           rstd.data(), n, h, stream));
      VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardWeight<bf16>(
          lnf_wg, lnf_bg, gx.data(), y.data(), mean.data(), rstd.data(), n, h, stream));
    }
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    out_state.Release();
    y.Reset();
    gx.Reset();
    mean.Reset();
    rstd.Reset();
    // B+W of the layers; the embedding gradient to the position table and the input layer.
    VP_BENCH_ASSIGN(dx, act(false));  // (b, s, h)
    VP_BENCH_RETURN_IF_ERROR(stack->Backward({j, 0}, dy.data(), dx.data()));
    dy.Reset();
    MarkPhase(stream, Phase::kOther);
    if (!o.llama()) {
      VP_CUDA_RETURN_IF_ERROR(
          PositionEmbeddingBackward<bf16>(wpe_grad, dx.data(), b, s, h, 0, stream));
      VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    }
    VP_BENCH_RETURN_IF_ERROR(input->BackwardBroadcast(in_state, *self, 0, dx.data()));
    MarkPhase(stream, Phase::kOther);
    VP_BENCH_RETURN_IF_ERROR(input->Backward(in_state));
    dev.alloc.ReleasePending();  // what this thread freed since its last Finish (ActionDone)
    return absl::OkStatus();
  };

  // AdamW (the runtime's defaults: β 0.9/0.95, ε 1e-8, weight decay 0.1), lr 3e-4, clip 1.0.
  std::vector<double> host_partials(kSquaredNormBlocks);
  auto optimizer = [&](int64_t t, double* grad_norm) -> absl::Status {
    MarkPhase(stream, Phase::kOptimizer);
    VP_CUDA_RETURN_IF_ERROR(SquaredNormPartials(partials.data(), g, count, stream));
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_partials.data(), partials.data(),
                                            kSquaredNormBlocks * sizeof(double),
                                            cudaMemcpyDeviceToHost, stream));
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    double sq = 0;
    for (double v : host_partials) sq += v;
    *grad_norm = std::sqrt(sq);
    AdamWParams ap;
    ap.lr = 3e-4f;
    ap.grad_scale = *grad_norm > 1.0 ? static_cast<float>(1.0 / *grad_norm) : 1.0f;
    ap.bc1 = 1.0 - std::pow(static_cast<double>(ap.beta1), static_cast<double>(t));
    ap.bc2 = 1.0 - std::pow(static_cast<double>(ap.beta2), static_cast<double>(t));
    MarkPhase(stream, Phase::kOptimizer);
    VP_CUDA_RETURN_IF_ERROR(AdamWStep(master.data(), params.data(), g, adam_m.data(), adam_v.data(),
                                      decay.data(), count, ap, stream));
    return Finish(ctx);
  };

  double total_s = 0, loss = 0, grad_norm = 0;
  std::vector<double> step_s;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    if (i == o.warmup) {  // the peaks of the timed steps only (the state is live throughout)
      dev.tracker.ResetPeaks();
      dev.alloc.ResetPeaks();
    }
    loss = 0;
    const auto t0 = std::chrono::steady_clock::now();
    VP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g, 0, count * sizeof(float), stream));  // ZeroGrads
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    for (int j = 0; j < m; ++j) VP_BENCH_RETURN_IF_ERROR(microbatch(j, &loss));
    VP_BENCH_RETURN_IF_ERROR(optimizer(i + 1, &grad_norm));
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("  step %d%s: %.3f s, loss %.4f, grad norm %.4g\n", i,
                i < o.warmup ? " (warm-up)" : "", sec, loss, grad_norm);
    if (i >= o.warmup) {
      total_s += sec;
      step_s.push_back(sec);
    }
  }
  const double mean_s = total_s / o.iters;
  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const double median_s = sorted[sorted.size() / 2];
  VP_BENCH_ASSIGN(master_finite, AllFinite(master.data(), count));
  const AllocatorStats st = dev.alloc.stats();
  const double flops = StepFlops(o);
  const double tokens = static_cast<double>(m) * n;
  size_t free_b = 0, total_b = 0;
  VP_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  report.Line("whole step (mean)", flops, mean_s);
  std::printf(
      "  %.0f tokens/s (mean of %d steps; median %.3f s); loss %.4f (ln V = %.3f), "
      "weights finite: %s\n",
      tokens / mean_s, o.iters, median_s, loss, std::log(double(partition.vocab)),
      master_finite && std::isfinite(loss) ? "yes" : "NO");
  std::printf(
      "  memory (timed steps): peak in use %.2f GiB (parameters %.2f, gradients %.2f, optimizer "
      "%.2f, activations %.2f), peak reserved %.2f GiB (%.3fx in use); device used %.2f of "
      "%.2f GiB (context, cuBLAS workspaces included)\n",
      Gib(st.allocated_peak), Gib(dev.tracker.peak(MemoryCategory::kParameters)),
      Gib(dev.tracker.peak(MemoryCategory::kGradients)),
      Gib(dev.tracker.peak(MemoryCategory::kOptimizer)),
      Gib(dev.tracker.peak(MemoryCategory::kActivations)), Gib(st.reserved_peak),
      st.allocated_peak > 0 ? static_cast<double>(st.reserved_peak) / st.allocated_peak : 0.0,
      Gib(static_cast<double>(total_b - free_b)), Gib(static_cast<double>(total_b)));
  std::printf(
      "PERF section=step tokens_per_step=%.0f step_s=%.4f median_s=%.4f tokens_per_s=%.0f "
      "mfu=%s tflops=%.1f peak_inuse_gib=%.2f peak_reserved_gib=%.2f loss=%.4f params=%zu\n",
      tokens, mean_s, median_s, tokens / mean_s, report.MfuText(flops, mean_s).c_str(),
      flops / mean_s / 1e12, Gib(st.allocated_peak), Gib(st.reserved_peak), loss, count);
  if (!master_finite || !std::isfinite(loss)) {
    return absl::InternalError("step: non-finite loss or weights");
  }
  // Where a whole step's time goes: one more step, profiled. "busy" is the compute stream's
  // marked phases, "idle" its waits after each Finish (host work, syncs, C1 on the comm stream).
  return BreakdownStatus("step", [&]() -> absl::Status {
    VP_BENCH_ASSIGN(timer, PhaseTimer::Start(stream));
    VP_BENCH_RETURN_IF_ERROR(timer->Collect().status());
    const auto t0 = std::chrono::steady_clock::now();
    double profiled_loss = 0;
    MarkPhase(stream, Phase::kOptimizer);  // ZeroGrads
    VP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g, 0, count * sizeof(float), stream));
    VP_BENCH_RETURN_IF_ERROR(Finish(ctx));
    for (int j = 0; j < m; ++j) VP_BENCH_RETURN_IF_ERROR(microbatch(j, &profiled_loss));
    VP_BENCH_RETURN_IF_ERROR(optimizer(o.warmup + o.iters + 1, &grad_norm));
    const double wall_ms =
        1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    VP_BENCH_ASSIGN(phases, timer->Collect());
    // The wall time includes host work before the first mark (none is left unmarked after).
    PrintBreakdown("step", phases, timer->dropped(),
                   absl::StrFormat("; wall %.1f ms (unprofiled %.1f), stream busy %.1f%% of it",
                                   wall_ms, mean_s * 1e3, 100 * phases.busy_ms() / wall_ms));
    return absl::OkStatus();
  }());
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
  const Options& o = *opts;
  // A misspelt kernel switch would time the default kernels under the name asked for.
  if (absl::Status st = CheckKernelSwitches(); !st.ok()) {
    std::fprintf(stderr, "cuda_bench: %s\n", std::string(st.message()).c_str());
    return 2;
  }
  if (o.print_flops) {  // no device needed: the FLOP convention, for torch_baseline.py's test
    absl::StatusOr<vocab::VocabPartition> partition = vocab::MakeVocabPartition(o.rows, 1, 0);
    if (!partition.ok()) {
      std::fprintf(stderr, "%s\n", partition.status().ToString().c_str());
      return 2;
    }
    // Parameters without the padding rows a shard may carry (the model's own count).
    const StepLayout lay = MakeStepLayout(o, o.rows);
    std::printf(
        "FLOPS layer_per_microbatch=%.17g step=%.17g tokens_per_step=%d params=%zu "
        "padded_rows=%lld\n",
        LayerFlops(o, o.batch), StepFlops(o), o.microbatches * o.tokens(), lay.count,
        static_cast<long long>(partition->rows));
    return 0;
  }
  if (DeviceCount() == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  const std::string name = DeviceName(0).value_or("unknown");
  int failures = 0;
  auto run = [&](const char* section, const absl::Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "%s: %s\n", section, s.ToString().c_str());
      std::printf("PERF section=%s FAIL %s\n", section, std::string(s.message()).c_str());
      ++failures;
    }
  };
  // The MFU peak: --peak, else the one measured here, else the datasheet table.
  std::optional<double> peak = o.peak;
  std::string source = "--peak";
  if (o.peak_section) {
    absl::StatusOr<double> measured = MeasurePeakTflops(o);
    run("peak", measured.status());
    if (measured.ok() && !peak) {
      peak = *measured;
      source = "measured";
    }
  }
  if (!peak) {
    peak = PeakBf16Tflops(name);
    source = peak ? "datasheet table" : "";
  }
  std::printf("GPU %s, MFU against %s TFLOP/s%s\n", name.c_str(),
              peak ? absl::StrFormat("%.1f", *peak).c_str() : "unknown",
              peak ? absl::StrCat(" (", source, ")").c_str() : "");
  std::printf("PERF section=config gpu=\"%s\" mfu_peak_tflops=%s peak_source=\"%s\"\n",
              name.c_str(), peak ? absl::StrFormat("%.1f", *peak).c_str() : "n/a", source.c_str());
  std::fflush(stdout);
  const Reporter report(peak);
  // Each section flushes its lines before the next starts: perf.sh may stop the program.
  auto flushed = [&](const char* section, const absl::Status& s) {
    run(section, s);
    std::fflush(stdout);
  };
  if (o.layer) flushed("layer", RunLayerPasses(o, report));
  if (o.output) {
    for (OutputAlgorithm a : o.algorithms) flushed("output", RunOutputLayer(o, a, report));
  }
  if (o.gemm) flushed("gemm", RunGemms(o, report));
  if (o.attention) flushed("attention", RunAttention(o, report));
  if (o.memory) flushed("memory", RunMemory(o));
  if (o.step) flushed("step", RunStep(o, report));
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
