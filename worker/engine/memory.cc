#include "worker/engine/memory.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace vp::engine {

std::string_view MemoryCategoryName(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kParameters:
      return "parameters";
    case MemoryCategory::kGradients:
      return "gradients";
    case MemoryCategory::kOptimizer:
      return "optimizer";
    case MemoryCategory::kActivations:
      return "activations";
    case MemoryCategory::kCount:
      break;
  }
  return "unknown";
}

namespace {
void RaiseTo(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

void MemoryTracker::Add(MemoryCategory c, int64_t bytes) {
  const int i = static_cast<int>(c);
  RaiseTo(peak_[i], current_[i].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  RaiseTo(total_peak_, total_current_.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}

void MemoryTracker::Sub(MemoryCategory c, int64_t bytes) {
  current_[static_cast<int>(c)].fetch_sub(bytes, std::memory_order_relaxed);
  total_current_.fetch_sub(bytes, std::memory_order_relaxed);
}

int64_t MemoryTracker::current(MemoryCategory c) const {
  return current_[static_cast<int>(c)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::peak(MemoryCategory c) const {
  return peak_[static_cast<int>(c)].load(std::memory_order_relaxed);
}
int64_t MemoryTracker::total_peak() const { return total_peak_.load(std::memory_order_relaxed); }
int64_t MemoryTracker::total_current() const {
  return total_current_.load(std::memory_order_relaxed);
}

void MemoryTracker::ResetPeaks() {
  for (int i = 0; i < kN; ++i) peak_[i].store(current_[i].load());
  total_peak_.store(total_current_.load());
}

namespace {

// Linux 5.14's MADV_POPULATE_WRITE, for headers older than the kernel.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

}  // namespace

float* Buffer::MapZeroed(size_t bytes) {
  // Page-aligned, and the kernel hands out zeroed pages: no memset. Some buffers are mapped
  // afresh every step (what the pool gives back, the output layer's n×V block, the final
  // norm's), so their first touch must be cheap:
  //  - transparent huge pages where the system allows them (THP "madvise", the usual
  //    default): one fault per 2 MiB instead of 512. On a virtual machine each 4 KiB page's
  //    first write can cost microseconds even after it was populated — a GEMM writing a fresh
  //    4 MiB output ran 3-4× slower than into a reused one (docs/benchmarks.md §1);
  //  - the pages faulted in now, writable (MADV_POPULATE_WRITE): without populating, a step at
  //    s = 8192 was ~35% slower. MAP_POPULATE does it on kernels before 5.14, but only as
  //    read faults of the shared zero page, which every first write then copies.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // advice: refused where THP is off
  if (madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
    munmap(p, bytes);
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1,
             0);
    if (p == MAP_FAILED) throw std::bad_alloc();
  }
  return static_cast<float*>(p);
}

void Buffer::FreeDeleter::operator()(float* p) const {
  if (mapped_bytes > 0) {
    munmap(p, mapped_bytes);
  } else {
    std::free(p);
  }
}

Buffer::Buffer(MemoryTracker* tracker, MemoryCategory category, size_t count)
    : count_(count), tracker_(tracker), category_(category) {
  if (count == 0) return;
  // 64-byte alignment: a cache line, and what AVX-512 loads and cuBLAS-style kernels like.
  const size_t bytes = ((count * sizeof(float) + 63) / 64) * 64;
  if (bytes >= kMappedBytes) {
    data_ = std::unique_ptr<float, FreeDeleter>(MapZeroed(bytes), FreeDeleter(bytes));
  } else {
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    data_.reset(static_cast<float*>(p));
  }
  if (tracker_ != nullptr) tracker_->Add(category_, static_cast<int64_t>(count_ * sizeof(float)));
}

Buffer::~Buffer() { Release(); }

void Buffer::Release() {
  if (data_ && tracker_ != nullptr) {
    tracker_->Sub(category_, static_cast<int64_t>(count_ * sizeof(float)));
  }
  data_.reset();
  count_ = 0;
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::move(other.data_)),
      count_(other.count_),
      tracker_(other.tracker_),
      category_(other.category_) {
  other.count_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::move(other.data_);
    count_ = other.count_;
    tracker_ = other.tracker_;
    category_ = other.category_;
    other.count_ = 0;
  }
  return *this;
}

void Buffer::Zero() {
  if (count_ > 0) std::memset(data_.get(), 0, count_ * sizeof(float));
}

}  // namespace vp::engine
