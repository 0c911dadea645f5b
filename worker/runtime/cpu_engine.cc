#include "worker/runtime/cpu_engine.h"

#include <cmath>
#include <cstring>

#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::runtime {

using engine::Buffer;
using engine::MemoryCategory;

absl::StatusOr<std::unique_ptr<CpuStageEngine>> CpuStageEngine::Create(
    const TrainerOptions& options, const engine::RankLayout& layout,
    const std::vector<int>& seq_bounds, engine::vocab::OutputAlgorithm algorithm) {
  std::unique_ptr<CpuStageEngine> e(new CpuStageEngine());
  e->opt_ = options;
  e->tracker_ = std::make_unique<engine::MemoryTracker>();
  auto model = engine::RankModel::Create(options.model, layout, options.microbatch_size, seq_bounds,
                                         algorithm, e->tracker_.get());
  if (!model.ok()) return model.status();
  e->model_ = std::move(*model);
  e->model_->Init(options.seed);
  auto opt = engine::AdamW::Create(e->tracker_.get(), e->model_->param_count(), options.adamw,
                                   e->model_->DecayRanges());
  if (!opt.ok()) return opt.status();
  e->optimizer_ = std::make_unique<engine::AdamW>(std::move(*opt));
  return e;
}

absl::StatusOr<Buffer> CpuStageEngine::Act(size_t n, bool, Thread) {
  return Buffer(tracker_.get(), MemoryCategory::kActivations, n);
}

absl::Status CpuStageEngine::EmbedChunk(Buffer& x, const InputState& in, int b, int s, int len,
                                        int h, int start) {
  for (int r = 0; r < b; ++r) {  // rows [start, start + len) of each sample
    std::memcpy(x.data() + static_cast<size_t>(r) * len * h,
                in.output() + (static_cast<size_t>(r) * s + start) * h, sizeof(float) * len * h);
  }
  engine::cpu::PositionEmbeddingForward(x.data(), model_->wpe(), b, len, h, start);
  return absl::OkStatus();
}

absl::Status CpuStageEngine::EmbedChunkBackward(Buffer& dembed, const Buffer& dx, int b, int s,
                                                int len, int h, int start) {
  engine::cpu::PositionEmbeddingBackward(model_->wpe_grad(), dx.data(), b, len, h, start);
  for (int r = 0; r < b; ++r) {
    std::memcpy(dembed.data() + (static_cast<size_t>(r) * s + start) * h,
                dx.data() + static_cast<size_t>(r) * len * h, sizeof(float) * len * h);
  }
  return absl::OkStatus();
}

absl::Status CpuStageEngine::FinalNormForward(XState& xs, Buffer out, int n) {
  const int h = opt_.model.hidden;
  xs.x = Buffer(tracker_.get(), MemoryCategory::kActivations, static_cast<size_t>(n) * h);
  xs.mean = Buffer(tracker_.get(), MemoryCategory::kActivations, n);
  xs.rstd = Buffer(tracker_.get(), MemoryCategory::kActivations, n);
  engine::cpu::LayerNormForward(xs.x.data(), xs.mean.data(), xs.rstd.data(), out.data(),
                                model_->lnf_weight(), model_->lnf_bias(), n, h);
  xs.x_last = std::move(out);
  return absl::OkStatus();
}

absl::Status CpuStageEngine::FinalNormBackward(Buffer& dout, const float* grad_input, XState& xs,
                                               int n) {
  const int h = opt_.model.hidden;
  engine::cpu::LayerNormBackwardInput(dout.data(), grad_input, xs.x_last.data(),
                                      model_->lnf_weight(), xs.mean.data(), xs.rstd.data(), n, h);
  engine::cpu::LayerNormBackwardWeight(model_->lnf_weight_grad(), model_->lnf_bias_grad(),
                                       grad_input, xs.x_last.data(), xs.mean.data(), xs.rstd.data(),
                                       n, h);
  xs.x_last = Buffer();
  xs.mean = Buffer();
  xs.rstd = Buffer();
  return absl::OkStatus();
}

absl::Status CpuStageEngine::OptimizerStep(int64_t, comm::Communicator& comm, bool tied_copy_sync,
                                           float lr, float grad_clip, double* grad_norm) {
  const int h = opt_.model.hidden;
  if (tied_copy_sync) {
    // Both copies end with ∇wte = ∇(input use) + ∇(output use); the others add zeros.
    const int64_t rows = engine::vocab::PaddedVocab(opt_.model.vocab, 1);
    Buffer sum(tracker_.get(), MemoryCategory::kActivations, static_cast<size_t>(rows) * h);
    const engine::ParamTensor* in = model_->Find("transformer.wte.weight");
    const engine::ParamTensor* out = model_->tied_output_copy();
    for (const engine::ParamTensor* t : {in, out}) {
      if (t == nullptr) continue;
      for (size_t i = 0; i < sum.size(); ++i) sum.data()[i] += model_->grads()[t->offset + i];
    }
    if (auto st = comm.AllReduce(sum.data(), sum.size(), comm::ReduceOp::kSum); !st.ok()) {
      return st;
    }
    for (const engine::ParamTensor* t : {in, out}) {
      if (t != nullptr) {
        std::memcpy(model_->grads() + t->offset, sum.data(), sizeof(float) * sum.size());
      }
    }
  }
  // Σ g² over this rank's parameters, the tied output copy counted once (by its twin).
  double sq = engine::SquaredNorm(model_->grads(), model_->param_count());
  if (const engine::ParamTensor* copy = tied_copy_sync ? model_->tied_output_copy() : nullptr) {
    sq -= engine::SquaredNorm(model_->grads() + copy->offset, copy->count());
  }
  float sqf[1] = {static_cast<float>(sq)};
  // fp32 all-reduce of the partial sums: the norm only scales clipping.
  if (auto st = comm.AllReduce(sqf, 1, comm::ReduceOp::kSum); !st.ok()) return st;
  *grad_norm = std::sqrt(static_cast<double>(sqf[0]));
  optimizer_->Step(model_->params(), model_->grads(), lr,
                   engine::ClipScale(static_cast<double>(sqf[0]), grad_clip));
  return absl::OkStatus();
}

}  // namespace vp::runtime
