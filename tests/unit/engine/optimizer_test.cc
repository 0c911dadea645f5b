#include "worker/engine/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace vp::engine {
namespace {

// Two AdamW steps on 6 parameters: [0, 4) decayed, [4, 6) not; step 2 uses another lr and a
// clipping scale of 0.5.
const std::vector<float> kP0 = {0.5f, -1.25f, 2.0f, 0.75f, -0.3f, 1.5f};
const std::vector<float> kG1 = {0.1f, -0.2f, 0.3f, -0.4f, 0.5f, -0.6f};
const std::vector<float> kG2 = {-0.05f, 0.25f, 0.15f, 0.35f, -0.45f, 0.0f};

std::vector<float> RunTwoSteps(MemoryTracker* tracker) {
  const AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  auto opt = AdamW::Create(tracker, 6, cfg, {{0, 4, true}, {4, 2, false}});
  EXPECT_TRUE(opt.ok()) << opt.status();
  std::vector<float> p = kP0;
  opt->Step(p.data(), kG1.data(), 0.01f);
  opt->Step(p.data(), kG2.data(), 0.02f, 0.5f);
  EXPECT_EQ(opt->step(), 2);
  return p;
}

TEST(AdamW, TwoStepsMatchHandComputation) {
  MemoryTracker tracker;
  const std::vector<float> p = RunTwoSteps(&tracker);
  // The update written out in double, independently of the implementation.
  const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (int i = 0; i < 6; ++i) {
    const bool decay = i < 4;
    double x = kP0[i], m = 0, v = 0;
    const double lrs[2] = {0.01, 0.02};
    const double gs[2] = {kG1[i], 0.5 * kG2[i]};
    for (int t = 1; t <= 2; ++t) {
      const double lr = lrs[t - 1], g = gs[t - 1];
      if (decay) x *= 1 - lr * wd;
      m = b1 * m + (1 - b1) * g;
      v = b2 * v + (1 - b2) * g * g;
      const double mhat = m / (1 - std::pow(b1, t)), vhat = v / (1 - std::pow(b2, t));
      x -= lr * mhat / (std::sqrt(vhat) + eps);
    }
    EXPECT_NEAR(p[i], x, 2e-6) << i;
  }
}

TEST(AdamW, TwoStepsMatchTorch) {
  // torch 1.13 (Debian, /usr/bin/python3) torch.optim.AdamW (fp32, betas (0.9, 0.95), eps 1e-8,
  // weight_decay 0.1 on the first group, 0 on the second), same gradients and learning rates,
  // printed with %.9g.
  const std::vector<float> torch_p2 = {0.479025722f, -1.23278129f,  1.9672246f,
                                       0.76409483f,  -0.316161484f, 1.52357292f};
  const std::vector<float> p = RunTwoSteps(nullptr);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(p[i], torch_p2[i], 1e-6) << i;
}

TEST(AdamW, StateIsChargedToOptimizerAndRangesAreValidated) {
  MemoryTracker tracker;
  {
    auto opt = AdamW::Create(&tracker, 100, {}, {{0, 100, true}});
    ASSERT_TRUE(opt.ok());
    EXPECT_EQ(tracker.current(MemoryCategory::kOptimizer), 2 * 100 * 4);
  }
  EXPECT_EQ(tracker.current(MemoryCategory::kOptimizer), 0);
  EXPECT_FALSE(AdamW::Create(nullptr, 10, {}, {{8, 3, true}}).ok());
  EXPECT_FALSE(AdamW::Create(nullptr, 10, {1.0f, 0.95f, 1e-8f, 0.1f}, {}).ok());
}

TEST(Clipping, MatchesTorchClipGradNormFactor) {
  const std::vector<float> g = {3.0f, 4.0f};
  const double sq = SquaredNorm(g.data(), g.size());
  EXPECT_DOUBLE_EQ(sq, 25.0);
  EXPECT_NEAR(ClipScale(sq, 1.0f), 1.0 / (5.0 + 1e-6), 1e-8);
  EXPECT_EQ(ClipScale(sq, 10.0f), 1.0f);  // norm below max: untouched
  EXPECT_EQ(ClipScale(sq, 0.0f), 1.0f);   // disabled
  // Sharded: the caller sums squared norms across ranks before asking.
  EXPECT_NEAR(ClipScale(SquaredNorm(g.data(), 1) + SquaredNorm(g.data() + 1, 1), 2.5f),
              2.5 / (5.0 + 1e-6), 1e-7);
}

TEST(LrSchedule, WarmupThenCosineToMinLr) {
  const LrSchedule s{1.0f, 0.1f, 10, 110, true};
  EXPECT_FLOAT_EQ(s.At(0), 0.1f);  // (0 + 1) / 10
  EXPECT_FLOAT_EQ(s.At(4), 0.5f);
  EXPECT_FLOAT_EQ(s.At(9), 1.0f);
  EXPECT_FLOAT_EQ(s.At(10), 1.0f);   // cosine starts at lr
  EXPECT_FLOAT_EQ(s.At(60), 0.55f);  // halfway: min + (lr - min) / 2
  EXPECT_NEAR(s.At(35), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.25)), 1e-6);
  EXPECT_FLOAT_EQ(s.At(110), 0.1f);
  EXPECT_FLOAT_EQ(s.At(500), 0.1f);  // stays at min_lr past the end
}

TEST(LrSchedule, ConstantAfterWarmup) {
  const LrSchedule s{3e-4f, 0.0f, 4, 100, false};
  EXPECT_FLOAT_EQ(s.At(1), 1.5e-4f);
  EXPECT_FLOAT_EQ(s.At(3), 3e-4f);
  EXPECT_FLOAT_EQ(s.At(99), 3e-4f);
  const LrSchedule no_warmup{3e-4f, 0.0f, 0, 100, true};
  EXPECT_FLOAT_EQ(no_warmup.At(0), 3e-4f);
  EXPECT_NEAR(no_warmup.At(50), 1.5e-4f, 1e-9);
}

}  // namespace
}  // namespace vp::engine
