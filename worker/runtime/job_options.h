// A job spec mapped onto what one rank trains with: the trainer's options and its BLAS threads.
// One mapping for every pipeline size, so the standalone run, a pipeline rank, profiling and
// `vocabpipe export` read the spec the same way.
#pragma once

#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "vocabpipe/v1/job.pb.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

// The engine's model shape from a (defaults-applied) model spec.
engine::ModelConfig ModelConfigFromSpec(const vocabpipe::v1::ModelSpec& m);
// parallel.recompute (validated: none, selective or full) as the engine's mode.
engine::Recompute RecomputeFromSpec(const vocabpipe::v1::ParallelSpec& p);

// Maps a validated JobSpec onto the trainer's options.
//   plan == nullptr: the standalone model (parallel.pipeline must be 1, device cpu); the output
//     layer runs Algorithm 1 for `vocab: vocab1` (so it can be exercised standalone), else
//     Algorithm 2 (at p = 1 every vocabulary method computes the same thing);
//   plan != nullptr: one rank of that plan; m and L must match the plan's, and the output-layer
//     algorithm follows the plan's barrier count (2 = Algorithm 1, C1 + C2; else Algorithm 2).
//     The device is the rank's business (worker/launch/job_rank.h), not checked here.
absl::StatusOr<TrainerOptions> TrainerOptionsFromSpec(const vocabpipe::v1::JobSpec& spec,
                                                      const planner::Plan* plan = nullptr);

// BLAS threads per rank: train.threads, or an even share of the cores when it is 0.
int WorkerThreads(const vocabpipe::v1::JobSpec& spec);

}  // namespace vp::runtime
