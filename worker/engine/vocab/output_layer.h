// The output layer (lm head + softmax cross-entropy) on one rank's vocabulary shard, split into
// the paper's passes so a pipeline runtime can interleave them with transformer passes:
//
//   S  (compute)  logits of the shard, local max/sum, P' kept in place        (n × rows)
//   C1 (barrier)  all-reduce max and sums → per-token loss on every rank;
//                 Algorithm 2 also all-reduces ∇X here
//   T  (compute)  softmax − onehot, ∇W_r += gradᵀ X; Algorithm 1 also ∇X' = grad W_r
//   C2 (barrier)  Algorithm 1 only: all-reduce sum of ∇X'
//
// The shard does not own weights: it points at rows [begin, begin+rows) of the model's flat
// buffers, laid out like Hugging Face lm_head.weight / wte (row t = token t, h floats). With
// tied embeddings the InputLayerShard of the same rank points at the same rows.
//
// Everything a microbatch needs between passes lives in an OutputLayerState, so several
// microbatches can be in flight and C1/C2 can run on a communication thread (with its own
// Communicator) while the compute thread runs S/T of another microbatch. All shard methods are
// const; T writes the gradient rows, so T calls (and the input layer's backward when tied) must
// be serialised by the caller — they are compute passes on one thread.
//
// Math and shapes: docs/vocab-parallel-math.md.
//
// Tensor parallelism (docs/tensor-parallel.md): the vocabulary is cut into p·t shards, shard
// v = pp·t + tp on pipeline rank pp, tensor rank tp, and each rank holds m = n/t of the
// microbatch's n token rows (sequence parallelism). S gathers the group's rows, computes its
// shard's statistics for all n tokens and merges them over the tensor group, so that each rank
// leaves S with the statistics of the group's t shards taken together (one shard t times wider)
// for its own m tokens: C1 and C2 then run over the pipeline unchanged, on m tokens instead of
// n. T gathers the rows and the merged scale again. With t = 1 nothing is exchanged in S or T.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/memory.h"
#include "worker/engine/tensor_parallel/parallel_linear.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine::vocab {

// Algorithm 1: two barriers (C1 after S, C2 after T); ∇X comes from T.
// Algorithm 2: one barrier (C1); ∇X is formed in S/C1 from A = P'·W_r and the label rows.
enum class OutputAlgorithm { kAlgorithm1, kAlgorithm2 };

// The host arithmetic of a tensor group's merge of its t shards' S statistics (the CPU and the
// device shards' MergeOverTensorGroup). GroupShareTerms, per token i of n: delta = m'_i − M_i (M
// the group's max; −inf for an all-padding shard, whose terms are then exactly 0),
// share[i] = s'_i·exp(delta), sums[i] = share[i] and sums[n + i] = z'_i + delta where the label is
// in this shard (local_label[i] >= 0), else 0. After sums is summed over the group,
// NormalizeGroupShares divides share[i] by sums[i] (0 where the whole group is padding).
void GroupShareTerms(int n,
                     const float* local_max,      // (n) m'
                     const float* group_max,      // (n) M
                     const float* local_sum,      // (n) s'
                     const float* label_logit,    // (n) z'
                     const int32_t* local_label,  // (n)
                     float* share,                // (n) out
                     float* sums);                // (2n) out
void NormalizeGroupShares(int n, const float* group_sums /* (>= n) */, float* share /* (n) */);

class OutputLayerState {
 public:
  enum class Phase { kNone, kS, kC1, kT, kC2 };

  OutputLayerState() = default;
  OutputLayerState(OutputLayerState&&) noexcept = default;
  OutputLayerState& operator=(OutputLayerState&&) noexcept = default;

  // The tokens whose loss and input gradient this rank holds: n at t = 1, its m = n/t rows
  // under tensor parallelism.
  int n() const { return n_; }
  // The last pass completed on this state.
  Phase phase() const { return phase_; }
  // Per-token loss log s + m − y_label, identical on every rank of the pipeline group. Valid
  // after C1.
  const float* losses() const { return loss_.data(); }  // (n())
  // ∇X of the loss w.r.t. the output-layer input (n(), h), identical on every rank of the
  // pipeline group: after C1 (Algorithm 2) or C2 (Algorithm 1). Null before.
  const float* grad_input() const { return grad_input_ready() ? grad_x_.data() : nullptr; }
  bool grad_input_ready() const;
  // Frees every buffer (losses and ∇X too). T already frees the n×rows buffer.
  void Release();
  // Bytes currently held (all charged to kActivations).
  int64_t bytes() const;

 private:
  friend class OutputLayerShard;

  // Letters: n_all the rows S computes logits for (all the group's tokens), n = n_all / t this
  // rank's tokens (n_all = n at t = 1).
  OutputAlgorithm algorithm_ = OutputAlgorithm::kAlgorithm2;
  Phase phase_ = Phase::kNone;
  int n_ = 0;
  int n_all_ = 0;
  float d_ = 0;                       // loss gradient per token
  std::vector<int32_t> local_label_;  // (n_all) label row in this shard, -1 where not local
  std::vector<uint8_t> label_here_;   // (n) the label is in this shard (t = 1) / group (t > 1)
  Buffer probs_;        // (n_all, rows): Y, then P' = exp(Y − m')/s', then grad; 0 on padding
  Buffer group_share_;  // t > 1: (n_all) s'·exp(m' − M)/S, this shard's part of the group's P'
  Buffer local_max_;    // (n) m', -inf for an all-padding shard (t > 1: the group's M)
  Buffer local_sum_;    // (n) s', 0 for an all-padding shard (t > 1: the group's S)
  Buffer label_logit_;  // (n) y_label − m' where the label is here, else 0
  Buffer scale_;        // (n) after C1: s'·exp(m' − m) / s, the factor turning P' into softmax
  Buffer loss_;         // (n) after C1
  Buffer grad_x_;       // (n, h): A then ∇X (Algorithm 2), ∇X' then ∇X (Algorithm 1)
  Buffer label_rows_;   // t > 1, Algorithm 2: (n, h) the label's weight row, from its shard
};

class OutputLayerShard {
 public:
  // weight, weight_grad: (partition.rows, hidden) row-major, rows >= partition.valid_rows are
  // padding (zero weights; their gradients are never written). tracker may be null.
  // tensor: the tensor group (default: none); then the partition is over p·t shards and this is
  // shard pp·t + tensor.rank(). Its communicator is used by S and T only (the compute thread).
  static absl::StatusOr<OutputLayerShard> Create(const VocabPartition& partition, int hidden,
                                                 OutputAlgorithm algorithm, const float* weight,
                                                 float* weight_grad, MemoryTracker* tracker,
                                                 tp::TensorGroup tensor = {});

  // S pass. x (n/t, h): this rank's rows of the last transformer output (after the final norm)
  // for the group's n tokens (all of them at t = 1); labels (n): the next-token ids of all n
  // rows, in [0, V); d: loss gradient per token (1/tokens of the global batch for a mean loss).
  // Copies the labels; x is not kept (T takes it again).
  absl::StatusOr<OutputLayerState> S(const float* x, const int32_t* labels, int n, float d) const;
  // Barrier C1 (collectives only on n-sized vectors; Algorithm 2 adds one n×h all-reduce).
  absl::Status C1(OutputLayerState& state, comm::Communicator& comm) const;
  // T pass. x (n/t, h): the same input as in S. Accumulates into the gradient rows.
  absl::Status T(OutputLayerState& state, const float* x) const;
  // Barrier C2, Algorithm 1 only (an error for Algorithm 2, whose ∇X is final after C1).
  absl::Status C2(OutputLayerState& state, comm::Communicator& comm) const;

  const VocabPartition& partition() const { return partition_; }
  int hidden() const { return hidden_; }
  OutputAlgorithm algorithm() const { return algorithm_; }

  // T hands its n×rows buffer back to the shard and the next S of the same (or smaller) n
  // reuses it: a fresh 100+ MB buffer costs a page fault per 4 KiB and a memset, which
  // measured ~40% of S+T time. The spare stays charged to kActivations (it is held memory;
  // with T(i) just before S(i+1) it does not raise the peak). Drop it at the end of a step.
  void ReleaseWorkspace() const;

 private:
  OutputLayerShard(const VocabPartition& partition, int hidden, OutputAlgorithm algorithm,
                   const float* weight, float* weight_grad, MemoryTracker* tracker,
                   tp::TensorGroup tensor)
      : partition_(partition),
        hidden_(hidden),
        algorithm_(algorithm),
        weight_(weight),
        weight_grad_(weight_grad),
        tracker_(tracker),
        sp_(tensor, /*pool=*/nullptr),
        spare_(std::make_unique<Spare>()) {}

  // t > 1: merges the shard statistics of S over the tensor group (OutputLayerShard::S).
  absl::Status MergeOverTensorGroup(OutputLayerState& st) const;
  // t > 1: whether global token `label` is a real row of this tensor group's t shards.
  bool GroupOwns(int64_t label) const;

  // Takes the spare n×rows buffer if it holds at least `count` floats, else a fresh one.
  Buffer TakeWorkspace(size_t count) const;

  // Shared by S (compute thread) and T; a mutex because S/T of different microbatches may be
  // called from different threads. Heap-held so the shard stays movable.
  struct Spare {
    std::mutex mu;
    Buffer buffer;  // padding columns are zero: nothing ever writes them
  };

  VocabPartition partition_;
  int hidden_;
  OutputAlgorithm algorithm_;
  const float* weight_;  // (rows, h)
  float* weight_grad_;   // (rows, h)
  MemoryTracker* tracker_;
  // The tensor group's row exchanges (into the shard's own buffers: no pool).
  tp::SequenceParallel sp_;
  std::unique_ptr<Spare> spare_;
};

}  // namespace vp::engine::vocab
