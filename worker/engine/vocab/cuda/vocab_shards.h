// The vocabulary layers on one rank's shard, on a CUDA device: the same passes, states and
// rules as worker/engine/vocab/output_layer.h and input_layer.h (read those first), with
// E = float or bf16 weights and activations and fp32 statistics, losses, ∇X and weight
// gradients. Pointers named weight/x/root_grad are device pointers; labels and tokens are host
// arrays (the runtime's batch), uploaded by the pass.
//
// Streams: S, T, Forward and Backward (compute passes) run on `compute`; C1, C2, ForwardReduce
// and BackwardBroadcast (barriers, called from the runtime's communication thread, or from the
// compute thread with a 1-rank communicator) run their small kernels on `comm`. The
// communicator gets device pointers (NCCL, or a host-staged communicator) and is called only
// after the context's stream is idle. Every public method returns after Finish(ctx)
// (device.h), so states move between threads freely.
//
// Tensor parallelism (`tensor` of t > 1 at Create; the CPU shards' rules and messages): the
// partition is over p·t shards and a rank holds m = n/t of the microbatch's token rows. S gathers
// the group's rows, computes its shard's statistics for all n tokens and merges them over the
// tensor group (the n-sized vectors on the host: a few floats a token), keeping the merged
// statistics, A and the label rows of its own m tokens for C1; T gathers the rows and the merged
// scale again. The input layer looks up all n tokens and reduce-scatters over the group (IF),
// and gathers the m-row gradient back to n rows before its scatter-add (IB). The group's
// collectives run on the compute context (they are inside the compute passes).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/tensor_parallel/cuda/parallel_linear.h"
#include "worker/engine/vocab/output_layer.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine::cuda {

using vocab::OutputAlgorithm;

template <typename E>
class DeviceOutputLayerShard;

template <typename E>
class DeviceOutputLayerState {
 public:
  using Phase = vocab::OutputLayerState::Phase;

  DeviceOutputLayerState() = default;
  DeviceOutputLayerState(DeviceOutputLayerState&&) noexcept = default;
  DeviceOutputLayerState& operator=(DeviceOutputLayerState&&) noexcept = default;

  int n() const { return n_; }
  Phase phase() const { return phase_; }
  // Per-token losses, host copy (n), identical on every rank. Valid after C1.
  const float* losses() const { return loss_host_.data(); }
  // ∇X (n, h) fp32 on the device after C1 (Algorithm 2) or C2 (Algorithm 1); null before.
  const float* grad_input() const;
  bool grad_input_ready() const;
  void Release();
  int64_t bytes() const;  // device bytes held

 private:
  friend class DeviceOutputLayerShard<E>;

  OutputAlgorithm algorithm_ = OutputAlgorithm::kAlgorithm2;
  Phase phase_ = Phase::kNone;
  int n_ = 0;
  float d_ = 0;
  DeviceArray<int32_t> local_label_;  // (n)
  DeviceArray<E> probs_;              // (n, rows) Y → P' → grad
  DeviceArray<float> local_max_;      // (n)
  DeviceArray<float> local_sum_;      // (n)
  DeviceArray<float> label_logit_;    // (n)
  DeviceArray<float> scale_;          // (n)
  DeviceArray<float> sums_;           // (2n) C1's sum all-reduce (scale, label term)
  DeviceArray<float> loss_;           // (n)
  DeviceArray<float> grad_x_;         // (n, h)
  std::vector<float> loss_host_;      // (n)
  // Tensor parallelism (t > 1): n_ is this rank's m tokens, n_all_ the group's n (local_label_
  // and probs_ are the group's n rows); the merged shard's label test for C1 and, for
  // Algorithm 2, -d times the label's weight row of each own token; each shard's share of the
  // merged P' (host, n_all).
  int n_all_ = 0;
  DeviceArray<int32_t> c1_label_;   // (n) 0 where the group owns the label, -1 elsewhere
  DeviceArray<int32_t> no_label_;   // (n_all) all -1: VocabGradInputFix as a row scaling
  DeviceArray<float> label_rows_;   // (n, h) -d·W[label] (Algorithm 2)
  std::vector<float> group_share_;  // (n_all)
};

template <typename E>
class DeviceOutputLayerShard {
 public:
  // weight (partition.rows, h) T, weight_grad (partition.rows, h) fp32, both device.
  // partition.rows must be a multiple of 8 and h too (cuBLASLt alignment).
  static absl::StatusOr<std::unique_ptr<DeviceOutputLayerShard>> Create(
      const vocab::VocabPartition& partition, int hidden, OutputAlgorithm algorithm,
      const E* weight, float* weight_grad, const DeviceContext& compute, const DeviceContext& comm,
      engine::tp::TensorGroup tensor = {});

  absl::StatusOr<DeviceOutputLayerState<E>> S(const E* x, const int32_t* labels, int n,
                                              float d) const;
  absl::Status C1(DeviceOutputLayerState<E>& state, comm::Communicator& comm) const;
  absl::Status T(DeviceOutputLayerState<E>& state, const E* x) const;
  absl::Status C2(DeviceOutputLayerState<E>& state, comm::Communicator& comm) const;
  // No cached workspace on the device (the caching allocator already reuses the n×rows block);
  // kept for the runtime's interface.
  void ReleaseWorkspace() const {}

  const vocab::VocabPartition& partition() const { return partition_; }
  int hidden() const { return hidden_; }
  OutputAlgorithm algorithm() const { return algorithm_; }

 private:
  DeviceOutputLayerShard() = default;
  // t > 1: S's statistics of the group's t shards merged (DeviceOutputLayerShard::S).
  // labels: the group's n global labels (host); local_label: their rows in this shard, or -1.
  absl::Status MergeOverTensorGroup(DeviceOutputLayerState<E>& st, const int32_t* labels,
                                    const std::vector<int32_t>& local_label) const;
  // t > 1: whether global token `label` is a real row of this tensor group's t shards.
  bool GroupOwns(int64_t label) const;

  vocab::VocabPartition partition_;
  int hidden_ = 0;
  OutputAlgorithm algorithm_ = OutputAlgorithm::kAlgorithm2;
  const E* weight_ = nullptr;
  float* weight_grad_ = nullptr;
  DeviceContext compute_;
  DeviceContext comm_;
  engine::tp::TensorGroup tensor_;
  // The group's row exchanges on the compute context: E rows, fp32 sums.
  std::unique_ptr<tp::DeviceSequenceParallel<E>> rows_;
  std::unique_ptr<tp::DeviceSequenceParallel<float>> sums_;
};

template <typename E>
class DeviceInputLayerShard;

template <typename E>
class DeviceInputLayerState {
 public:
  DeviceInputLayerState() = default;
  DeviceInputLayerState(DeviceInputLayerState&&) noexcept = default;
  DeviceInputLayerState& operator=(DeviceInputLayerState&&) noexcept = default;

  int n() const { return n_; }
  // The embedding output (n, h), fp32 on the device (so IF_REDUCE sums in fp32): this shard's
  // rows after Forward, the full lookup after ForwardReduce. Null after ReleaseOutput.
  const float* output() const { return output_.empty() ? nullptr : output_.data(); }
  void ReleaseOutput() { output_.Reset(); }

 private:
  friend class DeviceInputLayerShard<E>;
  int n_ = 0;
  int n_all_ = 0;                // t > 1: the group's tokens (n_ = n_all_ / t this rank's)
  DeviceArray<int32_t> tokens_;  // (n_all) global ids
  DeviceArray<float> output_;    // (n, h)
  DeviceArray<E> output_grad_;   // (n, h) after BackwardBroadcast (a byte-exact copy)
};

template <typename E>
class DeviceInputLayerShard {
 public:
  // weight (partition.rows, h) T, weight_grad fp32, both device.
  static absl::StatusOr<std::unique_ptr<DeviceInputLayerShard>> Create(
      const vocab::VocabPartition& partition, int hidden, const E* weight, float* weight_grad,
      const DeviceContext& compute, const DeviceContext& comm, engine::tp::TensorGroup tensor = {});

  // IF, local part. tokens (n) host, in [0, V).
  absl::StatusOr<DeviceInputLayerState<E>> Forward(const int32_t* tokens, int n) const;
  // IF_REDUCE: fp32 sum all-reduce of the output.
  absl::Status ForwardReduce(DeviceInputLayerState<E>& state, comm::Communicator& comm) const;
  // IB_BCAST: root's root_grad (n, h) on the device (read on the root only; may be null
  // elsewhere) reaches every rank's state. Sent as bytes (E = bf16: n·h/2 "floats").
  absl::Status BackwardBroadcast(DeviceInputLayerState<E>& state, comm::Communicator& comm,
                                 int root, const E* root_grad) const;
  // IB, local part: weight_grad[row of token] += grad for tokens in this shard.
  absl::Status Backward(DeviceInputLayerState<E>& state) const;

  const vocab::VocabPartition& partition() const { return partition_; }
  int hidden() const { return hidden_; }

 private:
  DeviceInputLayerShard() = default;

  vocab::VocabPartition partition_;
  int hidden_ = 0;
  const E* weight_ = nullptr;
  float* weight_grad_ = nullptr;
  DeviceContext compute_;
  DeviceContext comm_;
  std::unique_ptr<tp::DeviceSequenceParallel<E>> rows_;      // the gradient's gather
  std::unique_ptr<tp::DeviceSequenceParallel<float>> sums_;  // the lookup's reduce-scatter
};

extern template class DeviceOutputLayerShard<float>;
extern template class DeviceOutputLayerShard<bf16>;
extern template class DeviceInputLayerShard<float>;
extern template class DeviceInputLayerShard<bf16>;

}  // namespace vp::engine::cuda
