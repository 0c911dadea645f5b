#include "worker/engine/vocab/partition.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vp::engine::vocab {

int64_t PaddedVocab(int64_t vocab, int world) {
  const int64_t m = 2 * static_cast<int64_t>(world);
  return (vocab + m - 1) / m * m;
}

absl::StatusOr<VocabPartition> MakeVocabPartition(int64_t vocab, int world, int rank) {
  if (vocab < 1) return absl::InvalidArgumentError(absl::StrCat("vocab ", vocab, " < 1"));
  if (world < 1) return absl::InvalidArgumentError(absl::StrCat("world ", world, " < 1"));
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside [0, world ", world, ")"));
  }
  VocabPartition p;
  p.vocab = vocab;
  p.padded_vocab = PaddedVocab(vocab, world);
  p.world = world;
  p.rank = rank;
  p.rows = p.padded_vocab / world;
  p.begin = rank * p.rows;
  p.valid_rows = std::clamp<int64_t>(vocab - p.begin, 0, p.rows);
  return p;
}

}  // namespace vp::engine::vocab
