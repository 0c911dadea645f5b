#include "worker/engine/memory.h"

#include <gtest/gtest.h>

namespace vp::engine {
namespace {

TEST(MemoryTracker, CountsLiveAndPeakPerCategory) {
  MemoryTracker tracker;
  {
    Buffer params(&tracker, MemoryCategory::kParameters, 100);
    Buffer acts(&tracker, MemoryCategory::kActivations, 50);
    EXPECT_EQ(tracker.current(MemoryCategory::kParameters), 400);
    EXPECT_EQ(tracker.total_current(), 600);
    Buffer moved = std::move(acts);
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 200);
    EXPECT_EQ(moved.size(), 50u);
    EXPECT_EQ(moved.data()[49], 0.0f);
  }
  EXPECT_EQ(tracker.total_current(), 0);
  EXPECT_EQ(tracker.peak(MemoryCategory::kActivations), 200);
  EXPECT_EQ(tracker.total_peak(), 600);
  tracker.ResetPeaks();
  EXPECT_EQ(tracker.total_peak(), 0);
}

TEST(Buffer, IsAlignedAndZeroed) {
  Buffer b(nullptr, MemoryCategory::kActivations, 33);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b.data()[i], 0.0f);
}

}  // namespace
}  // namespace vp::engine
