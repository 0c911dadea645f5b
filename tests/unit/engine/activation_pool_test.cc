#include "worker/engine/activation_pool.h"

#include <gtest/gtest.h>

namespace vp::engine {
namespace {

TEST(ActivationPool, RecyclesBuffersAndChargesOnlyLiveBytes) {
  MemoryTracker tracker;
  ActivationPool pool(&tracker);
  float* first = nullptr;
  {
    PooledBuffer a = pool.Acquire(1000);
    EXPECT_EQ(a.size(), 1000u);
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 4000);
    first = a.data();
    a.data()[7] = 3.0f;
  }
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  EXPECT_EQ(pool.cached_bytes(), 4000);
  PooledBuffer b = pool.Acquire(1000);  // same size: same memory, contents kept
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(b.data()[7], 3.0f);
  EXPECT_EQ(pool.cached_bytes(), 0);
  PooledBuffer moved = std::move(b);
  EXPECT_TRUE(b.empty());
  moved.Reset();
  PooledBuffer z = pool.Acquire(1000, /*zero=*/true);
  EXPECT_EQ(z.data()[7], 0.0f);
  PooledBuffer other = pool.Acquire(10);  // different size: fresh
  EXPECT_NE(other.data(), z.data());
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 4040);
  EXPECT_EQ(tracker.peak(MemoryCategory::kActivations), 4040);
  z.Reset();
  other.Reset();
  pool.ReleaseCached();
  EXPECT_EQ(pool.cached_bytes(), 0);
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
}

// Parked buffers of other sizes are freed before a fresh allocation would take live + parked
// bytes past the most ever live at once plus a quarter of it, so the pool holds no more than
// that.
TEST(ActivationPool, FootprintStaysWithinThePeakOfLiveBytesAndItsSlack) {
  ActivationPool pool(nullptr);
  {
    PooledBuffer a = pool.Acquire(1000);
    PooledBuffer b = pool.Acquire(600);
  }  // live peak 1600 floats, slack 400; both parked
  EXPECT_EQ(pool.cached_bytes(), 6400);
  PooledBuffer c = pool.Acquire(300);  // fresh: 300 + 1600 parked <= 2000: both kept
  EXPECT_EQ(pool.cached_bytes(), 6400);
  c.Reset();
  PooledBuffer d = pool.Acquire(500);  // fresh: 500 + 1900 parked > 2000, so 1000 goes
  EXPECT_EQ(pool.cached_bytes(), 3600);
  PooledBuffer e = pool.Acquire(600);  // reused
  EXPECT_EQ(pool.cached_bytes(), 1200);
}

}  // namespace
}  // namespace vp::engine
