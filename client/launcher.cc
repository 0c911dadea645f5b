#include "client/launcher.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "coordinator/planner/layout.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/spec_input.h"
#include "proto/plan/topology.h"
#include "proto/runlog/step_lines.h"
#include "proto/safefs/dir.h"
#include "proto/safefs/run_owner.h"
#include "proto/spec/job_spec.h"
#include "proto/spec/storage_root.h"
#include "worker/data/token_file.h"
#include "worker/data/token_shards.h"
#include "worker/data/tokenizer.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/transformer/transformer.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/planner_inputs.h"
#include "worker/launch/run_dir.h"
#include "worker/launch/run_lock.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/launch/step_recorder.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/flops.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/run_job.h"

extern char** environ;

namespace vp::cli {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(10);
// After SIGTERM, how long a worker gets before SIGKILL.
constexpr auto kTermGrace = std::chrono::seconds(2);

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int wait_status = 0;
  int64_t exit_round = 0;       // the launcher's poll round in which the exit was seen
  Clock::time_point exit_time;  // when the launcher saw it
  std::string jsonl;
  int64_t offset = 0;                 // bytes of jsonl consumed
  std::string partial;                // an incomplete last line
  std::vector<nlohmann::json> lines;  // reported steps not yet merged, in order

  bool failed() const {
    return !running && pid > 0 && !(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0);
  }
};

// Reads what the worker appended to its jsonl since the last call.
absl::Status ReadNewLines(Worker& w) {
  // By handle, never through a link (the rank creates the file the same way).
  const fs::path path(w.jsonl);
  auto f = launch::OpenRunFile(path.parent_path().string(), path.filename().string(), O_RDONLY);
  if (absl::IsNotFound(f.status())) return absl::OkStatus();  // not created yet
  if (!f.ok()) return f.status();
  std::string text;
  char buf[1 << 16];
  for (ssize_t n; (n = pread(f->get(), buf, sizeof(buf), w.offset + text.size())) > 0;) {
    text.append(buf, static_cast<size_t>(n));
  }
  w.offset += static_cast<int64_t>(text.size());
  w.partial += text;
  size_t start = 0;
  for (size_t nl; (nl = w.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    const std::string line = w.partial.substr(start, nl - start);
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return absl::DataLossError(absl::StrCat(w.jsonl, ": unreadable line: ", line));
    }
    if (auto st = runlog::CheckRankLine(j, w.jsonl); !st.ok()) {
      return absl::DataLossError(st.message());
    }
    w.lines.push_back(std::move(j));
  }
  w.partial.erase(0, start);
  return absl::OkStatus();
}

// The last non-empty line of a rank's log: the worker's error message.
std::string LastLogLine(const std::string& path) {
  const fs::path p(path);
  auto f = launch::OpenRunFile(p.parent_path().string(), p.filename().string(), O_RDONLY);
  if (!f.ok()) return "";  // a link is not followed into another file's text
  auto text = safefs::ReadAll(f->get(), path, size_t{256} << 20);
  if (!text.ok()) return "";
  std::string last;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    if (line.find_first_not_of(" \t\r") != absl::string_view::npos) last = std::string(line);
  }
  return last;
}

std::string FailureReason(const Worker& w, const std::string& log) {
  if (WIFSIGNALED(w.wait_status)) {
    const int sig = WTERMSIG(w.wait_status);
    return absl::StrCat("killed by signal ", sig, " (", strsignal(sig), ")");
  }
  std::string last = LastLogLine(log);
  if (last.empty()) last = "no message";
  return absl::StrCat("exit code ", WEXITSTATUS(w.wait_status), ": ", last);
}

// Reaps workers that exited (noting the poll round); returns how many are still running.
int Reap(std::vector<Worker>& workers, int64_t round) {
  int running = 0;
  for (Worker& w : workers) {
    if (!w.running) continue;
    int status = 0;
    const pid_t r = waitpid(w.pid, &status, WNOHANG);
    if (r == w.pid) {
      w.running = false;
      w.wait_status = status;
      w.exit_round = round;
      w.exit_time = Clock::now();
    } else {
      ++running;
    }
  }
  return running;
}

// Signals every running worker, waits up to `grace` for them to exit.
void SignalAndWait(std::vector<Worker>& workers, int sig, Clock::duration grace) {
  for (Worker& w : workers) {
    if (w.running) kill(w.pid, sig);
  }
  const auto deadline = Clock::now() + grace;
  while (Reap(workers, INT64_MAX) > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace

absl::Status CheckJobRunsHere(const vocabpipe::v1::JobSpec& spec) {
  if (spec.device() != "cpu") {
    // Not runnable here (no CUDA in the build, or no GPU on this host): Unimplemented, which
    // the CLI reports as invalid input (exit 2) before anything starts.
    if (auto device = launch::RankCudaDevice(spec, 0, -1); !device.ok()) {
      return absl::IsInvalidArgument(device.status())
                 ? device.status()
                 : absl::UnimplementedError(device.status().message());
    }
  }
  // The shards' headers only (the ranks map the tokens): every shard there, valid, one token
  // width, a recorded vocabulary bound within model.vocab_size; and the tokenizer beside them.
  const int64_t vocab = spec.model().vocab_size();
  const std::vector<std::string> entries = spec::DataPathEntries(spec.data());
  if (absl::Status st = data::CheckDataTokenizer(entries.front(), vocab); !st.ok()) return st;
  if (auto st = data::CheckTokenShardEntries(
                    spec.data().paths().empty() ? "data.path" : "data.paths", entries, vocab)
                    .status();
      !st.ok()) {
    return st;
  }
  // The validation tokens and the sampling tokenizer, before any rank starts.
  if (spec::HasValidationData(spec.data())) {
    const std::vector<std::string> val = spec::ValPathEntries(spec.data());
    if (absl::Status st = data::CheckDataTokenizer(val.front(), vocab); !st.ok()) return st;
    if (auto st =
            data::CheckTokenShardEntries(
                spec.data().val_paths().empty() ? "data.val_path" : "data.val_paths", val, vocab)
                .status();
        !st.ok()) {
      return st;
    }
  }
  return runtime::CheckSampling(spec);
}

absl::StatusOr<std::string> LocalDaemonDevice(const vocabpipe::v1::JobSpec& spec, int rank,
                                              int cuda_devices) {
  if (spec.device().empty() || spec.device() == "cpu") return std::string("cpu");
  auto device = launch::PickCudaDevice(spec.device(), rank, -1, cuda_devices);
  if (!device.ok()) return device.status();
  return absl::StrCat("cuda:", *device);
}

absl::StatusOr<pid_t> SpawnLogged(const std::vector<std::string>& argv,
                                  const std::string& log_path) {
  // The log lives in the run folder: opened here by handle, never through a link.
  const fs::path log(log_path);
  auto fd = launch::OpenRunFile(log.parent_path().string(), log.filename().string(),
                                O_WRONLY | O_CREAT | O_TRUNC);
  if (!fd.ok()) return fd.status();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fd->get(), 1);
  posix_spawn_file_actions_adddup2(&actions, fd->get(), 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  return pid;
}

absl::StatusOr<std::string> FindWorkerBinary(const std::string& override_path) {
  std::vector<fs::path> candidates;
  if (!override_path.empty()) {
    candidates.push_back(override_path);
  } else if (const char* env = std::getenv("VOCABPIPE_WORKER"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  } else {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) return absl::InternalError(absl::StrCat("/proc/self/exe: ", ec.message()));
    candidates.push_back(self.parent_path() / "vocabpipe-worker");
    candidates.push_back(self.parent_path().parent_path() / "worker" / "main" / "vocabpipe-worker");
  }
  for (const fs::path& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c.string();
  }
  std::vector<std::string> names;
  for (const fs::path& c : candidates) names.push_back(c.string());
  return absl::NotFoundError(absl::StrCat("vocabpipe-worker not found (looked at ",
                                          absl::StrJoin(names, ", "),
                                          "); set VOCABPIPE_WORKER or pass --worker"));
}

namespace {

// parallel.world: the planner's layout choice, with the engine's measured layer activations
// under each recomputation mode and the device's default link.
absl::StatusOr<vocabpipe::v1::JobSpec> ChooseLayout(const vocabpipe::v1::JobSpec& spec,
                                                    std::ostream& progress) {
  planner::LayoutOptions lo;
  lo.link = planner::DefaultLink(spec.device());
  // The modes the choice weighs: all three under `recompute: auto`, else the one named (a
  // layer's forward and backward at the job's size each: not free at large shapes).
  std::vector<std::string> modes = {spec.parallel().recompute()};
  if (modes[0] == "auto") modes = {"none", "selective", "full"};
  for (const std::string& mode : modes) {
    vocabpipe::v1::JobSpec probe = spec;
    probe.mutable_parallel()->set_recompute(mode);
    auto bytes = launch::MeasureJobLayerActivations(probe);
    if (!bytes.ok()) return bytes.status();
    const auto r = planner::ParseRecompute(mode);
    lo.activations[static_cast<int>(*r)] = {.kept = bytes->kept,
                                            .backward_transient = bytes->backward_transient,
                                            .held_for_w = bytes->held_for_w};
  }
  auto layout = planner::ResolveLayout(spec, lo);
  if (!layout.ok()) return layout.status();
  progress << "layout: " << planner::LayoutName(layout->chosen) << " of "
           << layout->candidates.size() << " candidates for " << spec.parallel().world()
           << " ranks\n"
           << planner::LayoutTable(*layout);
  return layout->spec;
}

}  // namespace

absl::StatusOr<runtime::RunSummary> RunPipelineJob(const vocabpipe::v1::JobSpec& requested,
                                                   const LaunchOptions& options,
                                                   std::ostream& progress) {
  vocabpipe::v1::JobSpec spec = requested;
  if (planner::NeedsLayoutChoice(spec)) {
    auto chosen = ChooseLayout(spec, progress);
    if (!chosen.ok()) return chosen.status();
    spec = *chosen;
  }
  const int p = spec.parallel().pipeline();
  // d replicas of the pipeline, t tensor ranks a stage: d·t·p rank processes
  // (proto/plan/topology.h numbers them).
  const int t = std::max(1, spec.parallel().tensor());
  auto topology = planner::Topology::Create(p, spec.parallel().data(), t, spec::kMaxRanks);
  if (!topology.ok()) return topology.status();
  const int world = topology->world();
  // Everything that can be checked before a process starts is checked here, so bad input is
  // InvalidArgument (exit code 2) and not a worker failure.
  if (auto st = CheckJobRunsHere(spec); !st.ok()) return st;
  // The planner's memory model takes the engine's real per-layer activation size.
  auto layer_bytes = launch::MeasureJobLayerActivations(spec);
  if (!layer_bytes.ok()) return layer_bytes.status();
  planner::SpecPlanOptions plan_options;
  plan_options.activations = {.kept = layer_bytes->kept,
                              .backward_transient = layer_bytes->backward_transient,
                              .held_for_w = layer_bytes->held_for_w};
  auto built = planner::BuildPlanFromSpec(spec, plan_options);
  if (!built.ok()) return built.status();
  const planner::Plan& plan = built->plan;
  std::vector<int64_t> predicted(world, 0);  // every replica of a stage as the stage
  if (auto sim = planner::Simulate(plan, built->input); sim.ok()) {
    for (int r = 0; r < world; ++r) {
      const int stage = topology->CoordOf(r).stage;
      predicted[r] = sim->ranks[stage].state_bytes + sim->ranks[stage].peak_activation_bytes;
    }
  }
  auto topt = runtime::TrainerOptionsFromSpec(spec, &plan);
  if (!topt.ok()) return topt.status();
  auto binary = FindWorkerBinary(options.worker_binary);
  if (!binary.ok()) return binary.status();

  const std::string dir = spec.checkpoint().dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("checkpoint.dir: cannot create ", dir, ": ", ec.message()));
  }
  // This launch's id: its store keys, and the run that owns the directory while it runs (the
  // ranks join the lock under the same id).
  const std::string attempt = absl::StrCat(getpid(), "-", absl::ToUnixMillis(absl::Now()));
  // A local run's folders are this account's (OWNER): another user's run folder, as
  // checkpoint.dir or model.init_from, is refused like a submitted job's.
  const safefs::RunUser user{safefs::LocalUserName(), false};
  if (auto st = spec::CheckSpecOwners(spec, options.resume, user, ""); !st.ok()) return st;
  auto lock = launch::RunDirLock::Acquire(dir, attempt, user);
  if (!lock.ok()) return lock.status();
  int64_t first_step = 0;
  if (options.resume) {
    auto latest = launch::LatestVerifiedStep(dir, p * t);  // shards: stage × tensor rank
    if (latest.ok()) {
      first_step = latest->step;
      for (const std::string& w : latest->warnings) {
        std::cerr << "vocabpipe run: warning: " << w << std::endl;
      }
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }
  const int64_t steps = spec.train().steps();
  launch::StepRecorder recorder(dir, steps, first_step > 0, options.interactive, progress);
  if (auto st = recorder.Start(); !st.ok()) return st;
  if (first_step >= steps && steps > 0) {  // nothing left to train
    runtime::RunSummary summary = recorder.Finish(0);
    summary.first_step = first_step;
    return summary;
  }

  // A fresh store per launch (the attempt id in the key prefix guards against leftovers too),
  // removed and made by handle: a link in its place is removed as a link.
  {
    auto folder = safefs::Dir::Open(dir);
    if (!folder.ok()) return folder.status();
    if (auto st = folder->RemoveTree("store"); !st.ok()) return st;
    if (auto store = folder->Sub("store", /*create=*/true); !store.ok()) return store.status();
  }
  for (int r = 0; r < world; ++r) fs::remove(launch::RankMetricsPath(dir, r), ec);
  if (auto st = launch::WriteRunFiles(dir, spec, plan); !st.ok()) return st;

  // MFU is against the peak of one rank's BLAS threads, measured before the workers start, or
  // against the GPU's dense bf16 peak (0, no MFU, for a GPU missing from the table).
  double peak_flops = 0;
  std::string peak_source;
  if (spec.device() == "cpu") {
    engine::cpu::SetBlasThreads(runtime::WorkerThreads(spec));
    const runtime::CpuPeak peak = runtime::CpuPeakFlops();
    peak_flops = peak.flops;
    peak_source = peak.source;
  } else if (auto device = launch::RankCudaDevice(spec, 0, -1); device.ok()) {
    peak_flops = launch::CudaPeakFlops(*device);
  }
  const auto& cfg = topt->model;
  const int microbatches_per_step = topology->data() * topt->microbatches;  // d·m
  const double tokens_per_step =
      static_cast<double>(microbatches_per_step) * topt->microbatch_size * cfg.seq_len;
  const runlog::StepContext context{
      .tokens_per_step = tokens_per_step,
      .model_flops_per_step =
          microbatches_per_step * runtime::ModelFlopsPerMicrobatch(cfg, topt->microbatch_size),
      .peak_flops_per_rank = peak_flops,
      .predicted_memory = predicted};

  std::vector<Worker> workers(world);
  for (int r = 0; r < world; ++r) {
    Worker& w = workers[r];
    w.rank = r;
    w.jsonl = launch::RankMetricsPath(dir, r);
    std::vector<std::string> argv = {*binary,
                                     "--run-dir",
                                     dir,
                                     "--rank",
                                     absl::StrCat(r),
                                     "--timeout",
                                     absl::StrCat(absl::ToDoubleSeconds(options.timeout)),
                                     "--attempt",
                                     attempt,
                                     "--run-id",
                                     attempt};
    if (first_step > 0) {
      argv.push_back("--resume-step");
      argv.push_back(absl::StrCat(first_step));
    }
    auto pid = SpawnLogged(argv, launch::RankLogPath(dir, r));
    if (!pid.ok()) {
      SignalAndWait(workers, SIGKILL, kTermGrace);
      return pid.status();
    }
    w.pid = *pid;
    w.running = true;
  }

  // Watch: merge every step all ranks reported, reap exits, stop at the first failure.
  absl::Status launcher_error;  // a failure of the launcher itself (merge, unreadable report)
  int64_t next_step = first_step;
  auto drain = [&]() -> absl::Status {
    for (Worker& w : workers) {
      if (auto st = ReadNewLines(w); !st.ok()) return st;
    }
    while (std::all_of(workers.begin(), workers.end(),
                       [](const Worker& w) { return !w.lines.empty(); })) {
      std::vector<nlohmann::json> ranks;
      for (Worker& w : workers) {
        ranks.push_back(std::move(w.lines.front()));
        w.lines.erase(w.lines.begin());
        if (ranks.back()["step"] != next_step) {
          return absl::DataLossError(absl::StrCat(
              w.jsonl, ": reported step ", ranks.back()["step"].dump(), ", expected ", next_step));
        }
      }
      auto merged = runlog::MergeRankLines(ranks, context);
      if (!merged.ok()) return merged.status();
      if (auto st = recorder.Record(*merged); !st.ok()) return st;
      ++next_step;
    }
    return absl::OkStatus();
  };
  auto any_failed = [&] {
    return std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.failed(); });
  };
  int64_t round = 0;
  while (true) {
    const int running = Reap(workers, ++round);
    if (launcher_error = drain(); !launcher_error.ok()) break;
    if (any_failed() || running == 0) break;
    std::this_thread::sleep_for(kPollInterval);
  }
  if (!launcher_error.ok()) {
    SignalAndWait(workers, SIGTERM, kTermGrace);
  } else if (any_failed()) {
    // The others lose their peer and fail on their own within the Gloo timeout; wait that
    // long at most, then terminate whoever is left.
    const auto deadline =
        Clock::now() + absl::ToChronoSeconds(options.timeout) + std::chrono::milliseconds(500);
    while (Reap(workers, ++round) > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(kPollInterval);
    }
    SignalAndWait(workers, SIGTERM, kTermGrace);
  }
  SignalAndWait(workers, SIGKILL, std::chrono::seconds(5));
  recorder.EndProgress();
  if (!launcher_error.ok()) return launcher_error;

  if (any_failed()) {
    (void)drain();  // keep the metrics of every step that all ranks finished
    // The first to fail is the cause, and among failures seen close together (kSimultaneous of
    // the first) a rank killed by a signal beats one that exited on its own, and one killed by
    // SIGPIPE comes after the other signals: when a rank vanishes its peers fail, exit or die
    // writing to its closed socket — and a peer can be reaped first, since a killed process
    // closes its sockets before it can be waited for, and a loaded machine may run the peer's
    // whole exit in between. Ranks the launcher itself stopped (round INT64_MAX) come last.
    constexpr auto kSimultaneous = std::chrono::milliseconds(500);
    std::vector<const Worker*> failed;
    for (const Worker& w : workers) {
      if (w.failed()) failed.push_back(&w);
    }
    auto consequence = [](const Worker* w) {  // 0 a cause, 1 a broken pipe, 2 an exit
      if (!WIFSIGNALED(w->wait_status)) return 2;
      return WTERMSIG(w->wait_status) == SIGPIPE ? 1 : 0;
    };
    auto stopped = [](const Worker* w) { return w->exit_round == INT64_MAX; };
    Clock::time_point first_seen = Clock::time_point::max();
    for (const Worker* w : failed) {
      if (!stopped(w)) first_seen = std::min(first_seen, w->exit_time);
    }
    auto near_first = [&](const Worker* w) {
      return !stopped(w) && w->exit_time - first_seen <= kSimultaneous;
    };
    std::stable_sort(failed.begin(), failed.end(), [&](const Worker* a, const Worker* b) {
      if (stopped(a) != stopped(b)) return stopped(b);
      if (near_first(a) != near_first(b)) return near_first(a);
      if (near_first(a) && consequence(a) != consequence(b)) {
        return consequence(a) < consequence(b);
      }
      return a->exit_round < b->exit_round;
    });
    const Worker& first = *failed.front();
    std::string message =
        absl::StrCat("rank ", first.rank,
                     " failed: ", FailureReason(first, launch::RankLogPath(dir, first.rank)),
                     " (log: ", launch::RankLogPath(dir, first.rank), ")");
    for (size_t i = 1; i < failed.size(); ++i) {
      absl::StrAppend(&message, "; then rank ", failed[i]->rank, ": ",
                      FailureReason(*failed[i], launch::RankLogPath(dir, failed[i]->rank)));
    }
    return absl::AbortedError(message);
  }
  if (auto st = drain(); !st.ok()) return st;
  if (steps > 0 && next_step != steps) {
    return absl::DataLossError(absl::StrCat("the workers exited after step ", next_step, " of ",
                                            steps, " without an error; see ", dir,
                                            "/rank_<R>.log"));
  }
  return recorder.Finish(peak_flops, peak_source);
}

}  // namespace vp::cli
