// `vocabpipe run` for parallel.pipeline = p > 1 on one host: builds and validates the plan,
// prepares the run directory (run_dir.h), starts p `vocabpipe-worker` processes, merges their
// per-step reports into one progress line and one metrics.jsonl object per step, merges
// checkpoint shards, and stops every worker when one fails (docs/operations.md, "Pipeline
// runs").
#pragma once

#include <sys/types.h>

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "vocabpipe/v1/job.pb.h"
#include "worker/runtime/run_job.h"

namespace vp::cli {

struct LaunchOptions {
  bool resume = false;       // continue from the latest step all ranks saved
  bool interactive = false;  // redraw one progress line with '\r'
  // The worker executable. Empty: $VOCABPIPE_WORKER, else `vocabpipe-worker` beside the
  // running executable, else ../worker/main/vocabpipe-worker from it (the build tree).
  std::string worker_binary;
  // Gloo timeout of the workers, and how long the launcher waits for the other workers to
  // stop on their own after one failed before it terminates them.
  absl::Duration timeout = absl::Seconds(60);
};

// What a run on this host needs beyond a valid spec and plan: a device it has (cuda:
// Unimplemented in a build without CUDA or on a host without a GPU; InvalidArgument for a cuda:N
// it lacks) and a token file whose every id is below model.vocab_size (InvalidArgument); the same
// for data.val_path when given, and the tokenizer that train.sample_every needs.
absl::Status CheckJobRunsHere(const vocabpipe::v1::JobSpec& spec);

// The --device of the worker daemon that `vocabpipe run` starts for rank `rank` of a local
// control-plane run, among `cuda_devices` CUDA devices on this host: "cpu" for a cpu job, else
// "cuda:N" by the rank's own rule (launch::PickCudaDevice: the spec's cuda:N, else
// rank % cuda_devices). A daemon registers with the device it is given, and the coordinator
// places a cuda job only on cuda daemons.
absl::StatusOr<std::string> LocalDaemonDevice(const vocabpipe::v1::JobSpec& spec, int rank,
                                              int cuda_devices);

// Starts `argv` with stdin from /dev/null and stdout + stderr to log_path (truncated).
absl::StatusOr<pid_t> SpawnLogged(const std::vector<std::string>& argv,
                                  const std::string& log_path);

// Finds the worker executable as LaunchOptions::worker_binary describes.
absl::StatusOr<std::string> FindWorkerBinary(const std::string& override_path);

// Runs the job to the end. A worker that fails makes it return Aborted("rank R failed:
// <reason>") once every worker has exited; a spec or plan the planner rejects is
// InvalidArgument.
absl::StatusOr<runtime::RunSummary> RunPipelineJob(const vocabpipe::v1::JobSpec& spec,
                                                   const LaunchOptions& options,
                                                   std::ostream& progress);

}  // namespace vp::cli
