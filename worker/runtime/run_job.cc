#include "worker/runtime/run_job.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/safefs/dir.h"
#include "proto/spec/job_spec.h"
#include "worker/data/sample_reader.h"
#include "worker/data/token_file.h"
#include "worker/data/token_shards.h"
#include "worker/data/tokenizer.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/flops.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/process_memory.h"

namespace vp::runtime {
namespace fs = std::filesystem;

absl::StatusOr<BatchFn> OpenJobBatches(const vocabpipe::v1::JobSpec& spec, int replica) {
  const int d = std::max(1, spec.parallel().data());
  if (replica < 0 || replica >= d) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica ", replica, " is not in [0, parallel.data = ", d, ")"));
  }
  const std::vector<std::string> entries = spec::DataPathEntries(spec.data());
  if (absl::Status st = data::CheckDataTokenizer(entries.front(), spec.model().vocab_size());
      !st.ok()) {
    return st;
  }
  // The shards are read in place: the rank never holds the corpus in memory (token_shards.h).
  auto tokens = data::OpenTokenShards(
      spec.data().paths().empty() ? "data.path" : "data.paths", entries, spec.model().vocab_size(),
      spec.data().shuffle() ? data::TokenAccess::kRandom : data::TokenAccess::kSequential);
  if (!tokens.ok()) return tokens.status();
  auto reader =
      data::SampleReader::Create(*tokens, {.seq_len = spec.model().seq_len(),
                                           .microbatch_size = spec.parallel().microbatch_size(),
                                           .microbatches = d * spec.parallel().microbatches(),
                                           .shuffle = spec.data().shuffle(),
                                           .seed = spec.train().seed()});
  if (!reader.ok()) return reader.status();
  auto shared = std::make_shared<data::SampleReader>(std::move(*reader));
  // The step's d·m microbatches in one order; replica r trains on r·m .. r·m + m − 1.
  const int first = replica * spec.parallel().microbatches();
  return BatchFn([shared, first](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    return shared->Fill(step, first + j, inputs, targets);
  });
}

absl::StatusOr<BatchFn> OpenValidationBatches(const vocabpipe::v1::JobSpec& spec) {
  const std::vector<std::string> entries = spec::ValPathEntries(spec.data());
  if (entries.empty() || entries.front().empty()) {
    return absl::InvalidArgumentError("data.val_path: required for evaluation");
  }
  const std::string field = spec.data().val_paths().empty() ? "data.val_path" : "data.val_paths";
  if (absl::Status st = data::CheckDataTokenizer(entries.front(), spec.model().vocab_size());
      !st.ok()) {
    return st;
  }
  auto tokens = data::OpenTokenShards(field, entries, spec.model().vocab_size(),
                                      data::TokenAccess::kSequential);
  if (!tokens.ok()) return tokens.status();
  // One microbatch per "step" of the reader: microbatch r·m + j is the reader's step r·m + j.
  auto reader =
      data::SampleReader::Create(*tokens, {.seq_len = spec.model().seq_len(),
                                           .microbatch_size = spec.parallel().microbatch_size(),
                                           .microbatches = 1,
                                           .shuffle = false,
                                           .seed = 0});
  if (!reader.ok()) return reader.status();
  auto shared = std::make_shared<data::SampleReader>(std::move(*reader));
  const int64_t m = spec.parallel().microbatches();
  return BatchFn([shared, m](int64_t round, int j, int32_t* inputs, int32_t* targets) {
    return shared->Fill(round * m + j, 0, inputs, targets);
  });
}

bool EvaluatesAfter(const vocabpipe::v1::JobSpec& spec, int64_t done) {
  const int every = spec.train().eval_every();
  return every > 0 && (done % every == 0 || done == spec.train().steps());
}

std::string DataTokenizerPath(const vocabpipe::v1::JobSpec& spec) {
  return (fs::path(data::DataFolder(spec::DataPathEntries(spec.data()).front())) /
          "tokenizer.model")
      .string();
}

absl::Status CopyDataTokenizer(const vocabpipe::v1::JobSpec& spec, const std::string& step_dir) {
  // The data's folder was confined by the storage-root check; the tokenizer in it is read
  // without following a link (a link there could name a model outside the root, which would
  // then be copied into the run), and written into the step folder by handle.
  auto data_dir = safefs::Dir::OpenFollowing(fs::path(DataTokenizerPath(spec)).parent_path());
  if (!data_dir.ok()) return absl::OkStatus();  // no data folder: nothing to copy
  if (data_dir->KindOf("tokenizer.model") == safefs::Kind::kMissing) return absl::OkStatus();
  auto text = data_dir->ReadFile("tokenizer.model", size_t{1} << 30);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("the tokenizer beside data.path: ", text.status().message()));
  }
  auto to = safefs::Dir::Open(step_dir);
  if (!to.ok()) return to.status();
  if (auto st = to->WriteFileAtomically("tokenizer.model", *text); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("cannot copy the tokenizer: ", st.message()));
  }
  return absl::OkStatus();
}

bool SamplesAfter(const vocabpipe::v1::JobSpec& spec, int64_t done) {
  const int every = spec.train().sample_every();
  return every > 0 && (done % every == 0 || done == spec.train().steps());
}

absl::Status CheckSampling(const vocabpipe::v1::JobSpec& spec) {
  if (spec.train().sample_every() <= 0) return absl::OkStatus();
  std::error_code ec;
  if (!fs::exists(DataTokenizerPath(spec), ec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.sample_every: needs a tokenizer; ", DataTokenizerPath(spec),
        " does not exist (`vocabpipe data tokenize` writes it beside the token files)"));
  }
  return absl::OkStatus();
}

SampleOptions TrainingSampleOptions(const vocabpipe::v1::JobSpec& spec) {
  return {.max_tokens = spec.train().sample_tokens(),
          .temperature = 1.0f,
          .top_k = 40,
          .seed = spec.train().seed()};
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

  BatchFn val_batches;
  if (spec.train().eval_every() > 0) {
    auto val = OpenValidationBatches(spec);
    if (!val.ok()) return val.status();
    val_batches = std::move(*val);
  }

  if (auto st = CheckSampling(spec); !st.ok()) return st;

  auto trainer = StandaloneTrainer::Create(*topt);
  if (!trainer.ok()) return trainer.status();
  StandaloneTrainer& tr = **trainer;
  std::unique_ptr<EngineDecoder> sampler;  // the trained weights, copied at each sample
  if (spec.train().sample_every() > 0) {
    auto d = EngineDecoder::Create(tr.model());
    if (!d.ok()) return d.status();
    sampler = std::move(*d);
  }

  const std::string run_dir = spec.checkpoint().dir();
  auto run = safefs::Dir::Create(run_dir);
  if (!run.ok()) {
    return absl::Status(run.status().code(),
                        absl::StrCat("checkpoint.dir: ", run.status().message()));
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
  auto metrics = run->OpenFile("metrics.jsonl",
                               O_WRONLY | O_CREAT | O_APPEND | (first_step > 0 ? 0 : O_TRUNC));
  if (!metrics.ok()) return metrics.status();

  const int64_t steps = spec.train().steps();
  const int every = spec.checkpoint().every();
  const int64_t max_shard_bytes = spec.checkpoint().max_shard_bytes() > 0
                                      ? spec.checkpoint().max_shard_bytes()
                                      : kDefaultMaxShardBytes;
  if (steps == 0) {  // steps: 0 saves the initial model and stops
    if (auto st = SaveCheckpoint(run_dir, 0, tr.model(), tr.optimizer(), max_shard_bytes); !st.ok())
      return st;
    if (auto st = CopyDataTokenizer(spec, CheckpointDir(run_dir, 0)); !st.ok()) return st;
    summary.last_checkpoint = CheckpointDir(run_dir, 0);
  }

  const CpuPeak cpu_peak = CpuPeakFlops();
  summary.peak_flops = cpu_peak.flops;
  summary.peak_source = cpu_peak.source;
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
    bool over_peak = false;
    const double mfu = ClampedMfu(flops_per_step / r->seconds, summary.peak_flops, &over_peak);
    summary.peak_stale |= over_peak;
    // The run's real footprint: the process's peak resident memory so far (the engine's
    // buffers, the program and its libraries, allocator slack, the start-up's transients such as
    // the sgemm peak probe), never less than the engine's own.
    const int64_t process_peak = PeakResidentBytes();
    const int64_t peak = std::max(tr.memory().total_peak(), process_peak);
    nlohmann::json line = {
        {"step", step},
        {"loss", r->loss},
        {"lr", r->lr},
        {"grad_norm", r->grad_norm},
        {"tokens_per_s", tps},
        {"mfu", mfu},
        {"mfu_peak_flops", summary.peak_flops},
        {"peak_memory_bytes", peak},
        {"step_seconds", r->seconds},
        {"memory",
         {{"parameters", tr.memory().peak(engine::MemoryCategory::kParameters)},
          {"gradients", tr.memory().peak(engine::MemoryCategory::kGradients)},
          {"optimizer", tr.memory().peak(engine::MemoryCategory::kOptimizer)},
          {"activations", tr.memory().peak(engine::MemoryCategory::kActivations)},
          {"process", process_peak}}},
    };
    std::string val_text;
    if (EvaluatesAfter(spec, step + 1)) {
      auto val = tr.Evaluate(0, spec.train().eval_batches(), val_batches);
      if (!val.ok()) {
        return absl::Status(val.status().code(), absl::StrCat("evaluation after step ", step + 1,
                                                              ": ", val.status().message()));
      }
      line["val_loss"] = *val;
      summary.has_val_loss = true;
      summary.final_val_loss = *val;
      val_text = absl::StrFormat(" | val %.4f", *val);
    }
    std::string sample_text;
    if (SamplesAfter(spec, step + 1)) {
      if (auto st = sampler->CopyWeights(tr.model()); !st.ok()) return st;
      auto sample = SampleText(*sampler, DataTokenizerPath(spec), "", TrainingSampleOptions(spec));
      if (!sample.ok()) {
        return absl::Status(sample.status().code(), absl::StrCat("sample after step ", step + 1,
                                                                 ": ", sample.status().message()));
      }
      line["sample"] = sample->text;
      sample_text = sample->text;
    }
    // A sample may end inside a multi-byte character: such bytes are written as U+FFFD.
    const std::string metrics_line =
        line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (auto st = safefs::WriteAll(metrics->get(), metrics_line.data(), metrics_line.size(),
                                   summary.metrics_path);
        !st.ok()) {
      return st;
    }
    if (step == first_step) summary.first_loss = r->loss;
    summary.final_loss = r->loss;
    summary.peak_memory_bytes = std::max(summary.peak_memory_bytes, peak);
    summary.steps_run += 1;

    const double eta = elapsed / summary.steps_run * static_cast<double>(steps - step - 1);
    const std::string text = absl::StrFormat(
        "step %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | MFU %.1f%% | mem %.1f MiB | ETA %s",
        step + 1, steps, r->loss, val_text, r->lr, tps, 100.0 * mfu, peak / 1048576.0,
        FormatDuration(eta));
    if (options.interactive) {
      progress << "\r" << text << "\033[K" << std::flush;
    } else {
      progress << text << "\n";
    }
    if (!sample_text.empty()) {
      if (options.interactive) progress << "\n";
      progress << "sample after step " << step + 1 << ":\n" << sample_text << "\n---\n";
    }
    const int64_t done = step + 1;
    if ((every > 0 && done % every == 0) || done == steps) {
      if (auto st = SaveCheckpoint(run_dir, done, tr.model(), tr.optimizer(), max_shard_bytes);
          !st.ok()) {
        return st;
      }
      if (auto st = CopyDataTokenizer(spec, CheckpointDir(run_dir, done)); !st.ok()) return st;
      summary.last_checkpoint = CheckpointDir(run_dir, done);
    }
  }
  if (options.interactive && summary.steps_run > 0) progress << "\n";
  if (timed_steps > 0) {
    summary.tokens_per_s = tokens_per_step * timed_steps / timed_seconds;
    summary.mfu =
        ClampedMfu(flops_per_step * timed_steps / timed_seconds, summary.peak_flops, nullptr);
  }
  return summary;
}

}  // namespace vp::runtime
