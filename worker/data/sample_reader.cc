#include "worker/data/sample_reader.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace vp::data {
namespace {

// SplitMix64 finalizer: a cheap, well-mixing 64-bit hash.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

constexpr int kFeistelRounds = 6;

}  // namespace

int64_t PermuteIndex(int64_t i, int64_t n, uint64_t key) {
  // Domain 2^(2*half) >= n with half >= 1; at most 4n, so cycle walking takes < 4 steps on
  // average.
  int bits = 2;
  while ((int64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = static_cast<uint64_t>(i);
  do {
    uint64_t left = x >> half;
    uint64_t right = x & mask;
    for (int r = 0; r < kFeistelRounds; ++r) {
      const uint64_t f = Mix(right ^ Mix(key + static_cast<uint64_t>(r))) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

SampleReader::SampleReader(std::shared_ptr<const TokenSource> tokens, SampleOrder order)
    : tokens_(std::move(tokens)),
      order_(order),
      num_tokens_(tokens_->size()),
      samples_per_epoch_((num_tokens_ + order.seq_len - 1) / order.seq_len) {}

absl::StatusOr<SampleReader> SampleReader::Create(std::shared_ptr<const TokenSource> tokens,
                                                  SampleOrder order) {
  if (tokens == nullptr || tokens->size() < 1) {
    return absl::InvalidArgumentError("data: the token source is empty");
  }
  if (order.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len: must be >= 1 (got ", order.seq_len, ")"));
  }
  if (order.microbatch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch_size: must be >= 1 (got ", order.microbatch_size, ")"));
  }
  if (order.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatches: must be >= 1 (got ", order.microbatches, ")"));
  }
  return SampleReader(std::move(tokens), order);
}

int64_t SampleReader::SampleIndex(int64_t step, int64_t microbatch, int64_t row) const {
  return (step * order_.microbatches + microbatch) * order_.microbatch_size + row;
}

int64_t SampleReader::SampleStart(int64_t k) const {
  const __int128 s = order_.seq_len;
  if (!order_.shuffle) return static_cast<int64_t>((static_cast<__int128>(k) * s) % num_tokens_);
  const int64_t epoch = k / samples_per_epoch_;
  const int64_t i = k % samples_per_epoch_;
  const uint64_t key = order_.seed ^ (static_cast<uint64_t>(epoch) * 0xd1b54a32d192ed03ull);
  // P(i) < E = ceil(N / s), so P(i) * s < N: every start lies inside the stream.
  return PermuteIndex(i, samples_per_epoch_, key) * order_.seq_len;
}

absl::Status SampleReader::Fill(int64_t step, int64_t microbatch, int32_t* inputs,
                                int32_t* targets) const {
  if (step < 0)
    return absl::InvalidArgumentError(absl::StrCat("step: must be >= 0 (got ", step, ")"));
  if (microbatch < 0 || microbatch >= order_.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "microbatch: must be in [0, ", order_.microbatches, ") (got ", microbatch, ")"));
  }
  const int64_t s = order_.seq_len;
  std::vector<uint32_t> window(static_cast<size_t>(s + 1));  // (s + 1) tokens of one sample
  for (int64_t t = 0; t < order_.microbatch_size; ++t) {
    // Read s + 1 tokens from start, wrapping at the end of the stream (possibly several times
    // when the stream is shorter than a sample).
    int64_t pos = SampleStart(SampleIndex(step, microbatch, t));
    int64_t filled = 0;
    while (filled < s + 1) {
      const int64_t len = std::min(s + 1 - filled, num_tokens_ - pos);
      if (absl::Status st = tokens_->Read(pos, len, window.data() + filled); !st.ok()) return st;
      filled += len;
      pos = 0;
    }
    int32_t* in = inputs + t * s;   // (s)
    int32_t* tg = targets + t * s;  // (s)
    for (int64_t i = 0; i < s; ++i) {
      in[i] = static_cast<int32_t>(window[static_cast<size_t>(i)]);
      tg[i] = static_cast<int32_t>(window[static_cast<size_t>(i + 1)]);
    }
  }
  return absl::OkStatus();
}

}  // namespace vp::data
