// A recycling allocator for activation buffers.
//
// A pipeline rank allocates and frees the same activation shapes for every (microbatch,
// sequence chunk) slot. Fresh 64-byte-aligned multi-megabyte allocations come from mmap, so each
// pass would otherwise pay page faults and Buffer's zero fill on tens of megabytes (measured:
// ~40% of a layer's F+B+W time at h=256). The pool keeps returned buffers and hands them out
// again for the same element count.
//
// Accounting: the tracker's kActivations counts *live* (acquired) bytes, so its peak is the
// rank's peak activation memory as the planner predicts it; bytes parked in the pool are
// reported by cached_bytes() and given back by ReleaseCached().
//
// Footprint: a parked buffer only serves a request of its own size, so buffers freed in one
// phase (the MLP input, the qkv block) could sit idle while another phase allocates other
// sizes, and the process would hold more than the peak the tracker reports. So a fresh
// allocation first frees parked buffers, largest first, while live + parked bytes would exceed
// the highest live total seen plus a slack of a quarter of it (at most kMaxSlackBytes): the
// pool never holds more than that. The slack is what a layer's working set of sizes needs
// beyond its live peak (the backward's buffers are parked while the forward's are live): with
// none, a GPT-2 layer at h = 256 unmapped and mapped three buffers afresh every backward and
// ran its B pass 1.4× slower (docs/benchmarks.md §1); 1/8 left half of that. What stays parked
// after a forward (sizes only the backward uses) is still resident while other, non-pool
// buffers (the output layer's n×V block) come on top; the standalone trainer therefore calls
// ReleaseCached() between the stack's forward and the output layer (docs/benchmarks.md §13).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "worker/engine/memory.h"

namespace vp::engine {

class ActivationPool;

// A buffer on loan from an ActivationPool; returns itself on destruction or Reset(). Contents
// of a recycled buffer are arbitrary unless it was acquired with zero = true.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  ~PooledBuffer() { Reset(); }
  PooledBuffer(PooledBuffer&& other) noexcept;
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;

  float* data() { return buf_.data(); }
  const float* data() const { return buf_.data(); }
  size_t size() const { return buf_.size(); }
  bool empty() const { return buf_.empty(); }
  // Gives the buffer back to its pool now.
  void Reset();

 private:
  friend class ActivationPool;
  PooledBuffer(ActivationPool* pool, Buffer buf) : pool_(pool), buf_(std::move(buf)) {}

  ActivationPool* pool_ = nullptr;
  Buffer buf_;
};

class ActivationPool {
 public:
  // The most the pool holds beyond its live peak (see "Footprint" above).
  static constexpr int64_t kMaxSlackBytes = int64_t{64} << 20;

  // tracker may be null. The pool must outlive every buffer it lends.
  explicit ActivationPool(MemoryTracker* tracker) : tracker_(tracker) {}
  ActivationPool(const ActivationPool&) = delete;
  ActivationPool& operator=(const ActivationPool&) = delete;

  // A buffer of exactly `count` floats (count 0 gives an empty buffer), zero-filled if asked.
  PooledBuffer Acquire(size_t count, bool zero = false);

  int64_t cached_bytes() const;
  // Frees every parked buffer.
  void ReleaseCached();

 private:
  friend class PooledBuffer;
  void Return(Buffer buf);

  MemoryTracker* tracker_;
  mutable std::mutex mu_;
  std::multimap<size_t, Buffer> free_;  // by element count
  int64_t cached_bytes_ = 0;
  int64_t live_bytes_ = 0;       // lent out now
  int64_t peak_live_bytes_ = 0;  // the most ever lent out at once
};

}  // namespace vp::engine
