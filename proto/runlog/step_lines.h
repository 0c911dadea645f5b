// The per-step lines of a pipeline run (docs/formats.md, "metrics.jsonl").
//
// Every rank appends one *rank line* per step to rank_<R>.jsonl (worker/launch/worker.h writes it):
//   {"step": 0-based, "rank", "seconds", "busy_seconds", "busy": {pass: s}, "comm": {kind: s},
//    "compute_wait_seconds", "comm_seconds", "memory": {category: bytes, "total", and where
//    measured "process", "footprint": worker.h RankStepJson}, "lr",
//    "grad_norm", "has_loss", "loss" (on the rank that holds the loss),
//    "checkpoint_step" (when the rank saved its shard after this step) and "checkpoint_seconds"
//    (how long that save held the step: shard written, fsynced, manifest, marked),
//    "val_loss" and "eval_seconds" (when an evaluation followed the step; val_loss on every
//    rank that holds output-layer rows), "sample" (rank 0, when a sample followed the step),
//    "stage" and "replica" (data parallelism, parallel.data > 1: the job rank's coordinates),
//    "data_parallel_seconds" (the gradient reduction's share of OPT, when d > 1)}
// The p rank lines of a step merge into one *step line*, the metrics.jsonl object that the
// local launcher writes, the coordinator stores with the step's event and `vocabpipe run`
// writes from those events:
//   {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes" (the largest
//    rank footprint, else total),
//    "step_seconds" (slowest rank), "busy_max_over_mean", "memory_max_over_min",
//    "checkpoint_step" and "checkpoint_seconds" (the slowest rank's) when every rank saved,
//    "val_loss" (when evaluated), "sample", "stages":
//    [per rank: seconds, busy_seconds, busy, compute_wait_seconds, comm_seconds, comm, memory,
//    predicted_memory_total, checkpoint_seconds when the rank saved, stage, replica and
//    data_parallel_seconds when the rank line has them]}
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vp::runlog {

// What a step line needs beyond the rank lines.
struct StepContext {
  double tokens_per_step = 0;             // microbatches x microbatch_size x seq_len
  double model_flops_per_step = 0;        // forward + backward model FLOPs of one step
  double peak_flops_per_rank = 0;         // MFU's denominator per rank; 0: MFU is reported as 0
  std::vector<int64_t> predicted_memory;  // per rank (state + activations); missing: 0
};

// Checks a rank line: every field the merge reads has its type and sign. InvalidArgument
// naming `where` and the field ("step_json[2].memory.total: must be an integer >= 0").
absl::Status CheckRankLine(const nlohmann::json& line, const std::string& where);

// Merges the p lines of one step (ranks[r] from rank r, each passing CheckRankLine, all of the
// same step) into its step line. InvalidArgument when the lines disagree on the step or a
// rank is out of order.
absl::StatusOr<nlohmann::json> MergeRankLines(const std::vector<nlohmann::json>& ranks,
                                              const StepContext& context);

// The one-line progress display of a step line:
//   step 3/10 | loss 4.1234 [| val 4.2345] | lr 1.00e-03 | 1234 tok/s | MFU 12.3% |
//   busy max/mean 1.01 | mem max/min 1.20 (max 12.3 MiB) | ETA 00:00:12
std::string ProgressLine(const nlohmann::json& step_line, int64_t total_steps, double eta_seconds);

}  // namespace vp::runlog
