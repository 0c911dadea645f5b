// The run directory of a pipeline run (checkpoint.dir): what the launcher and its worker
// processes share. Everything is a plain file, so a run can be inspected, exported and resumed
// with nothing but the folder.
//
//   <dir>/job.yaml                    the job spec as run (block YAML, absolute paths)
//   <dir>/plan.txt                    the plan every rank executes (planner::PlanToText)
//   <dir>/store/                      Gloo FileStore for the rendezvous (fresh per launch)
//   <dir>/rank_<R>.pid                worker R's process id (written by the worker)
//   <dir>/rank_<R>.log                worker R's stdout + stderr
//   <dir>/rank_<R>.jsonl              one object per step from worker R (this launch only)
//   <dir>/metrics.jsonl               one object per step, merged (proto/runlog) by the
//                                     launcher or written by `vocabpipe run` from the
//                                     coordinator's step events
//   <dir>/step_<N>/rank_<R>/          rank R's shard at step N: model.safetensors,
//                                     optimizer.safetensors, DONE (the resume state)
//   <dir>/step_<N>/model.safetensors  merged Hugging Face GPT-2 checkpoint, config.json, DONE
//                                     (merged by rank 0 once every rank saved its shard)
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::launch {

std::string SpecPath(const std::string& dir);
std::string PlanPath(const std::string& dir);
std::string StoreDir(const std::string& dir);
std::string RankPidPath(const std::string& dir, int rank);
std::string RankLogPath(const std::string& dir, int rank);
std::string RankMetricsPath(const std::string& dir, int rank);
std::string MetricsPath(const std::string& dir);
// <dir>/step_<N>/rank_<R>
std::string ShardDir(const std::string& dir, int64_t step, int rank);

// Writes job.yaml and plan.txt (atomically: temporary file, then rename).
absl::Status WriteRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                           const planner::Plan& plan);

struct RunFiles {
  vocabpipe::v1::JobSpec spec;
  planner::Plan plan;
};
// Reads and validates job.yaml and plan.txt; the plan must match the spec (p, m, L).
absl::StatusOr<RunFiles> ReadRunFiles(const std::string& dir);

// Keeps the lines of metrics.jsonl whose step is below first_step (a resumed run writes the
// rest again). A missing file is an empty one.
absl::Status KeepMetricsBefore(const std::string& path, int64_t first_step);

}  // namespace vp::launch
