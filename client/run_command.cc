// vocabpipe run job.yaml [--resume] [--steps N] [--timeout SECONDS] [--worker PATH]: trains a
// job. parallel.pipeline = 1 trains in this process (runtime::RunStandaloneJob); p > 1 starts
// p vocabpipe-worker processes on this host (launch::RunPipelineJob).
#include <unistd.h>

#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "client/commands.h"
#include "proto/spec/job_spec.h"
#include "worker/launch/launcher.h"
#include "worker/runtime/run_job.h"

namespace vp::cli {
namespace {

constexpr char kUsage[] =
    "usage: vocabpipe run JOB.yaml [--resume] [--steps N] [--timeout SECONDS] [--worker PATH]\n";

}  // namespace

int RunRunCommand(const Args& args, std::ostream& out, std::ostream& err) {
  std::string spec_path;
  runtime::RunOptions options;
  options.interactive = isatty(STDOUT_FILENO) && &out == &std::cout;
  launch::LaunchOptions launch;
  int64_t steps_override = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--resume") {
      options.resume = true;
    } else if (a == "--steps") {
      if (i + 1 >= args.size() || !absl::SimpleAtoi(args[i + 1], &steps_override) ||
          steps_override < 0) {
        err << "vocabpipe run: --steps needs a non-negative integer\n";
        return 2;
      }
      ++i;
    } else if (a == "--timeout") {
      double seconds = 0;
      if (i + 1 >= args.size() || !absl::SimpleAtod(args[i + 1], &seconds) || seconds <= 0) {
        err << "vocabpipe run: --timeout needs seconds > 0\n";
        return 2;
      }
      launch.timeout = absl::Seconds(seconds);
      ++i;
    } else if (a == "--worker") {
      if (i + 1 >= args.size()) {
        err << "vocabpipe run: --worker needs a path\n";
        return 2;
      }
      launch.worker_binary = args[++i];
    } else if (!a.empty() && a[0] == '-') {
      err << "vocabpipe run: unknown flag " << a << "\n" << kUsage;
      return 2;
    } else if (spec_path.empty()) {
      spec_path = a;
    } else {
      err << "vocabpipe run: more than one job spec given (" << spec_path << ", " << a << ")\n";
      return 2;
    }
  }
  if (spec_path.empty()) {
    err << kUsage;
    return 2;
  }
  auto spec = spec::LoadJobSpecFile(spec_path);
  if (!spec.ok()) {
    err << spec.status().message() << "\n";
    return 2;
  }
  if (steps_override >= 0) spec->mutable_train()->set_steps(static_cast<int32_t>(steps_override));
  absl::StatusOr<runtime::RunSummary> summary;
  if (spec->parallel().pipeline() == 1) {
    summary = runtime::RunStandaloneJob(*spec, options, out);
  } else {
    launch.resume = options.resume;
    launch.interactive = options.interactive;
    summary = launch::RunPipelineJob(*spec, launch, out);
  }
  if (!summary.ok()) {
    err << "vocabpipe run: " << summary.status().message() << "\n";
    return absl::IsInvalidArgument(summary.status()) || absl::IsUnimplemented(summary.status()) ? 2
                                                                                                : 1;
  }
  out << absl::StrFormat(
      "done: %d steps, loss %.4f -> %.4f, %.0f tokens/s, MFU %.1f%% of a measured %.1f GFLOP/s "
      "sgemm peak%s, peak memory %.1f MiB\nmetrics: %s\ncheckpoint: %s\n",
      summary->steps_run, summary->first_loss, summary->final_loss, summary->tokens_per_s,
      100.0 * summary->mfu, summary->peak_flops / 1e9,
      spec->parallel().pipeline() > 1 ? " per rank" : "", summary->peak_memory_bytes / 1048576.0,
      summary->metrics_path, summary->last_checkpoint);
  return 0;
}

}  // namespace vp::cli
