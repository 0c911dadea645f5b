// One pipeline rank's model on a CUDA device: the device twin of engine::RankModel plus its
// AdamW state.
//
// The tensor table, initialisation and checkpoint I/O stay on the host: the model keeps a host
// engine::RankModel (not charged to the tracker) with the same flat layout, and copies between
// the two on Upload()/Download(). On the device:
//   master   fp32 (param_count)  AdamW's master weights           kOptimizer (T = bf16 only)
//   params   T    (param_count)  what the passes read             kParameters
//   grads    fp32 (param_count)  accumulated over a step          kGradients
//   m, v     fp32 (shard)        AdamW moments                    kOptimizer
//   decay    u8   (shard)        1 where weight decay applies     kOptimizer
// With T = float the passes read the master weights directly (no separate copy).
//
// ZeRO-1 (a ZeroShard of parts > 1): the AdamW state covers only this replica's range
// comm::RangeOf(param_count, parts, index) of the flat buffer — the host AdamW is a shard of
// the same range, so checkpoints save it as on the CPU.
//
// Tensor parallelism (a TensorGroup of t > 1): the host mirror is the tensor rank's slices
// (RankModel with the group), the layer stacks and vocabulary shards run the group's
// collectives inside their passes (their communicator takes device pointers). OptimizerStep updates
// the range's master weights (and their T copy); GatherParams then all-gathers the fp32 master
// weights over the data group and refreshes the whole T copy. Without ZeRO the shard is the whole
// buffer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/transformer/cuda/transformer.h"
#include "worker/engine/vocab/cuda/vocab_shards.h"

namespace vp::comm {
class Communicator;
}  // namespace vp::comm

namespace vp::engine::cuda {

// Which part of the flat buffer this rank's optimizer state covers: part `index` of `parts`
// (ZeRO-1 over `parts` data-parallel replicas), or the whole buffer (parts = 1).
struct ZeroShard {
  int parts = 1;
  int index = 0;
};

template <typename T>
class DeviceRankModel {
 public:
  // compute: the compute thread's context (stacks, S/T, IF/IB, optimizer); comm: the
  // communication thread's (vocabulary barriers). hidden and ffn_hidden must be multiples of 8.
  static absl::StatusOr<std::unique_ptr<DeviceRankModel>> Create(
      const ModelConfig& cfg, const RankLayout& layout, int microbatch_size,
      std::vector<int> seq_bounds, vocab::OutputAlgorithm algorithm, const AdamWConfig& adamw,
      const DeviceContext& compute, const DeviceContext& comm, ZeroShard zero = {},
      engine::tp::TensorGroup tensor = {});

  // Host view: tensor table, Init, checkpoints. Valid after Download(); Upload() after changing.
  RankModel& host() { return *host_; }
  AdamW& host_optimizer() { return *host_opt_; }
  // Host → device: parameters (master and T copy) and AdamW state (m, v, step).
  absl::Status Upload();
  // Device → host: master parameters and AdamW state.
  absl::Status Download();

  // The runtime's interface (the CPU RankModel's names).
  const ModelConfig& config() const { return cfg_; }
  int num_chunks() const { return static_cast<int>(stacks_.size()); }
  DeviceLayerStack<T>& stack(int chunk) { return *stacks_[chunk]; }
  bool has_input_layer() const { return input_ != nullptr; }
  bool has_output_layer() const { return output_ != nullptr; }
  DeviceInputLayerShard<T>& input_layer() { return *input_; }
  DeviceOutputLayerShard<T>& output_layer() { return *output_; }
  size_t param_count() const { return count_; }
  float* grads() const { return grads_.data(); }                   // (param_count) fp32
  const T* wpe() const { return Params() + wpe_offset_; }          // (s, h)
  float* wpe_grad() const { return grads_.data() + wpe_offset_; }  // (s, h)
  const T* lnf_weight() const { return Params() + lnf_offset_; }   // (h)
  const T* lnf_bias() const { return Params() + lnf_offset_ + cfg_.hidden; }
  float* lnf_weight_grad() const { return grads_.data() + lnf_offset_; }
  float* lnf_bias_grad() const { return grads_.data() + lnf_offset_ + cfg_.hidden; }

  absl::Status ZeroGrads();
  // Σ g² over grads[offset, offset+count) in fp64 (synchronises the compute stream).
  absl::StatusOr<double> SquaredNorm(size_t offset, size_t count);
  // One AdamW step (the host optimizer's step count and config) on the master weights, then
  // the T copy refreshed. grad_scale: clipping.
  absl::Status OptimizerStep(float lr, float grad_scale);
  // ZeRO-1's parameter gather: every replica's range of the fp32 master weights over `data`
  // (device pointers; the compute stream must be idle, as OptimizerStep leaves it), then the T
  // copy of the whole buffer refreshed. Nothing to do without a shard.
  absl::Status GatherParams(comm::Communicator& data);
  // Tensor parallelism: the replicated tensors' gradients (norms, row-parallel biases, the
  // position table, replicated key/value heads) summed over the tensor group, once a step before
  // OPT (each rank computed them from its own token rows). Nothing to do without a group.
  absl::Status SumReplicatedGrads();
  size_t shard_begin() const { return shard_begin_; }
  size_t shard_count() const { return shard_count_; }

 private:
  DeviceRankModel() = default;
  T* Params() const;

  ModelConfig cfg_;
  DeviceContext compute_;
  std::unique_ptr<RankModel> host_;
  std::unique_ptr<AdamW> host_opt_;
  size_t count_ = 0;
  engine::tp::TensorGroup tensor_;
  size_t shard_begin_ = 0;  // the optimizer state's range of the flat buffer
  size_t shard_count_ = 0;
  size_t wpe_offset_ = 0;
  size_t lnf_offset_ = 0;
  DeviceArray<float> master_;  // fp32 weights (the parameters themselves when T = float)
  DeviceArray<T> params_;      // T = bf16 only
  DeviceArray<float> grads_;
  DeviceArray<float> m_, v_;
  DeviceArray<uint8_t> decay_;
  DeviceArray<double> norm_partials_;
  std::vector<std::unique_ptr<DeviceLayerStack<T>>> stacks_;
  std::unique_ptr<DeviceInputLayerShard<T>> input_;
  std::unique_ptr<DeviceOutputLayerShard<T>> output_;
};

extern template class DeviceRankModel<float>;
extern template class DeviceRankModel<bf16>;

}  // namespace vp::engine::cuda
