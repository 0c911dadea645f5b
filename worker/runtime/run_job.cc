#include "worker/runtime/run_job.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/data/sample_reader.h"
#include "worker/data/token_file.h"
#include "worker/data/tokenizer.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/flops.h"
#include "worker/runtime/job_options.h"

namespace vp::runtime {
namespace fs = std::filesystem;

absl::StatusOr<BatchFn> OpenJobBatches(const vocabpipe::v1::JobSpec& spec) {
  if (absl::Status st = data::CheckDataTokenizer(spec.data().path(), spec.model().vocab_size());
      !st.ok()) {
    return st;
  }
  auto file = data::TokenFile::Load(spec.data().path(), spec.model().vocab_size());
  if (!file.ok()) return file.status();
  auto reader = data::SampleReader::Create(std::make_shared<data::TokenFile>(std::move(*file)),
                                           {.seq_len = spec.model().seq_len(),
                                            .microbatch_size = spec.parallel().microbatch_size(),
                                            .microbatches = spec.parallel().microbatches(),
                                            .shuffle = spec.data().shuffle(),
                                            .seed = spec.train().seed()});
  if (!reader.ok()) return reader.status();
  auto shared = std::make_shared<data::SampleReader>(std::move(*reader));
  return BatchFn([shared](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    return shared->Fill(step, j, inputs, targets);
  });
}

namespace {

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return absl::StrFormat("%02d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
}

}  // namespace

absl::StatusOr<RunSummary> RunStandaloneJob(const vocabpipe::v1::JobSpec& spec,
                                            const RunOptions& options, std::ostream& progress) {
  auto topt = TrainerOptionsFromSpec(spec);
  if (!topt.ok()) return topt.status();
  engine::cpu::SetBlasThreads(spec.train().threads());

  auto batches_or = OpenJobBatches(spec);
  if (!batches_or.ok()) return batches_or.status();
  const BatchFn batches = std::move(*batches_or);

  auto trainer = StandaloneTrainer::Create(*topt);
  if (!trainer.ok()) return trainer.status();
  StandaloneTrainer& tr = **trainer;

  const std::string run_dir = spec.checkpoint().dir();
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("checkpoint.dir: cannot create ", run_dir, ": ", ec.message()));
  }
  RunSummary summary;
  int64_t first_step = 0;
  if (options.resume) {
    auto latest = LatestCheckpointStep(run_dir);
    if (latest.ok()) {
      if (auto st = LoadCheckpoint(CheckpointDir(run_dir, *latest), tr.model(), &tr.optimizer());
          !st.ok()) {
        return st;
      }
      first_step = *latest;
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }
  if (first_step == 0 && !spec.model().init_from().empty()) {  // a fresh run from HF weights
    if (auto st = InitFromHfDir(spec.model().init_from(), tr.model()); !st.ok()) return st;
  }
  summary.first_step = first_step;
  summary.metrics_path = (fs::path(run_dir) / "metrics.jsonl").string();
  // A fresh run starts a new metrics file; a resumed one appends to it.
  std::ofstream metrics(summary.metrics_path, first_step > 0 ? std::ios::app : std::ios::trunc);
  if (!metrics) return absl::InternalError(absl::StrCat(summary.metrics_path, ": cannot open"));

  const int64_t steps = spec.train().steps();
  const int every = spec.checkpoint().every();
  if (steps == 0) {  // steps: 0 saves the initial model and stops
    if (auto st = SaveCheckpoint(run_dir, 0, tr.model(), tr.optimizer()); !st.ok()) return st;
    summary.last_checkpoint = CheckpointDir(run_dir, 0);
  }

  summary.peak_flops = MeasureCpuPeakFlops();
  const auto& cfg = topt->model;
  const double tokens_per_step =
      static_cast<double>(topt->microbatches) * topt->microbatch_size * cfg.seq_len;
  const double flops_per_step =
      topt->microbatches * ModelFlopsPerMicrobatch(cfg, topt->microbatch_size);
  double timed_seconds = 0, timed_steps = 0, elapsed = 0;
  for (int64_t step = first_step; step < steps; ++step) {
    tr.memory().ResetPeaks();
    auto r = tr.Step(step, batches);
    if (!r.ok()) return r.status();
    elapsed += r->seconds;
    if (step > first_step || steps - first_step == 1) {
      timed_seconds += r->seconds;
      timed_steps += 1;
    }
    const double tps = tokens_per_step / r->seconds;
    const double mfu = flops_per_step / r->seconds / summary.peak_flops;
    const int64_t peak = tr.memory().total_peak();
    nlohmann::json line = {
        {"step", step},
        {"loss", r->loss},
        {"lr", r->lr},
        {"grad_norm", r->grad_norm},
        {"tokens_per_s", tps},
        {"mfu", mfu},
        {"peak_memory_bytes", peak},
        {"step_seconds", r->seconds},
        {"memory",
         {{"parameters", tr.memory().peak(engine::MemoryCategory::kParameters)},
          {"gradients", tr.memory().peak(engine::MemoryCategory::kGradients)},
          {"optimizer", tr.memory().peak(engine::MemoryCategory::kOptimizer)},
          {"activations", tr.memory().peak(engine::MemoryCategory::kActivations)}}},
    };
    metrics << line.dump() << "\n";
    metrics.flush();
    if (step == first_step) summary.first_loss = r->loss;
    summary.final_loss = r->loss;
    summary.peak_memory_bytes = std::max(summary.peak_memory_bytes, peak);
    summary.steps_run += 1;

    const double eta = elapsed / summary.steps_run * static_cast<double>(steps - step - 1);
    const std::string text = absl::StrFormat(
        "step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | MFU %.1f%% | mem %.1f MiB | ETA %s",
        step + 1, steps, r->loss, r->lr, tps, 100.0 * mfu, peak / 1048576.0, FormatDuration(eta));
    if (options.interactive) {
      progress << "\r" << text << "\033[K" << std::flush;
    } else {
      progress << text << "\n";
    }
    const int64_t done = step + 1;
    if ((every > 0 && done % every == 0) || done == steps) {
      if (auto st = SaveCheckpoint(run_dir, done, tr.model(), tr.optimizer()); !st.ok()) {
        return st;
      }
      summary.last_checkpoint = CheckpointDir(run_dir, done);
    }
  }
  if (options.interactive && summary.steps_run > 0) progress << "\n";
  if (timed_steps > 0) {
    summary.tokens_per_s = tokens_per_step * timed_steps / timed_seconds;
    summary.mfu = flops_per_step * timed_steps / timed_seconds / summary.peak_flops;
  }
  return summary;
}

}  // namespace vp::runtime
