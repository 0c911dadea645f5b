#include "worker/runtime/cpu_engine.h"

#include <cmath>
#include <cstring>

#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/runtime/optimizer_step.h"
#include "worker/runtime/tensor_rows.h"

namespace vp::runtime {

using engine::Buffer;
using engine::MemoryCategory;

absl::StatusOr<std::unique_ptr<CpuStageEngine>> CpuStageEngine::Create(
    const TrainerOptions& options, const engine::RankLayout& layout,
    const std::vector<int>& seq_bounds, engine::vocab::OutputAlgorithm algorithm,
    comm::Communicator* tensor) {
  std::unique_ptr<CpuStageEngine> e(new CpuStageEngine());
  e->opt_ = options;
  e->seq_bounds_ = seq_bounds;
  e->tensor_ = options.tensor.size > 1 ? tensor : nullptr;
  e->tracker_ = std::make_unique<engine::MemoryTracker>();
  auto model =
      engine::RankModel::Create(options.model, layout, options.microbatch_size, seq_bounds,
                                algorithm, e->tracker_.get(), engine::tp::TensorGroup(e->tensor_));
  if (!model.ok()) return model.status();
  e->model_ = std::move(*model);
  e->model_->Init(options.seed);
  const size_t params = e->model_->param_count();
  const comm::ShardRange shard =
      options.data.zero ? comm::RangeOf(params, options.data.replicas, options.data.replica)
                        : comm::ShardRange{0, params};
  auto opt = engine::AdamW::CreateShard(e->tracker_.get(), params, options.adamw,
                                        e->model_->DecayRanges(), shard.begin, shard.count);
  if (!opt.ok()) return opt.status();
  e->optimizer_ = std::make_unique<engine::AdamW>(std::move(*opt));
  return e;
}

absl::StatusOr<Buffer> CpuStageEngine::Act(size_t n, bool, Thread) {
  return Buffer(tracker_.get(), MemoryCategory::kActivations, n);
}

absl::Status CpuStageEngine::EmbedSeqChunk(Buffer& x, const InputState& in, int b, int s, int len,
                                           int h, int start) {
  if (tensor_ != nullptr) {  // the rank's rows of the chunk, each at its own position
    const TensorRows rows(opt_.tensor.size, opt_.tensor.rank, b, seq_bounds_);
    const int q = rows.ChunkAt(start);
    const float* src = in.output() + static_cast<size_t>(rows.EmbedOffset(q)) * h;
    std::memcpy(x.data(), src, sizeof(float) * rows.LocalRows(q) * h);
    if (!opt_.model.llama()) {
      for (int i = 0; i < rows.LocalRows(q); ++i) {
        const float* wpe = model_->wpe() + static_cast<size_t>(rows.Row(q, i).second) * h;
        float* row = x.data() + static_cast<size_t>(i) * h;
        for (int c = 0; c < h; ++c) row[c] += wpe[c];
      }
    }
    return absl::OkStatus();
  }
  for (int r = 0; r < b; ++r) {  // rows [start, start + len) of each sample
    std::memcpy(x.data() + static_cast<size_t>(r) * len * h,
                in.output() + (static_cast<size_t>(r) * s + start) * h, sizeof(float) * len * h);
  }
  // Llama has no position table: RoPE inside the layers handles positions.
  if (!opt_.model.llama()) {
    engine::cpu::PositionEmbeddingForward(x.data(), model_->wpe(), b, len, h, start);
  }
  return absl::OkStatus();
}

absl::Status CpuStageEngine::EmbedSeqChunkBackward(Buffer& dembed, const Buffer& dx, int b, int s,
                                                   int len, int h, int start) {
  if (tensor_ != nullptr) {  // mirrors EmbedSeqChunk's rows
    const TensorRows rows(opt_.tensor.size, opt_.tensor.rank, b, seq_bounds_);
    const int q = rows.ChunkAt(start);
    if (!opt_.model.llama()) {
      for (int i = 0; i < rows.LocalRows(q); ++i) {
        float* wpe = model_->wpe_grad() + static_cast<size_t>(rows.Row(q, i).second) * h;
        const float* row = dx.data() + static_cast<size_t>(i) * h;
        for (int c = 0; c < h; ++c) wpe[c] += row[c];
      }
    }
    std::memcpy(dembed.data() + static_cast<size_t>(rows.EmbedOffset(q)) * h, dx.data(),
                sizeof(float) * rows.LocalRows(q) * h);
    return absl::OkStatus();
  }
  if (!opt_.model.llama()) {
    engine::cpu::PositionEmbeddingBackward(model_->wpe_grad(), dx.data(), b, len, h, start);
  }
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
  if (opt_.model.llama()) {  // final RMSNorm (mean stays unused)
    engine::cpu::RmsNormForward(xs.x.data(), xs.rstd.data(), out.data(), model_->lnf_weight(), n, h,
                                opt_.model.rms_eps);
  } else {
    engine::cpu::LayerNormForward(xs.x.data(), xs.mean.data(), xs.rstd.data(), out.data(),
                                  model_->lnf_weight(), model_->lnf_bias(), n, h);
  }
  xs.x_last = std::move(out);
  return absl::OkStatus();
}

absl::Status CpuStageEngine::FinalNormBackward(Buffer& dout, const float* grad_input, XState& xs,
                                               int n) {
  const int h = opt_.model.hidden;
  if (opt_.model.llama()) {
    engine::cpu::RmsNormBackwardInput(dout.data(), grad_input, xs.x_last.data(),
                                      model_->lnf_weight(), xs.rstd.data(), n, h);
    engine::cpu::RmsNormBackwardWeight(model_->lnf_weight_grad(), grad_input, xs.x_last.data(),
                                       xs.rstd.data(), n, h);
  } else {
    engine::cpu::LayerNormBackwardInput(dout.data(), grad_input, xs.x_last.data(),
                                        model_->lnf_weight(), xs.mean.data(), xs.rstd.data(), n, h);
    engine::cpu::LayerNormBackwardWeight(model_->lnf_weight_grad(), model_->lnf_bias_grad(),
                                         grad_input, xs.x_last.data(), xs.mean.data(),
                                         xs.rstd.data(), n, h);
  }
  xs.x_last = Buffer();
  xs.mean = Buffer();
  xs.rstd = Buffer();
  return absl::OkStatus();
}

namespace {

// The optimizer step's arithmetic on host memory (optimizer_step.h).
class CpuGradOps {
 public:
  using Scratch = Buffer;
  CpuGradOps(engine::RankModel& model, engine::AdamW& adamw, engine::MemoryTracker* tracker)
      : model_(model), adamw_(adamw), tracker_(tracker) {}

  const engine::RankModel& host() const { return model_; }
  absl::StatusOr<Scratch> ZeroScratch(size_t n) {
    return Buffer(tracker_, MemoryCategory::kActivations, n);  // zero-filled
  }
  absl::Status AddGrads(Scratch& sum, size_t offset) {
    const float* g = model_.grads() + offset;
    for (size_t i = 0; i < sum.size(); ++i) sum.data()[i] += g[i];
    return absl::OkStatus();
  }
  absl::Status SetGrads(size_t offset, const Scratch& sum) {
    std::memcpy(model_.grads() + offset, sum.data(), sizeof(float) * sum.size());
    return absl::OkStatus();
  }
  absl::Status Sync() { return absl::OkStatus(); }
  absl::Status AllReduceSum(comm::Communicator& comm, Scratch& sum) {
    return comm.AllReduce(sum.data(), sum.size(), comm::ReduceOp::kSum);
  }
  absl::StatusOr<double> SquaredNorm(size_t offset, size_t n) {
    return engine::SquaredNorm(model_.grads() + offset, n);
  }
  absl::StatusOr<float> AllReduceScalar(comm::Communicator& comm, float value) {
    float v[1] = {value};
    if (absl::Status st = comm.AllReduce(v, 1, comm::ReduceOp::kSum); !st.ok()) return st;
    return v[0];
  }
  absl::Status AdamW(float lr, float scale) {
    adamw_.Step(model_.params(), model_.grads(), lr, scale);
    return absl::OkStatus();
  }
  absl::Status AllReduceGrads(comm::Communicator& data, size_t offset, size_t n) {
    return data.AllReduce(model_.grads() + offset, n, comm::ReduceOp::kSum);
  }
  absl::Status ReduceScatterGrads(comm::Communicator& data) {
    return data.ReduceScatterSum(model_.grads(), model_.param_count());
  }
  absl::Status AllGatherParams(comm::Communicator& data) {
    return data.AllGather(model_.params(), model_.param_count());
  }

 private:
  engine::RankModel& model_;
  engine::AdamW& adamw_;
  engine::MemoryTracker* tracker_;
};
static_assert(GradOps<CpuGradOps>);

}  // namespace

absl::Status CpuStageEngine::OptimizerStep(int64_t, comm::Communicator& comm,
                                           comm::Communicator* data, bool tied_copy_sync, float lr,
                                           float grad_clip, double* grad_norm, double* data_seconds,
                                           const std::vector<comm::ShardRange>& reduced) {
  CpuGradOps ops(*model_, *optimizer_, tracker_.get());
  return RunOptimizerStep(ops, comm, data, opt_.data.zero, tied_copy_sync, lr, grad_clip, grad_norm,
                          data_seconds, reduced, tensor_);
}

absl::StatusOr<comm::ShardRange> CpuStageEngine::AllReduceChunkGrads(comm::Communicator& data,
                                                                     int chunk) {
  const engine::RankModel::ParamSpan span = model_->ChunkParams(chunk);
  CpuGradOps ops(*model_, *optimizer_, tracker_.get());
  if (absl::Status st = ops.AllReduceGrads(data, span.offset, span.count); !st.ok()) return st;
  return comm::ShardRange{span.offset, span.count};
}

}  // namespace vp::runtime
