// `vocabpipe run` for parallel.pipeline = 1: loads the data, trains, writes metrics.jsonl,
// progress lines and checkpoints as the job spec says.
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"
#include "worker/runtime/sampler.h"
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
  bool has_val_loss = false;
  double final_val_loss = 0;  // the last evaluation's, where has_val_loss
  double tokens_per_s = 0;    // over all steps but the first (warm-up)
  double mfu = 0;             // likewise; against the CPU sgemm peak, at most 1
  double peak_flops = 0;      // that peak, FLOP/s (runtime::CpuPeakFlops on the CPU)
  std::string peak_source;    // where the peak came from (CpuPeak::source); empty: unknown
  bool peak_stale = false;    // a step ran faster than the peak (its MFU was capped at 100%)
  int64_t peak_memory_bytes = 0;
  std::string metrics_path;
  std::string last_checkpoint;
};

// Opens the job's token shards (data.path or data.paths: read in place, headers checked against
// the vocabulary, worker/data/token_shards.h) and returns the function that fills microbatch j
// of a step in the spec's sample order. Every pipeline rank calls this: all ranks read the same
// microbatches (inputs for IF, targets for S/T). With parallel.data = d the step has d·m
// microbatches in the sample order and `replica`'s microbatch j is the step's r·m + j, so d
// replicas of m see exactly the samples one pipeline of d·m would.
absl::StatusOr<BatchFn> OpenJobBatches(const vocabpipe::v1::JobSpec& spec, int replica = 0);

// Opens data.val_path (validated against the vocabulary and its tokenizer.model like
// data.path) and returns the function that fills evaluation microbatch j of round r: validation
// microbatch r·m + j (m = parallel.microbatches) from the start of the file, never shuffled,
// so every evaluation reads the same tokens whatever its round size. NotFound-free: a spec
// without data.val_path is an InvalidArgument naming the field.
absl::StatusOr<BatchFn> OpenValidationBatches(const vocabpipe::v1::JobSpec& spec);

// Whether the step that has just finished (done = step + 1 steps) is followed by an evaluation:
// every train.eval_every steps and after the last one.
bool EvaluatesAfter(const vocabpipe::v1::JobSpec& spec, int64_t done);

// The tokenizer.model beside data.path (where `vocabpipe data tokenize` writes it).
std::string DataTokenizerPath(const vocabpipe::v1::JobSpec& spec);

// Copies the data's tokenizer.model into a checkpoint step folder (atomically), so that the
// checkpoint can be sampled on its own. No tokenizer beside the data: nothing to copy.
absl::Status CopyDataTokenizer(const vocabpipe::v1::JobSpec& spec, const std::string& step_dir);

// Whether training writes a sample after `done` steps: every train.sample_every steps and after
// the last one.
bool SamplesAfter(const vocabpipe::v1::JobSpec& spec, int64_t done);

// Checks that sampling can run (train.sample_every > 0 needs the data's tokenizer.model).
absl::Status CheckSampling(const vocabpipe::v1::JobSpec& spec);

// The options of a training sample (train.sample_tokens tokens, temperature 1, top-k 40,
// seed train.seed).
SampleOptions TrainingSampleOptions(const vocabpipe::v1::JobSpec& spec);

// Trains the job in this process. `progress` gets the progress line and a closing summary.
absl::StatusOr<RunSummary> RunStandaloneJob(const vocabpipe::v1::JobSpec& spec,
                                            const RunOptions& options, std::ostream& progress);

}  // namespace vp::runtime
