#include "worker/runtime/cuda/cuda_engine.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/kernel_switches.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/model/cuda/model_kernels.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/vocab/partition.h"
#include "worker/runtime/optimizer_step.h"
#include "worker/runtime/tensor_rows.h"

namespace vp::runtime {

using engine::MemoryCategory;
using engine::cuda::DeviceArray;
using engine::cuda::Finish;

namespace {

// A run of a tensor rank's rows of chunk q that lie in one sample, at consecutive positions:
// rows [first_row, first_row + rows) of the rank's block, positions [position, position + rows).
struct RowRun {
  int first_row = 0;
  int rows = 0;
  int position = 0;
};

// The rank's block of a chunk's b·len rows crosses from one sample into the next at most b
// times: one run per sample it touches.
std::vector<RowRun> RowRuns(const TensorRows& rows, int q) {
  std::vector<RowRun> runs;
  const int m = rows.LocalRows(q);
  for (int i = 0; i < m;) {
    const auto [sample, position] = rows.Row(q, i);
    int n = 1;
    while (i + n < m && rows.Row(q, i + n).first == sample) ++n;
    runs.push_back({.first_row = i, .rows = n, .position = position});
    i += n;
  }
  return runs;
}

}  // namespace

template <typename T>
absl::StatusOr<std::unique_ptr<CudaStageEngine<T>>> CudaStageEngine<T>::Create(
    const TrainerOptions& options, const engine::RankLayout& layout,
    const std::vector<int>& seq_bounds, engine::vocab::OutputAlgorithm algorithm, int device,
    comm::Communicator* tensor) {
  // The operator's kernel switches first: a misspelt one would train with other kernels, silently.
  if (absl::Status st = engine::cuda::CheckKernelSwitches(); !st.ok()) return st;
  const int count = engine::cuda::DeviceCount();
  if (count == 0) return absl::FailedPreconditionError("no CUDA device");
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: cuda:", device, " does not exist (", count, " devices)"));
  }
  std::unique_ptr<CudaStageEngine> e(new CudaStageEngine());
  e->opt_ = options;
  e->device_ = device;
  e->seq_bounds_ = seq_bounds;
  e->tensor_ = options.tensor.size > 1 ? tensor : nullptr;
  if (options.tensor.size > 1 && e->tensor_ == nullptr) {
    return absl::InvalidArgumentError("cuda rank: parallel.tensor > 1 needs the tensor group");
  }
  if (auto st = e->EnterThread(); !st.ok()) return st;
  e->tracker_ = std::make_unique<engine::MemoryTracker>();
  e->alloc_ = std::make_unique<engine::cuda::CachingAllocator>(
      engine::cuda::MakeCudaMemoryBackend(), e->tracker_.get(),
      engine::cuda::CachingAllocator::Reuse::kAfterSync);
  auto cs = engine::cuda::CudaStream::Create(engine::cuda::CudaStream::Priority::kNormal);
  if (!cs.ok()) return cs.status();
  e->compute_stream_ = std::move(*cs);
  // The vocabulary barriers' kernels go ahead of queued transformer work.
  auto vs = engine::cuda::CudaStream::Create(engine::cuda::CudaStream::Priority::kHigh);
  if (!vs.ok()) return vs.status();
  e->comm_stream_ = std::move(*vs);
  auto g1 = engine::cuda::GemmRunner::Create();
  if (!g1.ok()) return g1.status();
  e->compute_gemm_ = std::move(*g1);
  auto g2 = engine::cuda::GemmRunner::Create();
  if (!g2.ok()) return g2.status();
  e->comm_gemm_ = std::move(*g2);
  // VOCABPIPE_ATTENTION=cudnn asks for cuDNN's fused attention (bf16 only: fp32 attention runs
  // the FMA kernels, whose results must equal the CPU's); a missing library is the operator's
  // error to see, not a silent fallback.
  if constexpr (std::is_same_v<T, engine::cuda::bf16>) {
    auto dnn = engine::cuda::ChosenCudnnAttention(e->alloc_.get());
    if (!dnn.ok()) return dnn.status();
    e->attention_ = std::move(*dnn);
  }
  e->compute_ = {e->compute_stream_.get(), e->compute_gemm_.get(), e->alloc_.get(),
                 e->attention_.get()};
  e->comm_ = {e->comm_stream_.get(), e->comm_gemm_.get(), e->alloc_.get()};
  // ZeRO-1: the AdamW state of this replica's range only (the range RunOptimizerStep
  // reduce-scatters into, comm::RangeOf over the data group).
  const engine::cuda::ZeroShard zero =
      options.data.zero ? engine::cuda::ZeroShard{options.data.replicas, options.data.replica}
                        : engine::cuda::ZeroShard{};
  auto model = Model::Create(options.model, layout, options.microbatch_size, seq_bounds, algorithm,
                             options.adamw, e->compute_, e->comm_, zero,
                             engine::tp::TensorGroup(e->tensor_));
  if (!model.ok()) return model.status();
  e->model_ = std::move(*model);
  // The same initialisation as the CPU engine (slice-independent), then to the device.
  e->model_->host().Init(options.seed);
  if (auto st = e->model_->Upload(); !st.ok()) return st;
  return e;
}

template <typename T>
CudaStageEngine<T>::~CudaStageEngine() {
  if (alloc_ != nullptr) {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();  // nothing may still read a block the allocator frees
  }
}

template <typename T>
absl::Status CudaStageEngine<T>::EnterThread() {
  VP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<typename CudaStageEngine<T>::Buffer> CudaStageEngine<T>::Act(size_t n, bool zero,
                                                                            Thread thread) {
  return Buffer::Create(ctx(thread), MemoryCategory::kActivations, n, zero);
}

template <typename T>
absl::Status CudaStageEngine<T>::EmbedSeqChunk(Buffer& x, const InputState& in, int b, int s,
                                               int len, int h, int start) {
  // Llama has no position table: RoPE inside the layers handles positions.
  const T* wpe = opt_.model.llama() ? nullptr : model_->wpe();
  if (tensor_ != nullptr) {
    // The rank's rows of the chunk (tensor_rows.h), each at its own position: its embedding rows
    // converted to T, then the position rows added one sample's run of rows at a time.
    const TensorRows rows(opt_.tensor.size, opt_.tensor.rank, b, seq_bounds_);
    const int q = rows.ChunkAt(start), m = rows.LocalRows(q);
    const float* src = in.output() + static_cast<size_t>(rows.EmbedOffset(q)) * h;
    const long count = static_cast<long>(m) * h;
    if constexpr (std::is_same_v<T, float>) {
      VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(x.data(), src, count * sizeof(float),
                                              cudaMemcpyDeviceToDevice, compute_.stream));
    } else {
      VP_CUDA_RETURN_IF_ERROR(engine::cuda::FloatToBf16(x.data(), src, count, compute_.stream));
    }
    if (wpe != nullptr) {
      for (const RowRun& run : RowRuns(rows, q)) {
        VP_CUDA_RETURN_IF_ERROR(engine::cuda::PositionEmbeddingForward<T>(
            x.data() + static_cast<size_t>(run.first_row) * h, wpe, 1, run.rows, h, run.position,
            compute_.stream));
      }
    }
    return Finish(compute_);
  }
  VP_CUDA_RETURN_IF_ERROR(engine::cuda::EmbedSeqChunkForward<T>(x.data(), in.output(), wpe, b, s,
                                                                len, h, start, compute_.stream));
  return Finish(compute_);
}

template <typename T>
absl::Status CudaStageEngine<T>::EmbedSeqChunkBackward(Buffer& dembed, const Buffer& dx, int b,
                                                       int s, int len, int h, int start) {
  if (tensor_ != nullptr) {  // mirrors EmbedSeqChunk's rows
    const TensorRows rows(opt_.tensor.size, opt_.tensor.rank, b, seq_bounds_);
    const int q = rows.ChunkAt(start), m = rows.LocalRows(q);
    if (!opt_.model.llama()) {
      for (const RowRun& run : RowRuns(rows, q)) {
        VP_CUDA_RETURN_IF_ERROR(engine::cuda::PositionEmbeddingBackward<T>(
            model_->wpe_grad(), dx.data() + static_cast<size_t>(run.first_row) * h, 1, run.rows, h,
            run.position, compute_.stream));
      }
    }
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        dembed.data() + static_cast<size_t>(rows.EmbedOffset(q)) * h, dx.data(),
        sizeof(T) * static_cast<size_t>(m) * h, cudaMemcpyDeviceToDevice, compute_.stream));
    return Finish(compute_);
  }
  if (!opt_.model.llama()) {
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::PositionEmbeddingBackward<T>(
        model_->wpe_grad(), dx.data(), b, len, h, start, compute_.stream));
  }
  // dx (b, len, h) into rows [start, start+len) of every sequence of dembed (b, s, h).
  const size_t row = sizeof(T) * static_cast<size_t>(h);
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(dembed.data() + static_cast<size_t>(start) * h, row * s,
                                            dx.data(), row * len, row * len, b,
                                            cudaMemcpyDeviceToDevice, compute_.stream));
  return Finish(compute_);
}

template <typename T>
absl::Status CudaStageEngine<T>::FinalNormForward(XState& xs, Buffer out, int n) {
  const int h = opt_.model.hidden;
  auto x =
      Buffer::Create(compute_, MemoryCategory::kActivations, static_cast<size_t>(n) * h, false);
  if (!x.ok()) return x.status();
  auto mean = DeviceArray<float>::Create(compute_, MemoryCategory::kActivations, n, false);
  if (!mean.ok()) return mean.status();
  auto rstd = DeviceArray<float>::Create(compute_, MemoryCategory::kActivations, n, false);
  if (!rstd.ok()) return rstd.status();
  xs.x = std::move(*x);
  xs.mean = std::move(*mean);
  xs.rstd = std::move(*rstd);
  if (opt_.model.llama()) {  // final RMSNorm (mean stays unused)
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::RmsNormForward<T>(xs.x.data(), xs.rstd.data(), out.data(),
                                                            model_->lnf_weight(), n, h,
                                                            opt_.model.rms_eps, compute_.stream));
  } else {
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::LayerNormForward<T>(
        xs.x.data(), xs.mean.data(), xs.rstd.data(), out.data(), model_->lnf_weight(),
        model_->lnf_bias(), n, h, compute_.stream));
  }
  xs.x_last = std::move(out);
  return Finish(compute_);
}

template <typename T>
absl::Status CudaStageEngine<T>::FinalNormBackward(Buffer& dout, const float* grad_input,
                                                   XState& xs, int n) {
  const int h = opt_.model.hidden;
  const size_t nh = static_cast<size_t>(n) * h;
  // ∇X is fp32 (identical on every rank after the barrier); the layer norm reads it as T.
  const T* g = nullptr;
  Buffer converted;
  if constexpr (std::is_same_v<T, float>) {
    g = grad_input;
  } else {
    auto c = Buffer::Create(compute_, MemoryCategory::kActivations, nh, false);
    if (!c.ok()) return c.status();
    converted = std::move(*c);
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::FloatToBf16(converted.data(), grad_input,
                                                      static_cast<long>(nh), compute_.stream));
    g = converted.data();
  }
  if (opt_.model.llama()) {
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::RmsNormBackwardInput<T>(
        dout.data(), dout.data(), g, xs.x_last.data(), model_->lnf_weight(), xs.rstd.data(), n, h,
        compute_.stream));
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::RmsNormBackwardWeight<T>(
        model_->lnf_weight_grad(), g, xs.x_last.data(), xs.rstd.data(), n, h, compute_.stream));
  } else {
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::LayerNormBackwardInput<T>(
        dout.data(), dout.data(), g, xs.x_last.data(), model_->lnf_weight(), xs.mean.data(),
        xs.rstd.data(), n, h, compute_.stream));
    VP_CUDA_RETURN_IF_ERROR(engine::cuda::LayerNormBackwardWeight<T>(
        model_->lnf_weight_grad(), model_->lnf_bias_grad(), g, xs.x_last.data(), xs.mean.data(),
        xs.rstd.data(), n, h, compute_.stream));
  }
  xs.x_last.Reset();
  xs.mean.Reset();
  xs.rstd.Reset();
  converted.Reset();
  return Finish(compute_);
}

namespace {

// The optimizer step's arithmetic on device memory (optimizer_step.h). The communicators take
// device pointers, so the scalar all-reduce goes through a one-element device array.
template <typename T>
class CudaGradOps {
 public:
  using Scratch = DeviceArray<float>;
  CudaGradOps(engine::cuda::DeviceRankModel<T>& model, const engine::cuda::DeviceContext& ctx)
      : model_(model), ctx_(ctx) {}

  const engine::RankModel& host() const { return model_.host(); }
  absl::StatusOr<Scratch> ZeroScratch(size_t n) {
    return Scratch::Create(ctx_, MemoryCategory::kActivations, n, /*zero=*/true);
  }
  absl::Status AddGrads(Scratch& sum, size_t offset) {
    VP_CUDA_RETURN_IF_ERROR(
        engine::cuda::ResidualForward<float>(sum.data(), sum.data(), model_.grads() + offset,
                                             static_cast<long>(sum.size()), ctx_.stream));
    return absl::OkStatus();
  }
  absl::Status SetGrads(size_t offset, const Scratch& sum) {
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(model_.grads() + offset, sum.data(), sum.bytes(),
                                            cudaMemcpyDeviceToDevice, ctx_.stream));
    return absl::OkStatus();
  }
  absl::Status Sync() { return Finish(ctx_); }
  absl::Status AllReduceSum(comm::Communicator& comm, Scratch& sum) {
    return comm.AllReduce(sum.data(), sum.size(), comm::ReduceOp::kSum);
  }
  absl::StatusOr<double> SquaredNorm(size_t offset, size_t n) {
    return model_.SquaredNorm(offset, n);
  }
  absl::StatusOr<float> AllReduceScalar(comm::Communicator& comm, float value) {
    auto scalar = Scratch::Create(ctx_, MemoryCategory::kActivations, 1, /*zero=*/false);
    if (!scalar.ok()) return scalar.status();
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scalar->data(), &value, sizeof(float),
                                            cudaMemcpyHostToDevice, ctx_.stream));
    if (auto st = Finish(ctx_); !st.ok()) return st;
    if (auto st = comm.AllReduce(scalar->data(), 1, comm::ReduceOp::kSum); !st.ok()) return st;
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&value, scalar->data(), sizeof(float),
                                            cudaMemcpyDeviceToHost, ctx_.stream));
    if (auto st = Finish(ctx_); !st.ok()) return st;
    return value;
  }
  absl::Status AdamW(float lr, float scale) { return model_.OptimizerStep(lr, scale); }
  // The gradients are written on the compute stream, the communicator has its own: drain first.
  absl::Status AllReduceGrads(comm::Communicator& data, size_t offset, size_t n) {
    if (auto st = Finish(ctx_); !st.ok()) return st;
    return data.AllReduce(model_.grads() + offset, n, comm::ReduceOp::kSum);
  }
  // ZeRO-1: the whole fp32 gradient buffer reduce-scattered (this replica keeps its range's
  // sum), AdamW on the range (AdamW above: the model's state is the range's), then the fp32
  // master weights all-gathered and the T copy refreshed (DeviceRankModel::GatherParams).
  absl::Status ReduceScatterGrads(comm::Communicator& data) {
    if (auto st = Finish(ctx_); !st.ok()) return st;
    return data.ReduceScatterSum(model_.grads(), model_.param_count());
  }
  absl::Status AllGatherParams(comm::Communicator& data) { return model_.GatherParams(data); }

 private:
  engine::cuda::DeviceRankModel<T>& model_;
  const engine::cuda::DeviceContext& ctx_;
};
static_assert(GradOps<CudaGradOps<float>>);
static_assert(GradOps<CudaGradOps<engine::cuda::bf16>>);

}  // namespace

template <typename T>
absl::Status CudaStageEngine<T>::OptimizerStep(int64_t, comm::Communicator& comm,
                                               comm::Communicator* data, bool tied_copy_sync,
                                               float lr, float grad_clip, double* grad_norm,
                                               double* data_seconds,
                                               const std::vector<comm::ShardRange>& reduced) {
  if (opt_.data.zero && data != nullptr && data->size() > 1 &&
      (data->size() != opt_.data.replicas || data->rank() != opt_.data.replica)) {
    return absl::InvalidArgumentError(absl::StrCat("zero: the data group is replica ", data->rank(),
                                                   " of ", data->size(),
                                                   ", the optimizer state was sharded for replica ",
                                                   opt_.data.replica, " of ", opt_.data.replicas));
  }
  CudaGradOps<T> ops(*model_, compute_);
  return RunOptimizerStep(ops, comm, data, opt_.data.zero, tied_copy_sync, lr, grad_clip, grad_norm,
                          data_seconds, reduced, tensor_);
}

// The compute stream wrote the chunk's gradients (its last W): the ops drain it, then sum.
template <typename T>
absl::StatusOr<comm::ShardRange> CudaStageEngine<T>::AllReduceChunkGrads(comm::Communicator& data,
                                                                         int chunk) {
  const engine::RankModel::ParamSpan span = model_->host().ChunkParams(chunk);
  CudaGradOps<T> ops(*model_, compute_);
  if (auto st = ops.AllReduceGrads(data, span.offset, span.count); !st.ok()) return st;
  return comm::ShardRange{span.offset, span.count};
}

template <typename T>
absl::Status CudaStageEngine<T>::AllReduceHostFloats(comm::Communicator& comm, float* values,
                                                     size_t n) {
  auto device = DeviceArray<float>::Create(compute_, MemoryCategory::kActivations, n, false);
  if (!device.ok()) return device.status();
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device->data(), values, n * sizeof(float),
                                          cudaMemcpyHostToDevice, compute_.stream));
  if (auto st = Finish(compute_); !st.ok()) return st;
  if (auto st = comm.AllReduce(device->data(), n, comm::ReduceOp::kSum); !st.ok()) return st;
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(values, device->data(), n * sizeof(float),
                                          cudaMemcpyDeviceToHost, compute_.stream));
  return Finish(compute_);
}

template class CudaStageEngine<float>;
template class CudaStageEngine<engine::cuda::bf16>;

}  // namespace vp::runtime
