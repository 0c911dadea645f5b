#include "worker/daemon/worker_daemon.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/plan/plan.h"
#include "proto/safefs/run_owner.h"
#include "proto/spec/job_spec.h"
#include "proto/spec/storage_root.h"
#include "vocabpipe/v1/service.grpc.pb.h"
#include "worker/daemon/coordinator_link.h"
#include "worker/daemon/log_tail.h"
#include "worker/daemon/profile.h"
#include "worker/data/tokenizer.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/launch/grpc_store.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/preemption.h"
#include "worker/launch/run_dir.h"
#include "worker/launch/run_lock.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/runtime/flops.h"

extern char** environ;

namespace vp::daemon {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;
namespace {

// How often a running rank's new step lines are sent to the coordinator.
constexpr absl::Duration kMetricsBatch = absl::Milliseconds(500);
// The step lines of one report at most (whole lines; a line is a few hundred bytes).
constexpr uintmax_t kMaxReportBytes = 1 << 20;

void Log(const std::string& msg) { std::cerr << "vocabpipe-worker: " << msg << std::endl; }

// The job's token files as this worker sees them (data::CheckDataFile): what would fail every
// attempt of the rank alike.
absl::Status CheckRunInputs(const v1::JobSpec& spec) {
  const int64_t vocab = spec.model().vocab_size();
  if (auto st = data::CheckDataFiles(spec::DataPathEntries(spec.data()), vocab,
                                     spec.data().paths().empty() ? "data.path" : "data.paths");
      !st.ok()) {
    return st;
  }
  if (spec::HasValidationData(spec.data())) {
    return data::CheckDataFiles(
        spec::ValPathEntries(spec.data()), vocab,
        spec.data().val_paths().empty() ? "data.val_path" : "data.val_paths");
  }
  return absl::OkStatus();
}

int64_t MemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

// One rank process started for a RunTask.
struct Task {
  std::string job_id;
  std::string attempt;
  int rank = 0;
  pid_t pid = -1;
  // The run directory's lock under the job's id, held while the rank runs (the rank holds its
  // own as well); dropped when the task is reaped or killed.
  std::optional<launch::RunDirLock> lock;
  std::vector<std::string> warnings;  // for the coordinator's job events (sent once)
  std::string metrics_path, log_path;
  size_t offset = 0;  // bytes of the metrics file already reported
  absl::Time last_sent = absl::InfinitePast();
  std::string store_secret;  // the attempt's rendezvous secret (for a re-registration)
};

// A rank that has ended but whose last step lines or exit report the coordinator has not
// acknowledged yet (it was down or restarting): both are resent until it has.
struct Ended {
  Task task;
  v1::ReportTaskRequest report{};
  absl::Time next_try = absl::InfinitePast();
};

class Daemon {
 public:
  Daemon(const DaemonOptions& options, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : options_(options),
        link_(options.coordinator, std::move(credentials), options.rpc_deadline, Log) {}

  ~Daemon() {
    KillAll();
    if (const int pid = profile_pid_.load(); pid > 0) kill(pid, SIGKILL);
    if (profiler_.joinable()) profiler_.join();
  }

  void Loop(const std::atomic<bool>* stop) {
    if (options_.measure_peak) {
      // A GPU daemon reports its device's dense bf16 peak (0 when not in the table).
      peak_flops_ = options_.device.rfind("cuda:", 0) == 0
                        ? launch::CudaPeakFlops(std::stoi(options_.device.substr(5)))
                        : runtime::CpuPeakFlops().flops;
    }
    absl::Time next_beat = absl::InfinitePast();
    bool warned = false;
    absl::Time grace_end = absl::InfiniteFuture();
    bool grace_killed = false;
    while (true) {
      const absl::Time now = absl::Now();
      if (stop->load() && !leaving_) {
        if (!task_ || worker_id_.empty()) break;
        // A preemption: first the coordinator learns that nothing new may run here, then the
        // rank gets SIGTERM and the grace period to save its emergency checkpoint and exit.
        leaving_ = true;
        grace_end = now + options_.preempt_grace;
        Log(absl::StrCat("stopping: rank ", task_->rank, " of ", task_->job_id,
                         " saves an emergency checkpoint (grace ",
                         absl::FormatDuration(options_.preempt_grace), ")"));
        Beat(/*wait=*/false);  // the rank's grace must not wait for an unreachable coordinator
        if (task_) kill(task_->pid, SIGTERM);
      }
      if (leaving_) {
        // The rank exited and its exit was reported (or the grace is over: a coordinator that
        // is away does not keep a stopping daemon).
        if (!task_ && (!ended_ || now > grace_end)) break;
        if (now > grace_end && !grace_killed) {
          Log(absl::StrCat("rank ", task_->rank, " of ", task_->job_id,
                           " did not stop within the grace period; killing it"));
          kill(task_->pid, SIGKILL);
          grace_killed = true;
        }
      }
      if (worker_id_.empty()) {
        if (now >= next_beat) {
          if (auto st = Register(); !st.ok()) {
            // The link logs, rate-limited, why the coordinator cannot be reached or refuses
            // this worker; any other refusal (a bad field) is logged once.
            if (!warned && !absl::IsUnavailable(st) && !absl::IsDeadlineExceeded(st) &&
                !absl::IsUnauthenticated(st) && !absl::IsPermissionDenied(st)) {
              Log(absl::StrCat("register with ", options_.coordinator, ": ", st.message(),
                               " (retrying)"));
            }
            warned = true;
            next_beat = now + absl::Seconds(1);
          } else {
            warned = false;
            next_beat = now;
          }
        }
      } else if (now >= next_beat) {
        next_beat = now + interval_;
        Beat();
      }
      if (task_) Poll();
      if (ended_) Flush();
      if (!dying_.empty()) Reap();
      // At most 10 wake-ups a second (more only for a shorter heartbeat interval): a rank's
      // new step lines reach the coordinator within 0.1 s, and the daemon stays out of the
      // ranks' way (it shares their cores).
      std::this_thread::sleep_for(
          absl::ToChronoMilliseconds(std::min(absl::Milliseconds(100), interval_)));
    }
  }

 private:
  // Reports (fail-fast: they are resent until acknowledged).
  template <typename Request, typename Response, typename Call>
  grpc::Status Unary(Call call, const Request& req, Response* resp) {
    return link_.Call(call, req, resp);
  }

  absl::Status Register() {
    v1::RegisterWorkerRequest req;
    req.set_device(options_.device);
    // Usable memory: the GPU's for a GPU daemon, else the host's (the coordinator admits a
    // job only when the planner's per-rank prediction fits it).
    req.set_memory_bytes(options_.device.rfind("cuda:", 0) == 0
                             ? launch::CudaMemoryBytes(std::stoi(options_.device.substr(5)))
                             : MemoryBytes());
    req.set_address(options_.address);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    req.set_hostname(host);
    req.set_pid(getpid());
    req.set_threads(static_cast<int>(std::thread::hardware_concurrency()));
    req.set_peak_flops(peak_flops_);
    if (options_.rank_hint >= 0) req.set_rank_hint(options_.rank_hint);
    // The rank this daemon still holds: a restarted coordinator re-adopts it (or answers with
    // a cancel in the first heartbeat).
    if (const Task* held = task_ ? &*task_ : ended_ ? &ended_->task : nullptr) {
      req.mutable_held()->set_job_id(held->job_id);
      req.mutable_held()->set_attempt(held->attempt);
      req.mutable_held()->set_rank(held->rank);
      req.mutable_held()->set_store_secret(held->store_secret);
    }
    v1::RegisterWorkerResponse resp;
    // Waits for the channel (bounded), which drives the reconnection after a restart; the link
    // logs why the coordinator cannot be reached (coordinator_link.h).
    grpc::Status st = link_.Keepalive(&v1::WorkerService::Stub::RegisterWorker, req, &resp);
    if (st.error_code() == grpc::StatusCode::PERMISSION_DENIED && req.has_held()) {
      // The coordinator will not give this rank back to this worker (another certificate or
      // another secret than the rank was assigned with): it cannot be part of its job any more.
      Log(absl::StrCat("the coordinator refused to re-adopt ", req.held().job_id(), " rank ",
                       req.held().rank(), ": ", st.error_message(), "; stopping the rank"));
      if (task_) Kill();
      ended_.reset();
    }
    if (!st.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
    }
    worker_id_ = resp.worker_id();
    acked_seq_ = 0;  // command numbers start again with each registration
    // A restarted coordinator acknowledged step lines it then lost (a step is merged only once
    // every rank reported it, and the part in between lives in memory): send the held rank's
    // lines again from the start; it merges each step once.
    if (task_) task_->offset = 0;
    if (ended_) ended_->task.offset = 0;
    interval_ = absl::Milliseconds(std::max<int64_t>(10, resp.heartbeat_interval_ms()));
    Log(absl::StrCat(
        "registered as ", worker_id_, " with ", options_.coordinator, ", address ",
        options_.address,
        options_.rank_hint >= 0 ? absl::StrCat(", rank hint ", options_.rank_hint) : "",
        req.has_held()
            ? absl::StrCat(", holding ", req.held().job_id(), " rank ", req.held().rank())
            : ""));
    return absl::OkStatus();
  }

  // wait: wait for the channel while it is down (CoordinatorLink::Keepalive), which drives
  // the reconnection; else one fail-fast try.
  void Beat(bool wait = true) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker_id_);
    if (task_) {
      req.set_job_id(task_->job_id);
      req.set_attempt(task_->attempt);
    }
    req.set_leaving(leaving_);
    req.set_acked_seq(acked_seq_);
    v1::HeartbeatResponse resp;
    grpc::Status st = wait ? link_.Keepalive(&v1::WorkerService::Stub::Heartbeat, req, &resp)
                           : link_.Call(&v1::WorkerService::Stub::Heartbeat, req, &resp);
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The coordinator restarted or dropped this worker. The rank keeps running: the new
      // registration names it, and the coordinator re-adopts it or tells us to cancel it.
      Log(absl::StrCat(
          worker_id_, " unknown to the coordinator; registering again",
          task_ ? absl::StrCat(" (still running ", task_->job_id, " rank ", task_->rank, ")")
                : ""));
      worker_id_.clear();
      return;
    }
    if (!st.ok()) return;  // the next beat retries; the link logged why (rate-limited)
    for (const v1::WorkerCommand& cmd : resp.commands()) {
      // A command resent because our acknowledgement had not arrived yet: handled already.
      if (cmd.seq() > 0 && cmd.seq() <= acked_seq_) continue;
      acked_seq_ = std::max(acked_seq_, cmd.seq());
      if (cmd.has_cancel()) {
        const v1::CancelTask& c = cmd.cancel();
        auto matches = [&c](const Task& t) {
          return t.job_id == c.job_id() && (c.attempt().empty() || c.attempt() == t.attempt);
        };
        if (task_ && matches(*task_)) {
          Log(absl::StrCat("cancel ", task_->job_id, " rank ", task_->rank));
          Kill();
        }
        StopProfile(c.job_id());
        if (ended_ && matches(ended_->task)) ended_.reset();  // its reports are not wanted
      } else if (leaving_) {
        // Sent before the coordinator saw this daemon leave: not started (the job's ranks on
        // other workers time out and it restarts elsewhere).
        Log("stopping: a new task is not started");
      } else if (cmd.has_run()) {
        Run(cmd.run());
      } else if (cmd.has_profile()) {
        Profile(cmd.profile());
      }
    }
  }

  void ReportTask(const std::string& job_id, const std::string& attempt, int rank, bool ok,
                  const std::string& message, const v1::PassCosts* costs = nullptr,
                  int term_signal = 0, bool refused = false) {
    v1::ReportTaskRequest req;
    req.set_worker_id(worker_id_);
    req.set_job_id(job_id);
    req.set_attempt(attempt);
    req.set_refused(refused);
    req.set_rank(rank);
    req.set_ok(ok);
    req.set_message(message);
    if (costs != nullptr) *req.mutable_costs() = *costs;
    req.set_term_signal(term_signal);
    v1::ReportTaskResponse resp;
    grpc::Status st = Unary(&v1::WorkerService::Stub::ReportTask, req, &resp);
    if (!st.ok()) Log(absl::StrCat("report ", job_id, ": ", st.error_message()));
  }

  // Kills the profiling child of `job_id` (any job's when empty): a tensor group's profile
  // whose peer failed would otherwise wait for it until the group's connect timeout. Called,
  // like Profile, on the heartbeat thread only.
  void StopProfile(const std::string& job_id) {
    if (!job_id.empty() && job_id != profiling_job_) return;
    if (const int pid = profile_pid_.load(); pid > 0) kill(pid, SIGKILL);
  }

  void Profile(const v1::ProfileTask& task) {
    // A new profile means the coordinator is done with the previous one (its job planned,
    // failed or was cancelled): never wait for it on this (the heartbeat) thread.
    StopProfile("");
    if (profiler_.joinable()) profiler_.join();
    profiling_job_ = task.job_id();
    // Off the heartbeat thread: profiling takes a few seconds and heartbeats must go on.
    const int device =
        options_.device.rfind("cuda:", 0) == 0 ? std::stoi(options_.device.substr(5)) : -1;
    ProfileChildOptions child{.worker_binary = options_.worker_binary,
                              .cuda_device = device,
                              .memory_limit_bytes = options_.profile_memory_limit,
                              .store_address = options_.coordinator,
                              .tls = options_.tls,
                              .insecure = options_.insecure,
                              .hostname = options_.address};
    profiler_ = std::thread([this, task, child, id = worker_id_] {
      // In a child process: whatever happens there, the daemon goes on.
      auto costs = ProfileInChild(task, child, [this](int pid) { profile_pid_ = pid; });
      if (!costs.ok())
        Log(absl::StrCat("profile of ", task.job_id(), ": ", costs.status().message()));
      v1::ReportTaskRequest req;
      req.set_worker_id(id);
      req.set_job_id(task.job_id());
      req.set_rank(-1);
      req.set_ok(costs.ok());
      if (costs.ok()) {
        *req.mutable_costs() = *costs;
      } else {
        req.set_message(std::string(costs.status().message()));
      }
      v1::ReportTaskResponse resp;
      grpc::Status st = Unary(&v1::WorkerService::Stub::ReportTask, req, &resp);
      if (!st.ok())
        Log(absl::StrCat("report profile of ", task.job_id(), ": ", st.error_message()));
    });
  }

  void Run(const v1::RunTask& run) {
    if (task_) {
      ReportTask(run.job_id(), run.attempt(), run.rank(), false,
                 absl::StrCat("worker ", worker_id_, " is still running ", task_->job_id));
      return;
    }
    const std::string dir = run.spec().checkpoint().dir();
    auto fail = [&](const std::string& why) {
      ReportTask(run.job_id(), run.attempt(), run.rank(), false, why, nullptr, 0,
                 /*refused=*/true);
    };
    // This worker's own root, checked on its own view of the file system (the coordinator
    // checked its root at submit).
    if (auto st = spec::CheckSpecPaths(run.spec(), options_.storage_root); !st.ok()) {
      return fail(absl::StrCat("worker storage root: ", st.message()));
    }
    // The run folders this rank reads belong to the job's user (checked at submit too).
    const safefs::RunUser user{run.run_owner().empty() ? safefs::LocalUserName() : run.run_owner(),
                               run.run_owner_admin()};
    if (auto st = spec::CheckSpecOwners(run.spec(), run.resume(), user, options_.storage_root);
        !st.ok()) {
      return fail(std::string(st.message()));
    }
    // A token file that is missing, truncated or not one, or a tokenizer that does not match,
    // fails the same way in every attempt: refused here, before the fork, it is not retried.
    if (auto st = CheckRunInputs(run.spec()); !st.ok()) return fail(std::string(st.message()));
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return fail(absl::StrCat("checkpoint.dir ", dir, ": ", ec.message()));
    // The coordinator sends this rank's slice only (planner::RankSlice); it goes to a file of
    // this rank's own, since the ranks share checkpoint.dir.
    auto plan = planner::PlanFromText(run.plan_text());
    if (!plan.ok()) return fail(absl::StrCat("plan: ", plan.status().message()));
    // d replicas of the pipeline, t tensor ranks a stage: d·t·p ranks, each given its stage's
    // slice.
    const int64_t world = static_cast<int64_t>(plan->pipeline) *
                          std::max(1, run.spec().parallel().data()) *
                          std::max(1, run.spec().parallel().tensor());
    if (run.rank() < 0 || run.rank() >= world) {
      return fail(absl::StrCat("plan: no rank ", run.rank(), " in ", world, " ranks (",
                               run.spec().parallel().data(), " replicas of a pipeline of ",
                               plan->pipeline, " stages of ",
                               std::max(1, run.spec().parallel().tensor()), " tensor ranks)"));
    }
    // Before anything is written: another job's run directory is refused, naming it.
    const std::string run_id = run.run_id().empty() ? run.job_id() : run.run_id();
    auto lock = launch::RunDirLock::Acquire(dir, run_id, user);
    if (!lock.ok()) return fail(std::string(lock.status().message()));
    if (auto st = launch::WriteRankRunFiles(dir, run.spec(), *plan, run.rank()); !st.ok()) {
      return fail(std::string(st.message()));
    }
    Task t;
    int64_t resume_step = -1;
    if (run.resume()) {
      // The ranks share checkpoint.dir, so every daemon finds the same verified step.
      // Shards: stage × tensor rank.
      auto latest = launch::LatestVerifiedStep(
          dir, plan->pipeline * std::max(1, run.spec().parallel().tensor()),
          run.resume_limited() ? run.resume_max_step() : -1);
      if (latest.ok()) {
        resume_step = latest->step;
        for (const std::string& w : latest->warnings) {
          Log(absl::StrCat(run.job_id(), ": warning: ", w));
          if (run.rank() == 0) t.warnings.push_back(w);  // one event per job, not per rank
        }
      } else if (!absl::IsNotFound(latest.status())) {
        return fail(absl::StrCat("resume: ", latest.status().message()));
      }
    }
    t.lock = std::move(*lock);
    t.attempt = run.attempt();
    t.store_secret = run.store_secret();
    t.job_id = run.job_id();
    t.rank = run.rank();
    t.metrics_path = launch::RankMetricsPath(dir, run.rank());
    t.log_path = launch::RankLogPath(dir, run.rank());
    fs::remove(t.metrics_path, ec);  // the rank truncates it too, but only once it starts

    std::vector<std::string> args = {
        options_.worker_binary,
        "--run-dir",
        dir,
        "--rank",
        std::to_string(run.rank()),
        "--attempt",
        run.attempt(),
        "--run-id",
        run_id,
        "--timeout",
        absl::StrCat(std::max<int64_t>(1, run.timeout_ms()) / 1000.0),
    };
    // The store over the same channel security as the daemon's own calls.
    const std::vector<std::string> store =
        launch::StoreFlags(options_.coordinator, options_.address, options_.tls, options_.insecure);
    args.insert(args.end(), store.begin(), store.end());
    if (options_.device.rfind("cuda:", 0) == 0) {  // this daemon's GPU
      args.push_back("--cuda-device");
      args.push_back(options_.device.substr(5));
    }
    if (resume_step >= 0) {
      args.push_back("--resume-step");
      args.push_back(std::to_string(resume_step));
    }
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    // The run's rendezvous secret goes in the environment (a command line is readable by every
    // user of the host); built before the fork, which may only call async-signal-safe functions.
    const std::string secret_var = absl::StrCat(auth::kRunSecretEnv, "=", run.store_secret());
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).rfind(absl::StrCat(auth::kRunSecretEnv, "="), 0) != 0) {
        envp.push_back(*e);
      }
    }
    envp.push_back(const_cast<char*>(secret_var.c_str()));
    envp.push_back(nullptr);
    // Never through a link planted under the log's name (launch::OpenRankLog).
    auto log_fd = launch::OpenRankLog(dir, run.rank());
    if (!log_fd.ok()) return fail(std::string(log_fd.status().message()));
    const int log = log_fd->release();
    const pid_t pid = fork();
    if (pid == 0) {   // child: only async-signal-safe calls until exec
      sigset_t none;  // whatever the forking thread blocks, the rank must not
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      dup2(log, STDOUT_FILENO);
      dup2(log, STDERR_FILENO);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(log);
    if (pid < 0) return fail("fork failed");
    t.pid = pid;
    Log(absl::StrCat("running ", t.job_id, " rank ", t.rank, " (pid ", pid, ", log ", t.log_path,
                     ")"));
    task_ = std::move(t);
  }

  // Sends the rank's new per-step lines, then reaps it when it has exited.
  void Poll() {
    int status = 0;
    const pid_t r = waitpid(task_->pid, &status, WNOHANG);
    // Step lines go out in batches, at most every kMetricsBatch: one report (one RPC, one
    // coordinator commit, one watch event per step) per batch instead of per step keeps the
    // control plane's CPU off the ranks' cores.
    if (r != task_->pid) {
      if (absl::Now() - task_->last_sent >= kMetricsBatch) SendMetrics(*task_);
      return;
    }
    // Exited: its last lines (all in the file now) and its exit report go out until the
    // coordinator has them (Flush), however long it is away.
    Ended e{.task = std::move(*task_)};
    task_.reset();
    e.report.set_job_id(e.task.job_id);
    e.report.set_attempt(e.task.attempt);
    e.report.set_rank(e.task.rank);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      e.report.set_ok(true);
    } else {
      std::string why = WIFSIGNALED(status) ? absl::StrCat("killed by signal ", WTERMSIG(status))
                                            : absl::StrCat("exit code ", WEXITSTATUS(status));
      const std::string last = LastLogLine(e.task.log_path, 1000);
      if (!last.empty()) absl::StrAppend(&why, ": ", last);
      e.report.set_ok(false);
      e.report.set_message(why);
      e.report.set_term_signal(WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      e.report.set_stopped(WIFEXITED(status) && WEXITSTATUS(status) == launch::kPreemptedExitCode);
    }
    ended_ = std::move(e);
    Flush();
  }

  // The ended rank's remaining step lines, then its exit report; retried every second while
  // the coordinator does not acknowledge them (down, restarting, or this daemon is between
  // registrations).
  void Flush() {
    if (worker_id_.empty() || absl::Now() < ended_->next_try) return;
    ended_->next_try = absl::Now() + absl::Seconds(1);
    if (!SendMetrics(ended_->task)) return;
    ended_->report.set_worker_id(worker_id_);
    v1::ReportTaskResponse resp;
    grpc::Status st = Unary(&v1::WorkerService::Stub::ReportTask, ended_->report, &resp);
    if (st.ok() || Settled(st)) {
      if (!st.ok()) Log(absl::StrCat("report ", ended_->task.job_id, ": ", st.error_message()));
      ended_.reset();
    }
  }

  // A refusal that resending cannot change (bad request, a job the coordinator does not know).
  // An unknown worker id is not one: the next registration brings a new id to resend with.
  static bool Settled(const grpc::Status& st) {
    switch (st.error_code()) {
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::PERMISSION_DENIED:
      case grpc::StatusCode::FAILED_PRECONDITION:
        return true;
      case grpc::StatusCode::NOT_FOUND:
        return st.error_message().rfind("worker_id:", 0) != 0;
      default:
        return false;
    }
  }

  // Sends the task's warnings and its complete step lines not yet acknowledged. True when
  // nothing is left to send.
  bool SendMetrics(Task& task) {
    if (!task.warnings.empty()) {
      v1::ReportMetricsRequest req;
      req.set_worker_id(worker_id_);
      req.set_job_id(task.job_id);
      req.set_attempt(task.attempt);
      req.set_rank(task.rank);
      for (const std::string& w : task.warnings) req.add_warnings(w);
      v1::ReportMetricsResponse resp;
      grpc::Status st = Unary(&v1::WorkerService::Stub::ReportMetrics, req, &resp);
      if (!st.ok() && !Settled(st)) return false;
      task.warnings.clear();
    }
    // In requests of at most kMaxReportBytes: a daemon that re-registered sends the whole
    // file again (the coordinator drops the steps it has merged already).
    for (;;) {
      std::error_code ec;  // a stat first: most polls find nothing new
      const uintmax_t size = fs::file_size(task.metrics_path, ec);
      if (ec || size <= task.offset) return true;
      task.last_sent = absl::Now();
      // By handle, never through a link (the rank created the file the same way).
      const fs::path metrics(task.metrics_path);
      auto f = launch::OpenRunFile(metrics.parent_path().string(), metrics.filename().string(),
                                   O_RDONLY);
      if (!f.ok()) return true;
      std::string rest(std::min<uintmax_t>(size - task.offset, kMaxReportBytes), '\0');
      const ssize_t got = pread(f->get(), rest.data(), rest.size(), task.offset);
      rest.resize(got > 0 ? static_cast<size_t>(got) : 0);
      const size_t end = rest.rfind('\n');
      if (end == std::string::npos) return true;  // no complete line yet
      v1::ReportMetricsRequest req;
      req.set_worker_id(worker_id_);
      req.set_job_id(task.job_id);
      req.set_attempt(task.attempt);
      req.set_rank(task.rank);
      for (absl::string_view line : absl::StrSplit(rest.substr(0, end), '\n')) {
        if (!line.empty()) req.add_step_json(std::string(line));
      }
      v1::ReportMetricsResponse resp;
      grpc::Status st = Unary(&v1::WorkerService::Stub::ReportMetrics, req, &resp);
      if (!st.ok() && !Settled(st)) return false;  // resent (steps are merged once) next time
      task.offset += end + 1;
    }
  }

  // SIGKILL (a rank takes SIGTERM as a preemption and saves first; a cancelled job must not);
  // reaped by Reap() from the loop, so heartbeats never wait for a dying rank. No report: the
  // coordinator asked for it (or forgot the job).
  void Kill() {
    kill(task_->pid, SIGKILL);
    dying_.push_back({task_->pid, absl::Now() + absl::Seconds(2)});
    task_.reset();
  }

  void Reap() {
    for (auto it = dying_.begin(); it != dying_.end();) {
      int status = 0;
      if (waitpid(it->pid, &status, WNOHANG) != 0) {
        it = dying_.erase(it);
        continue;
      }
      if (absl::Now() > it->kill_at) kill(it->pid, SIGKILL);
      ++it;
    }
  }

  // On exit: nothing may outlive the daemon.
  void KillAll() {
    if (task_) Kill();
    for (const Dying& d : dying_) {
      kill(d.pid, SIGKILL);
      waitpid(d.pid, nullptr, 0);
    }
    dying_.clear();
  }

  struct Dying {
    pid_t pid;
    absl::Time kill_at;
  };
  std::vector<Dying> dying_;
  const DaemonOptions options_;
  CoordinatorLink link_;  // the channel to the coordinator (coordinator_link.h)
  std::string worker_id_;
  absl::Duration interval_ = absl::Seconds(1);
  double peak_flops_ = 0;
  std::optional<Task> task_;
  std::optional<Ended> ended_;  // the previous rank, while its reports are unacknowledged
  int64_t acked_seq_ = 0;       // the last WorkerCommand.seq handled (this registration)
  bool leaving_ = false;        // stopping: the running rank saves and exits, nothing new starts
  std::thread profiler_;
  std::atomic<int> profile_pid_{-1};  // the profiling child while it runs
  std::string profiling_job_;         // the job of the latest profile (heartbeat thread)
};

}  // namespace

absl::Status RunDaemon(const DaemonOptions& options, const std::atomic<bool>* stop) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("--coordinator: HOST:PORT required");
  }
  if (options.worker_binary.empty()) {
    return absl::InvalidArgumentError("worker_binary: the rank executable is required");
  }
  const std::string& d = options.device;
  if (d != "cpu" && d.rfind("cuda", 0) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--device: \"", d, "\" is not cpu or cuda:N"));
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.insecure) {
    if (auto st = auth::CheckInsecure(options.tls, options.coordinator, "--coordinator");
        !st.ok()) {
      return st;
    }
    credentials = grpc::InsecureChannelCredentials();
  } else {
    if (!options.tls.any()) {
      return absl::InvalidArgumentError(
          "TLS required: --tls-ca, --tls-cert and --tls-key (a worker certificate from "
          "vocabpipe certs init), or --insecure with a loopback --coordinator");
    }
    if (options.tls.cert.empty() || options.tls.key.empty()) {
      return absl::InvalidArgumentError(
          "--tls-cert, --tls-key: a worker needs its certificate and key (vocabpipe certs init)");
    }
    auto tls = auth::ClientCredentials(options.tls);
    if (!tls.ok()) return tls.status();
    credentials = *tls;
  }
  Daemon daemon(options, std::move(credentials));
  daemon.Loop(stop);
  return absl::OkStatus();
}

}  // namespace vp::daemon
