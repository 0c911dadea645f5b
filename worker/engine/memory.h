// Memory accounting for one rank: every engine buffer is charged to a category, so a worker can
// report parameters + gradients + optimizer state + peak activations as docs/engine.md
// ("FLOPs and memory") describes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace vp::engine {

enum class MemoryCategory : int { kParameters = 0, kGradients, kOptimizer, kActivations, kCount };

std::string_view MemoryCategoryName(MemoryCategory c);

// Counts live and peak bytes per category. Thread-safe (the communication thread allocates
// receive buffers while compute runs). Owned by whoever owns the rank's model; never global.
class MemoryTracker {
 public:
  void Add(MemoryCategory c, int64_t bytes);
  void Sub(MemoryCategory c, int64_t bytes);
  int64_t current(MemoryCategory c) const;
  int64_t peak(MemoryCategory c) const;
  // Peak of the sum over all categories (not the sum of per-category peaks).
  int64_t total_peak() const;
  int64_t total_current() const;
  // Restarts peak tracking from the current values (e.g. at the start of a step).
  void ResetPeaks();

 private:
  static constexpr int kN = static_cast<int>(MemoryCategory::kCount);
  std::array<std::atomic<int64_t>, kN> current_{};
  std::array<std::atomic<int64_t>, kN> peak_{};
  std::atomic<int64_t> total_current_{0};
  std::atomic<int64_t> total_peak_{0};
};

// A zero-initialised, 64-byte aligned float array charged to a tracker for its lifetime.
// Move-only. A default-constructed Buffer is empty. `tracker` may be null (not accounted).
//
// Buffers of kMappedBytes or more are mapped straight from the kernel (mmap) and unmapped when
// freed, so the process's resident memory follows the tracker. Through malloc they did not:
// glibc raises its mmap threshold to the size of each mapped block it frees (up to 32 MiB), so
// after the first few frees every activation-sized block came from the heap, and freed heap
// blocks stay resident until the top of the heap is free. Measured at s = 8192 (p = 1, h = 128,
// V = 1000): 40 MiB of resident memory the tracker did not count (docs/benchmarks.md §13).
class Buffer {
 public:
  Buffer() = default;
  Buffer(MemoryTracker* tracker, MemoryCategory category, size_t count);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  void Zero();

 private:
  static constexpr size_t kMappedBytes = size_t{1} << 20;
  // `bytes` (a multiple of 64) of zeroed, mapped and already faulted-in memory; bad_alloc when
  // the system has none.
  static float* MapZeroed(size_t bytes);

  // Frees with munmap when `mapped_bytes` is set (a mapped buffer), else with free.
  // (Constructors rather than a member initializer: unique_ptr checks that its deleter is
  // default-constructible before Buffer is complete.)
  struct FreeDeleter {
    FreeDeleter() noexcept : mapped_bytes(0) {}
    explicit FreeDeleter(size_t bytes) noexcept : mapped_bytes(bytes) {}
    void operator()(float* p) const;
    size_t mapped_bytes;
  };
  void Release();

  std::unique_ptr<float, FreeDeleter> data_;
  size_t count_ = 0;
  MemoryTracker* tracker_ = nullptr;
  MemoryCategory category_ = MemoryCategory::kActivations;
};

}  // namespace vp::engine
