// The CUDA engine of the plan executor (a StageEngine, worker/runtime/stage_engine.h;
// CpuStageEngine is the reference): one device per rank, a compute stream and a
// high-priority stream for the vocabulary barriers, one caching allocator shared by the rank's
// threads (reuse after sync), T = float or bf16 activations and parameters.
//
// Ordering: every engine and model method returns with its stream idle (device.h), so the
// executor's keys order device work across threads exactly as they order host work on the CPU.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"
#include "worker/engine/model/cuda/rank_model.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

template <typename T>
class CudaStageEngine {
 public:
  using Elem = T;
  using Buffer = engine::cuda::DeviceArray<T>;
  using Model = engine::cuda::DeviceRankModel<T>;
  using InputState = engine::cuda::DeviceInputLayerState<T>;
  using OutputState = engine::cuda::DeviceOutputLayerState<T>;
  enum Thread { kCompute, kComm };

  struct XState {
    Buffer x;                               // (n, h) the output layer's input
    Buffer x_last;                          // (n, h) the last layer's output (owner, until B)
    engine::cuda::DeviceArray<float> mean;  // (n) ln_f statistics (owner)
    engine::cuda::DeviceArray<float> rstd;  // (n)
  };

  // Makes `device` current on the calling thread, creates the streams, allocator, GEMM runners
  // and the model (initialised from options.seed on the host, then uploaded). tensor: this
  // stage's tensor group (options.tensor; null for t = 1), a communicator on device pointers.
  static absl::StatusOr<std::unique_ptr<CudaStageEngine>> Create(
      const TrainerOptions& options, const engine::RankLayout& layout,
      const std::vector<int>& seq_bounds, engine::vocab::OutputAlgorithm algorithm, int device,
      comm::Communicator* tensor = nullptr);
  ~CudaStageEngine();

  Model& model() { return *model_; }
  engine::MemoryTracker& tracker() { return *tracker_; }
  int device() const { return device_; }

  absl::StatusOr<Buffer> Act(size_t n, bool zero, Thread thread);
  absl::Status EmbedSeqChunk(Buffer& x, const InputState& in, int b, int s, int len, int h,
                             int start);
  absl::Status EmbedSeqChunkBackward(Buffer& dembed, const Buffer& dx, int b, int s, int len, int h,
                                     int start);
  absl::Status FinalNormForward(XState& xs, Buffer out, int n);
  absl::Status FinalNormBackward(Buffer& dout, const float* grad_input, XState& xs, int n);
  absl::Status OptimizerStep(int64_t step, comm::Communicator& comm, comm::Communicator* data,
                             bool tied_copy_sync, float lr, float grad_clip, double* grad_norm,
                             double* data_seconds, const std::vector<comm::ShardRange>& reduced);
  // GRAD_SYNC: model chunk `chunk`'s gradients summed over the replicas; the range it covered.
  absl::StatusOr<comm::ShardRange> AllReduceChunkGrads(comm::Communicator& data, int chunk);
  // n host floats summed over `comm` through a device buffer (the communicators take device
  // pointers).
  absl::Status AllReduceHostFloats(comm::Communicator& comm, float* values, size_t n);
  absl::Status ZeroGrads() { return model_->ZeroGrads(); }
  // Tensor parallelism: the replicated tensors' gradients summed over the tensor group.
  absl::Status SumTensorReplicatedGrads() { return model_->SumReplicatedGrads(); }
  absl::Status EnterThread();
  void ActionDone(Thread) { alloc_->ReleasePending(); }

 private:
  CudaStageEngine() = default;
  const engine::cuda::DeviceContext& ctx(Thread t) const {
    return t == kCompute ? compute_ : comm_;
  }

  TrainerOptions opt_;
  int device_ = 0;
  std::vector<int> seq_bounds_;
  comm::Communicator* tensor_ = nullptr;  // t > 1 only
  // Declared before everything that allocates from it: destroyed last.
  std::unique_ptr<engine::MemoryTracker> tracker_;
  std::unique_ptr<engine::cuda::CachingAllocator> alloc_;
  engine::cuda::CudaStream compute_stream_, comm_stream_;
  std::unique_ptr<engine::cuda::GemmRunner> compute_gemm_, comm_gemm_;
  // cuDNN's attention for the compute thread's layers (VOCABPIPE_ATTENTION=cudnn, bf16), else
  // null; its workspace is the allocator's, so it goes first.
  std::unique_ptr<engine::cuda::CudnnAttention> attention_;
  engine::cuda::DeviceContext compute_, comm_;
  std::unique_ptr<Model> model_;
};

extern template class CudaStageEngine<float>;
extern template class CudaStageEngine<engine::cuda::bf16>;

}  // namespace vp::runtime
