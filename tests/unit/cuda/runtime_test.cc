// Device-free tests of the CUDA runtime layer: these run for real on machines without a GPU.
#include "worker/engine/kernels/cuda/runtime.h"

#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/nccl/stream_query.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/launch/cuda_environment.h"

namespace vp::engine::cuda {
namespace {

TEST(PeakTable, KnownDevicesAndUnknown) {
  EXPECT_EQ(PeakBf16Tflops("NVIDIA A100-SXM4-80GB"), 312.0);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H100 80GB HBM3"), 989.0);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H200"), 989.0);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA L40S"), 362.0);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA L40"), 181.0);
  EXPECT_FALSE(PeakBf16Tflops("NVIDIA GeForce GTX 1080").has_value());
}

TEST(Mfu, AbsentRatherThanNegative) {
  EXPECT_NEAR(*Mfu(989e12 * 0.5, 1.0, 989.0), 0.5, 1e-12);
  EXPECT_FALSE(Mfu(1e12, 1.0, std::nullopt).has_value());
  EXPECT_FALSE(Mfu(1e12, 0.0, 989.0).has_value());
  EXPECT_FALSE(Mfu(1e12, 1.0, -100.0).has_value());
}

TEST(StatusMapping, CodesAndLocation) {
  const absl::Status oom = CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)", "f.cc", 7);
  EXPECT_TRUE(absl::IsResourceExhausted(oom));
  EXPECT_NE(oom.message().find("f.cc:7"), absl::string_view::npos);
  EXPECT_NE(oom.message().find("cudaMalloc(&p, n)"), absl::string_view::npos);
  EXPECT_TRUE(absl::IsFailedPrecondition(CudaStatus(cudaErrorNoDevice, "x", "f", 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(CudaStatus(cudaErrorInvalidValue, "x", "f", 1)));
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x", "f", 1).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "x", "f", 1)));
}

// The count agrees with the devices that answer: each one below it has a name, the one at the
// count has none (without a device: 0, and device 0 has no name), and asking again gives the
// same count.
TEST(DeviceCount, AgreesWithDeviceNames) {
  const int count = DeviceCount();
  ASSERT_GE(count, 0);
  for (int d = 0; d < count; ++d) {
    const absl::StatusOr<std::string> name = DeviceName(d);
    ASSERT_TRUE(name.ok()) << name.status();
    EXPECT_FALSE(name->empty());
  }
  EXPECT_FALSE(DeviceName(count).ok());
  EXPECT_EQ(DeviceCount(), count);
}

TEST(CachingAllocator, RoundsToSizeClasses) {
  EXPECT_EQ(CachingAllocator::RoundUp(1), 512u);
  EXPECT_EQ(CachingAllocator::RoundUp(512), 512u);
  EXPECT_EQ(CachingAllocator::RoundUp(513), 1024u);
  EXPECT_EQ(CachingAllocator::RoundUp(size_t{1} << 20), size_t{1} << 20);
  EXPECT_EQ(CachingAllocator::RoundUp((size_t{1} << 20) + 1), size_t{2} << 20);
  EXPECT_EQ(CachingAllocator::RoundUp((size_t{4} << 20) + 1), size_t{6} << 20);
}

TEST(CachingAllocator, ChargesCategoriesAndReusesBlocks) {
  MemoryTracker tracker;
  CachingAllocator alloc(MakeHostMemoryBackend(), &tracker);
  {
    auto w = alloc.Allocate(MemoryCategory::kParameters, 1000);  // class 1024
    ASSERT_TRUE(w.ok());
    auto a = alloc.Allocate(MemoryCategory::kActivations, 3 << 20);  // class 4 MiB
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(tracker.current(MemoryCategory::kParameters), 1024);
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 4 << 20);
    EXPECT_EQ(alloc.stats().allocated, 1024 + (4 << 20));
    a->Reset();
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
    EXPECT_EQ(tracker.peak(MemoryCategory::kActivations), 4 << 20);
    EXPECT_EQ(alloc.stats().reserved, 1024 + (4 << 20));  // cached, still held
    // Same class: served from the cache, no new backend allocation.
    auto b = alloc.Allocate(MemoryCategory::kGradients, (3 << 20) + 5);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(alloc.stats().backend_allocs, 2);
    EXPECT_EQ(alloc.stats().cache_hits, 1);
    EXPECT_EQ(tracker.current(MemoryCategory::kGradients), 4 << 20);
    // A different class misses.
    auto c = alloc.Allocate(MemoryCategory::kOptimizer, 100);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(alloc.stats().backend_allocs, 3);
    EXPECT_EQ(alloc.stats().allocated_peak, 1024 + (4 << 20) + 512);
  }
  EXPECT_EQ(tracker.total_current(), 0);
  EXPECT_EQ(alloc.stats().allocated, 0);
  EXPECT_EQ(alloc.stats().reserved, 1024 + (4 << 20) + 512);
  alloc.EmptyCache();
  EXPECT_EQ(alloc.stats().reserved, 0);
  EXPECT_EQ(alloc.stats().reserved_peak, 1024 + (4 << 20) + 512);
  alloc.ResetPeaks();
  EXPECT_EQ(alloc.stats().reserved_peak, 0);
}

// Reuse after sync: a block freed on one thread is not handed out (to any thread) until the
// freeing thread says its stream is idle; accounting drops at the free.
TEST(CachingAllocator, ReuseAfterSyncParksFreedBlocksPerThread) {
  MemoryTracker tracker;
  CachingAllocator alloc(MakeHostMemoryBackend(), &tracker, CachingAllocator::Reuse::kAfterSync);
  void* first = nullptr;
  {
    auto a = alloc.Allocate(MemoryCategory::kActivations, 4096);
    ASSERT_TRUE(a.ok());
    first = a->data();
  }  // freed on this thread: pending, not cached
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  EXPECT_EQ(alloc.pending_bytes(), 4096);
  // Another thread releasing its own (empty) pending list does not free ours.
  std::thread([&] { alloc.ReleasePending(); }).join();
  EXPECT_EQ(alloc.pending_bytes(), 4096);
  auto b = alloc.Allocate(MemoryCategory::kActivations, 4096);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(b->data(), first);  // a fresh block: the parked one may still be in use
  EXPECT_EQ(alloc.stats().cache_hits, 0);
  alloc.ReleasePending();  // this thread's stream is idle now
  EXPECT_EQ(alloc.pending_bytes(), 0);
  auto c = alloc.Allocate(MemoryCategory::kActivations, 4000);  // same 4096 class
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), first);
  EXPECT_EQ(alloc.stats().cache_hits, 1);
}

TEST(CachingAllocator, MoveTransfersOwnership) {
  MemoryTracker tracker;
  CachingAllocator alloc(MakeHostMemoryBackend(), &tracker);
  auto a = alloc.Allocate(MemoryCategory::kActivations, 64);
  ASSERT_TRUE(a.ok());
  DeviceBuffer moved = std::move(*a);
  EXPECT_TRUE(a->empty());
  EXPECT_EQ(moved.bytes(), 64u);
  a->Reset();  // no-op on the moved-from buffer
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 512);
  moved = DeviceBuffer();
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  auto z = alloc.Allocate(MemoryCategory::kActivations, 0);
  ASSERT_TRUE(z.ok());
  EXPECT_TRUE(z->empty());
}

// A backend with a byte budget: proves that out-of-memory empties the cache and retries.
class BudgetBackend final : public DeviceMemoryBackend {
 public:
  explicit BudgetBackend(size_t budget) : left_(budget) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes > left_) return absl::ResourceExhaustedError("budget");
    left_ -= bytes;
    blocks_.emplace_back(bytes);
    sizes_[blocks_.back().data()] = bytes;
    return static_cast<void*>(blocks_.back().data());
  }
  void Free(void* p) override { left_ += sizes_.at(p); }

 private:
  size_t left_;
  std::vector<std::vector<char>> blocks_;
  std::map<void*, size_t> sizes_;
};

TEST(CachingAllocator, OutOfMemoryEmptiesCacheAndRetries) {
  CachingAllocator alloc(std::make_unique<BudgetBackend>(size_t{4} << 20), nullptr);
  {
    auto a = alloc.Allocate(MemoryCategory::kActivations, size_t{4} << 20);
    ASSERT_TRUE(a.ok());
  }  // cached: the whole budget is now in the free list
  auto b = alloc.Allocate(MemoryCategory::kActivations, size_t{2} << 20);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(alloc.stats().reserved, 2 << 20);
  auto c = alloc.Allocate(MemoryCategory::kActivations, size_t{4} << 20);
  EXPECT_TRUE(absl::IsResourceExhausted(c.status()));
  EXPECT_NE(c.status().message().find("activations"), absl::string_view::npos) << c.status();
}

// Records what the allocator asks of its backend; Allocate fails past a byte budget, and the
// stream synchronisation can be made to fail.
class RecordingBackend final : public DeviceMemoryBackend {
 public:
  RecordingBackend(size_t budget, std::vector<std::string>* log) : left_(budget), log_(log) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes > left_) {
      log_->push_back("alloc-fail " + std::to_string(bytes));
      return absl::ResourceExhaustedError("budget");
    }
    left_ -= bytes;
    log_->push_back("alloc " + std::to_string(bytes));
    blocks_.emplace_back(bytes);
    sizes_[blocks_.back().data()] = bytes;
    return static_cast<void*>(blocks_.back().data());
  }
  void Free(void* p) override {
    left_ += sizes_.at(p);
    log_->push_back("free " + std::to_string(sizes_.at(p)));
  }
  void ClearError() override { log_->push_back("clear-error"); }
  absl::Status SynchronizeStream(StreamHandle stream) override {
    log_->push_back(stream == nullptr ? "sync null" : "sync");
    return sync_status_;
  }
  absl::Status sync_status_ = absl::OkStatus();

 private:
  size_t left_;
  std::vector<std::string>* log_;
  std::vector<std::vector<char>> blocks_;
  std::map<void*, size_t> sizes_;
};

// A stand-in stream handle: the recording backend never dereferences it.
StreamHandle FakeStream() { return reinterpret_cast<StreamHandle>(uintptr_t{0x5157}); }

constexpr size_t kMiB = size_t{1} << 20;

// Out of memory in reuse-after-sync mode: the error is cleared first, the caller's stream is
// synchronised, the blocks this thread released (pending) are moved to the cache and returned
// to the backend, and only then is the request retried.
TEST(CachingAllocator, OutOfMemoryClearsErrorSyncsStreamAndReleasesPendingFirst) {
  std::vector<std::string> log;
  CachingAllocator alloc(std::make_unique<RecordingBackend>(4 * kMiB, &log), nullptr,
                         CachingAllocator::Reuse::kAfterSync);
  {
    auto a = alloc.Allocate(MemoryCategory::kActivations, 4 * kMiB, FakeStream());
    ASSERT_TRUE(a.ok()) << a.status();
  }  // released on this thread: pending, the whole budget is parked
  ASSERT_EQ(alloc.pending_bytes(), static_cast<int64_t>(4 * kMiB));
  auto b = alloc.Allocate(MemoryCategory::kActivations, 2 * kMiB, FakeStream());
  ASSERT_TRUE(b.ok()) << b.status();
  const std::vector<std::string> want = {"alloc 4194304", "alloc-fail 2097152", "clear-error",
                                         "sync",          "free 4194304",       "alloc 2097152"};
  EXPECT_EQ(log, want);
  EXPECT_EQ(alloc.pending_bytes(), 0);
  EXPECT_EQ(alloc.stats().reserved, static_cast<int64_t>(2 * kMiB));
  EXPECT_EQ(alloc.stats().allocated, static_cast<int64_t>(2 * kMiB));

  // A request that cannot fit even after the recovery: the retry's error is cleared as well.
  log.clear();
  auto c = alloc.Allocate(MemoryCategory::kGradients, 4 * kMiB, FakeStream());
  EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
  EXPECT_NE(c.status().message().find("gradients"), absl::string_view::npos) << c.status();
  const std::vector<std::string> want_fail = {"alloc-fail 4194304", "clear-error", "sync",
                                              "alloc-fail 4194304", "clear-error"};
  EXPECT_EQ(log, want_fail);
}

// Without the caller's stream the allocator cannot know that the released blocks are idle:
// they stay pending (only the cache is emptied), and the failure names the pending bytes.
TEST(CachingAllocator, OutOfMemoryWithoutAStreamKeepsPendingBlocks) {
  std::vector<std::string> log;
  CachingAllocator alloc(std::make_unique<RecordingBackend>(4 * kMiB, &log), nullptr,
                         CachingAllocator::Reuse::kAfterSync);
  { ASSERT_TRUE(alloc.Allocate(MemoryCategory::kActivations, 4 * kMiB).ok()); }
  auto b = alloc.Allocate(MemoryCategory::kActivations, 2 * kMiB);
  EXPECT_TRUE(absl::IsResourceExhausted(b.status())) << b.status();
  EXPECT_NE(b.status().message().find("4194304 pending"), absl::string_view::npos) << b.status();
  EXPECT_EQ(alloc.pending_bytes(), static_cast<int64_t>(4 * kMiB));
  const std::vector<std::string> want = {"alloc 4194304", "alloc-fail 2097152", "clear-error",
                                         "alloc-fail 2097152", "clear-error"};
  EXPECT_EQ(log, want);
}

// A stream that fails to synchronise (a sticky device error) is reported, not retried past.
TEST(CachingAllocator, OutOfMemoryReportsAFailedStreamSync) {
  std::vector<std::string> log;
  auto backend = std::make_unique<RecordingBackend>(kMiB, &log);
  backend->sync_status_ = absl::InternalError("illegal address");
  CachingAllocator alloc(std::move(backend), nullptr, CachingAllocator::Reuse::kAfterSync);
  auto a = alloc.Allocate(MemoryCategory::kActivations, 2 * kMiB, FakeStream());
  EXPECT_TRUE(absl::IsInternal(a.status())) << a.status();
  EXPECT_NE(a.status().message().find("illegal address"), absl::string_view::npos);
  const std::vector<std::string> want = {"alloc-fail 2097152", "clear-error", "sync"};
  EXPECT_EQ(log, want);
}

TEST(CudaEnvironment, EagerModuleLoadingIsSetAtProcessStart) {
  // The CUDA test main applies it before any test runs, as every vocabpipe main does.
  const char* now = std::getenv("CUDA_MODULE_LOADING");
  ASSERT_NE(now, nullptr);
  EXPECT_STREQ(now, "EAGER");
  EXPECT_EQ(launch::PrepareCudaEnvironment(), "");  // already EAGER: nothing to report
  setenv("CUDA_MODULE_LOADING", "LAZY", 1);
  const std::string note = launch::PrepareCudaEnvironment();
  EXPECT_NE(note.find("CUDA_MODULE_LOADING=LAZY replaced by EAGER"), std::string::npos) << note;
  EXPECT_STREQ(std::getenv("CUDA_MODULE_LOADING"), "EAGER");
}

// A stream polled while busy must not leave cudaErrorNotReady as the thread's last error: the
// next kernel wrapper returns cudaGetLastError() and would report it as a launch failure.
TEST(StreamQuery, NotReadyIsNotReportedByTheNextLaunch) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // A host function that sleeps keeps the stream busy for a known time.
  ASSERT_EQ(cudaLaunchHostFunc(
                stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); },
                nullptr),
            cudaSuccess);
  EXPECT_EQ(comm::QueryStream(stream), cudaErrorNotReady);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  // The next launch on this thread reports success.
  void* mem = nullptr;
  ASSERT_EQ(cudaMalloc(&mem, 256 * sizeof(float)), cudaSuccess);
  float* x = static_cast<float*>(mem);
  EXPECT_EQ(GeluForward<float>(x, x, 256, stream), cudaSuccess);
  cudaError_t q = cudaErrorNotReady;
  for (int i = 0; i < 1000 && q == cudaErrorNotReady; ++i) {
    q = comm::QueryStream(stream);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(q, cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaFree(mem);
  cudaStreamDestroy(stream);
}

TEST(NcclIdExchange, RankZeroPublishesOthersWait) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  constexpr int kRanks = 3;
  std::vector<absl::StatusOr<comm::NcclIdBytes>> got(kRanks, absl::UnknownError("unset"));
  std::vector<std::thread> threads;
  for (int r = kRanks - 1; r >= 0; --r) {  // waiters start before the publisher
    threads.emplace_back([&, r] {
      got[r] = comm::ExchangeNcclId(*store, "job1/attempt0/vocab/nccl_unique_id", r,
                                    absl::Seconds(10), []() -> absl::StatusOr<comm::NcclIdBytes> {
                                      comm::NcclIdBytes id{};
                                      for (size_t i = 0; i < id.size(); ++i) id[i] = char(i * 7);
                                      return id;
                                    });
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(got[r].ok()) << got[r].status();
    EXPECT_EQ((*got[r])[5], char(35));
    EXPECT_EQ(*got[r], *got[0]);
  }
}

TEST(NcclIdExchange, MissingPublisherTimesOut) {
  gloo::rendezvous::HashStore store;
  auto got = comm::ExchangeNcclId(store, "nobody/nccl_unique_id", 1, absl::Milliseconds(100),
                                  []() -> absl::StatusOr<comm::NcclIdBytes> {
                                    return absl::InternalError("rank 1 must not create the id");
                                  });
  EXPECT_TRUE(absl::IsDeadlineExceeded(got.status())) << got.status();
}

TEST(NcclIdExchange, MalformedValueIsRejected) {
  gloo::rendezvous::HashStore store;
  store.set("bad/nccl_unique_id", std::vector<char>(5, 'x'));
  auto got = comm::ExchangeNcclId(store, "bad/nccl_unique_id", 2, absl::Seconds(1), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(got.status())) << got.status();
}

}  // namespace
}  // namespace vp::engine::cuda
