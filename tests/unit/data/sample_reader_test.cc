#include "worker/data/sample_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

namespace vp::data {
namespace {

// Tokens 0, 1, ..., n-1: a token's value is its position, which makes the order visible.
std::shared_ptr<const TokenSource> Iota(int64_t n) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 0u);
  return std::make_shared<TokenFile>(TokenFile::FromTokens(std::move(t)));
}

TEST(SampleReader, SequentialOrderAndWrapAround) {
  // N = 10, s = 4, b = 2, m = 2: step 0 reads samples 0..3, step 1 samples 4..7.
  absl::StatusOr<SampleReader> r = SampleReader::Create(Iota(10), {4, 2, 2, false, 0});
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int32_t> in(8), tg(8);
  ASSERT_TRUE(r->Fill(0, 0, in.data(), tg.data()).ok());
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(tg, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  // Microbatch 1 of step 0: samples 2 and 3 start at 8 and 12 % 10 = 2; sample 2 wraps.
  ASSERT_TRUE(r->Fill(0, 1, in.data(), tg.data()).ok());
  EXPECT_EQ(in, (std::vector<int32_t>{8, 9, 0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(tg, (std::vector<int32_t>{9, 0, 1, 2, 3, 4, 5, 6}));
  // Step 1, microbatch 0: samples 4 (start 16 % 10 = 6) and 5 (start 0).
  ASSERT_TRUE(r->Fill(1, 0, in.data(), tg.data()).ok());
  EXPECT_EQ(in, (std::vector<int32_t>{6, 7, 8, 9, 0, 1, 2, 3}));
  EXPECT_EQ(tg, (std::vector<int32_t>{7, 8, 9, 0, 1, 2, 3, 4}));
  EXPECT_EQ(r->SampleIndex(3, 1, 1), (3 * 2 + 1) * 2 + 1);
}

// The documented rule for a corpus extended with new shards (docs/formats.md §3): a resumed
// run continues at sample k = first_step * m * b. Unshuffled, the samples that did not wrap in
// the old corpus read the same tokens in the extended one, so a run resumed before wrapping
// reads on into the new tokens with no sample repeated or skipped; shuffled, the new epoch
// order covers every start of the extended corpus once.
TEST(SampleReader, AnExtendedCorpusContinuesAtTheNextSample) {
  const SampleOrder plain{8, 2, 2, false, 3}, shuffled{8, 2, 2, true, 3};
  absl::StatusOr<SampleReader> before = SampleReader::Create(Iota(100), plain);
  absl::StatusOr<SampleReader> after = SampleReader::Create(Iota(260), plain);
  ASSERT_TRUE(before.ok() && after.ok());
  // Steps 0-2 (12 samples, starts 0..88) ran on the old corpus; the run resumes at step 3.
  for (int64_t k = 0; k < 12; ++k) EXPECT_EQ(before->SampleStart(k), after->SampleStart(k)) << k;
  EXPECT_EQ(after->SampleIndex(3, 0, 0), 12);
  std::vector<int32_t> in(16), tg(16);
  ASSERT_TRUE(after->Fill(3, 0, in.data(), tg.data()).ok());
  EXPECT_EQ(in[0], 96);   // sample 12 starts at 12 * 8 = 96 and reads on past the old end
  EXPECT_EQ(in[8], 104);  // sample 13: wholly new tokens, where the old corpus would wrap
  EXPECT_EQ(before->SampleStart(13), 4);
  // Shuffled: every later epoch of the extended corpus visits each of its starts once.
  absl::StatusOr<SampleReader> grown = SampleReader::Create(Iota(260), shuffled);
  ASSERT_TRUE(grown.ok());
  const int64_t e = grown->samples_per_epoch();
  ASSERT_EQ(e, 33);  // ceil(260 / 8)
  std::set<int64_t> starts;
  for (int64_t k = 2 * e; k < 3 * e; ++k) starts.insert(grown->SampleStart(k));
  EXPECT_EQ(static_cast<int64_t>(starts.size()), e);
  EXPECT_EQ(*starts.rbegin(), (e - 1) * 8);
}

TEST(SampleReader, StreamShorterThanASample) {
  absl::StatusOr<SampleReader> r = SampleReader::Create(Iota(3), {5, 1, 1, false, 0});
  ASSERT_TRUE(r.ok());
  std::vector<int32_t> in(5), tg(5);
  ASSERT_TRUE(r->Fill(0, 0, in.data(), tg.data()).ok());
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(tg, (std::vector<int32_t>{1, 2, 0, 1, 2}));
}

TEST(SampleReader, Deterministic) {
  for (bool shuffle : {false, true}) {
    auto tokens = Iota(1000);
    absl::StatusOr<SampleReader> a = SampleReader::Create(tokens, {16, 3, 4, shuffle, 99});
    absl::StatusOr<SampleReader> b = SampleReader::Create(tokens, {16, 3, 4, shuffle, 99});
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<int32_t> in1(48), tg1(48), in2(48), tg2(48);
    for (int64_t step : {0, 5, 123}) {
      for (int64_t j = 0; j < 4; ++j) {
        ASSERT_TRUE(a->Fill(step, j, in1.data(), tg1.data()).ok());
        // Other reads in between change nothing: the order is a function of (step, j).
        ASSERT_TRUE(a->Fill(step + 1, (j + 1) % 4, in2.data(), tg2.data()).ok());
        ASSERT_TRUE(b->Fill(step, j, in2.data(), tg2.data()).ok());
        EXPECT_EQ(in1, in2);
        EXPECT_EQ(tg1, tg2);
        // Targets are the inputs shifted by one token.
        for (int t = 0; t < 3; ++t) {
          for (int i = 0; i + 1 < 16; ++i) EXPECT_EQ(tg1[t * 16 + i], in1[t * 16 + i + 1]);
        }
      }
    }
  }
}

TEST(SampleReader, ShuffleIsAPermutationPerEpoch) {
  // N = 100, s = 7: E = ceil(100 / 7) = 15 sample starts 0, 7, ..., 98 per epoch.
  absl::StatusOr<SampleReader> r = SampleReader::Create(Iota(100), {7, 1, 1, true, 5});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->samples_per_epoch(), 15);
  std::vector<int64_t> epoch0, epoch1;
  for (int64_t k = 0; k < 15; ++k) epoch0.push_back(r->SampleStart(k));
  for (int64_t k = 15; k < 30; ++k) epoch1.push_back(r->SampleStart(k));
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 15; ++i) expected.push_back(i * 7);
  std::vector<int64_t> sorted0 = epoch0, sorted1 = epoch1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  EXPECT_EQ(sorted0, expected);
  EXPECT_EQ(sorted1, expected);
  EXPECT_NE(epoch0, expected);  // actually shuffled
  EXPECT_NE(epoch0, epoch1);    // a new order every epoch
  // Another seed, another order.
  absl::StatusOr<SampleReader> r2 = SampleReader::Create(Iota(100), {7, 1, 1, true, 6});
  std::vector<int64_t> other;
  for (int64_t k = 0; k < 15; ++k) other.push_back(r2->SampleStart(k));
  EXPECT_NE(other, epoch0);
}

TEST(PermuteIndex, BijectionForManySizes) {
  for (int64_t n : {1, 2, 3, 4, 5, 17, 64, 100, 1000, 4097}) {
    std::vector<char> hit(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = PermuteIndex(i, n, 42);
      ASSERT_GE(p, 0);
      ASSERT_LT(p, n);
      EXPECT_FALSE(hit[p]) << "n=" << n << " collision at " << p;
      hit[p] = 1;
    }
  }
}

TEST(SampleReader, RejectsBadArguments) {
  EXPECT_FALSE(SampleReader::Create(Iota(0), {4, 1, 1, false, 0}).ok());
  EXPECT_THAT(SampleReader::Create(Iota(10), {0, 1, 1, false, 0}).status().message(),
              ::testing::HasSubstr("seq_len: must be >= 1"));
  EXPECT_FALSE(SampleReader::Create(Iota(10), {4, 0, 1, false, 0}).ok());
  EXPECT_FALSE(SampleReader::Create(Iota(10), {4, 1, 0, false, 0}).ok());
  absl::StatusOr<SampleReader> r = SampleReader::Create(Iota(10), {4, 1, 2, false, 0});
  ASSERT_TRUE(r.ok());
  std::vector<int32_t> in(4), tg(4);
  EXPECT_THAT(r->Fill(0, 2, in.data(), tg.data()).message(),
              ::testing::HasSubstr("microbatch: must be in [0, 2) (got 2)"));
  EXPECT_FALSE(r->Fill(-1, 0, in.data(), tg.data()).ok());
}

}  // namespace
}  // namespace vp::data
