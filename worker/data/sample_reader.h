// Sample order: which tokens make up microbatch j of optimizer step `step`.
//
// Sample k (k = (step * m + j) * b + t for row t of microbatch j, m microbatches of b rows)
// is s + 1 consecutive tokens starting at start(k), wrapping from the end of the token
// stream to its beginning; inputs are the first s, targets the last s (next-token labels).
//   shuffle = false: start(k) = (k * s) mod N.
//   shuffle = true:  the stream is cut into E = ceil(N / s) sample starts i * s per epoch;
//                    epoch e = k / E uses a pseudo-random permutation P_e of [0, E), seeded
//                    by (seed, e), and start(k) = P_e(k mod E) * s.
// The permutation is a keyed Feistel network with cycle walking (docs/formats.md), so it
// costs no memory and any sample can be computed on its own. The order is a pure function
// of (step, j): every pipeline rank reads the same microbatch, and a resumed run reads what
// the uninterrupted one would have.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/data/token_file.h"

namespace vp::data {

struct SampleOrder {
  int64_t seq_len = 1;          // s
  int64_t microbatch_size = 1;  // b
  int64_t microbatches = 1;     // m, per optimizer step
  bool shuffle = false;
  uint64_t seed = 0;  // train.seed
};

class SampleReader {
 public:
  // Fails when a size is < 1 or the source holds no tokens.
  static absl::StatusOr<SampleReader> Create(std::shared_ptr<const TokenSource> tokens,
                                             SampleOrder order);

  // Fills row t = 0..b-1 with sample (step * m + j) * b + t.
  absl::Status Fill(int64_t step, int64_t microbatch,
                    int32_t* inputs,          // (b, s)
                    int32_t* targets) const;  // (b, s)

  // Global index of row t of microbatch j at `step`.
  int64_t SampleIndex(int64_t step, int64_t microbatch, int64_t row) const;
  // First token of sample k, in [0, N).
  int64_t SampleStart(int64_t k) const;
  // Sample starts per epoch when shuffling: ceil(N / s).
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  const SampleOrder& order() const { return order_; }

 private:
  SampleReader(std::shared_ptr<const TokenSource> tokens, SampleOrder order);

  std::shared_ptr<const TokenSource> tokens_;
  SampleOrder order_;
  int64_t num_tokens_;
  int64_t samples_per_epoch_;
};

// A keyed pseudo-random permutation of [0, n) (n >= 1): a 6-round Feistel network on the
// smallest even-bit power of two >= n, cycle-walked back into range. Exposed for tests.
int64_t PermuteIndex(int64_t i, int64_t n, uint64_t key);

}  // namespace vp::data
