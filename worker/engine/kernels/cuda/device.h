// What the device model's passes share: the stream a pass enqueues on, that stream's GEMM runner
// and the rank's caching allocator, plus a typed device array on top of the allocator.
//
// Ordering rule of the device model (the CPU runtime's threads carry over unchanged): every
// public pass method enqueues its work on its context's stream and returns only after
// Finish(ctx) — the stream is idle and the blocks this thread freed are handed back to the
// allocator. So a buffer a pass produced can be given to another thread (and its stream) as soon
// as the method returns, and a freed block is never reused while a kernel still reads it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/memory.h"

namespace vp::engine::cuda {

class CudnnAttention;  // attention_cudnn.h

struct DeviceContext {
  cudaStream_t stream = nullptr;
  GemmRunner* gemm = nullptr;         // used only on this context's thread
  CachingAllocator* alloc = nullptr;  // shared by the rank's threads (thread-safe)
  // cuDNN's fused attention (VOCABPIPE_ATTENTION=cudnn), used only on this context's thread;
  // null: the attention kernels (RunAttentionForward/Backward in attention_cudnn.h choose).
  CudnnAttention* attention = nullptr;
};

// Synchronises ctx.stream, then returns the blocks this thread released to the allocator's cache
// (CachingAllocator::ReuseAfterSync).
absl::Status Finish(const DeviceContext& ctx);

// `count` elements of E in one device block charged to `category`; move-only.
template <typename E>
class DeviceArray {
 public:
  DeviceArray() = default;
  // A moved-from array is empty (count 0), like a moved-from DeviceBuffer.
  DeviceArray(DeviceArray&& other) noexcept
      : buf_(std::move(other.buf_)), count_(std::exchange(other.count_, 0)) {}
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    if (this != &other) {
      buf_ = std::move(other.buf_);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  // Zero-filled on ctx.stream when `zero` (cudaMemsetAsync), else contents are arbitrary.
  static absl::StatusOr<DeviceArray> Create(const DeviceContext& ctx, MemoryCategory category,
                                            size_t count, bool zero = true);

  E* data() const { return buf_.template as<E>(); }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(E); }
  bool empty() const { return count_ == 0; }
  void Reset() {
    buf_.Reset();
    count_ = 0;
  }

 private:
  DeviceArray(DeviceBuffer buf, size_t count) : buf_(std::move(buf)), count_(count) {}
  DeviceBuffer buf_;
  size_t count_ = 0;
};

}  // namespace vp::engine::cuda
