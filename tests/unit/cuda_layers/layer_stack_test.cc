// DeviceLayerStack against the CPU LayerStack. Create's argument checks run everywhere (they are
// done before the device is touched); the rest skips with "no CUDA device" without a GPU.
//
// Tolerances. fp32: 1e-4 relative per element plus a floor of 1e-5·max|reference| per tensor
// (cuBLASLt and OpenBLAS sum in different orders, and flash attention rescales its running
// softmax; values that cancel to near 0 need the floor). bf16 (parameters, activations and the
// cross-chunk dK/dV accumulators rounded to 8 mantissa bits, ≈ 4e-3 per rounding): outputs and
// input gradients within 3e-2 relative + 3e-2·max|reference|; each parameter-gradient tensor
// within 5e-2 relative L2 error (fp32 accumulation of bf16 products).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/cuda_test_device.h"
#include "tests/support/gloo_threads.h"
#include "worker/comm/nccl/staged_communicator.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"
#include "worker/engine/transformer/cuda/transformer.h"
#include "worker/engine/transformer/transformer.h"

namespace vp::engine::cuda {
namespace {

using ::testing::HasSubstr;

ModelConfig SmallConfig() {
  ModelConfig cfg;
  cfg.layers = 2;
  cfg.hidden = 32;
  cfg.heads = 4;
  cfg.vocab = 64;
  cfg.seq_len = 16;
  cfg.ffn_hidden = 128;
  return cfg;
}

// A Llama stack of the same size: head_dim 8, 2 key/value heads shared by 4 query heads (kv
// width 16, a multiple of 8 as the GEMMs need), SwiGLU width 48, RoPE positions from 0 and 8.
ModelConfig LlamaConfig() {
  ModelConfig cfg = SmallConfig();
  cfg.architecture = Architecture::kLlama;
  cfg.kv_heads = 2;
  cfg.ffn_hidden = 48;
  cfg.rope_theta = 10000.0f;
  return cfg;
}

constexpr int kBatch = 2;
const std::vector<int> kBounds = {0, 8, 16};

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& substr) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(substr));
}

// ---------------------------------------------------------------------------------------------
// Device-free: Create validates every argument before touching the device.

template <typename T>
void ExpectCreateRejectsBadArguments() {
  const DeviceContext no_device;  // null stream, gemm and alloc: never reached
  // Never dereferenced by Create; only null-ness and 16-byte alignment are checked.
  alignas(16) T params[8] = {};
  alignas(16) float grads[8] = {};
  const ModelConfig good = SmallConfig();
  auto create = [&](const ModelConfig& cfg, int first, int count, int b, std::vector<int> bounds,
                    const T* p, float* g) {
    return DeviceLayerStack<T>::Create(cfg, first, count, b, std::move(bounds), p, g, no_device)
        .status();
  };
  ModelConfig bad_heads = good;
  bad_heads.heads = 5;  // 32 % 5 != 0
  ExpectStatus(create(bad_heads, 0, 2, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "hidden % heads");
  ModelConfig odd_hidden = good;
  odd_hidden.hidden = 36;  // 36 % 4 == 0 but not a multiple of 8 (GEMM alignment)
  ExpectStatus(create(odd_hidden, 0, 2, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "multiples of 8");
  ModelConfig no_ffn = good;
  no_ffn.ffn_hidden = 0;
  ExpectStatus(create(no_ffn, 0, 2, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "ffn_hidden");
  ExpectStatus(create(good, 0, 0, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "layers [0, 0)");
  ExpectStatus(create(good, 1, 2, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "layers [1, 3)");
  ExpectStatus(create(good, 0, 2, 0, kBounds, params, grads), absl::StatusCode::kInvalidArgument,
               "microbatch_size");
  ExpectStatus(create(good, 0, 2, kBatch, {0, 8, 8, 16}, params, grads),
               absl::StatusCode::kInvalidArgument, "seq_bounds: must be strictly increasing");
  ExpectStatus(create(good, 0, 2, kBatch, {0, 8}, params, grads),
               absl::StatusCode::kInvalidArgument, "seq_bounds: must start at 0 and end at");
  ExpectStatus(create(good, 0, 2, kBatch, {0}, params, grads), absl::StatusCode::kInvalidArgument,
               "seq_bounds");
  ExpectStatus(create(good, 0, 2, kBatch, kBounds, nullptr, grads),
               absl::StatusCode::kInvalidArgument, "params");
  ExpectStatus(create(good, 0, 2, kBatch, kBounds, params, nullptr),
               absl::StatusCode::kInvalidArgument, "grads");
  // Every other argument valid: the missing GEMM runner / allocator is the error.
  ExpectStatus(create(good, 0, 2, kBatch, kBounds, params, grads),
               absl::StatusCode::kInvalidArgument, "ctx");
}

TEST(DeviceLayerStackCreate, RejectsBadArgumentsFloat) { ExpectCreateRejectsBadArguments<float>(); }

TEST(DeviceLayerStackCreate, RejectsBadArgumentsBf16) { ExpectCreateRejectsBadArguments<bf16>(); }

TEST(DeviceLayerStackCreate, RejectsLlamaKvWidthOffTheGemmAlignment) {
  alignas(16) float params[8] = {};
  alignas(16) float grads[8] = {};
  ModelConfig cfg = LlamaConfig();
  cfg.hidden = 48;
  cfg.heads = 8;  // head_dim 6, 2 key/value heads: k and v 12 columns wide
  auto s =
      DeviceLayerStack<float>::Create(cfg, 0, 2, kBatch, kBounds, params, grads, DeviceContext{})
          .status();
  ExpectStatus(s, absl::StatusCode::kInvalidArgument, "kv_heads·head_dim 12");
}

TEST(DeviceLayerStackCreate, RejectsMisalignedParams) {
  alignas(16) float params[8] = {};
  alignas(16) float grads[8] = {};
  auto s = DeviceLayerStack<float>::Create(SmallConfig(), 0, 2, kBatch, kBounds, params + 1, grads,
                                           DeviceContext{})
               .status();
  ExpectStatus(s, absl::StatusCode::kInvalidArgument, "16-byte aligned");
}

// ---------------------------------------------------------------------------------------------
// With a device.

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Positions [begin, end) of every sequence of full (b, s, h) as a (b, end-begin, h) chunk.
std::vector<float> ChunkRows(const std::vector<float>& full, int b, int s, int h, SeqChunk c) {
  std::vector<float> out;
  out.reserve(static_cast<size_t>(b) * c.len() * h);
  for (int i = 0; i < b; ++i) {
    const auto first = full.begin() + (static_cast<long>(i) * s + c.begin) * h;
    out.insert(out.end(), first, first + static_cast<long>(c.len()) * h);
  }
  return out;
}

// The schedule both stacks run: two microbatches interleaved, B in reverse chunk order, W split
// off and delayed (as ZB-style schedules do) and one fused B+W.
enum class Pass { kF, kB, kW, kBW };
struct Step {
  Pass pass;
  SlotKey slot;
};
const std::vector<Step> kSchedule = {
    {Pass::kF, {0, 0}}, {Pass::kF, {1, 0}}, {Pass::kF, {0, 1}},  {Pass::kF, {1, 1}},
    {Pass::kB, {0, 1}}, {Pass::kB, {0, 0}}, {Pass::kW, {0, 1}},  {Pass::kB, {1, 1}},
    {Pass::kW, {0, 0}}, {Pass::kW, {1, 1}}, {Pass::kBW, {1, 0}},
};

struct Inputs {
  std::vector<float> params;             // 2 layers, CPU init
  std::vector<std::vector<float>> x;     // per microbatch (b, s, h)
  std::vector<std::vector<float>> dout;  // per microbatch (b, s, h)
};

Inputs MakeInputs(const ModelConfig& cfg) {
  Inputs in;
  in.params.resize(cfg.layers * LayerParamCount(cfg));
  std::vector<float> no_grads(in.params.size());
  auto init = LayerStack::Create(cfg, 0, cfg.layers, kBatch, kBounds, in.params.data(),
                                 no_grads.data(), nullptr);
  EXPECT_TRUE(init.ok()) << init.status();
  if (init.ok()) init->InitParams(1234);
  // LayerNorm biases and linear biases start at 0 under the GPT-2 init; perturb every parameter
  // so a bias read from the wrong offset shows up in the comparison.
  const std::vector<float> noise = Random(in.params.size(), 99, 0.02f);
  for (size_t i = 0; i < in.params.size(); ++i) in.params[i] += noise[i];
  const size_t nh = static_cast<size_t>(kBatch) * cfg.seq_len * cfg.hidden;
  for (int mb = 0; mb < 2; ++mb) {
    in.x.push_back(Random(nh, 10 + mb));
    in.dout.push_back(Random(nh, 20 + mb));
  }
  return in;
}

struct Results {
  std::map<SlotKey, std::vector<float>> out;  // per slot (b, t, h)
  std::map<SlotKey, std::vector<float>> dx;   // per slot (b, t, h)
  std::vector<float> grads;
};

Results RunCpu(const ModelConfig& cfg, const Inputs& in) {
  Results r;
  std::vector<float> params = in.params;
  r.grads.assign(params.size(), 0.0f);
  MemoryTracker tracker;
  auto stack = LayerStack::Create(cfg, 0, cfg.layers, kBatch, kBounds, params.data(),
                                  r.grads.data(), &tracker);
  EXPECT_TRUE(stack.ok()) << stack.status();
  if (!stack.ok()) return r;
  for (const Step& step : kSchedule) {
    const SeqChunk c = stack->seq_chunk(step.slot.seq);
    const int mb = step.slot.microbatch;
    const size_t nh = static_cast<size_t>(kBatch) * c.len() * cfg.hidden;
    if (step.pass == Pass::kF) {
      const std::vector<float> x = ChunkRows(in.x[mb], kBatch, cfg.seq_len, cfg.hidden, c);
      std::vector<float>& out = r.out[step.slot];
      out.resize(nh);
      EXPECT_TRUE(stack->Forward(step.slot, x.data(), out.data()).ok());
    } else if (step.pass == Pass::kW) {
      EXPECT_TRUE(stack->BackwardWeight(step.slot).ok());
    } else {
      const std::vector<float> dout = ChunkRows(in.dout[mb], kBatch, cfg.seq_len, cfg.hidden, c);
      std::vector<float>& dx = r.dx[step.slot];
      dx.resize(nh);
      const absl::Status s = step.pass == Pass::kB
                                 ? stack->BackwardInput(step.slot, dout.data(), dx.data())
                                 : stack->Backward(step.slot, dout.data(), dx.data());
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  return r;
}

class DeviceLayerStackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    // The stack's allocator as a rank sets it up (shared by threads, reuse after Finish); test
    // inputs and outputs come from a second, untracked allocator so that the tracker's
    // kActivations counts only what the stack holds.
    alloc_ = std::make_unique<CachingAllocator>(MakeCudaMemoryBackend(), &tracker_,
                                                CachingAllocator::Reuse::kAfterSync);
    io_alloc_ = std::make_unique<CachingAllocator>(MakeCudaMemoryBackend(), nullptr);
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status();
    stream_ = std::move(*stream);
    auto gemm = GemmRunner::Create();
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    gemm_ = std::move(*gemm);
    // Under VOCABPIPE_ATTENTION=cudnn the layers' bf16 attention runs on cuDNN, as in a rank;
    // its kept workspace comes from the untracked allocator, so kActivations still counts only
    // what the stack holds.
    auto dnn = ChosenCudnnAttention(io_alloc_.get());
    ASSERT_TRUE(dnn.ok()) << dnn.status();
    attention_ = std::move(*dnn);
    ctx_ = DeviceContext{stream_.get(), gemm_.get(), alloc_.get(), attention_.get()};
    io_ = DeviceContext{stream_.get(), gemm_.get(), io_alloc_.get()};
  }

  // A device copy of host fp32 values as E (bf16: rounded to nearest even on the device).
  template <typename E>
  DeviceArray<E> ToDevice(const std::vector<float>& host) {
    auto f = DeviceArray<float>::Create(io_, MemoryCategory::kActivations, host.size(), false);
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok()) return {};
    EXPECT_EQ(cudaMemcpyAsync(f->data(), host.data(), host.size() * sizeof(float),
                              cudaMemcpyHostToDevice, io_.stream),
              cudaSuccess);
    if constexpr (std::is_same_v<E, float>) {
      EXPECT_EQ(cudaStreamSynchronize(io_.stream), cudaSuccess);
      return std::move(*f);
    } else {
      auto d = DeviceArray<E>::Create(io_, MemoryCategory::kActivations, host.size(), false);
      EXPECT_TRUE(d.ok()) << d.status();
      if (!d.ok()) return {};
      EXPECT_EQ(FloatToBf16(d->data(), f->data(), static_cast<long>(host.size()), io_.stream),
                cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(io_.stream), cudaSuccess);
      return std::move(*d);
    }
  }

  // n device values of E as host fp32.
  template <typename E>
  std::vector<float> ToHost(const E* p, size_t n) {
    std::vector<float> host(n);
    const float* src = nullptr;
    DeviceArray<float> tmp;
    if constexpr (std::is_same_v<E, float>) {
      src = p;
    } else {
      auto f = DeviceArray<float>::Create(io_, MemoryCategory::kActivations, n, false);
      EXPECT_TRUE(f.ok()) << f.status();
      if (!f.ok()) return host;
      tmp = std::move(*f);
      EXPECT_EQ(Bf16ToFloat(tmp.data(), p, static_cast<long>(n), io_.stream), cudaSuccess);
      src = tmp.data();
    }
    EXPECT_EQ(
        cudaMemcpyAsync(host.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost, io_.stream),
        cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(io_.stream), cudaSuccess);
    return host;
  }

  template <typename T>
  Results RunDevice(const ModelConfig& cfg, const Inputs& in) {
    Results r;
    DeviceArray<T> params = ToDevice<T>(in.params);
    DeviceArray<float> grads = ToDevice<float>(std::vector<float>(in.params.size(), 0.0f));
    auto stack = DeviceLayerStack<T>::Create(cfg, 0, cfg.layers, kBatch, kBounds, params.data(),
                                             grads.data(), ctx_);
    EXPECT_TRUE(stack.ok()) << stack.status();
    if (!stack.ok()) return r;
    DeviceLayerStack<T>& st = **stack;
    for (const Step& step : kSchedule) {
      const SeqChunk c = st.seq_chunk(step.slot.seq);
      const int mb = step.slot.microbatch;
      const size_t nh = static_cast<size_t>(kBatch) * c.len() * cfg.hidden;
      if (step.pass == Pass::kF) {
        // x is freed right after F: the stack must keep its own copy for W.
        DeviceArray<T> x = ToDevice<T>(ChunkRows(in.x[mb], kBatch, cfg.seq_len, cfg.hidden, c));
        DeviceArray<T> out = ToDevice<T>(std::vector<float>(nh, 0.0f));
        const absl::Status s = st.Forward(step.slot, x.data(), out.data());
        EXPECT_TRUE(s.ok()) << s;
        r.out[step.slot] = ToHost(out.data(), nh);
      } else if (step.pass == Pass::kW) {
        const absl::Status s = st.BackwardWeight(step.slot);
        EXPECT_TRUE(s.ok()) << s;
      } else {
        DeviceArray<T> dout =
            ToDevice<T>(ChunkRows(in.dout[mb], kBatch, cfg.seq_len, cfg.hidden, c));
        // Poisoned: B must overwrite dx, not accumulate into it.
        DeviceArray<T> dx = ToDevice<T>(std::vector<float>(nh, 7.0f));
        const absl::Status s = step.pass == Pass::kB
                                   ? st.BackwardInput(step.slot, dout.data(), dx.data())
                                   : st.Backward(step.slot, dout.data(), dx.data());
        EXPECT_TRUE(s.ok()) << s;
        r.dx[step.slot] = ToHost(dx.data(), nh);
      }
      if (step.pass == Pass::kF) {
        EXPECT_GT(tracker_.current(MemoryCategory::kActivations), 0);
      }
    }
    EXPECT_EQ(st.live_slots(), 0);
    // Every activation, K/V cache and dK/dV accumulator went back to the allocator.
    EXPECT_EQ(tracker_.current(MemoryCategory::kActivations), 0);
    r.grads = ToHost(grads.data(), grads.size());
    return r;
  }

  MemoryTracker tracker_;
  std::unique_ptr<CachingAllocator> alloc_;
  std::unique_ptr<CachingAllocator> io_alloc_;
  CudaStream stream_;
  std::unique_ptr<GemmRunner> gemm_;
  std::unique_ptr<CudnnAttention> attention_;
  DeviceContext ctx_;
  DeviceContext io_;
};

double MaxAbs(const std::vector<float>& v) {
  double m = 0.0;
  for (const float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// Elementwise: |got − want| <= rel·|want| + floor·max|want|; reports the first violation.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel,
                 double floor, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double abs_floor = floor * MaxAbs(want);
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rel * std::abs(want[i]) + abs_floor;
    if (!(std::abs(static_cast<double>(got[i]) - want[i]) <= tol)) {  // also catches NaN
      ADD_FAILURE() << what << " at " << i << ": got " << got[i] << ", want " << want[i]
                    << " (tolerance " << tol << ")";
      return;
    }
  }
}

// ‖got − want‖₂ <= rel·‖want‖₂.
void ExpectCloseL2(const std::vector<float>& got, const std::vector<float>& want, double rel,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_GT(norm, 0.0) << what;
  EXPECT_LE(std::sqrt(diff), rel * std::sqrt(norm)) << what;  // false for NaN
}

// Compares each named tensor of each layer's gradient block.
template <typename Compare>
void CompareGrads(const ModelConfig& cfg, const std::vector<float>& got,
                  const std::vector<float>& want, Compare compare) {
  ASSERT_EQ(got.size(), want.size());
  const size_t per_layer = LayerParamCount(cfg);
  for (int layer = 0; layer < cfg.layers; ++layer) {
    for (const TensorSpec& spec : LayerTensorSpecs(cfg)) {
      const size_t begin = layer * per_layer + spec.offset;
      const std::vector<float> g(got.begin() + begin, got.begin() + begin + spec.count());
      const std::vector<float> w(want.begin() + begin, want.begin() + begin + spec.count());
      compare(g, w, "grad " + LayerTensorName(cfg, layer, spec.name));
    }
  }
}

TEST_F(DeviceLayerStackTest, Fp32MatchesCpu) {
  const ModelConfig cfg = SmallConfig();
  const Inputs in = MakeInputs(cfg);
  const Results want = RunCpu(cfg, in);
  const Results got = RunDevice<float>(cfg, in);
  ASSERT_EQ(got.out.size(), want.out.size());
  ASSERT_EQ(got.dx.size(), want.dx.size());
  for (const auto& [slot, w] : want.out) {
    const std::string name =
        "out mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.out.at(slot), w, 1e-4, 1e-5, name);
  }
  for (const auto& [slot, w] : want.dx) {
    const std::string name =
        "dx mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.dx.at(slot), w, 1e-4, 1e-5, name);
  }
  CompareGrads(cfg, got.grads, want.grads,
               [](const std::vector<float>& g, const std::vector<float>& w,
                  const std::string& name) { ExpectClose(g, w, 1e-4, 1e-5, name); });
}

TEST_F(DeviceLayerStackTest, Bf16WithinTolerance) {
  const ModelConfig cfg = SmallConfig();
  const Inputs in = MakeInputs(cfg);
  const Results want = RunCpu(cfg, in);
  const Results got = RunDevice<bf16>(cfg, in);
  ASSERT_EQ(got.out.size(), want.out.size());
  ASSERT_EQ(got.dx.size(), want.dx.size());
  for (const auto& [slot, w] : want.out) {
    const std::string name =
        "out mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.out.at(slot), w, 3e-2, 3e-2, name);
  }
  for (const auto& [slot, w] : want.dx) {
    const std::string name =
        "dx mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.dx.at(slot), w, 3e-2, 3e-2, name);
  }
  CompareGrads(cfg, got.grads, want.grads,
               [](const std::vector<float>& g, const std::vector<float>& w,
                  const std::string& name) { ExpectCloseL2(g, w, 5e-2, name); });
}

// The Llama block (RMSNorm, RoPE at each chunk's absolute positions, grouped-query attention
// with dK/dV summed over each group and carried across chunks, SwiGLU, nn.Linear layout) on the
// same schedule: F, B and W of every slot against the CPU stack.
TEST_F(DeviceLayerStackTest, LlamaFp32MatchesCpu) {
  const ModelConfig cfg = LlamaConfig();
  const Inputs in = MakeInputs(cfg);
  const Results want = RunCpu(cfg, in);
  const Results got = RunDevice<float>(cfg, in);
  ASSERT_EQ(got.out.size(), want.out.size());
  ASSERT_EQ(got.dx.size(), want.dx.size());
  for (const auto& [slot, w] : want.out) {
    const std::string name =
        "llama out mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.out.at(slot), w, 1e-4, 1e-5, name);
  }
  for (const auto& [slot, w] : want.dx) {
    const std::string name =
        "llama dx mb " + std::to_string(slot.microbatch) + " seq " + std::to_string(slot.seq);
    ExpectClose(got.dx.at(slot), w, 1e-4, 1e-5, name);
  }
  CompareGrads(cfg, got.grads, want.grads,
               [](const std::vector<float>& g, const std::vector<float>& w,
                  const std::string& name) { ExpectClose(g, w, 1e-4, 1e-5, name); });
}

TEST_F(DeviceLayerStackTest, LlamaBf16WithinTolerance) {
  const ModelConfig cfg = LlamaConfig();
  const Inputs in = MakeInputs(cfg);
  const Results want = RunCpu(cfg, in);
  const Results got = RunDevice<bf16>(cfg, in);
  ASSERT_EQ(got.out.size(), want.out.size());
  for (const auto& [slot, w] : want.out) {
    ExpectClose(got.out.at(slot), w, 3e-2, 3e-2, "llama bf16 out");
  }
  for (const auto& [slot, w] : want.dx) {
    ExpectClose(got.dx.at(slot), w, 3e-2, 3e-2, "llama bf16 dx");
  }
  CompareGrads(cfg, got.grads, want.grads,
               [](const std::vector<float>& g, const std::vector<float>& w,
                  const std::string& name) { ExpectCloseL2(g, w, 5e-2, name); });
}

// Recomputation (selective, full) on the device against the CPU stack without it (which the
// CPU's own recompute_equivalence_test shows bit-identical to its recomputing modes), for GPT-2
// and Llama over the schedule's split and unsplit backwards and two sequence chunks (full
// recomputation refills the released K/V cache from the earlier chunk). fp32 tolerances.
TEST_F(DeviceLayerStackTest, RecomputeFp32MatchesCpu) {
  for (const ModelConfig& base : {SmallConfig(), LlamaConfig()}) {
    const Inputs in = MakeInputs(base);
    const Results want = RunCpu(base, in);
    for (const Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
      SCOPED_TRACE(std::string(base.llama() ? "llama " : "gpt2 ") +
                   (mode == Recompute::kFull ? "full" : "selective"));
      ModelConfig cfg = base;
      cfg.recompute = mode;
      const Results got = RunDevice<float>(cfg, in);
      ASSERT_EQ(got.out.size(), want.out.size());
      ASSERT_EQ(got.dx.size(), want.dx.size());
      for (const auto& [slot, w] : want.out) ExpectClose(got.out.at(slot), w, 1e-4, 1e-5, "out");
      for (const auto& [slot, w] : want.dx) ExpectClose(got.dx.at(slot), w, 1e-4, 1e-5, "dx");
      CompareGrads(cfg, got.grads, want.grads,
                   [](const std::vector<float>& g, const std::vector<float>& w,
                      const std::string& name) { ExpectClose(g, w, 1e-4, 1e-5, name); });
    }
  }
}

TEST_F(DeviceLayerStackTest, OutOfOrderCallsAreRejected) {
  const ModelConfig cfg = SmallConfig();
  const Inputs in = MakeInputs(cfg);
  DeviceArray<float> params = ToDevice<float>(in.params);
  DeviceArray<float> grads = ToDevice<float>(std::vector<float>(in.params.size(), 0.0f));
  auto stack = DeviceLayerStack<float>::Create(cfg, 0, cfg.layers, kBatch, kBounds, params.data(),
                                               grads.data(), ctx_);
  ASSERT_TRUE(stack.ok()) << stack.status();
  DeviceLayerStack<float>& st = **stack;
  EXPECT_EQ(st.num_seq_chunks(), 2);
  EXPECT_EQ(st.seq_chunk(1).begin, 8);
  EXPECT_EQ(st.seq_chunk(1).end, 16);
  const size_t nh = static_cast<size_t>(kBatch) * 8 * cfg.hidden;  // both chunks have 8 rows
  DeviceArray<float> x = ToDevice<float>(Random(nh, 5));
  DeviceArray<float> y = ToDevice<float>(std::vector<float>(nh, 0.0f));
  DeviceArray<float> g = ToDevice<float>(Random(nh, 6));

  ExpectStatus(st.Forward({0, 2}, x.data(), y.data()), absl::StatusCode::kInvalidArgument,
               "slot.seq");
  ExpectStatus(st.Forward({0, 1}, x.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "expected seq 0");
  ExpectStatus(st.BackwardInput({0, 0}, g.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "not forwarded");
  ExpectStatus(st.BackwardWeight({0, 0}), absl::StatusCode::kFailedPrecondition, "needs B");
  EXPECT_EQ(st.live_slots(), 0);

  ASSERT_TRUE(st.Forward({0, 0}, x.data(), y.data()).ok());
  EXPECT_EQ(st.live_slots(), 1);
  ExpectStatus(st.Forward({0, 0}, x.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "already forwarded");
  // B needs every chunk of the microbatch forwarded.
  ExpectStatus(st.BackwardInput({0, 0}, g.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "expected seq 1");
  ASSERT_TRUE(st.Forward({0, 1}, x.data(), y.data()).ok());
  // Chunks go backward in reverse order.
  ExpectStatus(st.BackwardInput({0, 0}, g.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "reverse order; expected seq 1");
  ExpectStatus(st.BackwardWeight({0, 1}), absl::StatusCode::kFailedPrecondition, "needs B");
  ASSERT_TRUE(st.BackwardInput({0, 1}, g.data(), y.data()).ok());
  ExpectStatus(st.BackwardInput({0, 1}, g.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "backward already ran");
  ASSERT_TRUE(st.BackwardWeight({0, 1}).ok());
  EXPECT_EQ(st.live_slots(), 1);
  ExpectStatus(st.BackwardWeight({0, 1}), absl::StatusCode::kFailedPrecondition, "needs B");
  ASSERT_TRUE(st.Backward({0, 0}, g.data(), y.data()).ok());
  EXPECT_EQ(st.live_slots(), 0);
  EXPECT_EQ(tracker_.current(MemoryCategory::kActivations), 0);
  // The microbatch is finished: its id starts afresh at chunk 0.
  ExpectStatus(st.Forward({0, 1}, x.data(), y.data()), absl::StatusCode::kFailedPrecondition,
               "expected seq 0");
  ASSERT_TRUE(st.Forward({0, 0}, x.data(), y.data()).ok());
  ASSERT_TRUE(st.Forward({0, 1}, x.data(), y.data()).ok());
  ASSERT_TRUE(st.Backward({0, 1}, g.data(), y.data()).ok());
  ASSERT_TRUE(st.Backward({0, 0}, g.data(), y.data()).ok());
  EXPECT_EQ(tracker_.current(MemoryCategory::kActivations), 0);
}

// ---------------------------------------------------------------------------------------------
// Tensor parallelism: t ranks as threads on one GPU (their group a Gloo group staged through
// host memory), each running the schedule above on its b·len/t sequence-parallel rows, against
// the CPU LayerStack at the same t (whose own tests prove it equal to t = 1): every rank's
// outputs, input gradients and gradient slices. The parameters are each rank's slice as the CPU
// stack initialises it (slice-independent), perturbed alike on both.

struct TensorRankResults {
  Results cpu, device;
  std::string error;
};

// Rows [r·m, (r+1)·m) of a chunk's (b·len, h) rows: tensor rank r's share.
std::vector<float> RankRows(const std::vector<float>& rows, int h, int r, int t) {
  const size_t m = rows.size() / h / t;
  return std::vector<float>(rows.begin() + static_cast<long>(r * m * h),
                            rows.begin() + static_cast<long>((r + 1) * m * h));
}

template <typename T>
std::vector<TensorRankResults> RunTensorRanks(const ModelConfig& cfg, int t) {
  std::vector<TensorRankResults> out(t);
  const Inputs whole = MakeInputs(cfg);  // only x and dout are used: the rows of every rank
  comm::testing::RunOnGlooRanks(t, [&](comm::GlooCommunicator& gloo) {
    const int r = gloo.rank();
    TensorRankResults& res = out[r];
    const engine::tp::TensorGroup cpu_group(&gloo);
    const size_t count = cfg.layers * LayerParamCount(cfg, t);
    std::vector<float> params(count), no_grads(count);
    {
      auto init = LayerStack::Create(cfg, 0, cfg.layers, kBatch, kBounds, params.data(),
                                     no_grads.data(), nullptr, cpu_group);
      if (!init.ok()) {
        res.error = init.status().ToString();
        return;
      }
      init->InitParams(1234);
      const std::vector<float> noise = Random(count, 99 + r, 0.02f);
      for (size_t i = 0; i < count; ++i) params[i] += noise[i];
    }
    auto rows = [&](const std::vector<float>& full, SeqChunk c) {
      return RankRows(ChunkRows(full, kBatch, cfg.seq_len, cfg.hidden, c), cfg.hidden, r, t);
    };
    // The CPU stack at t.
    {
      std::vector<float> p = params;
      res.cpu.grads.assign(count, 0.0f);
      MemoryTracker tracker;
      auto stack = LayerStack::Create(cfg, 0, cfg.layers, kBatch, kBounds, p.data(),
                                      res.cpu.grads.data(), &tracker, cpu_group);
      if (!stack.ok()) {
        res.error = stack.status().ToString();
        return;
      }
      for (const Step& step : kSchedule) {
        const SeqChunk c = stack->seq_chunk(step.slot.seq);
        const int mb = step.slot.microbatch;
        absl::Status st;
        if (step.pass == Pass::kF) {
          const std::vector<float> x = rows(whole.x[mb], c);
          std::vector<float>& o = res.cpu.out[step.slot];
          o.resize(x.size());
          st = stack->Forward(step.slot, x.data(), o.data());
        } else if (step.pass == Pass::kW) {
          st = stack->BackwardWeight(step.slot);
        } else {
          const std::vector<float> dout = rows(whole.dout[mb], c);
          std::vector<float>& dx = res.cpu.dx[step.slot];
          dx.resize(dout.size());
          st = step.pass == Pass::kB ? stack->BackwardInput(step.slot, dout.data(), dx.data())
                                     : stack->Backward(step.slot, dout.data(), dx.data());
        }
        if (!st.ok()) {
          res.error = absl::StrCat("cpu: ", st.ToString());
          return;
        }
      }
    }
    // The device stack at t, its group the same Gloo group staged through host memory.
    comm::StagedCommunicator staged(&gloo);
    test_support::TestDevice dev;
    if (!dev.error.empty()) {
      res.error = dev.error;
      return;
    }
    DeviceArray<T> p = dev.Up<T>(params);
    DeviceArray<float> g = dev.Up<float>(std::vector<float>(count, 0.0f));
    auto stack = DeviceLayerStack<T>::Create(cfg, 0, cfg.layers, kBatch, kBounds, p.data(),
                                             g.data(), dev.ctx, engine::tp::TensorGroup(&staged));
    if (!stack.ok()) {
      res.error = stack.status().ToString();
      return;
    }
    for (const Step& step : kSchedule) {
      const SeqChunk c = (*stack)->seq_chunk(step.slot.seq);
      const int mb = step.slot.microbatch;
      absl::Status st;
      if (step.pass == Pass::kF) {
        const std::vector<float> host_x = rows(whole.x[mb], c);
        DeviceArray<T> x = dev.Up<T>(host_x);
        DeviceArray<T> o = dev.Up<T>(std::vector<float>(host_x.size(), 0.0f));
        st = (*stack)->Forward(step.slot, x.data(), o.data());
        res.device.out[step.slot] = dev.Down(o.data(), o.size());
      } else if (step.pass == Pass::kW) {
        st = (*stack)->BackwardWeight(step.slot);
      } else {
        const std::vector<float> host_dout = rows(whole.dout[mb], c);
        DeviceArray<T> dout = dev.Up<T>(host_dout);
        DeviceArray<T> dx = dev.Up<T>(std::vector<float>(host_dout.size(), 7.0f));
        st = step.pass == Pass::kB ? (*stack)->BackwardInput(step.slot, dout.data(), dx.data())
                                   : (*stack)->Backward(step.slot, dout.data(), dx.data());
        res.device.dx[step.slot] = dev.Down(dx.data(), dx.size());
      }
      if (!st.ok()) {
        res.error = absl::StrCat("device: ", st.ToString());
        return;
      }
    }
    if ((*stack)->live_slots() != 0) res.error = "device: slots still live after the schedule";
    res.device.grads = dev.Down(g.data(), g.size());
  });
  return out;
}

template <typename T>
void ExpectTensorRanksMatchCpu(const ModelConfig& cfg, int t) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<TensorRankResults> ranks = RunTensorRanks<T>(cfg, t);
  const bool fp32 = std::is_same_v<T, float>;
  for (int r = 0; r < t; ++r) {
    const TensorRankResults& res = ranks[r];
    ASSERT_EQ(res.error, "") << "tensor rank " << r;
    const std::string at = " (tensor rank " + std::to_string(r) + ")";
    // fp32 to the fp32 tolerances, bf16 to the bf16 ones (the file comment).
    const double rel = fp32 ? 1e-4 : 3e-2, floor = fp32 ? 1e-5 : 3e-2;
    for (const auto& [what, got, want] : {std::tuple{"out", &res.device.out, &res.cpu.out},
                                          std::tuple{"dx", &res.device.dx, &res.cpu.dx}}) {
      ASSERT_EQ(got->size(), want->size()) << what;
      for (const auto& [slot, w] : *want) {
        ExpectClose(got->at(slot), w, rel, floor,
                    absl::StrCat(what, " mb ", slot.microbatch, " seq ", slot.seq, at));
      }
    }
    ASSERT_EQ(res.device.grads.size(), res.cpu.grads.size());
    const size_t per_layer = LayerParamCount(cfg, t);
    for (int layer = 0; layer < cfg.layers; ++layer) {
      for (const TensorSpec& spec : LayerTensorSpecs(cfg, t)) {
        const size_t begin = layer * per_layer + spec.offset;
        const std::vector<float> got(res.device.grads.begin() + begin,
                                     res.device.grads.begin() + begin + spec.count());
        const std::vector<float> want(res.cpu.grads.begin() + begin,
                                      res.cpu.grads.begin() + begin + spec.count());
        const std::string name = "grad " + LayerTensorName(cfg, layer, spec.name) + at;
        if (fp32) {
          ExpectClose(got, want, 1e-4, 1e-5, name);
        } else {
          ExpectCloseL2(got, want, 5e-2, name);
        }
      }
    }
  }
}

TEST(DeviceLayerStackTensorParallel, Gpt2Fp32TwoRanks) {
  ExpectTensorRanksMatchCpu<float>(SmallConfig(), 2);
}
TEST(DeviceLayerStackTensorParallel, Gpt2Fp32FourRanks) {
  ExpectTensorRanksMatchCpu<float>(SmallConfig(), 4);
}
TEST(DeviceLayerStackTensorParallel, Gpt2Bf16TwoRanks) {
  ExpectTensorRanksMatchCpu<bf16>(SmallConfig(), 2);
}
// Llama with its 2 key/value heads cut (one per rank) and with a single, replicated one.
TEST(DeviceLayerStackTensorParallel, LlamaFp32TwoRanks) {
  ExpectTensorRanksMatchCpu<float>(LlamaConfig(), 2);
}
TEST(DeviceLayerStackTensorParallel, LlamaFp32ReplicatedKeyValueHead) {
  ModelConfig cfg = LlamaConfig();
  cfg.kv_heads = 1;  // kv width 8: whole on both ranks
  ExpectTensorRanksMatchCpu<float>(cfg, 2);
}
TEST(DeviceLayerStackTensorParallel, LlamaBf16TwoRanks) {
  ExpectTensorRanksMatchCpu<bf16>(LlamaConfig(), 2);
}

// Device-free: the tensor rules are checked before the device is touched.
TEST(DeviceLayerStackCreate, RefusesATensorSplitTheModelOrTheDeviceCannotTake) {
  const DeviceContext no_device;
  alignas(16) float params[8] = {};
  alignas(16) float grads[8] = {};
  comm::testing::RunOnGlooRanks(2, [&](comm::GlooCommunicator& gloo) {
    const engine::tp::TensorGroup group(&gloo);
    auto create = [&](const ModelConfig& cfg, std::vector<int> bounds) {
      return DeviceLayerStack<float>::Create(cfg, 0, 1, kBatch, std::move(bounds), params, grads,
                                             no_device, group)
          .status();
    };
    ModelConfig odd_heads = SmallConfig();
    odd_heads.heads = 1;
    odd_heads.hidden = 32;
    ExpectStatus(create(odd_heads, kBounds), absl::StatusCode::kInvalidArgument, "heads");
    ExpectStatus(create(SmallConfig(), {0, 7, 16}), absl::StatusCode::kInvalidArgument,
                 "divisible by parallel.tensor");
    ModelConfig narrow = SmallConfig();  // 2 heads of 8: a rank's attention width 8 is fine,
    narrow.hidden = 16;                  // but its MLP width 24 / 2 = 12 is off the alignment
    narrow.heads = 2;
    narrow.ffn_hidden = 24;
    ExpectStatus(create(narrow, kBounds), absl::StatusCode::kInvalidArgument, "multiples of 8");
  });
}

}  // namespace
}  // namespace vp::engine::cuda
