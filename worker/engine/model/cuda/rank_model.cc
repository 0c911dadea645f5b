#include "worker/engine/model/cuda/rank_model.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/model/cuda/model_kernels.h"
#include "worker/engine/transformer/transformer.h"

namespace vp::engine::cuda {

template <typename T>
T* DeviceRankModel<T>::Params() const {
  if constexpr (std::is_same_v<T, float>) {
    return master_.data();
  } else {
    return params_.data();
  }
}

template <typename T>
absl::StatusOr<std::unique_ptr<DeviceRankModel<T>>> DeviceRankModel<T>::Create(
    const ModelConfig& cfg, const RankLayout& layout, int microbatch_size,
    std::vector<int> seq_bounds, vocab::OutputAlgorithm algorithm, const AdamWConfig& adamw,
    const DeviceContext& compute, const DeviceContext& comm, ZeroShard zero,
    engine::tp::TensorGroup tensor) {
  if (zero.parts < 1 || zero.index < 0 || zero.index >= zero.parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("device model: ZeRO shard ", zero.index, " must be in [0, ", zero.parts, ")"));
  }
  if (cfg.hidden % 8 != 0 || cfg.ffn_hidden % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.hidden (", cfg.hidden, ") and ffn_hidden (", cfg.ffn_hidden,
        ") must be multiples of 8 on a CUDA device (cuBLASLt needs 16-byte aligned rows)"));
  }
  if (compute.alloc == nullptr || compute.gemm == nullptr || comm.alloc == nullptr) {
    return absl::InvalidArgumentError("device contexts: allocator and GEMM runner required");
  }
  std::unique_ptr<DeviceRankModel> m(new DeviceRankModel());
  m->cfg_ = cfg;
  m->compute_ = compute;
  m->tensor_ = tensor;
  // The host mirror: layout, tensor table, initialisation; null tracker (host memory is not
  // what this rank reports).
  auto host =
      RankModel::Create(cfg, layout, microbatch_size, seq_bounds, algorithm, nullptr, tensor);
  if (!host.ok()) return host.status();
  m->host_ = std::move(*host);
  const RankModel& h = *m->host_;
  m->count_ = h.param_count();
  const comm::ShardRange shard = comm::RangeOf(m->count_, zero.parts, zero.index);
  m->shard_begin_ = shard.begin;
  m->shard_count_ = shard.count;
  auto opt =
      AdamW::CreateShard(nullptr, m->count_, adamw, h.DecayRanges(), shard.begin, shard.count);
  if (!opt.ok()) return opt.status();
  m->host_opt_ = std::make_unique<AdamW>(std::move(*opt));
  if (layout.holds_first_group) m->wpe_offset_ = static_cast<size_t>(h.wpe() - h.params());
  if (layout.holds_last_group) m->lnf_offset_ = static_cast<size_t>(h.lnf_weight() - h.params());

  const size_t n = m->count_;
  auto master = DeviceArray<float>::Create(
      compute, std::is_same_v<T, float> ? MemoryCategory::kParameters : MemoryCategory::kOptimizer,
      n);
  if (!master.ok()) return master.status();
  m->master_ = std::move(*master);
  if constexpr (!std::is_same_v<T, float>) {
    auto params = DeviceArray<T>::Create(compute, MemoryCategory::kParameters, n);
    if (!params.ok()) return params.status();
    m->params_ = std::move(*params);
  }
  const size_t ns = shard.count;  // the optimizer state's length
  for (auto [arr, cat, len] : {std::tuple{&m->grads_, MemoryCategory::kGradients, n},
                               std::tuple{&m->m_, MemoryCategory::kOptimizer, ns},
                               std::tuple{&m->v_, MemoryCategory::kOptimizer, ns}}) {
    auto a = DeviceArray<float>::Create(compute, cat, len);
    if (!a.ok()) return a.status();
    *arr = std::move(*a);
  }
  auto decay = DeviceArray<uint8_t>::Create(compute, MemoryCategory::kOptimizer, ns);
  if (!decay.ok()) return decay.status();
  m->decay_ = std::move(*decay);
  {
    // The decayed ranges' parts inside the shard, shard-relative.
    std::vector<uint8_t> mask(ns, 0);
    const size_t lo_shard = shard.begin, hi_shard = shard.end();
    for (const DecayRange& r : h.DecayRanges()) {
      const size_t lo = std::max(r.offset, lo_shard), hi = std::min(r.offset + r.count, hi_shard);
      if (r.weight_decay && lo < hi) {
        std::fill(mask.begin() + (lo - lo_shard), mask.begin() + (hi - lo_shard), uint8_t{1});
      }
    }
    VP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(m->decay_.data(), mask.data(), ns, cudaMemcpyHostToDevice, compute.stream));
    // The mask's host memory goes away at scope exit.
    if (auto st = Finish(compute); !st.ok()) return st;
  }
  auto partials =
      DeviceArray<double>::Create(compute, MemoryCategory::kOptimizer, kSquaredNormBlocks);
  if (!partials.ok()) return partials.status();
  m->norm_partials_ = std::move(*partials);

  // Layer stacks and shards over the device arrays, at the host layout's offsets.
  const std::string first_tensor = LayerTensorSpecs(cfg)[0].name;
  for (const RankLayout::Chunk& c : layout.chunks) {
    const ParamTensor* t = h.Find(LayerTensorName(cfg, c.first_layer, first_tensor));
    if (t == nullptr) return absl::InternalError("device model: layer tensor missing");
    auto stack = DeviceLayerStack<T>::Create(cfg, c.first_layer, c.count, microbatch_size,
                                             seq_bounds, m->Params() + t->offset,
                                             m->grads_.data() + t->offset, compute, tensor);
    if (!stack.ok()) return stack.status();
    m->stacks_.push_back(std::move(*stack));
  }
  if (const ParamTensor* wte = h.Find(EmbeddingTensorName(cfg)); wte != nullptr) {
    auto in =
        DeviceInputLayerShard<T>::Create(h.partition(), cfg.hidden, m->Params() + wte->offset,
                                         m->grads_.data() + wte->offset, compute, comm, tensor);
    if (!in.ok()) return in.status();
    m->input_ = std::move(*in);
  }
  if (h.has_output_layer()) {
    const ParamTensor* w = h.Find("lm_head.weight");
    if (w == nullptr) w = h.Find(EmbeddingTensorName(cfg));  // tied, same rank
    if (w == nullptr) return absl::InternalError("device model: output weight missing");
    auto out = DeviceOutputLayerShard<T>::Create(
        h.partition(), cfg.hidden, algorithm, m->Params() + w->offset, m->grads_.data() + w->offset,
        compute, comm, tensor);
    if (!out.ok()) return out.status();
    m->output_ = std::move(*out);
  }
  return m;
}

template <typename T>
absl::Status DeviceRankModel<T>::Upload() {
  const size_t bytes = count_ * sizeof(float);
  const size_t state_bytes = shard_count_ * sizeof(float);  // m, v: the shard's
  const cudaStream_t s = compute_.stream;
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(master_.data(), host_->params(), bytes, cudaMemcpyHostToDevice, s));
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m_.data(), host_opt_->m().data(), state_bytes, cudaMemcpyHostToDevice, s));
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(v_.data(), host_opt_->v().data(), state_bytes, cudaMemcpyHostToDevice, s));
  if constexpr (!std::is_same_v<T, float>) {
    VP_CUDA_RETURN_IF_ERROR(
        FloatToBf16(params_.data(), master_.data(), static_cast<long>(count_), s));
  }
  return Finish(compute_);  // the host buffers must not change before the copies land
}

template <typename T>
absl::Status DeviceRankModel<T>::Download() {
  const size_t bytes = count_ * sizeof(float);
  const size_t state_bytes = shard_count_ * sizeof(float);
  const cudaStream_t s = compute_.stream;
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_->params(), master_.data(), bytes, cudaMemcpyDeviceToHost, s));
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_opt_->m().data(), m_.data(), state_bytes, cudaMemcpyDeviceToHost, s));
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host_opt_->v().data(), v_.data(), state_bytes, cudaMemcpyDeviceToHost, s));
  return Finish(compute_);
}

template <typename T>
absl::Status DeviceRankModel<T>::ZeroGrads() {
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(grads_.data(), 0, count_ * sizeof(float), compute_.stream));
  return Finish(compute_);
}

template <typename T>
absl::StatusOr<double> DeviceRankModel<T>::SquaredNorm(size_t offset, size_t count) {
  VP_CUDA_RETURN_IF_ERROR(
      SquaredNormPartials(norm_partials_.data(), grads_.data() + offset, count, compute_.stream));
  std::vector<double> partial(kSquaredNormBlocks);
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(partial.data(), norm_partials_.data(),
                                          sizeof(double) * partial.size(), cudaMemcpyDeviceToHost,
                                          compute_.stream));
  if (auto st = Finish(compute_); !st.ok()) return st;
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

template <typename T>
absl::Status DeviceRankModel<T>::OptimizerStep(float lr, float grad_scale) {
  AdamW& opt = *host_opt_;
  opt.set_step(opt.step() + 1);
  const AdamWConfig& c = opt.config();
  AdamWParams p;
  p.lr = lr;
  p.beta1 = c.beta1;
  p.beta2 = c.beta2;
  p.eps = c.eps;
  p.weight_decay = c.weight_decay;
  p.grad_scale = grad_scale;
  // Bias corrections in double, as the CPU optimizer computes them.
  p.bc1 = 1.0 - std::pow(static_cast<double>(c.beta1), static_cast<double>(opt.step()));
  p.bc2 = 1.0 - std::pow(static_cast<double>(c.beta2), static_cast<double>(opt.step()));
  // The shard's elements only (the whole buffer without ZeRO-1); m, v and decay are the shard's.
  bf16* copy = nullptr;
  if constexpr (!std::is_same_v<T, float>) copy = params_.data() + shard_begin_;
  VP_CUDA_RETURN_IF_ERROR(AdamWStep(master_.data() + shard_begin_, copy,
                                    grads_.data() + shard_begin_, m_.data(), v_.data(),
                                    decay_.data(), shard_count_, p, compute_.stream));
  return Finish(compute_);
}

template <typename T>
absl::Status DeviceRankModel<T>::GatherParams(comm::Communicator& data) {
  if (shard_count_ == count_) return absl::OkStatus();
  if (auto st = Finish(compute_); !st.ok()) return st;
  if (auto st = data.AllGather(master_.data(), count_); !st.ok()) return st;
  if constexpr (!std::is_same_v<T, float>) {
    VP_CUDA_RETURN_IF_ERROR(
        FloatToBf16(params_.data(), master_.data(), static_cast<long>(count_), compute_.stream));
  }
  return Finish(compute_);
}

template <typename T>
absl::Status DeviceRankModel<T>::SumReplicatedGrads() {
  if (tensor_.size() == 1) return absl::OkStatus();
  if (auto st = Finish(compute_); !st.ok()) return st;  // the W passes wrote them
  return host_->SumReplicatedGrads(*tensor_.comm(), grads_.data());
}

template class DeviceRankModel<float>;
template class DeviceRankModel<bf16>;

}  // namespace vp::engine::cuda
