// kernels/cpu/fast_exp.h against libm: the vectorizable exp, tanh and sigmoid the GELU,
// attention softmax, SwiGLU and output-layer loops use.
#include "worker/engine/kernels/cpu/fast_exp.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace vp::engine::cpu {
namespace {

// Every float step of 1/1024 over [lo, hi]: dense enough to cross every reduction interval
// (k changes every ln2 ≈ 0.69) many times.
template <typename F>
void Sweep(float lo, float hi, F check) {
  for (float x = lo; x <= hi; x += 1.0f / 1024) check(x);
}

TEST(FastExp, ExpNonPositiveWithinFourUlpsOfLibm) {
  double worst = 0;
  Sweep(-87.0f, 0.0f, [&](float x) {
    const double want = std::exp(static_cast<double>(x));
    const double rel = std::abs(ExpNonPositive(x) - want) / want;
    worst = std::max(worst, rel);
  });
  EXPECT_LT(worst, 4 * std::numeric_limits<float>::epsilon()) << worst;
  EXPECT_EQ(ExpNonPositive(0.0f), 1.0f);
}

TEST(FastExp, ExpNonPositiveUnderflowsToATinyPositiveValue) {
  // Below -87 the result is clamped, never 0, never negative, never a NaN.
  for (float x : {-87.5f, -100.0f, -1e4f, -std::numeric_limits<float>::infinity()}) {
    const float e = ExpNonPositive(x);
    EXPECT_GT(e, 0.0f) << x;
    EXPECT_LT(e, 1e-37f) << x;
  }
}

TEST(FastExp, TanhWithinTwoUlpsOfOneOfLibm) {
  double worst = 0;
  Sweep(-20.0f, 20.0f, [&](float u) {
    worst = std::max(worst, std::abs(Tanh(u) - std::tanh(static_cast<double>(u))));
  });
  EXPECT_LT(worst, 2 * std::numeric_limits<float>::epsilon()) << worst;
}

TEST(FastExp, TanhIsOddAndExactAtTheExtremes) {
  Sweep(0.0f, 10.0f, [](float u) { EXPECT_EQ(Tanh(-u), -Tanh(u)) << u; });
  EXPECT_EQ(Tanh(0.0f), 0.0f);
  EXPECT_EQ(Tanh(50.0f), 1.0f);
  EXPECT_EQ(Tanh(-50.0f), -1.0f);
  EXPECT_EQ(Tanh(1e30f), 1.0f);
}

TEST(FastExp, SigmoidWithinTwoUlpsOfOneOfLibm) {
  double worst = 0;
  Sweep(-90.0f, 90.0f, [&](float g) {
    const double want = 1.0 / (1.0 + std::exp(-static_cast<double>(g)));
    worst = std::max(worst, std::abs(Sigmoid(g) - want));
  });
  EXPECT_LT(worst, 2 * std::numeric_limits<float>::epsilon()) << worst;
  EXPECT_EQ(Sigmoid(0.0f), 0.5f);
  EXPECT_EQ(Sigmoid(200.0f), 1.0f);
  EXPECT_GE(Sigmoid(-200.0f), 0.0f);
  EXPECT_LT(Sigmoid(-200.0f), 1e-37f);
}

}  // namespace
}  // namespace vp::engine::cpu
