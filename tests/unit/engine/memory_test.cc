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

// Buffers of 1 MiB and more are mapped from the kernel (memory.h): zeroed without a memset,
// page-aligned, and unmapped by whichever Buffer owns them last.
TEST(Buffer, LargeBuffersAreMappedZeroedAndMovable) {
  MemoryTracker tracker;
  constexpr size_t kCount = size_t{1} << 20;  // 4 MiB
  Buffer a(&tracker, MemoryCategory::kActivations, kCount);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  for (size_t i = 0; i < a.size(); i += 1021) EXPECT_EQ(a.data()[i], 0.0f);
  EXPECT_EQ(a.data()[kCount - 1], 0.0f);
  a.data()[kCount - 1] = 1.5f;
  Buffer small(&tracker, MemoryCategory::kActivations, 16);
  small = std::move(a);  // frees the small one (free), keeps the mapping
  EXPECT_EQ(small.data()[kCount - 1], 1.5f);
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), static_cast<int64_t>(kCount * 4));
  Buffer other(&tracker, MemoryCategory::kActivations, kCount + 3);
  small = std::move(other);  // unmaps the first mapping
  EXPECT_EQ(small.size(), kCount + 3);
  EXPECT_EQ(small.data()[kCount + 2], 0.0f);
  small = Buffer();
  EXPECT_EQ(tracker.total_current(), 0);
}

}  // namespace
}  // namespace vp::engine
