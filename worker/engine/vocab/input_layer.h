// The input embedding on one rank's vocabulary shard (docs/vocab-parallel-math.md §3).
//
//   IF local   : out (n, h) = rows of E_r for tokens in this shard, zero rows elsewhere
//   IF_REDUCE  : sum all-reduce of out; exactly one rank contributes each token's row, so the
//                sum is the plain embedding lookup, on every rank (stage 0 consumes it)
//   IB_BCAST   : broadcast of dL/d(out) (n, h) from the rank that ran the first layer group's B
//   IB local   : scatter-add of that gradient into the shard's gradient rows
//
// Tensor parallelism (docs/tensor-parallel.md): shard pp·t + tp of p·t, and each rank holds m =
// n/t of the token rows. IF looks up all n tokens in the shard and reduce-scatters over the
// tensor group, so IF_REDUCE sums the pipeline's shards of the rank's own m rows only; IB gathers
// the m-row gradient of the group back to n rows before its scatter-add.
//
// Like OutputLayerShard, the shard points at rows it does not own; with tied embeddings both
// shards of a rank point at the same weight and gradient rows, so IB and the output layer's T
// accumulate into one buffer (and must run on the same thread).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/memory.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine::vocab {

class InputLayerState {
 public:
  InputLayerState() = default;
  InputLayerState(InputLayerState&&) noexcept = default;
  InputLayerState& operator=(InputLayerState&&) noexcept = default;

  // The token rows this rank holds: n at t = 1, m = n/t under tensor parallelism.
  int n() const { return n_; }
  // The embedding output (n(), h): this shard's (group's) rows after Forward, the full lookup
  // after ForwardReduce. Null after ReleaseOutput.
  const float* output() const { return output_.data(); }
  float* mutable_output() { return output_.data(); }
  // The broadcast gradient (n(), h), valid between BackwardBroadcast and Backward.
  const float* output_grad() const { return output_grad_.data(); }
  // Frees the embedding output once the first layer group no longer needs it.
  void ReleaseOutput() { output_ = Buffer(); }

 private:
  friend class InputLayerShard;
  int n_ = 0;                         // this rank's rows
  int n_all_ = 0;                     // the group's rows (n_ · t)
  std::vector<int32_t> local_token_;  // (n_all) row in this shard, -1 where not local
  Buffer output_;                     // (n, h)
  Buffer output_grad_;                // (n, h)
};

class InputLayerShard {
 public:
  // weight, weight_grad: (partition.rows, hidden) row-major. tracker may be null.
  // tensor: the tensor group (default none), used by Forward and Backward (compute passes).
  static absl::StatusOr<InputLayerShard> Create(const VocabPartition& partition, int hidden,
                                                const float* weight, float* weight_grad,
                                                MemoryTracker* tracker,
                                                tp::TensorGroup tensor = {});

  // IF, local part. tokens (n) in [0, V): all the group's rows (each rank passes all n).
  absl::StatusOr<InputLayerState> Forward(const int32_t* tokens, int n) const;
  // IF_REDUCE: sum all-reduce of the output over all ranks.
  absl::Status ForwardReduce(InputLayerState& state, comm::Communicator& comm) const;
  // IB_BCAST: root's root_grad (n, h) reaches every rank's state. root_grad is read on the
  // root only (may be null elsewhere).
  absl::Status BackwardBroadcast(InputLayerState& state, comm::Communicator& comm, int root,
                                 const float* root_grad) const;
  // IB, local part: weight_grad[row of token] += grad for tokens in this shard; frees the
  // gradient buffer.
  absl::Status Backward(InputLayerState& state) const;

  const VocabPartition& partition() const { return partition_; }
  int hidden() const { return hidden_; }

 private:
  InputLayerShard(const VocabPartition& partition, int hidden, const float* weight,
                  float* weight_grad, MemoryTracker* tracker, tp::TensorGroup tensor)
      : partition_(partition),
        hidden_(hidden),
        weight_(weight),
        weight_grad_(weight_grad),
        tracker_(tracker),
        sp_(tensor, /*pool=*/nullptr) {}

  VocabPartition partition_;
  int hidden_;
  const float* weight_;  // (rows, h)
  float* weight_grad_;   // (rows, h)
  MemoryTracker* tracker_;
  // The tensor group's row exchanges (into the shard's own buffers: no pool).
  tp::SequenceParallel sp_;
};

}  // namespace vp::engine::vocab
