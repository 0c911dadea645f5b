// One pipeline rank executing a pass plan (the plan IR of proto/plan) against its model
// shard: transformer chunks, vocabulary shards, sequence chunks, optimizer step.
//
// Compute actions (F, B, W, BW, IF, IB, S, T, OPT) run on the calling thread in plan order.
// Communication actions (SEND/RECV_ACT/GRAD, BCAST_X, C1, C2, IF_REDUCE, IB_BCAST) run in plan
// order on communication threads with their own Communicators, so transfers and the vocabulary
// barriers overlap with transformer passes; each side waits only for the actions of the other
// that precede it in the plan and produce or consume its data. The planner proves the plan
// deadlock-free under blocking sends, and this split only relaxes that order.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "worker/comm/communicator.h"
#include "worker/engine/model/rank_model.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

// What one rank measured in one step.
struct RankStepResult {
  int64_t step = 0;
  bool has_loss = false;  // the rank saw every microbatch's loss (x_owner always does)
  double loss = 0;        // mean over the step's m·b·s tokens, where has_loss
  double grad_norm = 0;   // global (all ranks) L2 norm before clipping
  float lr = 0;
  double seconds = 0;  // wall time of the step on this rank
  // Busy seconds per compute action kind (indexed by planner::ActionKind), seconds the
  // compute thread waited for communication, and seconds the communication thread spent in
  // each communication kind (blocked in transfers and collectives).
  std::array<double, planner::kNumActionKinds> busy{};
  double compute_wait_seconds = 0;
  std::array<double, planner::kNumActionKinds> comm{};
  // Exposed seconds of the data-parallel reduction: the wait for the GRAD_SYNC thread after
  // the last compute action, plus OPT's own data-parallel collectives (the rest of the
  // gradients, ZeRO-1's gather; part of busy[OPT]). The overlapped GRAD_SYNC time is in
  // comm[GRAD_SYNC]. 0 without data parallelism.
  double data_parallel_seconds = 0;
  // Peaks of this step, bytes, from the engine's allocator.
  int64_t peak_parameters = 0, peak_gradients = 0, peak_optimizer = 0, peak_activations = 0;
  int64_t peak_total = 0;

  double busy_seconds() const;  // sum of busy
};

// What one rank measured in one forward-only evaluation (PipelineRank::Evaluate).
struct RankEvalResult {
  bool has_loss = false;  // the rank saw every microbatch's loss (every output-layer rank does)
  double loss = 0;        // mean cross-entropy over the evaluated tokens, where has_loss
  double seconds = 0;     // wall time on this rank
};

// One rank of a pipeline job on some device. The CPU rank (Create below) runs its passes on
// host threads and Gloo; the CUDA rank (worker/runtime/cuda) on a device with NCCL. Both execute
// the same plan with the same executor (rank_executor.h).
class PipelineRank {
 public:
  // CPU rank. comm: this rank's communicator over all plan.pipeline ranks, used only by the
  // communication thread (it must outlive the PipelineRank). options.microbatches must equal
  // plan.microbatches and options.model.layers plan.layers. data: the communicator over the
  // options.data.replicas replicas of this stage (rank = options.data.replica), null for one.
  // tensor: over the options.tensor.size tensor ranks of this stage (rank =
  // options.tensor.rank), null for one; used by the compute thread only.
  static absl::StatusOr<std::unique_ptr<PipelineRank>> Create(const planner::Plan& plan, int rank,
                                                              const TrainerOptions& options,
                                                              comm::Communicator* comm,
                                                              comm::Communicator* data = nullptr,
                                                              comm::Communicator* tensor = nullptr);
  virtual ~PipelineRank() = default;

  // Executes the plan once: every microbatch's passes, then the optimizer step.
  virtual absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches) = 0;
  // Forward-only evaluation through the same plan: its forward actions (IF, IF_REDUCE, F,
  // SEND/RECV_ACT, BCAST_X, S, C1) over num_batches microbatches, a multiple of
  // plan.microbatches run m at a time (round r fills microbatch j with batches(r, j, ...)).
  // Every rank must call it with the same arguments. Parameters, gradients and optimizer state
  // are untouched; the mean loss over the num_batches·b·s tokens is known after C1.
  virtual absl::StatusOr<RankEvalResult> Evaluate(int num_batches, const BatchFn& batches) = 0;

  // The host view of the rank's parameters and optimizer state (tensor table, checkpoints).
  // A device rank keeps its state on the device: call PullState() before reading the host view
  // and PushState() after changing it (loading a checkpoint). Both are no-ops on the CPU.
  virtual engine::RankModel& model() = 0;
  virtual engine::AdamW& optimizer() = 0;
  virtual absl::Status PullState() { return absl::OkStatus(); }
  virtual absl::Status PushState() { return absl::OkStatus(); }
  // Memory accounting of the rank's engine (device memory on a device rank).
  virtual engine::MemoryTracker& memory() = 0;
  virtual int rank() const = 0;
};

// For transports without tags (NCCL): between every ordered pair of ranks, the sends of one
// and the receives of the other must name the same transfers in the same plan order (a tag is
// the producing group, sequence chunk and microbatch). FailedPrecondition naming the first pair
// and position that differ. A pair with a rank whose action list is empty (a rank's slice,
// planner::RankSlice) is not compared: the coordinator validated the whole plan.
absl::Status CheckP2POrderMatches(const planner::Plan& plan);

}  // namespace vp::runtime
