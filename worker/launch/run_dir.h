// The run directory of a pipeline run (checkpoint.dir): what the launcher and its worker
// processes share. Everything is a plain file, so a run can be inspected, exported and resumed
// with nothing but the folder. Every file is opened from a handle of the folder, never
// through a link (proto/safefs/dir.h).
//
//   <dir>/OWNER                       the user whose run first claimed the folder
//                                     (proto/safefs/run_owner.h)
//   <dir>/LOCK                        the id of the run that holds the folder (run_lock.h)
//   <dir>/job.yaml                    the job spec as run (block YAML, absolute paths)
//   <dir>/plan.txt                    the plan every rank executes (planner::PlanToText),
//                                     written by the local launcher (`vocabpipe run`)
//   <dir>/plan_rank_<R>.txt           rank R's slice of the plan (planner::RankSlice), written
//                                     by the worker daemon that runs rank R: a daemon is sent
//                                     its own rank's actions only
//   <dir>/store/                      Gloo FileStore for the rendezvous (fresh per launch)
//   <dir>/rank_<R>.pid                worker R's process id (written by the worker)
//   <dir>/rank_<R>.log                worker R's stdout + stderr
//   <dir>/rank_<R>.jsonl              one object per step from worker R (this launch only)
//   <dir>/metrics.jsonl               one object per step, merged (proto/runlog) by the
//                                     launcher or written by `vocabpipe run` from the
//                                     coordinator's step events
//   <dir>/step_<N>/rank_<R>/          stage R's shard at step N: model.safetensors,
//                                     optimizer.safetensors, DONE (the resume state); with
//                                     data parallelism written by the stage's replica 0, and
//                                     under ZeRO-1 optimizer-Q-of-D.safetensors by each
//                                     replica Q instead (the files above named rank_<R> are
//                                     per job rank)
//   <dir>/step_<N>/model.safetensors  merged Hugging Face GPT-2 checkpoint, config.json, DONE
//                                     (merged by rank 0 once every rank saved its shard; above
//                                     checkpoint.max_shard_bytes model-0000k-of-0000n.safetensors
//                                     + model.safetensors.index.json instead)
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "proto/safefs/dir.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::launch {

std::string SpecPath(const std::string& dir);
std::string PlanPath(const std::string& dir);
std::string RankPlanPath(const std::string& dir, int rank);
std::string StoreDir(const std::string& dir);
std::string RankPidPath(const std::string& dir, int rank);
std::string RankLogPath(const std::string& dir, int rank);
std::string RankMetricsPath(const std::string& dir, int rank);
std::string MetricsPath(const std::string& dir);
// <dir>/step_<N>/rank_<R>
std::string ShardDir(const std::string& dir, int64_t step, int rank);

// A file of the run folder `dir`, opened by handle without following a link
// (proto/safefs/dir.h): the folder with O_DIRECTORY|O_NOFOLLOW, the file with O_NOFOLLOW plus
// `flags`; a link in either place is PermissionDenied naming it.
absl::StatusOr<safefs::UniqueFd> OpenRunFile(const std::string& dir, const std::string& name,
                                             int flags);
// rank_<R>.log for appending (the rank's stdout and stderr), as OpenRunFile opens it.
absl::StatusOr<safefs::UniqueFd> OpenRankLog(const std::string& dir, int rank);

// Writes job.yaml and plan.txt (atomically: temporary file, then rename).
absl::Status WriteRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                           const planner::Plan& plan);

struct RunFiles {
  vocabpipe::v1::JobSpec spec;
  planner::Plan plan;
};
// Writes job.yaml and plan_rank_<rank>.txt (a daemon's rank: the plan is its slice).
absl::Status WriteRankRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                               const planner::Plan& slice, int rank);

// Reads and validates job.yaml and the plan; the plan must match the spec (p, m, L). The plan:
// for rank >= 0, plan_rank_<rank>.txt when it exists (its slice), else plan.txt; for rank -1
// (the whole plan: report, export), plan.txt when it exists, else the plan rebuilt from every
// rank's slice (a control-plane run), else plan_rank_0.txt (the layout only).
absl::StatusOr<RunFiles> ReadRunFiles(const std::string& dir, int rank = -1);

// Keeps the lines of metrics.jsonl whose step is below first_step (a resumed run writes the
// rest again). A missing file is an empty one.
absl::Status KeepMetricsBefore(const std::string& path, int64_t first_step);

}  // namespace vp::launch
