// The CPU sgemm peak MFU is measured against: measured once per host, CPU model and thread
// count, then read from the cache file; VOCABPIPE_MEASURE_PEAK=1 measures it again; MFU is
// never above 1.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/runtime/flops.h"

namespace vp::runtime {
namespace {

namespace fs = std::filesystem;

class CpuPeakTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("vp_cpu_peak_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    setenv("VOCABPIPE_CACHE_DIR", dir_.c_str(), 1);
    unsetenv("VOCABPIPE_MEASURE_PEAK");
    engine::cpu::SetBlasThreads(1);
  }
  void TearDown() override {
    unsetenv("VOCABPIPE_CACHE_DIR");
    unsetenv("VOCABPIPE_MEASURE_PEAK");
    fs::remove_all(dir_);
  }
  fs::path dir_;
};

TEST_F(CpuPeakTest, MeasuredOnceThenReadFromTheCacheUntilAskedToMeasureAgain) {
  EXPECT_EQ(CpuPeakCachePath(), (dir_ / "cpu_peak.json").string());
  const CpuPeak first = CpuPeakFlops();
  EXPECT_GT(first.flops, 0);
  EXPECT_FALSE(first.cached);
  EXPECT_EQ(first.source, "measured now");
  ASSERT_TRUE(fs::exists(dir_ / "cpu_peak.json"));

  // The entry is keyed by host, CPU model and thread count; a later run reads it back exactly.
  const CpuPeak second = CpuPeakFlops();
  EXPECT_TRUE(second.cached);
  EXPECT_EQ(second.flops, first.flops);
  EXPECT_EQ(second.source.rfind("cached, measured ", 0), 0u) << second.source;

  // Another thread count is another entry.
  engine::cpu::SetBlasThreads(2);
  EXPECT_FALSE(CpuPeakFlops().cached);
  engine::cpu::SetBlasThreads(1);
  EXPECT_TRUE(CpuPeakFlops().cached);

  // A planted entry shows that the cache, not a new measurement, answers; the flag re-measures.
  std::ifstream in(dir_ / "cpu_peak.json");
  nlohmann::json cache = nlohmann::json::parse(in);
  ASSERT_EQ(cache.size(), 2u);
  for (auto& [key, entry] : cache.items()) entry["flops"] = 1234.0;
  std::ofstream(dir_ / "cpu_peak.json") << cache.dump();
  EXPECT_EQ(CpuPeakFlops().flops, 1234.0);
  setenv("VOCABPIPE_MEASURE_PEAK", "1", 1);
  const CpuPeak again = CpuPeakFlops();
  EXPECT_FALSE(again.cached);
  EXPECT_NE(again.flops, 1234.0);
  unsetenv("VOCABPIPE_MEASURE_PEAK");
  EXPECT_EQ(CpuPeakFlops().flops, again.flops);  // the new measurement replaced the entry
}

TEST_F(CpuPeakTest, AnUnreadableCacheIsPassedOver) {
  fs::create_directories(dir_);
  std::ofstream(dir_ / "cpu_peak.json") << "not json";
  const CpuPeak peak = CpuPeakFlops();
  EXPECT_GT(peak.flops, 0);
  EXPECT_FALSE(peak.cached);
  // An entry of the wrong type is measured again, not trusted (and does not throw).
  std::ifstream in(dir_ / "cpu_peak.json");
  nlohmann::json cache = nlohmann::json::parse(in);
  for (auto& [key, entry] : cache.items()) entry["flops"] = "fast";
  std::ofstream(dir_ / "cpu_peak.json") << cache.dump();
  EXPECT_FALSE(CpuPeakFlops().cached);
}

TEST(ClampedMfu, NeverAboveOneAndSaysWhenThePeakIsStale) {
  bool over = false;
  EXPECT_DOUBLE_EQ(ClampedMfu(50, 100, &over), 0.5);
  EXPECT_FALSE(over);
  EXPECT_DOUBLE_EQ(ClampedMfu(101.5, 100, &over), 1.0);
  EXPECT_TRUE(over);
  EXPECT_EQ(ClampedMfu(50, 0, nullptr), 0);
}

}  // namespace
}  // namespace vp::runtime
