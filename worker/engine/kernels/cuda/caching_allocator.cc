#include "worker/engine/kernels/cuda/caching_allocator.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/check.h"

namespace vp::engine::cuda {
namespace {

class CudaMemoryBackend final : public DeviceMemoryBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = nullptr;
    VP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    return p;
  }
  void Free(void* ptr) override { cudaFree(ptr); }
  void ClearError() override { (void)cudaGetLastError(); }
  absl::Status SynchronizeStream(StreamHandle stream) override {
    VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
};

class HostMemoryBackend final : public DeviceMemoryBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = std::aligned_alloc(256, bytes);  // class sizes are multiples of 512
    if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("malloc ", bytes));
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
};

}  // namespace

std::unique_ptr<DeviceMemoryBackend> MakeCudaMemoryBackend() {
  return std::make_unique<CudaMemoryBackend>();
}
std::unique_ptr<DeviceMemoryBackend> MakeHostMemoryBackend() {
  return std::make_unique<HostMemoryBackend>();
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      block_bytes_(std::exchange(other.block_bytes_, 0)),
      category_(other.category_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = std::exchange(other.owner_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    block_bytes_ = std::exchange(other.block_bytes_, 0);
    category_ = other.category_;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (ptr_ != nullptr && owner_ != nullptr) owner_->Release(ptr_, block_bytes_, category_);
  owner_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
  block_bytes_ = 0;
}

CachingAllocator::CachingAllocator(std::unique_ptr<DeviceMemoryBackend> backend,
                                   MemoryTracker* tracker, Reuse reuse)
    : backend_(std::move(backend)), tracker_(tracker), reuse_(reuse) {}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [thread, blocks] : pending_) {  // the device is idle by now (owner's contract)
    for (auto& [block, ptr] : blocks) free_[block].push_back(ptr);
  }
  pending_.clear();
  EmptyCacheLocked();
}

size_t CachingAllocator::RoundUp(size_t bytes) {
  const size_t g = bytes <= kSmallLimit ? kSmallGranule : kLargeGranule;
  return (bytes + g - 1) / g * g;
}

absl::StatusOr<void*> CachingAllocator::TakeBlockLocked(size_t block) {
  if (auto it = free_.find(block); it != free_.end() && !it->second.empty()) {
    void* ptr = it->second.back();
    it->second.pop_back();
    ++stats_.cache_hits;
    return ptr;
  }
  absl::StatusOr<void*> got = backend_->Allocate(block);
  if (!got.ok()) return got;
  ++stats_.backend_allocs;
  stats_.reserved += static_cast<int64_t>(block);
  if (stats_.reserved > stats_.reserved_peak) stats_.reserved_peak = stats_.reserved;
  return got;
}

absl::StatusOr<DeviceBuffer> CachingAllocator::Allocate(MemoryCategory category, size_t bytes,
                                                        StreamHandle stream) {
  if (bytes == 0) return DeviceBuffer();
  const size_t block = RoundUp(bytes);
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<void*> got = TakeBlockLocked(block);
  if (!got.ok()) {
    // The failed cudaMalloc left its error for this thread: clear it before anything else can
    // launch a kernel and mistake it for a launch failure.
    backend_->ClearError();
    if (absl::IsResourceExhausted(got.status())) {
      absl::Status synced = absl::OkStatus();
      if (stream != nullptr) {
        // Outside the lock: the stream may take a while, and the other threads keep allocating.
        lock.unlock();
        synced = backend_->SynchronizeStream(stream);
        lock.lock();
        // This thread's stream is idle, so the blocks it released are free to reuse.
        if (synced.ok()) ReleasePendingLocked(std::this_thread::get_id());
      }
      if (synced.ok()) {
        // Cached blocks of other classes may be what keeps the device full.
        EmptyCacheLocked();
        got = TakeBlockLocked(block);
        if (!got.ok()) backend_->ClearError();
      } else {
        got = synced;
      }
    }
  }
  if (!got.ok()) {
    return absl::Status(
        got.status().code(),
        absl::StrCat("caching allocator: ", bytes, " bytes for ",
                     std::string(MemoryCategoryName(category)), " (", stats_.allocated,
                     " allocated, ", stats_.reserved, " reserved, ", pending_bytes_,
                     " pending): ", std::string(got.status().message())));
  }
  stats_.allocated += static_cast<int64_t>(block);
  if (stats_.allocated > stats_.allocated_peak) stats_.allocated_peak = stats_.allocated;
  if (tracker_ != nullptr) tracker_->Add(category, static_cast<int64_t>(block));
  return DeviceBuffer(this, *got, bytes, block, category);
}

void CachingAllocator::Release(void* ptr, size_t block_bytes, MemoryCategory category) {
  std::lock_guard<std::mutex> lock(mu_);
  if (reuse_ == Reuse::kAfterSync) {
    pending_[std::this_thread::get_id()].emplace_back(block_bytes, ptr);
    pending_bytes_ += static_cast<int64_t>(block_bytes);
  } else {
    free_[block_bytes].push_back(ptr);
  }
  stats_.allocated -= static_cast<int64_t>(block_bytes);
  if (tracker_ != nullptr) tracker_->Sub(category, static_cast<int64_t>(block_bytes));
}

void CachingAllocator::ReleasePending() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleasePendingLocked(std::this_thread::get_id());
}

void CachingAllocator::ReleasePendingLocked(std::thread::id thread) {
  auto it = pending_.find(thread);
  if (it == pending_.end()) return;
  for (auto& [block, ptr] : it->second) {
    free_[block].push_back(ptr);
    pending_bytes_ -= static_cast<int64_t>(block);
  }
  pending_.erase(it);
}

int64_t CachingAllocator::pending_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_bytes_;
}

void CachingAllocator::EmptyCache() {
  std::lock_guard<std::mutex> lock(mu_);
  EmptyCacheLocked();
}

void CachingAllocator::EmptyCacheLocked() {
  for (auto& [block, ptrs] : free_) {
    for (void* p : ptrs) {
      backend_->Free(p);
      stats_.reserved -= static_cast<int64_t>(block);
    }
  }
  free_.clear();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::ResetPeaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.allocated_peak = stats_.allocated;
  stats_.reserved_peak = stats_.reserved;
}

}  // namespace vp::engine::cuda
