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
// bytes past the most ever live at once, so the pool holds no more than its live peak.
TEST(ActivationPool, FootprintStaysWithinThePeakOfLiveBytes) {
  ActivationPool pool(nullptr);
  {
    PooledBuffer a = pool.Acquire(1000);
    PooledBuffer b = pool.Acquire(500);
  }  // live peak 1500 floats; both parked
  EXPECT_EQ(pool.cached_bytes(), 6000);
  PooledBuffer c = pool.Acquire(200);  // fresh: 200 + 1500 parked > 1500, so 1000 goes
  EXPECT_EQ(pool.cached_bytes(), 2000);
  PooledBuffer d = pool.Acquire(500);  // reused
  EXPECT_EQ(pool.cached_bytes(), 0);
  c.Reset();
  PooledBuffer e = pool.Acquire(700);  // fresh: 1200 live + 200 parked <= 1500 peak: kept
  EXPECT_EQ(pool.cached_bytes(), 800);
}

}  // namespace
}  // namespace vp::engine
