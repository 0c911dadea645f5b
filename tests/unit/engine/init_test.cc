#include "worker/engine/init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace vp::engine {
namespace {

TEST(TensorId, IsStableAndDistinguishesNames) {
  EXPECT_EQ(TensorId("transformer.wte.weight"), TensorId(std::string("transformer.wte.weight")));
  EXPECT_NE(TensorId("transformer.h.0.attn.c_attn.weight"),
            TensorId("transformer.h.1.attn.c_attn.weight"));
  EXPECT_NE(TensorId(""), TensorId("a"));
}

TEST(InitNormal, SliceEqualsSameSliceOfWhole) {
  const uint64_t id = TensorId("transformer.wte.weight");
  std::vector<float> whole(1000);
  InitNormal(whole.data(), whole.size(), 0.02f, 1234, id, 0);
  // A vocabulary shard owning elements [300, 700) draws them on its own.
  std::vector<float> shard(400);
  InitNormal(shard.data(), shard.size(), 0.02f, 1234, id, 300);
  for (size_t i = 0; i < shard.size(); ++i) ASSERT_EQ(shard[i], whole[300 + i]) << i;
  std::vector<float> other_seed(1000), other_tensor(1000);
  InitNormal(other_seed.data(), 1000, 0.02f, 1235, id, 0);
  InitNormal(other_tensor.data(), 1000, 0.02f, 1234, TensorId("transformer.wpe.weight"), 0);
  EXPECT_NE(other_seed, whole);
  EXPECT_NE(other_tensor, whole);
}

TEST(InitNormal, HasRequestedMoments) {
  std::vector<float> x(200000);
  InitNormal(x.data(), x.size(), 2.0f, 7, 99, 0);
  double s = 0, s2 = 0, s4 = 0;
  for (const float v : x) {
    s += v;
    s2 += double(v) * v;
  }
  const double mean = s / x.size(), var = s2 / x.size() - mean * mean;
  for (const float v : x) s4 += std::pow((v - mean) / std::sqrt(var), 4);
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(var), 2.0, 0.02);
  EXPECT_NEAR(s4 / x.size(), 3.0, 0.1);  // Gaussian kurtosis, not uniform's 1.8
  for (const float v : x) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace vp::engine
