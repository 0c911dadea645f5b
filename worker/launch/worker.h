// One pipeline rank as a process (`vocabpipe-worker --run-dir DIR --rank R`): reads the job
// spec and plan the launcher wrote into DIR, loads the data (every rank reads the same
// microbatches), connects to the other ranks over Gloo (FileStore in DIR/store), builds a
// runtime::PipelineRank and runs the steps, appending one JSON object per step to
// DIR/rank_<R>.jsonl and saving its checkpoint shard at checkpoint steps.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/plan/plan.h"
#include "worker/runtime/pipeline_rank.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace vp::launch {

struct WorkerOptions {
  std::string run_dir;
  int rank = 0;
  // Bound on the rendezvous and on every Gloo transfer and collective: a rank whose peer died
  // fails within it.
  absl::Duration timeout = absl::Seconds(60);
  // Names this launch's keys in the store (a relaunch must not read stale addresses).
  std::string attempt = "0";
  // Names the run in the checkpoint manifests and owns the run directory's lock (run_lock.h):
  // the job id under a coordinator, the launch's id for `vocabpipe run --direct`. Empty: the
  // attempt.
  std::string run_id;
  int64_t resume_step = -1;  // >= 0: load the rank's shard of this step and continue after it
  // Rendezvous store. Null: a FileStore in DIR/store (ranks on one host, `vocabpipe run`);
  // worker daemons pass the coordinator's (grpc_store.h).
  std::shared_ptr<gloo::rendezvous::Store> store;
  // IP this rank's Gloo transport binds to and publishes.
  std::string hostname = "127.0.0.1";
  // CUDA jobs: the device index this rank uses (a daemon's --device cuda:N); -1 = from the
  // spec (cuda:N), else rank % devices on this host.
  int cuda_device = -1;
  // Called with an error raised once the PipelineRank exists, before anything is torn down.
  // The process entry point reports and _Exits there: after a transport error the executor's
  // communication thread may still sit in a Gloo call until its timeout, and destroying the
  // rank would join it. Null: the error is returned as usual.
  std::function<void(const absl::Status&)> on_fatal;
  // Set by the process's SIGTERM handler (null: never): the ranks agree on a step, save an
  // emergency checkpoint after it and stop (preemption.h). preempt_poll: how often a rank
  // that was not signalled looks for a peer's request.
  const std::atomic<bool>* preempt = nullptr;
  absl::Duration preempt_poll = absl::Milliseconds(250);
};

struct WorkerOutcome {
  // >= 0: the ranks stopped early after this step for a preemption; its checkpoint is saved
  // (and merged by rank 0). -1: the job ran to its end.
  int64_t preempted_after = -1;
};

// Runs the rank to the end of the job, or to an agreed preemption step. Errors name the stage
// (spec, data, connect, step N, checkpoint) and are meant for the rank's log.
absl::StatusOr<WorkerOutcome> RunWorker(const WorkerOptions& options);

// What a rank process holds beyond the engine's accounting, for one step (-1: not measured).
struct RankFootprint {
  int64_t process_peak = -1;  // the process's peak resident memory so far (VmHWM)
  bool device = false;        // a CUDA rank: memory.total stays the device's
};

// The JSON object a worker appends for one step (one line of rank_<R>.jsonl); `eval`, when not
// null, is the evaluation that followed the step ("val_loss", "eval_seconds"). memory holds the
// engine's categories and their peak "total" (what the planner predicts), and from `footprint`
// "process" and "footprint": the rank's real peak (a CPU rank: the larger of the
// engine's and the process's; a CUDA rank: the device's), which status and the dashboards show.
std::string RankStepJson(int rank, const runtime::RankStepResult& r, int64_t checkpoint_step,
                         const runtime::RankEvalResult* eval = nullptr,
                         const RankFootprint& footprint = {}, double checkpoint_seconds = -1);

}  // namespace vp::launch
