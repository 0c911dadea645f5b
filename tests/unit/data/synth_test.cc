#include "worker/data/synth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>
#include <vector>

namespace vp::data {
namespace {

double H2(double p) { return -(p * std::log(p) + (1 - p) * std::log(1 - p)); }

TEST(Synth, TwoStateChainMatchesClosedForm) {
  // P = [[1-a, a], [b, 1-b]]: pi = (b, a) / (a + b), H = pi_0 h(a) + pi_1 h(b).
  const double a = 0.3, b = 0.1;
  absl::StatusOr<MarkovChain> chain =
      MakeMarkovChain(2, {0, 2, 4}, {0, 1, 0, 1}, {1 - a, a, b, 1 - b});
  ASSERT_TRUE(chain.ok()) << chain.status();
  const Stationary st = StationaryDistribution(*chain);
  EXPECT_NEAR(st.pi[0], b / (a + b), 1e-12);
  EXPECT_NEAR(st.pi[1], a / (a + b), 1e-12);
  EXPECT_NEAR(EntropyRate(*chain), b / (a + b) * H2(a) + a / (a + b) * H2(b), 1e-12);
}

TEST(Synth, PeriodicChainStillConverges) {
  // 0 -> 1 -> 0 deterministically (period 2) and 2 -> 0 (transient): plain power iteration
  // from the uniform start would oscillate forever; the lazy chain converges to (1/2, 1/2, 0).
  absl::StatusOr<MarkovChain> chain = MakeMarkovChain(3, {0, 1, 2, 3}, {1, 0, 0}, {1, 1, 1});
  ASSERT_TRUE(chain.ok());
  const Stationary st = StationaryDistribution(*chain);
  EXPECT_LT(st.residual, 1e-12);
  EXPECT_NEAR(st.pi[0], 0.5, 1e-9);
  EXPECT_NEAR(st.pi[1], 0.5, 1e-9);
  EXPECT_NEAR(st.pi[2], 0.0, 1e-9);
  EXPECT_NEAR(EntropyRate(*chain), 0.0, 1e-12);
}

TEST(Synth, HandMadeChainValidation) {
  EXPECT_THAT(MakeMarkovChain(2, {0, 1, 2}, {0, 2}, {1, 1}).status().message(),
              ::testing::HasSubstr("row 1: successor 2 not in [0, 2)"));
  EXPECT_THAT(MakeMarkovChain(2, {0, 1, 2}, {0, 1}, {1, 0.5}).status().message(),
              ::testing::HasSubstr("row 1: probabilities sum to 0.5"));
  EXPECT_THAT(MakeMarkovChain(2, {0, 0, 2}, {0, 1}, {0.5, 0.5}).status().message(),
              ::testing::HasSubstr("row 0: has no successors"));
}

TEST(Synth, RandomChainShape) {
  absl::StatusOr<MarkovChain> chain = MakeRandomMarkovChain(100, 6, 7);
  ASSERT_TRUE(chain.ok());
  for (int32_t i = 0; i < 100; ++i) {
    ASSERT_EQ(chain->row_offsets[i + 1] - chain->row_offsets[i], 6);
    std::set<int32_t> succ;
    double sum = 0;
    for (int64_t e = chain->row_offsets[i]; e < chain->row_offsets[i + 1]; ++e) {
      succ.insert(chain->successors[e]);
      EXPECT_GT(chain->probs[e], 0.0);
      sum += chain->probs[e];
    }
    EXPECT_EQ(succ.size(), 6u) << "successors of " << i << " are not distinct";
    EXPECT_TRUE(succ.contains((i + 1) % 100));
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
  // Branching is capped at V for tiny vocabularies.
  absl::StatusOr<MarkovChain> tiny = MakeRandomMarkovChain(2, 8, 1);
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->successors.size(), 4u);
  EXPECT_THAT(MakeRandomMarkovChain(1, 4, 1).status().message(),
              ::testing::HasSubstr("vocab: must be >= 2"));
  EXPECT_THAT(MakeRandomMarkovChain(10, 1, 1).status().message(),
              ::testing::HasSubstr("branching: must be in [2, 256]"));
}

TEST(Synth, GeneratedTokensInRangeAndSeeded) {
  absl::StatusOr<MarkovChain> chain = MakeRandomMarkovChain(300, 4, 11);
  ASSERT_TRUE(chain.ok());
  const std::vector<uint32_t> a = GenerateTokens(*chain, 20000, 3);
  ASSERT_EQ(a.size(), 20000u);
  for (uint32_t id : a) ASSERT_LT(id, 300u);
  // Every transition is an edge of the chain.
  for (size_t t = 0; t + 1 < a.size(); ++t) {
    const int64_t begin = chain->row_offsets[a[t]], end = chain->row_offsets[a[t] + 1];
    bool found = false;
    for (int64_t e = begin; e < end; ++e) found |= chain->successors[e] == int32_t(a[t + 1]);
    ASSERT_TRUE(found) << a[t] << " -> " << a[t + 1];
  }
  EXPECT_EQ(GenerateTokens(*chain, 20000, 3), a);
  EXPECT_NE(GenerateTokens(*chain, 20000, 4), a);
  absl::StatusOr<MarkovChain> again = MakeRandomMarkovChain(300, 4, 11);
  EXPECT_EQ(again->successors, chain->successors);
  EXPECT_EQ(again->probs, chain->probs);
}

TEST(Synth, EmpiricalConditionalEntropyMatchesRate) {
  const int32_t v = 64;
  absl::StatusOr<MarkovChain> chain = MakeRandomMarkovChain(v, 5, 2024);
  ASSERT_TRUE(chain.ok());
  const int64_t n = 2000000;
  const std::vector<uint32_t> tokens = GenerateTokens(*chain, n, 9);
  std::vector<double> pair(static_cast<size_t>(v) * v, 0), first(v, 0);
  for (int64_t t = 0; t + 1 < n; ++t) {
    pair[tokens[t] * v + tokens[t + 1]] += 1;
    first[tokens[t]] += 1;
  }
  // Plug-in estimate of H(X_{t+1} | X_t).
  double h = 0;
  for (int32_t i = 0; i < v; ++i) {
    for (int32_t j = 0; j < v; ++j) {
      const double c = pair[i * v + j];
      if (c > 0) h -= c / (n - 1) * std::log(c / first[i]);
    }
  }
  const double rate = EntropyRate(*chain);
  EXPECT_GT(rate, 0.1);
  EXPECT_LT(rate, std::log(5.0));
  EXPECT_NEAR(h, rate, 0.01);
  // Unigram frequencies approach the stationary distribution.
  const Stationary st = StationaryDistribution(*chain);
  for (int32_t i = 0; i < v; ++i) EXPECT_NEAR(first[i] / (n - 1), st.pi[i], 0.003);
}

// A 256k-token vocabulary (the paper's largest) still gives a converged stationary distribution
// and an entropy rate inside (0.5, log K). How long it takes is measured by bench/data
// (data_synth_bench), not asserted here.
TEST(Synth, LargeVocabularyConverges) {
  absl::StatusOr<MarkovChain> chain = MakeRandomMarkovChain(262144, 8, 1);
  ASSERT_TRUE(chain.ok());
  const Stationary st = StationaryDistribution(*chain);
  EXPECT_LT(st.residual, 1e-13);
  double sum = 0;
  for (double p : st.pi) sum += p;
  EXPECT_NEAR(sum, 1.0, 1e-9);
  const double rate = EntropyRate(*chain);
  EXPECT_GT(rate, 0.5);
  EXPECT_LT(rate, std::log(8.0));
  RecordProperty("stationary_iterations", st.iterations);
}

}  // namespace
}  // namespace vp::data
