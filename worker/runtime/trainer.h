// Standalone training (parallel.pipeline = 1): the whole model on this process, every pass of
// a step run in order. The vocabulary layers still go through their S / C1 / T passes (on the
// 1-rank communicator), so standalone training exercises the same code a pipeline runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/config.h"
#include "worker/engine/memory.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"

namespace vp::runtime {

// This rank's place on the data-parallel axis (parallel.data, parallel.zero): replica `replica`
// of `replicas` copies of the pipeline. With zero, the rank keeps the AdamW state of its range
// of the flat parameter buffer only (comm::RangeOf(params, replicas, replica): ZeRO stage 1).
struct DataParallelOptions {
  int replicas = 1;  // d
  int replica = 0;   // r in [0, d)
  bool zero = false;
};

// Tensor parallelism (parallel.tensor): this rank is `rank` of `size` tensor ranks of its stage
// (docs/tensor-parallel.md).
struct TensorParallelOptions {
  int size = 1;  // t
  int rank = 0;  // in [0, t)
};

struct TrainerOptions {
  engine::ModelConfig model;
  int microbatch_size = 1;  // b
  int microbatches = 1;     // m
  engine::vocab::OutputAlgorithm algorithm = engine::vocab::OutputAlgorithm::kAlgorithm2;
  engine::AdamWConfig adamw;
  engine::LrSchedule lr;
  float grad_clip = 0.0f;  // 0 disables
  uint64_t seed = 1234;
  DataParallelOptions data;
  TensorParallelOptions tensor;
};

// Fills the inputs and targets (both (b, s) int32) of microbatch j of step `step`.
using BatchFn =
    std::function<absl::Status(int64_t step, int microbatch, int32_t* inputs, int32_t* targets)>;

struct StepResult {
  int64_t step = 0;
  double loss = 0;  // mean cross-entropy over the step's m·b·s tokens
  float lr = 0;
  double grad_norm = 0;  // global L2 norm before clipping
  double seconds = 0;    // wall time of the step
};

class StandaloneTrainer {
 public:
  static absl::StatusOr<std::unique_ptr<StandaloneTrainer>> Create(const TrainerOptions& options);

  // One optimizer step: forward and backward of every microbatch, clipping, AdamW.
  absl::StatusOr<StepResult> Step(int64_t step, const BatchFn& batches);
  // Forward + backward of every microbatch without the optimizer step: leaves the step's
  // gradients in model().grads() and returns the mean loss.
  absl::StatusOr<double> ComputeGradients(int64_t step, const BatchFn& batches);

  // Forward-only evaluation: the mean cross-entropy over `num_batches` microbatches of b·s
  // tokens, batches(step, j, ...) filling microbatch j. Runs the same forward passes as a
  // training step (input layer, layer stack, final LayerNorm, output layer S and C1) and no
  // backward: parameters, gradients and optimizer state are left as they are.
  absl::StatusOr<double> Evaluate(int64_t step, int num_batches, const BatchFn& batches);

  engine::RankModel& model() { return *model_; }
  engine::AdamW& optimizer() { return *optimizer_; }
  engine::MemoryTracker& memory() { return *tracker_; }
  const TrainerOptions& options() const { return options_; }

 private:
  struct PassKey {
    explicit PassKey() = default;
  };

 public:
  explicit StandaloneTrainer(PassKey) {}

 private:
  // What the forward of one microbatch leaves for its backward: the input layer's state, the
  // last layer's output, the final LayerNorm's output and statistics, the output layer's state
  // after S and C1 (defined in trainer.cc).
  struct Forwarded;
  // The forward passes of one microbatch up to the per-token losses (IF + reduce, position
  // embeddings, the layer stack, ln_f, S, C1); adds their sum times d to *loss. Without
  // keep_for_backward the stack drops its saved activations as soon as its forward is done.
  absl::StatusOr<Forwarded> Forward(int j, const int32_t* inputs, const int32_t* targets, float d,
                                    bool keep_for_backward, double* loss);
  // Forward of one microbatch up to the per-token losses; adds their sum times d to *loss.
  absl::Status ForwardOnly(int j, const int32_t* inputs, const int32_t* targets, float d,
                           double* loss);
  // Forward and backward of one microbatch; adds its loss share to *loss.
  absl::Status Microbatch(int j, const int32_t* inputs, const int32_t* targets, float d,
                          double* loss);

  TrainerOptions options_;
  std::unique_ptr<engine::MemoryTracker> tracker_;
  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<engine::RankModel> model_;
  std::unique_ptr<engine::AdamW> optimizer_;
};

}  // namespace vp::runtime
