// Test helper: compares two safetensors checkpoints tensor by tensor (header-only; link
// vp_runtime for ReadSafetensors).
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "worker/runtime/safetensors.h"

namespace vp::testing {

// The largest |a − b| / max(1, |b|) over every element of every tensor of b (a must hold the
// same names and shapes: a mismatch fails the test and returns infinity).
inline double WorstRelativeDifference(const std::filesystem::path& a,
                                      const std::filesystem::path& b) {
  auto wa = runtime::ReadSafetensors(a.string());
  auto wb = runtime::ReadSafetensors(b.string());
  EXPECT_TRUE(wa.ok()) << wa.status();
  EXPECT_TRUE(wb.ok()) << wb.status();
  if (!wa.ok() || !wb.ok()) return INFINITY;
  EXPECT_EQ(wa->tensors.size(), wb->tensors.size()) << a << " vs " << b;
  double worst = 0;
  for (const auto& [name, tb] : wb->tensors) {
    const auto it = wa->tensors.find(name);
    EXPECT_NE(it, wa->tensors.end()) << name << " missing from " << a;
    if (it == wa->tensors.end()) return INFINITY;
    EXPECT_EQ(it->second.shape, tb.shape) << name;
    if (it->second.shape != tb.shape) return INFINITY;
    for (size_t i = 0; i < tb.data.size(); ++i) {
      worst = std::max(worst, std::abs(double(it->second.data[i]) - tb.data[i]) /
                                  std::max(1.0, std::abs(double(tb.data[i]))));
    }
  }
  return worst;
}

// Same names and shapes, and |a − b| <= tol · max(1, |b|) for every element.
inline void ExpectSameWeights(const std::filesystem::path& a, const std::filesystem::path& b,
                              double tol) {
  EXPECT_LE(WorstRelativeDifference(a, b), tol) << a << " vs " << b;
}

}  // namespace vp::testing
