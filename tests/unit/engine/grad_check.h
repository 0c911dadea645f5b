// Central finite differences for the engine's backward tests. Forward passes run in fp32; the
// scalar loss Σ w·out is accumulated in double so the difference quotient is limited by the
// fp32 forward, not by the reduction. Sizes are small and inputs O(1), eps 1e-2, so truncation
// (~eps²) and round-off (~1e-7/eps) errors both stay near 1e-4 relative.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

namespace vp::engine::testing {

inline std::vector<float> RandomVector(size_t n, uint32_t seed, float scale = 1.0f,
                                       float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = offset + scale * dist(rng);
  return v;
}

inline double WeightedSum(const float* out, const std::vector<float>& w) {
  double s = 0.0;
  for (size_t i = 0; i < w.size(); ++i) s += static_cast<double>(w[i]) * out[i];
  return s;
}

// Compares analytic[i] with the central difference of loss() in x[i], for every i.
template <typename LossFn>
void ExpectGradientMatches(const std::string& what, float* x, size_t n,
                           const std::vector<float>& analytic, LossFn loss, float eps = 1e-2f,
                           double atol = 1e-3, double rtol = 1e-2) {
  ASSERT_EQ(analytic.size(), n) << what;
  int failures = 0;
  for (size_t i = 0; i < n && failures < 5; ++i) {
    const float saved = x[i];
    const float up = saved + eps;
    const float down = saved - eps;
    x[i] = up;
    const double lp = loss();
    x[i] = down;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (static_cast<double>(up) - down);
    const double a = analytic[i];
    const double tol = atol + rtol * std::max(std::fabs(a), std::fabs(numeric));
    if (std::fabs(a - numeric) > tol) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: analytic " << a << " vs numeric " << numeric;
    }
  }
}

inline void ExpectAllNear(const std::string& what, const float* a, const float* b, size_t n,
                          double atol, double rtol = 0.0) {
  int failures = 0;
  for (size_t i = 0; i < n && failures < 5; ++i) {
    const double tol = atol + rtol * std::fabs(b[i]);
    if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= tol)) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " vs " << b[i];
    }
  }
}

}  // namespace vp::engine::testing
