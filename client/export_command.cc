// vocabpipe export RUN_DIR [--step N]: merges the per-rank checkpoint shards of a pipeline
// run into step_<N>/model.safetensors + config.json + DONE (latest complete step by default;
// above checkpoint.max_shard_bytes model-0000k-of-0000n.safetensors + the index instead),
// with the run's tokenizer.model (the one next to data.path, if any) beside it, so that
// `vocabpipe sample` finds it.
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/commands.h"
#include "worker/launch/run_dir.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/run_job.h"

namespace vp::cli {
namespace {

constexpr char kUsage[] = "usage: vocabpipe export RUN_DIR [--step N]\n";

}  // namespace

int RunExportCommand(const Args& args, std::ostream& out, std::ostream& err) {
  std::string dir;
  int64_t step = -1;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out << kUsage;
      return 0;
    }
    if (a == "--step") {
      if (i + 1 >= args.size() || !absl::SimpleAtoi(args[i + 1], &step) || step < 0) {
        err << "vocabpipe export: --step needs a non-negative integer\n" << kUsage;
        return 2;
      }
      ++i;
    } else if (!a.empty() && a[0] == '-') {
      err << "vocabpipe export: unknown flag " << a << "\n" << kUsage;
      return 2;
    } else if (dir.empty()) {
      dir = a;
    } else {
      err << "vocabpipe export: more than one run directory given\n" << kUsage;
      return 2;
    }
  }
  if (dir.empty()) {
    err << "vocabpipe export: missing RUN_DIR\n" << kUsage;
    return 2;
  }
  auto files = launch::ReadRunFiles(dir);
  if (!files.ok()) {
    err << "vocabpipe export: " << dir
        << " is not a pipeline run directory: " << files.status().message() << "\n";
    return 2;
  }
  const int world = files->plan.pipeline;
  if (step < 0) {
    auto latest = launch::LatestShardedStep(dir, world);
    if (!latest.ok()) {
      err << "vocabpipe export: " << latest.status().message() << "\n";
      return 1;
    }
    step = *latest;
  }
  auto topt = runtime::TrainerOptionsFromSpec(files->spec, &files->plan);
  if (!topt.ok()) {
    err << "vocabpipe export: " << topt.status().message() << "\n";
    return 2;
  }
  // checkpoint.max_shard_bytes of the run: above it the export is Hugging Face's sharded form.
  const int64_t max_shard_bytes = files->spec.checkpoint().max_shard_bytes() > 0
                                      ? files->spec.checkpoint().max_shard_bytes()
                                      : runtime::kDefaultMaxShardBytes;
  if (auto st = launch::MergeShards(dir, step, world, topt->model, max_shard_bytes); !st.ok()) {
    err << "vocabpipe export: " << st.message() << "\n";
    return 1;
  }
  if (auto st = runtime::CopyDataTokenizer(files->spec, runtime::CheckpointDir(dir, step));
      !st.ok()) {
    err << "vocabpipe export: " << st.message() << "\n";
    return 1;
  }
  // The single file, or the index of the sharded form.
  const std::filesystem::path step_dir(runtime::CheckpointDir(dir, step));
  const std::filesystem::path index = step_dir / runtime::kHfIndexFile;
  out << "exported step " << step << " of " << world << " ranks: "
      << (std::filesystem::exists(index) ? index : step_dir / runtime::kHfSingleFile).string()
      << "\n";
  return 0;
}

}  // namespace vp::cli
