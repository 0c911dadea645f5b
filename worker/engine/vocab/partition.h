// How the vocabulary is split across the p ranks of the pipeline (docs/vocab-parallel-math.md §1),
// or across the p·t ranks of pipeline × tensor (world = p·t, docs/tensor-parallel.md).
//
// V is padded up to Vp, the next multiple of 8p (the paper pads to a multiple of 2p so shards
// stay even under V-shape placements; 8p also keeps every shard's row count a multiple of 8,
// which cuBLASLt's 16-byte alignment needs for bf16 rows on a GPU); rank r owns rows [r·Vp/p,
// (r+1)·Vp/p) of both the input embedding and the output weight. Rows >= V are padding: they hold
// zero weights, never enter the softmax (not in the max, not in the sum) and keep zero gradients.
// With a small V and a large p a whole shard can be padding.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "worker/engine/tensor_parallel/parallel_linear.h"

namespace vp::engine::vocab {

struct VocabPartition {
  int64_t vocab = 0;         // V, the real vocabulary size
  int64_t padded_vocab = 0;  // Vp: V rounded up to a multiple of 8p
  int world = 1;             // p
  int rank = 0;              // r
  int64_t rows = 0;          // Vp / p, rows held by every shard (padding included)
  int64_t begin = 0;         // first global row (token id) of this shard: r·Vp/p
  int64_t valid_rows = 0;    // rows of this shard below V; 0 for an all-padding shard

  // True if global token id `token` is a real row of this shard.
  bool Owns(int64_t token) const { return token >= begin && token < begin + valid_rows; }
};

// Vp: V rounded up to a multiple of 8·world.
int64_t PaddedVocab(int64_t vocab, int world);

// The shard of `rank` among `world` ranks. Errors name the argument and the rule broken.
absl::StatusOr<VocabPartition> MakeVocabPartition(int64_t vocab, int world, int rank);

// Under tensor parallelism the partition is over p·t shards and shard v = pp·t + tp sits on
// pipeline rank pp, tensor rank tp: checks that world is a multiple of t and rank % t is the
// tensor rank.
absl::Status ValidateTensorShard(const char* layer, const VocabPartition& partition,
                                 const tp::TensorGroup& tensor);

// Checks the arguments every shard constructor takes; `layer` names the shard in the error.
absl::Status ValidateShardArgs(const char* layer, const VocabPartition& partition, int hidden,
                               const float* weight, const float* weight_grad);

}  // namespace vp::engine::vocab
