#include "worker/engine/activation_pool.h"

#include <algorithm>
#include <iterator>
#include <utility>

namespace vp::engine {

PooledBuffer::PooledBuffer(PooledBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), buf_(std::move(other.buf_)) {}

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::exchange(other.pool_, nullptr);
    buf_ = std::move(other.buf_);
  }
  return *this;
}

void PooledBuffer::Reset() {
  if (pool_ != nullptr && !buf_.empty()) pool_->Return(std::move(buf_));
  buf_ = Buffer();
  pool_ = nullptr;
}

PooledBuffer ActivationPool::Acquire(size_t count, bool zero) {
  if (count == 0) return PooledBuffer();
  Buffer buf;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(count);
    if (it != free_.end()) {
      buf = std::move(it->second);
      free_.erase(it);
      cached_bytes_ -= static_cast<int64_t>(count * sizeof(float));
    }
  }
  const int64_t bytes = static_cast<int64_t>(count * sizeof(float));
  if (buf.empty()) {
    // Untracked Buffer: the pool charges live bytes itself (see the header).
    std::multimap<size_t, Buffer> evicted;  // freed after the lock is dropped
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Keep live + parked within the high-water mark of live bytes and its slack (the
      // header): parked buffers of other sizes that would push the footprint past it go back
      // to the system first.
      const int64_t live = live_bytes_ + bytes;
      const int64_t peak = std::max(peak_live_bytes_, live);
      const int64_t cap = peak + std::min(peak / 4, kMaxSlackBytes);
      while (!free_.empty() && live + cached_bytes_ > cap) {
        auto largest = std::prev(free_.end());
        cached_bytes_ -= static_cast<int64_t>(largest->first * sizeof(float));
        evicted.insert(free_.extract(largest));
      }
    }
    buf = Buffer(nullptr, MemoryCategory::kActivations, count);
  } else if (zero) {
    buf.Zero();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_bytes_ += bytes;
    peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
  }
  if (tracker_ != nullptr) {
    tracker_->Add(MemoryCategory::kActivations, static_cast<int64_t>(count * sizeof(float)));
  }
  return PooledBuffer(this, std::move(buf));
}

void ActivationPool::Return(Buffer buf) {
  const int64_t bytes = static_cast<int64_t>(buf.size() * sizeof(float));
  if (tracker_ != nullptr) tracker_->Sub(MemoryCategory::kActivations, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  live_bytes_ -= bytes;
  cached_bytes_ += bytes;
  free_.emplace(buf.size(), std::move(buf));
}

int64_t ActivationPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

void ActivationPool::ReleaseCached() {
  std::multimap<size_t, Buffer> drop;
  std::lock_guard<std::mutex> lock(mu_);
  drop.swap(free_);
  cached_bytes_ = 0;
}

}  // namespace vp::engine
