// A caching device-memory allocator with per-category accounting.
//
// cudaMalloc/cudaFree synchronise the device and cost tens of microseconds, so freed blocks are
// kept in size-class free lists and handed to the next request of the same class:
//   small requests (<= 1 MiB) are rounded up to a multiple of 512 bytes,
//   large requests to a multiple of 2 MiB.
// A request reuses only a cached block of exactly its class (no splitting, so no fragmentation
// bookkeeping).
//
// Out of memory: when the backend reports it, the allocator (1) clears the error the failed
// cudaMalloc left for this thread (cudaGetLastError; otherwise the next kernel launch's check
// would report a launch failure), (2) synchronises the caller's stream and moves the blocks this
// thread released into the cache (they are idle now), (3) returns every cached block to the
// backend and (4) retries once. A failure after the retry clears the error again and returns
// ResourceExhausted.
//
// Accounting: every live block is charged, at its class size, to a MemoryCategory of a
// MemoryTracker (the same tracker/metrics as the CPU engine). The allocator also reports
//   allocated: bytes in live blocks (and its peak),
//   reserved:  allocated + cached bytes, i.e. what the process holds from the device (and peak).
//
// Streams: a cached block is reused by the next Allocate on any thread without waiting, so an
// allocator serves one stream (or streams the caller orders with events). A freed block whose
// last use is still queued on that stream is safe to reuse on the same stream (stream order).
// Thread-safe (one mutex).
//
// Several threads with their own streams (a pipeline rank's compute and communication threads)
// share one allocator in ReuseAfterSync mode: a released block is parked in the releasing
// thread's pending list and reaches the cache only when that thread calls ReleasePending()
// after synchronising its stream, so another thread cannot be handed a block whose last kernel
// is still queued. (Immediate mode returns blocks to the cache at once: one stream only.)
//
// The device is behind DeviceMemoryBackend so the bookkeeping is tested on a host backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/memory.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; this header stays free of CUDA headers

namespace vp::engine::cuda {

using StreamHandle = CUstream_st*;

class DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend() = default;
  // ResourceExhausted on out-of-memory (the allocator then recovers and retries once).
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Called after a failed Allocate: resets the error that failure recorded for the calling
  // thread (CUDA: cudaGetLastError), so the next kernel launch's check does not report it.
  virtual void ClearError() {}
  // Waits until every operation queued on `stream` is done.
  virtual absl::Status SynchronizeStream(StreamHandle stream) { return absl::OkStatus(); }
};

// cudaMalloc / cudaFree on the current device.
std::unique_ptr<DeviceMemoryBackend> MakeCudaMemoryBackend();
// malloc / free: for tests of the bookkeeping on machines without a device.
std::unique_ptr<DeviceMemoryBackend> MakeHostMemoryBackend();

class CachingAllocator;

// A block of device memory owned for its lifetime; returns to the allocator's cache on
// destruction. Move-only; a default-constructed DeviceBuffer is empty.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }  // as requested
  bool empty() const { return ptr_ == nullptr; }
  MemoryCategory category() const { return category_; }
  // Returns the block to the cache now.
  void Reset();

 private:
  friend class CachingAllocator;
  DeviceBuffer(CachingAllocator* owner, void* ptr, size_t bytes, size_t block_bytes,
               MemoryCategory category)
      : owner_(owner), ptr_(ptr), bytes_(bytes), block_bytes_(block_bytes), category_(category) {}

  CachingAllocator* owner_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  size_t block_bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::kActivations;
};

struct AllocatorStats {
  int64_t allocated = 0;  // bytes in live blocks (class sizes)
  int64_t allocated_peak = 0;
  int64_t reserved = 0;  // allocated + cached
  int64_t reserved_peak = 0;
  int64_t backend_allocs = 0;  // calls that reached the backend (cache misses)
  int64_t cache_hits = 0;
};

class CachingAllocator {
 public:
  static constexpr size_t kSmallLimit = size_t{1} << 20;  // 1 MiB
  static constexpr size_t kSmallGranule = 512;
  static constexpr size_t kLargeGranule = size_t{2} << 20;  // 2 MiB

  enum class Reuse { kImmediate, kAfterSync };

  // tracker may be null (no per-category accounting). The allocator must outlive its buffers.
  CachingAllocator(std::unique_ptr<DeviceMemoryBackend> backend, MemoryTracker* tracker,
                   Reuse reuse = Reuse::kImmediate);
  ~CachingAllocator();  // frees the cache; live buffers at destruction are a caller bug
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // The class size a request of `bytes` is served with.
  static size_t RoundUp(size_t bytes);

  // bytes 0 returns an empty buffer. Memory is not zeroed (use cudaMemsetAsync). `stream` is the
  // calling thread's stream: on out-of-memory it is synchronised so that the blocks this thread
  // released can be reused before the retry (null: they stay pending).
  absl::StatusOr<DeviceBuffer> Allocate(MemoryCategory category, size_t bytes,
                                        StreamHandle stream = nullptr);

  // ReuseAfterSync: moves the blocks the calling thread released into the cache (call after that
  // thread's stream is idle). A no-op in Immediate mode.
  void ReleasePending();
  // Bytes released and not yet reusable (ReuseAfterSync), all threads.
  int64_t pending_bytes() const;

  // Returns every cached block to the backend (live and pending blocks are untouched).
  void EmptyCache();
  AllocatorStats stats() const;
  // Restarts the allocated/reserved peaks from the current values (e.g. at a step start).
  void ResetPeaks();

 private:
  friend class DeviceBuffer;
  void Release(void* ptr, size_t block_bytes, MemoryCategory category);
  void EmptyCacheLocked();
  void ReleasePendingLocked(std::thread::id thread);
  // A cached block of class `block`, or a new one from the backend; counts reserved bytes.
  absl::StatusOr<void*> TakeBlockLocked(size_t block);

  std::unique_ptr<DeviceMemoryBackend> backend_;
  MemoryTracker* tracker_;
  Reuse reuse_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // class size → cached blocks
  // ReuseAfterSync: per releasing thread, (class size, block) not yet in free_.
  std::map<std::thread::id, std::vector<std::pair<size_t, void*>>> pending_;
  int64_t pending_bytes_ = 0;
  AllocatorStats stats_;
};

}  // namespace vp::engine::cuda
