// `vocabpipe run` for parallel.pipeline = 1: loads the data, trains, writes metrics.jsonl,
// progress lines and checkpoints as the job spec says.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

struct RunOptions {
  bool resume = false;       // continue from the latest complete checkpoint in checkpoint.dir
  bool interactive = false;  // redraw one progress line with '\r' (a terminal)
};

struct RunSummary {
  int64_t steps_run = 0;
  int64_t first_step = 0;
  double first_loss = 0;
  double final_loss = 0;
  double tokens_per_s = 0;  // over all steps but the first (warm-up)
  double mfu = 0;           // likewise; against the measured CPU sgemm peak
  double peak_flops = 0;    // the measured peak, FLOP/s
  int64_t peak_memory_bytes = 0;
  std::string metrics_path;
  std::string last_checkpoint;
};

// Opens the job's token file (validated against the vocabulary) and returns the function that
// fills microbatch j of a step in the spec's sample order. Every pipeline rank calls this: all
// ranks read the same microbatches (inputs for IF, targets for S/T).
absl::StatusOr<BatchFn> OpenJobBatches(const vocabpipe::v1::JobSpec& spec);

// Trains the job in this process. `progress` gets the progress line and a closing summary.
absl::StatusOr<RunSummary> RunStandaloneJob(const vocabpipe::v1::JobSpec& spec,
                                            const RunOptions& options, std::ostream& progress);

}  // namespace vp::runtime
