// The CPU engine of the plan executor (a StageEngine, stage_engine.h): host
// buffers charged to the rank's MemoryTracker, the CPU RankModel and AdamW, OpenBLAS kernels.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/memory.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

class CpuStageEngine {
 public:
  using Elem = float;
  using Buffer = engine::Buffer;
  using Model = engine::RankModel;
  using InputState = engine::vocab::InputLayerState;
  using OutputState = engine::vocab::OutputLayerState;
  enum Thread { kCompute, kComm };

  // X of the last layer group for one (microbatch, sequence chunk).
  struct XState {
    Buffer x;       // (n, h) the output layer's input (after ln_f); every rank, until T
    Buffer x_last;  // (n, h) the last layer's output, before ln_f (owner only, until B)
    Buffer mean;    // (n) ln_f statistics (owner only)
    Buffer rstd;    // (n)
  };

  // tensor: the communicator of this stage's tensor group (options.tensor; null for t = 1).
  static absl::StatusOr<std::unique_ptr<CpuStageEngine>> Create(
      const TrainerOptions& options, const engine::RankLayout& layout,
      const std::vector<int>& seq_bounds, engine::vocab::OutputAlgorithm algorithm,
      comm::Communicator* tensor = nullptr);

  Model& model() { return *model_; }
  engine::AdamW& optimizer() { return *optimizer_; }
  engine::MemoryTracker& tracker() { return *tracker_; }

  // Host buffers are always zero-filled.
  absl::StatusOr<Buffer> Act(size_t n, bool zero, Thread thread);
  // x (b, len, h) = rows [start, start+len) of each sequence of the embedding output
  // in.output() (b, s, h), plus wpe rows [start, start+len). Under tensor parallelism x is the
  // rank's rows of the chunk and in.output() its embedding rows (tensor_rows.h).
  absl::Status EmbedSeqChunk(Buffer& x, const InputState& in, int b, int s, int len, int h,
                             int start);
  // wpe grad += Σ_b dx; dx (b, len, h) copied into rows [start, start+len) of dembed (b, s, h).
  absl::Status EmbedSeqChunkBackward(Buffer& dembed, const Buffer& dx, int b, int s, int len, int h,
                                     int start);
  // ln_f on `out` (n, h): fills x, mean, rstd and keeps out as x_last.
  absl::Status FinalNormForward(XState& xs, Buffer out, int n);
  // dout (n, h, zeroed) += ln_f's input gradient; ln_f's weight gradients; frees x_last and
  // the statistics.
  absl::Status FinalNormBackward(Buffer& dout, const float* grad_input, XState& xs, int n);
  // Tied copies summed, gradients summed over the replicas (`data`, null for one), global
  // gradient norm (all-reduced over `comm`), clipping, AdamW (optimizer_step.h).
  absl::Status OptimizerStep(int64_t step, comm::Communicator& comm, comm::Communicator* data,
                             bool tied_copy_sync, float lr, float grad_clip, double* grad_norm,
                             double* data_seconds, const std::vector<comm::ShardRange>& reduced);
  // GRAD_SYNC: model chunk `chunk`'s gradients summed over the replicas; the range it covered.
  absl::StatusOr<comm::ShardRange> AllReduceChunkGrads(comm::Communicator& data, int chunk);
  absl::Status AllReduceHostFloats(comm::Communicator& comm, float* values, size_t n) {
    return comm.AllReduce(values, n, comm::ReduceOp::kSum);
  }
  // Tensor parallelism: the replicated tensors' gradients summed over the tensor group.
  absl::Status SumTensorReplicatedGrads() { return model_->SumReplicatedGrads(); }
  absl::Status ZeroGrads() {
    model_->ZeroGrads();
    return absl::OkStatus();
  }
  absl::Status EnterThread() { return absl::OkStatus(); }
  void ActionDone(Thread) {}

 private:
  CpuStageEngine() = default;

  TrainerOptions opt_;
  std::vector<int> seq_bounds_;
  comm::Communicator* tensor_ = nullptr;  // t > 1 only
  std::unique_ptr<engine::MemoryTracker> tracker_;
  std::unique_ptr<engine::RankModel> model_;
  std::unique_ptr<engine::AdamW> optimizer_;
};

}  // namespace vp::runtime
