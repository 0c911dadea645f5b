// The device vocabulary shards (worker/engine/vocab/cuda/vocab_shards.h) against the CPU shards
// (worker/engine/vocab/): output layer S/C1/T/C2 under both algorithms, input layer
// IF/IF_REDUCE/IB_BCAST/IB. Several vocabulary shards are emulated as threads on one GPU, each
// with a StagedCommunicator around a Gloo communicator (NCCL refuses two ranks on one device).
//
// Argument validation and pass-order checks run before the device is touched and are tested
// everywhere; the rest skips with "no CUDA device" without a GPU.
#include "worker/engine/vocab/cuda/vocab_shards.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gloo/rendezvous/hash_store.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/nccl/staged_communicator.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/vocab/input_layer.h"
#include "worker/engine/vocab/output_layer.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine::cuda {
namespace {

using ::testing::HasSubstr;
using vocab::VocabPartition;

#define SKIP_WITHOUT_DEVICE() \
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device"

// Errors inside helpers and rank threads become exceptions: GoogleTest reports one thrown in a
// test body, and the rank harness catches them per thread.
void Ok(const absl::Status& s, const std::string& what) {
  if (!s.ok()) throw std::runtime_error(absl::StrCat(what, ": ", s.ToString()));
}
template <typename T>
T OrThrow(absl::StatusOr<T> v, const std::string& what) {
  Ok(v.status(), what);
  return std::move(*v);
}
void CudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename E>
std::vector<E> ToE(const std::vector<float>& v) {
  std::vector<E> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<E, float>) {
      out[i] = v[i];
    } else {
      out[i] = __float2bfloat16(v[i]);  // round to nearest even, as the device conversion
    }
  }
  return out;
}
// What the device sees of v when it is stored as E (the CPU references take this).
template <typename E>
std::vector<float> AsE(const std::vector<float>& v) {
  if constexpr (std::is_same_v<E, float>) {
    return v;
  } else {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(__float2bfloat16(v[i]));
    return out;
  }
}

// One emulated rank's device: a caching allocator shared by two contexts (compute and comm, each
// with its own stream) as the runtime sets it up. Declared before, so destroyed after, every
// DeviceArray a test takes from it.
struct DeviceRank {
  MemoryTracker tracker;
  CachingAllocator alloc{MakeCudaMemoryBackend(), &tracker, CachingAllocator::Reuse::kAfterSync};
  CudaStream compute_stream = OrThrow(CudaStream::Create(), "compute stream");
  CudaStream comm_stream = OrThrow(CudaStream::Create(CudaStream::Priority::kHigh), "comm stream");
  std::unique_ptr<GemmRunner> compute_gemm = OrThrow(GemmRunner::Create(), "gemm");
  std::unique_ptr<GemmRunner> comm_gemm = OrThrow(GemmRunner::Create(), "gemm");
  DeviceContext compute{compute_stream.get(), compute_gemm.get(), &alloc};
  DeviceContext comm{comm_stream.get(), comm_gemm.get(), &alloc};
};

// Synchronous copies. The device is synchronised after the upload: a pageable cudaMemcpy may
// return before its DMA has landed, and the passes read on non-blocking streams.
template <typename T>
DeviceArray<T> Upload(const DeviceContext& ctx, MemoryCategory category,
                      const std::vector<T>& host) {
  DeviceArray<T> a = OrThrow(DeviceArray<T>::Create(ctx, category, host.size(), false), "alloc");
  CudaOk(cudaMemcpy(a.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
         "upload");
  CudaOk(cudaDeviceSynchronize(), "upload sync");
  return a;
}
template <typename T>
std::vector<T> Download(const T* dev, size_t count) {
  if (dev == nullptr) throw std::runtime_error("download of a null device pointer");
  std::vector<T> host(count);
  CudaOk(cudaMemcpy(host.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return host;
}

// Elementwise |got − want| <= rel·max(|want|, 0.01·max|want|): relative, with a floor for
// entries much smaller than the array's scale (summation order differs between cuBLASLt and
// OpenBLAS, which moves small entries by a few ulps of the large ones).
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float rel,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0.0f;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float tol = rel * std::max(std::fabs(want[i]), 0.01f * scale);
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      if (++bad <= 3) ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside rel " << rel;
}

// max|got − want| <= tol·max|want| (the bf16 runs, whose error scales with the array).
void ExpectCloseToScale(const std::vector<float>& got, const std::vector<float>& want, float tol,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float scale = 0.0f, err = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    err = std::max(err, std::fabs(got[i] - want[i]));
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "]";
  }
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << ", scale " << scale;
}

// A shard of `rows` rows (a multiple of 8, as the device shards require) for rank r of p;
// padded_vocab = p·rows >= V. MakeVocabPartition pads to 2p only, so device tests pick rows.
VocabPartition DevicePartition(int64_t vocab, int world, int rank, int64_t rows) {
  VocabPartition q;
  q.vocab = vocab;
  q.padded_vocab = rows * world;
  q.world = world;
  q.rank = rank;
  q.rows = rows;
  q.begin = rank * rows;
  q.valid_rows = std::clamp<int64_t>(vocab - q.begin, 0, rows);
  return q;
}

// ---------------------------------------------------------------------------------------------
// Device-free: validation and pass order, all before the device is touched.

struct FakeDevice {
  MemoryTracker tracker;
  CachingAllocator alloc{MakeHostMemoryBackend(), &tracker, CachingAllocator::Reuse::kAfterSync};
  // Create never dereferences the runner: any non-null address stands for one here.
  alignas(GemmRunner) unsigned char gemm_storage[sizeof(GemmRunner)];
  DeviceContext compute{nullptr, reinterpret_cast<GemmRunner*>(gemm_storage), &alloc};
  DeviceContext comm{nullptr, nullptr, &alloc};
  std::vector<float> weight = std::vector<float>(64 * 16);  // stands for a device pointer
  std::vector<float> grad = std::vector<float>(64 * 16);
};

TEST(DeviceVocabShardsArgs, CreateRejectsBadArgumentsNamingTheField) {
  FakeDevice f;
  const VocabPartition good = DevicePartition(61, 1, 0, 64);
  const auto alg = OutputAlgorithm::kAlgorithm2;
  auto out = [&](const VocabPartition& q, int h, const float* w, float* g, DeviceContext c,
                 DeviceContext m) {
    return DeviceOutputLayerShard<float>::Create(q, h, alg, w, g, c, m).status();
  };
  auto in = [&](const VocabPartition& q, int h, const float* w, float* g, DeviceContext c,
                DeviceContext m) {
    return DeviceInputLayerShard<float>::Create(q, h, w, g, c, m).status();
  };
  const float* w = f.weight.data();
  float* g = f.grad.data();
  for (auto create : {std::function<absl::Status(const VocabPartition&, int, const float*, float*,
                                                 DeviceContext, DeviceContext)>(out),
                      std::function<absl::Status(const VocabPartition&, int, const float*, float*,
                                                 DeviceContext, DeviceContext)>(in)}) {
    EXPECT_TRUE(create(good, 16, w, g, f.compute, f.comm).ok());
    auto expect_bad = [&](absl::Status s, const char* field) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(field));
    };
    expect_bad(create(good, 0, w, g, f.compute, f.comm), "hidden");
    expect_bad(create(good, 12, w, g, f.compute, f.comm), "multiple of 8");
    VocabPartition q = good;
    q.rows = 62;  // MakeVocabPartition(61, 1, 0) would give this: not cuBLASLt-aligned
    q.valid_rows = 61;
    expect_bad(create(q, 16, w, g, f.compute, f.comm), "partition.rows");
    q = good;
    q.valid_rows = 65;
    expect_bad(create(q, 16, w, g, f.compute, f.comm), "partition.valid_rows");
    expect_bad(create(good, 16, nullptr, g, f.compute, f.comm), "weight must be non-null");
    expect_bad(create(good, 16, w, nullptr, f.compute, f.comm), "weight_grad");
    DeviceContext c = f.compute;
    c.gemm = nullptr;
    expect_bad(create(good, 16, w, g, c, f.comm), "compute.gemm");
    c = f.compute;
    c.alloc = nullptr;
    expect_bad(create(good, 16, w, g, c, f.comm), "compute.alloc");
    DeviceContext m = f.comm;
    m.alloc = nullptr;
    expect_bad(create(good, 16, w, g, f.compute, m), "comm.alloc");
  }
  // bf16 goes through the same checks.
  const bf16* wb = reinterpret_cast<const bf16*>(f.weight.data());
  EXPECT_TRUE(DeviceOutputLayerShard<bf16>::Create(good, 16, alg, wb, g, f.compute, f.comm).ok());
  EXPECT_EQ(DeviceInputLayerShard<bf16>::Create(good, 20, wb, g, f.compute, f.comm).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DeviceVocabShardsArgs, PassOrderAndIdsAreCheckedBeforeTheDevice) {
  FakeDevice f;
  const VocabPartition q = DevicePartition(61, 1, 0, 64);
  auto self = comm::MakeSelfCommunicator();
  auto alg2 = OrThrow(
      DeviceOutputLayerShard<float>::Create(q, 16, OutputAlgorithm::kAlgorithm2, f.weight.data(),
                                            f.grad.data(), f.compute, f.comm),
      "create");
  auto alg1 = OrThrow(
      DeviceOutputLayerShard<float>::Create(q, 16, OutputAlgorithm::kAlgorithm1, f.weight.data(),
                                            f.grad.data(), f.compute, f.comm),
      "create");
  const float* x = f.weight.data();
  DeviceOutputLayerState<float> st;
  EXPECT_EQ(st.phase(), DeviceOutputLayerState<float>::Phase::kNone);
  EXPECT_FALSE(st.grad_input_ready());
  EXPECT_EQ(st.grad_input(), nullptr);
  absl::Status s = alg2->T(st, x);  // T before C1
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("T needs a state after C1, got one after none"));
  s = alg2->C1(st, *self);  // C1 before S
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("C1 needs a state after S"));
  s = alg2->C2(st, *self);  // Algorithm 2 has no C2
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("Algorithm 2 has no C2"));
  s = alg1->C2(st, *self);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("C2 needs a state after T"));

  const std::vector<int32_t> labels = {0, 61, 3};  // 61 = V: out of range
  s = alg2->S(x, labels.data(), 3, 0.1f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("labels[1] = 61 outside [0, V = 61)"));
  EXPECT_EQ(alg2->S(x, labels.data(), 0, 0.1f).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alg2->S(x, labels.data(), 1, std::numeric_limits<float>::quiet_NaN()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alg2->S(nullptr, labels.data(), 1, 0.1f).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto input = OrThrow(DeviceInputLayerShard<float>::Create(q, 16, f.weight.data(), f.grad.data(),
                                                            f.compute, f.comm),
                       "create");
  const std::vector<int32_t> tokens = {5, -1};
  s = input->Forward(tokens.data(), 2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tokens[1] = -1"));
  DeviceInputLayerState<float> in_st;
  EXPECT_EQ(input->ForwardReduce(in_st, *self).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(input->BackwardBroadcast(in_st, *self, 0, x).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(input->Backward(in_st).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.tracker.current(MemoryCategory::kActivations), 0);
}

// ---------------------------------------------------------------------------------------------
// Output layer with a device.

// Two microbatches of one vocabulary: the full weight (V, h), per microbatch x (n, h) and labels.
struct OutputCase {
  int64_t vocab = 0;
  int h = 16;
  int n = 13;
  float d = 0.0f;
  std::vector<float> weight;                 // (V, h)
  std::vector<std::vector<float>> x;         // per microbatch (n, h)
  std::vector<std::vector<int32_t>> labels;  // per microbatch (n)
};

OutputCase MakeOutputCase(int64_t vocab, int h, int n, uint32_t seed) {
  OutputCase c;
  c.vocab = vocab;
  c.h = h;
  c.n = n;
  c.d = 1.0f / (2 * n);  // mean over both microbatches
  c.weight = Random(static_cast<size_t>(vocab) * h, seed, 0.3f);
  std::mt19937 rng(seed + 1);
  for (int mb = 0; mb < 2; ++mb) {
    c.x.push_back(Random(static_cast<size_t>(n) * h, seed + 2 + mb, 1.0f));
    std::vector<int32_t> lab(n);
    for (int i = 0; i < n; ++i) lab[i] = static_cast<int32_t>(rng() % vocab);
    lab[0] = static_cast<int32_t>(vocab - 1);  // the last real row (next to the padding)
    lab[1] = lab[2];                           // a repeated label
    c.labels.push_back(lab);
  }
  return c;
}

struct OutputResult {
  std::vector<std::vector<float>> loss;    // per microbatch (n)
  std::vector<std::vector<float>> grad_x;  // per microbatch (n, h)
  std::vector<float> grad_w;               // (rows, h) of the shard, both microbatches
};

// The CPU reference: one unpartitioned shard (self communicator), weight and x as the device
// stores them (AsE<E>).
template <typename E>
OutputResult CpuOutput(const OutputCase& c, OutputAlgorithm alg) {
  const VocabPartition q = OrThrow(vocab::MakeVocabPartition(c.vocab, 1, 0), "partition");
  std::vector<float> w(static_cast<size_t>(q.rows) * c.h, 0.0f);  // zero padding rows
  const std::vector<float> we = AsE<E>(c.weight);
  std::copy(we.begin(), we.end(), w.begin());
  std::vector<float> gw(w.size(), 0.0f);
  auto shard = OrThrow(vocab::OutputLayerShard::Create(q, c.h, alg, w.data(), gw.data(), nullptr),
                       "cpu create");
  auto self = comm::MakeSelfCommunicator();
  OutputResult r;
  for (int mb = 0; mb < 2; ++mb) {
    const std::vector<float> x = AsE<E>(c.x[mb]);
    auto st = OrThrow(shard.S(x.data(), c.labels[mb].data(), c.n, c.d), "cpu S");
    Ok(shard.C1(st, *self), "cpu C1");
    Ok(shard.T(st, x.data()), "cpu T");
    if (alg == OutputAlgorithm::kAlgorithm1) Ok(shard.C2(st, *self), "cpu C2");
    r.loss.emplace_back(st.losses(), st.losses() + c.n);
    r.grad_x.emplace_back(st.grad_input(), st.grad_input() + static_cast<size_t>(c.n) * c.h);
  }
  r.grad_w.assign(gw.begin(), gw.begin() + static_cast<size_t>(c.vocab) * c.h);
  return r;
}

// Runs fn on a thread of its own and waits: the runtime calls the barriers from its
// communication thread, so states, arrays and allocator blocks cross threads.
void OnOtherThread(const std::function<void()>& fn) {
  std::string error;
  std::thread t([&] {
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  t.join();
  if (!error.empty()) throw std::runtime_error(error);
}

// One rank's device run of both microbatches through S, C1, T (and C2), on its own DeviceRank.
// Also checks what must hold on every rank: ∇X ready exactly when the algorithm says, the state
// empty after Release, and every activation byte returned to the tracker.
// barriers_on_other_thread: C1/C2 from a second thread, as the runtime's communication thread.
template <typename E>
OutputResult DeviceOutput(const OutputCase& c, const VocabPartition& q, OutputAlgorithm alg,
                          comm::Communicator& comm, bool barriers_on_other_thread = false) {
  auto barrier = [&](const std::function<void()>& fn) {
    if (barriers_on_other_thread) {
      OnOtherThread(fn);
    } else {
      fn();
    }
  };
  DeviceRank dev;
  OutputResult r;
  {
    const int h = c.h, n = c.n;
    std::vector<float> w(static_cast<size_t>(q.rows) * h, 0.0f);  // zero padding rows
    for (int64_t j = 0; j < q.valid_rows; ++j) {
      std::copy_n(c.weight.begin() + (q.begin + j) * h, h, w.begin() + j * h);
    }
    DeviceArray<E> weight = Upload(dev.compute, MemoryCategory::kParameters, ToE<E>(w));
    DeviceArray<float> grad =
        Upload(dev.compute, MemoryCategory::kGradients, std::vector<float>(w.size(), 0.0f));
    auto shard = OrThrow(DeviceOutputLayerShard<E>::Create(q, h, alg, weight.data(), grad.data(),
                                                           dev.compute, dev.comm),
                         "create");
    for (int mb = 0; mb < 2; ++mb) {
      DeviceArray<E> x = Upload(dev.compute, MemoryCategory::kActivations, ToE<E>(c.x[mb]));
      auto st = OrThrow(shard->S(x.data(), c.labels[mb].data(), n, c.d), "S");
      if (st.phase() != DeviceOutputLayerState<E>::Phase::kS) throw std::runtime_error("phase S");
      if (st.grad_input_ready()) throw std::runtime_error("grad_x ready after S");
      barrier([&] { Ok(shard->C1(st, comm), "C1"); });
      if (st.grad_input_ready() != (alg == OutputAlgorithm::kAlgorithm2)) {
        throw std::runtime_error("grad_input_ready after C1 disagrees with the algorithm");
      }
      if (shard->C1(st, comm).code() != absl::StatusCode::kFailedPrecondition) {
        throw std::runtime_error("a second C1 was accepted");
      }
      Ok(shard->T(st, x.data()), "T");
      if (alg == OutputAlgorithm::kAlgorithm1) {
        if (st.grad_input() != nullptr) throw std::runtime_error("Algorithm 1 grad_x before C2");
        barrier([&] { Ok(shard->C2(st, comm), "C2"); });
      }
      r.loss.emplace_back(st.losses(), st.losses() + n);
      r.grad_x.push_back(Download(st.grad_input(), static_cast<size_t>(n) * h));
      st.Release();
      if (st.bytes() != 0) throw std::runtime_error("state holds bytes after Release");
    }
    r.grad_w = Download(grad.data(), grad.size());
    Ok(Finish(dev.compute), "finish");
  }
  if (dev.tracker.current(MemoryCategory::kActivations) != 0) {
    throw std::runtime_error(
        absl::StrCat("activation bytes left: ", dev.tracker.current(MemoryCategory::kActivations)));
  }
  return r;
}

// p ranks as threads, each with a StagedCommunicator over its own Gloo communicator (loopback
// TCP, one HashStore). All communicators are connected before any rank starts and destroyed
// after all have finished, so an early finisher never tears down a pair a peer still uses.
void RunOnStagedRanks(int p, const std::function<void(int, comm::Communicator&)>& fn) {
  static std::atomic<int> next_run{0};
  const std::string prefix = absl::StrCat("cuda_vocab", next_run.fetch_add(1));
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::unique_ptr<comm::GlooCommunicator>> gloo(p);
  std::vector<std::string> errors(p);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r) {
      threads.emplace_back([&, r] {
        comm::GlooOptions o;
        o.rank = r;
        o.size = p;
        o.store = store;
        o.prefix = prefix;
        o.timeout = absl::Seconds(30);
        auto c = comm::ConnectGloo(o);
        if (c.ok()) {
          gloo[r] = std::move(*c);
        } else {
          errors[r] = c.status().ToString();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < p; ++r) ASSERT_NE(gloo[r], nullptr) << errors[r];
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      comm::StagedCommunicator staged(gloo[r].get());
      try {
        fn(r, staged);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

const char* AlgName(OutputAlgorithm a) {
  return a == OutputAlgorithm::kAlgorithm1 ? "Algorithm 1" : "Algorithm 2";
}

TEST(DeviceOutputLayer, OneShardMatchesCpuFloat) {
  SKIP_WITHOUT_DEVICE();
  // V = 61 in 64 rows: three padding rows inside the one shard.
  const OutputCase c = MakeOutputCase(61, 32, 13, 11);
  const VocabPartition q = DevicePartition(c.vocab, 1, 0, 64);
  for (auto alg : {OutputAlgorithm::kAlgorithm1, OutputAlgorithm::kAlgorithm2}) {
    SCOPED_TRACE(AlgName(alg));
    const OutputResult want = CpuOutput<float>(c, alg);
    auto self = comm::MakeSelfCommunicator();
    // C1/C2 on a second thread (the comm context), S/T on this one (the compute context).
    const OutputResult got =
        DeviceOutput<float>(c, q, alg, *self, /*barriers_on_other_thread=*/true);
    for (int mb = 0; mb < 2; ++mb) {
      ExpectClose(got.loss[mb], want.loss[mb], 1e-4f, "loss");
      ExpectClose(got.grad_x[mb], want.grad_x[mb], 1e-4f, "grad_x");
    }
    ExpectClose({got.grad_w.begin(), got.grad_w.begin() + c.vocab * c.h}, want.grad_w, 1e-4f,
                "grad_w");
    for (size_t k = c.vocab * c.h; k < got.grad_w.size(); ++k) {
      ASSERT_EQ(got.grad_w[k], 0.0f) << "padding gradient written at " << k;
    }
  }
}

struct ShardedCase {
  int64_t vocab;
  int64_t rows;  // per shard; 2·rows >= vocab
};
void PrintTo(const ShardedCase& c, std::ostream* os) {
  *os << "V " << c.vocab << ", rows " << c.rows;
}

class DeviceOutputTwoShards : public ::testing::TestWithParam<ShardedCase> {};

TEST_P(DeviceOutputTwoShards, StagedGlooRanksMatchTheUnpartitionedCpuLayer) {
  SKIP_WITHOUT_DEVICE();
  const ShardedCase sc = GetParam();
  const int p = 2;
  const OutputCase c = MakeOutputCase(sc.vocab, 16, 13, 23);
  for (auto alg : {OutputAlgorithm::kAlgorithm1, OutputAlgorithm::kAlgorithm2}) {
    SCOPED_TRACE(AlgName(alg));
    const OutputResult want = CpuOutput<float>(c, alg);
    std::vector<OutputResult> got(p);
    std::vector<VocabPartition> parts(p);
    for (int r = 0; r < p; ++r) parts[r] = DevicePartition(c.vocab, p, r, sc.rows);
    RunOnStagedRanks(p, [&](int r, comm::Communicator& comm) {
      got[r] = DeviceOutput<float>(c, parts[r], alg, comm);
    });
    if (HasFailure()) return;
    for (int r = 0; r < p; ++r) {
      SCOPED_TRACE(absl::StrCat("rank ", r));
      // Losses and ∇X are global: every rank holds the unpartitioned result.
      for (int mb = 0; mb < 2; ++mb) {
        ExpectClose(got[r].loss[mb], want.loss[mb], 1e-4f, "loss");
        ExpectClose(got[r].grad_x[mb], want.grad_x[mb], 1e-4f, "grad_x");
      }
      // ∇W: the shard's real rows are its slice of the full gradient; padding rows stay 0.
      const VocabPartition& q = parts[r];
      const size_t real = static_cast<size_t>(q.valid_rows) * c.h;
      if (real > 0) {
        ExpectClose(
            {got[r].grad_w.begin(), got[r].grad_w.begin() + real},
            {want.grad_w.begin() + q.begin * c.h, want.grad_w.begin() + q.begin * c.h + real},
            1e-4f, "grad_w");
      }
      for (size_t k = real; k < got[r].grad_w.size(); ++k) {
        ASSERT_EQ(got[r].grad_w[k], 0.0f) << "padding gradient written at " << k;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shards, DeviceOutputTwoShards,
    ::testing::Values(ShardedCase{50, 32},   // second shard: 18 real rows, 14 padding
                      ShardedCase{20, 24}),  // second shard all padding (m' = −inf, s' = 0)
    [](const ::testing::TestParamInfo<ShardedCase>& info) {
      return absl::StrCat("V", info.param.vocab, "Rows", info.param.rows);
    });

// bf16 weights and activations against the CPU layer fed the same bf16-rounded weights and x in
// fp32. What remains is the device's own rounding: the logits, P' and the T-pass gradient are
// stored as bf16 in the n×rows buffer (8 mantissa bits, relative 2^-9 per value), while every
// GEMM accumulates in fp32 and the statistics, losses, ∇X and ∇W are fp32. With logits of order
// 1 that moves a loss by ~1e-2 and a gradient by ~1% of its array's largest entry; the tolerance
// is 3% of the array's scale (loss: of the largest loss), well below the O(1) error of a wrong
// scale, label or shard.
TEST(DeviceOutputLayer, OneShardBf16WithinDocumentedTolerance) {
  SKIP_WITHOUT_DEVICE();
  const OutputCase c = MakeOutputCase(61, 32, 13, 31);
  const VocabPartition q = DevicePartition(c.vocab, 1, 0, 64);
  constexpr float kTol = 3e-2f;
  for (auto alg : {OutputAlgorithm::kAlgorithm1, OutputAlgorithm::kAlgorithm2}) {
    SCOPED_TRACE(AlgName(alg));
    const OutputResult want = CpuOutput<bf16>(c, alg);
    auto self = comm::MakeSelfCommunicator();
    const OutputResult got = DeviceOutput<bf16>(c, q, alg, *self);
    for (int mb = 0; mb < 2; ++mb) {
      ExpectCloseToScale(got.loss[mb], want.loss[mb], kTol, "loss");
      ExpectCloseToScale(got.grad_x[mb], want.grad_x[mb], kTol, "grad_x");
    }
    ExpectCloseToScale({got.grad_w.begin(), got.grad_w.begin() + c.vocab * c.h}, want.grad_w, kTol,
                       "grad_w");
  }
}

// ---------------------------------------------------------------------------------------------
// Input layer with a device.

struct InputResult {
  std::vector<float> output;  // (n, h) after IF_REDUCE
  std::vector<float> grad_w;  // (rows, h) after IB
};

// IF + IF_REDUCE + IB_BCAST (from `root`) + IB on one rank. Weight rows of the full (V, h)
// table; gradient rows start at 0.25 so the scatter-add is checked to accumulate.
template <typename E>
InputResult DeviceInput(const std::vector<float>& table, int h, const std::vector<int32_t>& tokens,
                        const std::vector<float>& root_grad, const VocabPartition& q, int root,
                        comm::Communicator& comm) {
  DeviceRank dev;
  InputResult r;
  {
    const int n = static_cast<int>(tokens.size());
    std::vector<float> w(static_cast<size_t>(q.rows) * h, 0.0f);
    for (int64_t j = 0; j < q.valid_rows; ++j) {
      std::copy_n(table.begin() + (q.begin + j) * h, h, w.begin() + j * h);
    }
    DeviceArray<E> weight = Upload(dev.compute, MemoryCategory::kParameters, ToE<E>(w));
    DeviceArray<float> grad =
        Upload(dev.compute, MemoryCategory::kGradients, std::vector<float>(w.size(), 0.25f));
    auto shard = OrThrow(
        DeviceInputLayerShard<E>::Create(q, h, weight.data(), grad.data(), dev.compute, dev.comm),
        "create");
    auto st = OrThrow(shard->Forward(tokens.data(), n), "IF");
    Ok(shard->ForwardReduce(st, comm), "IF_REDUCE");
    r.output = Download(st.output(), static_cast<size_t>(n) * h);
    st.ReleaseOutput();
    if (st.output() != nullptr) throw std::runtime_error("output after ReleaseOutput");
    // Only the root's gradient is read: the others pass null.
    DeviceArray<E> g;
    if (comm.rank() == root) {
      g = Upload(dev.compute, MemoryCategory::kActivations, ToE<E>(root_grad));
    }
    Ok(shard->BackwardBroadcast(st, comm, root, g.data()), "IB_BCAST");
    Ok(shard->Backward(st), "IB");
    if (shard->Backward(st).code() != absl::StatusCode::kFailedPrecondition) {
      throw std::runtime_error("a second IB was accepted");
    }
    r.grad_w = Download(grad.data(), grad.size());
  }
  return r;
}

template <typename E>
void CheckInputLayer(int p, int64_t vocab, int64_t rows, int root) {
  const int h = 24, n = 11;
  const std::vector<float> table = Random(static_cast<size_t>(vocab) * h, 41, 1.0f);
  std::vector<int32_t> tokens(n);
  std::mt19937 rng(43);
  for (int& t : tokens) t = static_cast<int32_t>(rng() % vocab);
  tokens[3] = tokens[7];                        // repeated: adds twice
  tokens[0] = static_cast<int32_t>(vocab - 1);  // the last real row
  const std::vector<float> root_grad = Random(static_cast<size_t>(n) * h, 47, 1.0f);

  // References from the CPU input layer (one unpartitioned shard) on the values as E.
  const VocabPartition cq = OrThrow(vocab::MakeVocabPartition(vocab, 1, 0), "partition");
  std::vector<float> cw(static_cast<size_t>(cq.rows) * h, 0.0f), cg(cw.size(), 0.25f);
  const std::vector<float> te = AsE<E>(table);
  std::copy(te.begin(), te.end(), cw.begin());
  auto cpu = OrThrow(vocab::InputLayerShard::Create(cq, h, cw.data(), cg.data(), nullptr), "cpu");
  auto self = comm::MakeSelfCommunicator();
  auto cst = OrThrow(cpu.Forward(tokens.data(), n), "cpu IF");
  Ok(cpu.ForwardReduce(cst, *self), "cpu IF_REDUCE");
  const std::vector<float> want_out(cst.output(), cst.output() + static_cast<size_t>(n) * h);
  const std::vector<float> ge = AsE<E>(root_grad);
  Ok(cpu.BackwardBroadcast(cst, *self, 0, ge.data()), "cpu IB_BCAST");
  Ok(cpu.Backward(cst), "cpu IB");

  std::vector<InputResult> got(p);
  std::vector<VocabPartition> parts(p);
  for (int r = 0; r < p; ++r) parts[r] = DevicePartition(vocab, p, r, rows);
  if (p == 1) {
    got[0] = DeviceInput<E>(table, h, tokens, root_grad, parts[0], root, *self);
  } else {
    RunOnStagedRanks(p, [&](int r, comm::Communicator& comm) {
      got[r] = DeviceInput<E>(table, h, tokens, root_grad, parts[r], root, comm);
    });
    if (::testing::Test::HasFailure()) return;
  }
  for (int r = 0; r < p; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    // One shard contributes each row and the others exact zeros: the fp32 sum is exact.
    EXPECT_EQ(got[r].output, want_out);
    const VocabPartition& q = parts[r];
    const size_t real = static_cast<size_t>(q.valid_rows) * h;
    // fp32 atomics add a repeated token's rows in either order: a few ulps of the scale.
    ExpectCloseToScale({got[r].grad_w.begin(), got[r].grad_w.begin() + real},
                       {cg.begin() + q.begin * h, cg.begin() + q.begin * h + real}, 1e-6f,
                       "grad_w");
    for (size_t k = real; k < got[r].grad_w.size(); ++k) {
      ASSERT_EQ(got[r].grad_w[k], 0.25f) << "padding gradient written at " << k;
    }
  }
}

TEST(DeviceInputLayer, OneShardMatchesCpuFloat) {
  SKIP_WITHOUT_DEVICE();
  CheckInputLayer<float>(1, 61, 64, 0);
}

TEST(DeviceInputLayer, TwoShardsOverStagedGlooMatchCpuFloat) {
  SKIP_WITHOUT_DEVICE();
  CheckInputLayer<float>(2, 50, 32, 1);  // broadcast from the last rank, as in the pipeline
  CheckInputLayer<float>(2, 50, 32, 0);
}

// bf16 rows are looked up exactly (bf16 → fp32 is exact) and the broadcast is a byte copy, so
// the bf16 path must match the CPU layer run on the bf16-rounded values as tightly as fp32.
TEST(DeviceInputLayer, TwoShardsOverStagedGlooMatchCpuBf16) {
  SKIP_WITHOUT_DEVICE();
  CheckInputLayer<bf16>(2, 50, 32, 1);
}

}  // namespace
}  // namespace vp::engine::cuda
