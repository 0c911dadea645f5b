// Records the merged step lines of a pipeline run (proto/runlog): appends each to
// <dir>/metrics.jsonl, prints its progress line, and adds up the run's summary. The `--direct`
// launcher feeds it the lines it merges itself, `vocabpipe run` the lines carried by the
// coordinator's step events.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "proto/safefs/dir.h"
#include "worker/runtime/run_job.h"

namespace vp::launch {

class StepRecorder {
 public:
  // resume: the lines of metrics.jsonl before the first recorded step are kept (the rest is
  // written again); otherwise the file starts empty. interactive: the progress line is redrawn
  // in place with '\r'.
  StepRecorder(const std::string& dir, int64_t total_steps, bool resume, bool interactive,
               std::ostream& progress);
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  // Creates (or, resuming, keeps) metrics.jsonl.
  absl::Status Start();
  // One merged step line; lines come in step order.
  absl::Status Record(const nlohmann::json& line);
  // Ends an interactive progress line (before an error is printed under it). Finish does too.
  void EndProgress();
  // The run's summary. Throughput and MFU leave out the first step (warm-up) unless it is the
  // only one; peak_flops_per_rank is reported with them.
  runtime::RunSummary Finish(double peak_flops_per_rank, std::string peak_source = "");

 private:
  const std::string dir_;
  const int64_t total_steps_;
  const bool resume_, interactive_;
  std::ostream& progress_;
  safefs::UniqueFd file_;  // metrics.jsonl, opened without following a link
  runtime::RunSummary summary_;
  bool line_open_ = false;  // an interactive progress line waits for its newline
  double elapsed_ = 0, timed_seconds_ = 0, timed_tokens_ = 0, timed_mfu_seconds_ = 0;
};

}  // namespace vp::launch
