#include "worker/engine/vocab/partition.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vp::engine::vocab {

int64_t PaddedVocab(int64_t vocab, int world) {
  const int64_t m = 8 * static_cast<int64_t>(world);
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

absl::Status ValidateTensorShard(const char* layer, const VocabPartition& partition,
                                 const tp::TensorGroup& tensor) {
  const int t = tensor.size();
  if (partition.world % t != 0 || partition.rank % t != tensor.rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        layer, ": shard ", partition.rank, " of ", partition.world, " is not tensor rank ",
        tensor.rank(), " of ", t, " (shard pp·t + tp of p·t: the world must be a multiple of t)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateShardArgs(const char* layer, const VocabPartition& partition, int hidden,
                               const float* weight, const float* weight_grad) {
  if (hidden < 1) return absl::InvalidArgumentError(absl::StrCat("hidden ", hidden, " < 1"));
  if (partition.rows < 1 || partition.valid_rows < 0 || partition.valid_rows > partition.rows) {
    return absl::InvalidArgumentError(absl::StrCat("partition: rows ", partition.rows,
                                                   " must be >= 1 and valid_rows ",
                                                   partition.valid_rows, " in [0, rows]"));
  }
  if (weight == nullptr || weight_grad == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": weight and weight_grad must be non-null"));
  }
  return absl::OkStatus();
}

}  // namespace vp::engine::vocab
