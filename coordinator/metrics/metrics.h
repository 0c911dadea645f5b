// Prometheus exposition of the coordinator's job metrics (docs/operations.md, "Monitoring and
// deployment", lists every series).
//
// The coordinator owns one MetricsExporter. It feeds it the merged per-step figures of each
// job (the object the launcher writes as one line of <run_dir>/metrics.jsonl), the job state
// transitions and the worker counts; Prometheus scrapes them from GET /metrics on the bound
// address. Naming follows Prometheus practice: `vocabpipe_` prefix, base units, counters end in
// `_total`, and our labels are never `job` or `instance` (Prometheus attaches those itself at
// scrape time): the job id is `training_job`.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vp::metrics {

// The job states the coordinator uses (coordinator/server/coordinator.h). SetJobState writes 1
// for the current state and 0 for each of these, so `sum by (state) (vocabpipe_job_state)`
// counts jobs per state with every state present.
inline constexpr std::array<std::string_view, 7> kJobStates = {
    "PENDING", "PROFILING", "PLANNING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"};

class MetricsExporter {
 public:
  // Starts an HTTP listener on `bind_address` ("host:port"; port 0 picks a free port, see
  // port()) serving the text exposition at /metrics. An empty address starts no listener: the
  // series are then only readable through Scrape(). Unavailable when the address cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Create(const std::string& bind_address);
  ~MetricsExporter();
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  // The bound TCP port; 0 when no listener was started.
  int port() const;

  // Records one merged step of job `job_id` (one metrics.jsonl object: "step", "step_seconds",
  // "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes",
  // "busy_max_over_mean", "memory_max_over_min", "stages": [{"rank", "seconds",
  // "busy_seconds", "busy": {pass: s}, "compute_wait_seconds", "comm": {kind: s},
  // "memory": {kind: bytes}, "predicted_memory_total"}]). Only "step" is required, plus
  // "step_seconds" or per-stage "seconds" to derive it; absent figures leave their series
  // untouched. Counters (steps, tokens, pass and comm seconds) add this step's amounts, so call
  // it once per step. `schedule` and `vocab` label the job-level series; they are fixed by the
  // job's first step. InvalidArgument (naming the field) for a malformed object, a negative
  // duration, or a schedule/vocab different from the job's first step; nothing is recorded
  // then.
  absl::Status RecordStep(std::string_view job_id, std::string_view schedule,
                          std::string_view vocab, const nlohmann::json& step);

  // vocabpipe_job_state{training_job, state}: 1 for `state`, 0 for the other kJobStates (and
  // for any other state this job had before). InvalidArgument for an empty job id or state.
  absl::Status SetJobState(std::string_view job_id, std::string_view state);

  // vocabpipe_job_data_replicas{training_job} = `current` and
  // vocabpipe_job_requested_data_replicas{training_job} = `requested`: the data-parallel
  // replicas the job runs at now and the ones it asked for (they differ while an elastic job
  // runs shrunk). InvalidArgument for an empty job id or a count below 1.
  absl::Status SetJobReplicas(std::string_view job_id, int current, int requested);

  // vocabpipe_workers{state}: the number of registered workers in `state` (e.g. "idle",
  // "busy"); the caller picks the state names and sets each one it uses.
  void SetWorkerCount(std::string_view state, int64_t count);

  // Drops every series labelled training_job=`job_id` (step figures, per-stage figures and
  // job state). A later RecordStep/SetJobState for the id starts afresh. No-op for an unknown id.
  void RemoveJob(std::string_view job_id);

  // The current text exposition (what GET /metrics returns).
  std::string Scrape() const;

 private:
  struct Impl;
  explicit MetricsExporter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace vp::metrics
