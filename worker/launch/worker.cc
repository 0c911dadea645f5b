#include "worker/launch/worker.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "proto/plan/topology.h"
#include "proto/safefs/dir.h"
#include "proto/spec/job_spec.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/preemption.h"
#include "worker/launch/run_dir.h"
#include "worker/launch/run_lock.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/process_memory.h"
#include "worker/runtime/run_job.h"

namespace vp::launch {
namespace fs = std::filesystem;

std::string RankStepJson(int rank, const runtime::RankStepResult& r, int64_t checkpoint_step,
                         const runtime::RankEvalResult* eval, const RankFootprint& footprint,
                         double checkpoint_seconds) {
  nlohmann::json busy = nlohmann::json::object(), comm = nlohmann::json::object();
  double comm_total = 0;
  for (int k = 0; k < planner::kNumActionKinds; ++k) {
    const std::string name(planner::ActionKindName(static_cast<planner::ActionKind>(k)));
    if (r.busy[k] > 0) busy[name] = r.busy[k];
    if (r.comm[k] > 0) comm[name] = r.comm[k];
    comm_total += r.comm[k];
  }
  nlohmann::json j = {
      {"step", r.step},
      {"rank", rank},
      {"has_loss", r.has_loss},
      {"grad_norm", r.grad_norm},
      {"lr", r.lr},
      {"seconds", r.seconds},
      {"busy_seconds", r.busy_seconds()},
      {"busy", busy},
      {"compute_wait_seconds", r.compute_wait_seconds},
      {"comm_seconds", comm_total},
      {"comm", comm},
      {"memory",
       {{"parameters", r.peak_parameters},
        {"gradients", r.peak_gradients},
        {"optimizer", r.peak_optimizer},
        {"activations", r.peak_activations},
        {"total", r.peak_total}}},
  };
  if (footprint.process_peak >= 0) {
    j["memory"]["process"] = footprint.process_peak;
    // What the rank really holds, the figure status and the dashboards show: on a CPU rank the
    // process's peak (it includes the engine's buffers), on a CUDA rank the device's.
    j["memory"]["footprint"] =
        footprint.device ? r.peak_total : std::max(r.peak_total, footprint.process_peak);
  }
  if (r.has_loss) j["loss"] = r.loss;
  if (r.data_parallel_seconds > 0) j["data_parallel_seconds"] = r.data_parallel_seconds;
  if (checkpoint_step >= 0) j["checkpoint_step"] = checkpoint_step;
  if (checkpoint_seconds >= 0) j["checkpoint_seconds"] = checkpoint_seconds;
  if (eval != nullptr) {
    j["eval_seconds"] = eval->seconds;
    if (eval->has_loss) j["val_loss"] = eval->loss;
  }
  return j.dump();
}

namespace {

// After a save, the rank that wrote shard `shard` of `step` (stage·t + tensor rank) marks it
// complete in the rendezvous store.
absl::Status MarkShard(gloo::rendezvous::Store& store, const WorkerOptions& options, int shard,
                       int64_t step) {
  try {
    store.set(absl::StrCat("vocabpipe/", options.attempt, "/saved/", step, "/", shard), {'1'});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("marking this rank's shard of step ", step, " saved: ", e.what()));
  }
  return absl::OkStatus();
}

// Rank 0, after its own mark: waits for every rank's (bounded by the rank timeout), merges the
// shards into the Hugging Face checkpoint and applies checkpoint.keep_last. Merging here, in the
// job's own processes, works the same for local runs and daemon runs: the ranks already share
// checkpoint.dir (each writes its shard there).
absl::Status MergeStep(gloo::rendezvous::Store& store, const WorkerOptions& options, int world,
                       int64_t step, const engine::ModelConfig& config, int keep_last,
                       int64_t max_shard_bytes) {
  const std::string prefix = absl::StrCat("vocabpipe/", options.attempt, "/saved/", step, "/");
  try {
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(absl::StrCat(prefix, r));
    store.wait(keys, absl::ToChronoMilliseconds(options.timeout));
  } catch (const std::exception& e) {
    return absl::DeadlineExceededError(
        absl::StrCat("waiting for every rank's shard of step ", step, ": ", e.what()));
  }
  if (auto st = MergeShards(options.run_dir, step, world, config, max_shard_bytes); !st.ok()) {
    return st;
  }
  return PruneCheckpoints(options.run_dir, step, world, keep_last);
}

// Rank 0's merge of the newest saved step, off the training path: the shards (the resume
// state) are saved and marked before the rank goes on, the merge into the Hugging Face
// checkpoint runs on this thread meanwhile, so a slow merge (a large vocabulary, a slow file
// system) never holds up a step and never trips the peers' transfer timeout. At most one runs:
// the next merge, a sample (which reads the merged checkpoint) and the end of the run join it
// first, and its error fails the rank there.
class BackgroundMerge {
 public:
  BackgroundMerge() = default;
  BackgroundMerge(const BackgroundMerge&) = delete;
  BackgroundMerge& operator=(const BackgroundMerge&) = delete;
  ~BackgroundMerge() { (void)Join(); }

  absl::Status Start(std::function<absl::Status()> work) {
    if (auto st = Join(); !st.ok()) return st;
    thread_ = std::thread([this, work = std::move(work)] { status_ = work(); });
    return absl::OkStatus();
  }
  absl::Status Join() {
    if (thread_.joinable()) thread_.join();
    return std::exchange(status_, absl::OkStatus());
  }

 private:
  std::thread thread_;
  absl::Status status_;  // written by the thread, read after the join
};

// The text of a training sample from a merged checkpoint folder (runtime::SampleText).
absl::StatusOr<std::string> SampleCheckpoint(const vocabpipe::v1::JobSpec& spec,
                                             const std::string& step_dir) {
  auto decoder = runtime::LoadDecoder(step_dir);
  if (!decoder.ok()) return decoder.status();
  auto sample = runtime::SampleText(**decoder, runtime::DataTokenizerPath(spec), "",
                                    runtime::TrainingSampleOptions(spec));
  if (!sample.ok()) return sample.status();
  return sample->text;
}

}  // namespace

absl::StatusOr<WorkerOutcome> RunWorker(const WorkerOptions& options) {
  const std::string& dir = options.run_dir;
  auto files = ReadRunFiles(dir, options.rank);
  if (!files.ok()) return files.status();
  const vocabpipe::v1::JobSpec& spec = files->spec;
  const planner::Plan& plan = files->plan;
  const int p = plan.pipeline;
  // The job's ranks: d replicas of the p-stage pipeline, t tensor ranks a stage
  // (proto/plan/topology.h). The plan's ranks are the stages; checkpoint shards are per stage
  // and tensor rank (shard stage·t + tensor of p·t), written by replica 0.
  const int t = std::max(1, spec.parallel().tensor());
  auto topology = planner::Topology::Create(p, spec.parallel().data(), t, spec::kMaxRanks);
  if (!topology.ok()) return topology.status();
  const int world = topology->world();
  if (options.rank < 0 || options.rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank: ", options.rank, " is not in [0, ", world, ")"));
  }
  const planner::RankCoord coord = topology->CoordOf(options.rank);
  const int stage = coord.stage;
  const int shard = stage * t + coord.tensor, shards = p * t;
  const bool writes_shards = coord.replica == 0;
  // Held until the process exits: no other run may write into this directory meanwhile.
  const std::string run_id = options.run_id.empty() ? options.attempt : options.run_id;
  auto lock = RunDirLock::Acquire(dir, run_id);
  if (!lock.ok()) return lock.status();
  auto topt = runtime::TrainerOptionsFromSpec(spec, &plan);
  if (!topt.ok()) return topt.status();
  topt->data.replica = coord.replica;
  topt->tensor = {.size = t, .rank = coord.tensor};
  // For operators and tests: which process is this rank (the launcher and daemons start it).
  // By handle, replacing the name: a link planted there is never written through.
  {
    auto folder = safefs::Dir::Open(dir);
    if (!folder.ok()) return folder.status();
    if (auto st = folder->WriteFileAtomically(absl::StrCat("rank_", options.rank, ".pid"),
                                              absl::StrCat(getpid(), "\n"));
        !st.ok()) {
      return st;
    }
  }
  engine::cpu::SetBlasThreads(runtime::WorkerThreads(spec));

  // Data: every rank reads every microbatch (the first stage needs the inputs, the vocabulary
  // shards need the targets), so each rank opens the token file itself.
  // With d replicas, the replica's own m of the step's d·m microbatches.
  auto batches_or = runtime::OpenJobBatches(spec, coord.replica);
  if (!batches_or.ok()) return batches_or.status();
  const runtime::BatchFn batches = std::move(*batches_or);
  if (auto st = runtime::CheckSampling(spec); !st.ok()) return st;
  // Validation: every rank reads the same validation microbatches, like the training ones.
  runtime::BatchFn val_batches;
  if (spec.train().eval_every() > 0) {
    auto val = runtime::OpenValidationBatches(spec);
    if (!val.ok()) return val.status();
    val_batches = std::move(*val);
  }

  std::shared_ptr<gloo::rendezvous::Store> store = options.store;
  if (store == nullptr) {
    auto file_store = comm::MakeFileStore(StoreDir(dir));
    if (!file_store.ok()) return file_store.status();
    store = *file_store;
  }
  // The rank on the spec's device, with the communicators it needs (job_rank.h).
  const absl::Time connect_start = absl::Now();
  auto job_rank = ConnectJobRank(spec, plan, *topt, options, store);
  if (!job_rank.ok()) return job_rank.status();
  // For the operator reading the rank's log: where it runs and how long the connection (on a
  // GPU: context creation, module loading, the communicators) took.
  std::cerr << "rank " << options.rank << " (" << topology->Describe(options.rank) << "): device "
            << ((*job_rank)->cuda_device >= 0 ? absl::StrCat("cuda:", (*job_rank)->cuda_device)
                                              : std::string("cpu"))
            << ", transport " << (*job_rank)->transport << ", connected in "
            << absl::StrFormat("%.2f", absl::ToDoubleSeconds(absl::Now() - connect_start)) << " s"
            << std::endl;
  runtime::PipelineRank& rank = *(*job_rank)->rank;
  // A device rank keeps parameters and optimizer state on the device: checkpoints go through
  // the host view.
  // Replica 0 of each stage writes the stage's shard; under ZeRO-1 every replica writes its
  // range of the optimizer state beside it (shard_checkpoint.h: PrepareShardSave, then the
  // ranges, then the manifest, with the replicas in step between them), so no replica ever
  // holds more than its own range.
  comm::Communicator* data_group = (*job_rank)->data;
  const bool zero = rank.optimizer().sharded();
  auto save = [&](int64_t step) -> absl::Status {
    if (auto st = rank.PullState(); !st.ok()) return st;
    if (zero) {
      const int d = data_group->size();
      if (writes_shards) {
        if (auto st = PrepareShardSave(dir, step, shard); !st.ok()) return st;
      }
      if (auto st = data_group->Barrier(); !st.ok()) return st;
      if (auto st = SaveOptimizerRange(dir, step, shard, rank.model(), rank.optimizer(),
                                       data_group->rank(), d);
          !st.ok()) {
        return st;
      }
      if (auto st = data_group->Barrier(); !st.ok()) return st;
      if (!writes_shards) return absl::OkStatus();
      return SaveRankShard(dir, step, shard, shards, rank.model(), rank.optimizer(), run_id, d);
    }
    if (!writes_shards) return absl::OkStatus();
    return SaveRankShard(dir, step, shard, shards, rank.model(), rank.optimizer(), run_id);
  };
  auto fatal = [&](absl::Status st) {
    if (options.on_fatal) options.on_fatal(st);
    return st;
  };

  int64_t first_step = 0;
  if (options.resume_step >= 0) {
    const absl::Time load_start = absl::Now();
    // Every replica reads its stage's shard (under ZeRO-1 only the moments of its range, from
    // whichever form they were saved in). A step saved under another p is re-split by tensor
    // name and vocabulary row.
    auto saved = SavedRanksOf(dir, options.resume_step);
    if (!saved.ok()) return fatal(saved.status());
    engine::AdamW* into = &rank.optimizer();
    if (auto st = saved->world == shards && saved->tensor == t
                      ? LoadRankShard(dir, options.resume_step, shard, shards, rank.model(), into)
                      : LoadFromShards(dir, options.resume_step, saved->world, rank.model(), into);
        !st.ok()) {
      return fatal(st);
    }
    // For the operator (and bench/checkpoint): how long reading the shard back took.
    std::cerr << "rank " << options.rank << ": resumed from step " << options.resume_step << " in "
              << absl::StrFormat("%.2f", absl::ToDoubleSeconds(absl::Now() - load_start)) << " s"
              << std::endl;
    if (auto st = rank.PushState(); !st.ok()) return fatal(st);
    first_step = options.resume_step;
  } else if (!spec.model().init_from().empty()) {  // a fresh run from HF weights: this slice
    if (auto st = runtime::InitFromHfDir(spec.model().init_from(), rank.model()); !st.ok()) {
      return fatal(st);
    }
    if (auto st = rank.PushState(); !st.ok()) return fatal(st);
  }
  const std::string metrics_path = RankMetricsPath(dir, options.rank);
  auto metrics =
      OpenRunFile(dir, absl::StrCat("rank_", options.rank, ".jsonl"), O_WRONLY | O_CREAT | O_TRUNC);
  if (!metrics.ok()) return fatal(metrics.status());

  const int64_t steps = spec.train().steps();
  const int every = spec.checkpoint().every();
  // Every rank takes part (the store holds the request and the acknowledgements), signalled
  // or not: any rank may be the one the platform stops.
  BackgroundMerge merging;  // rank 0 only
  PreemptionAgreement preemption(*store, absl::StrCat("vocabpipe/", options.attempt, "/preempt/"),
                                 options.rank, world, options.preempt, options.preempt_poll);
  WorkerOutcome outcome;
  const int keep_last = spec.checkpoint().keep_last();
  const int64_t max_shard_bytes = spec.checkpoint().max_shard_bytes() > 0
                                      ? spec.checkpoint().max_shard_bytes()
                                      : runtime::kDefaultMaxShardBytes;
  if (steps == 0) {  // steps: 0 saves the initial model and stops (like a standalone run)
    if (auto st = save(0); !st.ok()) {
      return fatal(st);
    }
    if (writes_shards) {
      if (auto st = MarkShard(*store, options, shard, 0); !st.ok()) return fatal(st);
    }
    if (options.rank == 0) {
      if (auto st = MergeStep(*store, options, shards, 0, topt->model, keep_last, max_shard_bytes);
          !st.ok()) {
        return fatal(st);
      }
      if (auto st = runtime::CopyDataTokenizer(spec, runtime::CheckpointDir(dir, 0)); !st.ok()) {
        return fatal(st);
      }
    }
    return outcome;
  }
  for (int64_t step = first_step; step < steps; ++step) {
    rank.memory().ResetPeaks();
    auto r = rank.Step(step, batches);
    if (!r.ok()) {
      return fatal(
          absl::Status(r.status().code(), absl::StrCat("step ", step, ": ", r.status().message())));
    }
    const int64_t done = step + 1;
    // Evaluation before the save: every rank runs the plan's forward actions together.
    std::optional<runtime::RankEvalResult> eval;
    if (runtime::EvaluatesAfter(spec, done)) {
      auto e = rank.Evaluate(spec.train().eval_batches(), val_batches);
      if (!e.ok()) {
        return fatal(absl::Status(e.status().code(), absl::StrCat("evaluation after step ", done,
                                                                  ": ", e.status().message())));
      }
      eval = *e;
    }
    // A preemption: the step every rank agreed on gets an emergency checkpoint (the last
    // step's save is the usual one), then the ranks stop.
    auto stop = preemption.StopAfter(done);
    if (!stop.ok()) return fatal(stop.status());
    const bool preempted = *stop && done < steps;
    int64_t checkpoint_step = -1;
    // A sample is drawn from the merged checkpoint: sample steps save one too.
    const bool sample = runtime::SamplesAfter(spec, done);
    std::string sample_text;
    double checkpoint_seconds = -1;
    if ((every > 0 && done % every == 0) || done == steps || sample || preempted) {
      // What the save holds the step for: the rank's shard written, fsynced and its manifest in
      // place, then marked (rank 0's merge runs after, off the training path).
      const absl::Time save_start = absl::Now();
      if (auto st = save(done); !st.ok()) {
        return fatal(
            absl::Status(st.code(), absl::StrCat("checkpoint of step ", done, ": ", st.message())));
      }
      if (writes_shards) {
        if (auto st = MarkShard(*store, options, shard, done); !st.ok()) {
          return fatal(absl::Status(st.code(),
                                    absl::StrCat("checkpoint of step ", done, ": ", st.message())));
        }
      }
      checkpoint_step = done;
      checkpoint_seconds = absl::ToDoubleSeconds(absl::Now() - save_start);
      if (options.rank == 0) {
        const std::string step_dir = runtime::CheckpointDir(dir, done);
        auto merge = [&options, &spec, store, shards, done, step_dir, model = topt->model,
                      keep_last, max_shard_bytes]() -> absl::Status {
          absl::Status st =
              MergeStep(*store, options, shards, done, model, keep_last, max_shard_bytes);
          if (st.ok()) st = runtime::CopyDataTokenizer(spec, step_dir);
          if (st.ok()) return st;
          return absl::Status(st.code(),
                              absl::StrCat("checkpoint of step ", done, ": ", st.message()));
        };
        if (auto st = merging.Start(std::move(merge)); !st.ok()) return fatal(st);
        if (sample) {
          if (auto st = merging.Join(); !st.ok()) return fatal(st);
          auto text = SampleCheckpoint(spec, step_dir);
          if (!text.ok()) {
            return fatal(absl::Status(
                text.status().code(),
                absl::StrCat("sample after step ", done, ": ", text.status().message())));
          }
          sample_text = std::move(*text);
        }
      }
    }
    // The line is written after the save: whoever reads checkpoint_step in every rank's line
    // of a step finds every rank's shard verified on disk; the merged checkpoint follows (its
    // DONE marks it complete) and is complete when the ranks have exited.
    const RankFootprint footprint{.process_peak = runtime::PeakResidentBytes(),
                                  .device = (*job_rank)->cuda_device >= 0};
    std::string rank_line = RankStepJson(options.rank, *r, checkpoint_step, eval ? &*eval : nullptr,
                                         footprint, checkpoint_seconds);
    if (!sample_text.empty() || world > p) {
      nlohmann::json j = nlohmann::json::parse(rank_line);
      if (!sample_text.empty()) j["sample"] = sample_text;
      if (world > p) {  // data or tensor parallelism: where the rank sits on every axis
        j["stage"] = stage;
        j["replica"] = coord.replica;
        if (t > 1) j["tensor"] = coord.tensor;
      }
      rank_line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    rank_line += "\n";
    if (auto st =
            safefs::WriteAll(metrics->get(), rank_line.data(), rank_line.size(), metrics_path);
        !st.ok()) {
      return fatal(st);
    }
    if (preempted) {
      if (auto st = merging.Join(); !st.ok()) return fatal(st);
      outcome.preempted_after = done;
      return outcome;
    }
  }
  if (auto st = merging.Join(); !st.ok()) return fatal(st);
  return outcome;
}

}  // namespace vp::launch
