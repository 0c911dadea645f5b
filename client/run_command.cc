// vocabpipe run JOB.yaml [--resume] [--steps N] [--timeout SECONDS] [--worker PATH]
//                        [--output text|json] [--coordinator HOST:PORT | --direct]
//                        [--tls-ca FILE | --insecure]
//
// Default: the job goes through the control plane on this host, exactly as a submitted job
// does on a cluster: an in-process coordinator (gRPC on a loopback port, its SQLite file in
// checkpoint.dir) and parallel.pipeline local worker daemons (`vocabpipe-worker
// --coordinator`); the daemons register, profile the passes, get the plan and start the rank
// processes. This command submits the job, follows its event stream and writes
// checkpoint.dir/metrics.jsonl from the step events (each carries its merged line,
// proto/runlog), with one progress line per step and a summary at the end.
//   --coordinator HOST:PORT  submit to a running coordinator instead and watch the job (TLS
//                            with --tls-ca and $VOCABPIPE_TOKEN, or --insecure on loopback).
// The in-process coordinator serves plaintext on a unix socket in a 0700 folder of $TMPDIR (or
// /tmp), so no other local user can reach it (its daemons get --insecure).
//   --direct                 no control plane: p = 1 trains in this process
//                            (runtime::RunStandaloneJob), p > 1 starts the rank processes
//                            itself (RunPipelineJob). Same files, same numbers.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/commands.h"
#include "client/control_client.h"
#include "client/launcher.h"
#include "coordinator/planner/layout.h"
#include "coordinator/planner/spec_input.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"
#include "proto/spec/job_spec.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/run_dir.h"
#include "worker/launch/step_recorder.h"
#include "worker/runtime/run_job.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

namespace {

constexpr char kUsage[] =
    "usage: vocabpipe run JOB.yaml [--resume] [--steps N] [--timeout SECONDS] [--worker PATH]\n"
    "                              [--output text|json] [--coordinator HOST:PORT | --direct]\n"
    "                              [--tls-ca FILE | --insecure]\n";

struct RunFlags {
  std::string spec_path;
  bool resume = false;
  int64_t steps = -1;  // >= 0: overrides train.steps
  double timeout_seconds = 60;
  std::string worker_binary;
  std::string coordinator;  // non-empty: a running coordinator
  std::string tls_ca;       // its CA (--coordinator only)
  bool insecure = false;
  bool direct = false;
  bool json = false;
};

// Returns false (after writing why) on bad usage.
bool ParseRunFlags(const Args& args, std::ostream& err, RunFlags* f) {
  auto fail = [&](const std::string& why) {
    err << "vocabpipe run: " << why << "\n" << kUsage;
    return false;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool has_value = i + 1 < args.size();
    if (a == "--resume") {
      f->resume = true;
    } else if (a == "--direct") {
      f->direct = true;
    } else if (a == "--insecure") {
      f->insecure = true;
    } else if (a == "--tls-ca") {
      if (!has_value) return fail("--tls-ca needs a file");
      f->tls_ca = args[++i];
    } else if (a == "--control-plane") {
      // The default since the control plane runs every job; kept for old scripts.
    } else if (a == "--steps") {
      if (!has_value || !absl::SimpleAtoi(args[i + 1], &f->steps) || f->steps < 0) {
        return fail("--steps needs a non-negative integer");
      }
      ++i;
    } else if (a == "--timeout") {
      if (!has_value || !absl::SimpleAtod(args[i + 1], &f->timeout_seconds) ||
          !(f->timeout_seconds > 0)) {
        return fail("--timeout needs seconds > 0");
      }
      ++i;
    } else if (a == "--worker") {
      if (!has_value) return fail("--worker needs a path");
      f->worker_binary = args[++i];
    } else if (a == "--coordinator") {
      if (!has_value) return fail("--coordinator needs HOST:PORT");
      f->coordinator = args[++i];
    } else if (a == "--output") {
      if (!has_value || (args[i + 1] != "text" && args[i + 1] != "json")) {
        return fail("--output: text or json");
      }
      f->json = args[++i] == "json";
    } else if (!a.empty() && a[0] == '-') {
      return fail("unknown flag " + a);
    } else if (f->spec_path.empty()) {
      f->spec_path = a;
    } else {
      return fail(absl::StrCat("more than one job spec given (", f->spec_path, ", ", a, ")"));
    }
  }
  if (f->spec_path.empty()) return fail("give a job spec");
  if (f->direct && !f->coordinator.empty()) return fail("--direct and --coordinator exclude");
  if (f->coordinator.empty() && (f->insecure || !f->tls_ca.empty())) {
    return fail("--tls-ca, --insecure: only with --coordinator (a local run is on loopback)");
  }
  return true;
}

// The peak MFU is measured against: the CPU's measured sgemm rate, or the GPU's dense bf16
// tensor-core rate from the device table (job_rank.h CudaPeakFlops).
void PrintSummary(const runtime::RunSummary& s, bool per_rank, bool cuda, std::ostream& out) {
  std::string peak =
      cuda ? absl::StrFormat("the GPU's dense bf16 peak, %.0f TFLOP/s", s.peak_flops / 1e12)
           : absl::StrFormat("a %.1f GFLOP/s sgemm peak%s", s.peak_flops / 1e9,
                             s.peak_source.empty() ? "" : " (" + s.peak_source + ")");
  if (s.peak_stale) {
    absl::StrAppend(&peak,
                    "; some steps ran above it, so MFU is capped at 100% and the peak is "
                    "stale: VOCABPIPE_MEASURE_PEAK=1 measures it again");
  }
  out << absl::StrFormat(
      "done: %d steps, loss %.4f -> %.4f%s, %.0f tokens/s, MFU %.1f%% of %s%s, peak memory %.1f "
      "MiB\nmetrics: %s\ncheckpoint: %s\n",
      s.steps_run, s.first_loss, s.final_loss,
      s.has_val_loss ? absl::StrFormat(", validation loss %.4f", s.final_val_loss) : "",
      s.tokens_per_s, 100.0 * s.mfu, peak, per_rank ? " per rank" : "",
      s.peak_memory_bytes / 1048576.0, s.metrics_path, s.last_checkpoint);
}

// The daemons a local run starts: one per rank, d·t·p, or parallel.world when the planner
// chooses the layout.
int LocalRanks(const v1::JobSpec& spec) {
  const auto& p = spec.parallel();
  if (planner::NeedsLayoutChoice(spec)) return p.world();
  return std::max(1, p.pipeline()) * std::max(1, p.data()) * std::max(1, p.tensor());
}

int RunDirect(const v1::JobSpec& spec, const RunFlags& f, bool interactive, std::ostream& out,
              std::ostream& err) {
  absl::StatusOr<runtime::RunSummary> summary;
  // One rank on the CPU trains in this process; anything else (a pipeline, replicas, a tensor
  // group, a layout still to choose) runs worker processes.
  if (!planner::NeedsLayoutChoice(spec) && LocalRanks(spec) == 1 && spec.device() == "cpu") {
    runtime::RunOptions options;
    options.resume = f.resume;
    options.interactive = interactive;
    summary = runtime::RunStandaloneJob(spec, options, out);
  } else {
    LaunchOptions launch;
    launch.resume = f.resume;
    launch.interactive = interactive;
    launch.timeout = absl::Seconds(f.timeout_seconds);
    launch.worker_binary = f.worker_binary;
    summary = RunPipelineJob(spec, launch, out);
  }
  if (!summary.ok()) {
    err << "vocabpipe run: " << summary.status().message() << "\n";
    return absl::IsInvalidArgument(summary.status()) || absl::IsUnimplemented(summary.status())
               ? kExitUsage
               : kExitFailed;
  }
  PrintSummary(*summary, LocalRanks(spec) > 1, spec.device() != "cpu", out);
  return kExitOk;
}

v1::SubmitJobRequest SubmitRequest(const v1::JobSpec& spec, const RunFlags& f) {
  v1::SubmitJobRequest req;
  *req.mutable_spec() = spec;  // paths are already absolute (LoadJobSpecFile)
  std::error_code ec;
  req.set_base_dir(fs::absolute(f.spec_path, ec).parent_path().string());
  req.set_resume(f.resume);
  return req;
}

int SubmitAndWatch(const v1::JobSpec& spec, const RunFlags& f, std::ostream& out,
                   std::ostream& err) {
  ControlArgs a;
  a.coordinator = f.coordinator;
  a.tls_ca = f.tls_ca;
  a.insecure = f.insecure;
  if (std::string why; !ResolveSecurity(&a, &why)) {
    err << "vocabpipe run: " << why << "\n" << kUsage;
    return kExitUsage;
  }
  Stubs s = Connect(a);
  v1::SubmitJobResponse resp;
  grpc::Status st = s.jobs->SubmitJob(CallContext().get(), SubmitRequest(spec, f), &resp);
  if (!st.ok()) return ReportRpcError("run", st, f.coordinator, err);
  if (!f.json) out << "submitted " << resp.job_id() << " to " << f.coordinator << "\n";
  Args watch = {resp.job_id(), "--coordinator", f.coordinator};
  watch.insert(watch.end(), a.security_flags.begin(), a.security_flags.end());
  if (f.json) {
    watch.push_back("--output");
    watch.push_back("json");
  }
  return RunWatchCommand(watch, out, err);
}

// A folder of mode 0700 for the local coordinator's unix socket, removed (with the socket) on
// scope exit. In $TMPDIR (else /tmp): a socket path must stay short (108 bytes on Linux), which
// checkpoint.dir may not be.
class SocketDir {
 public:
  explicit SocketDir(std::string path) : path_(std::move(path)) {}
  SocketDir(SocketDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  SocketDir(const SocketDir&) = delete;
  SocketDir& operator=(const SocketDir&) = delete;
  ~SocketDir() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

absl::StatusOr<SocketDir> PrivateSocketDir() {
  std::string base = "/tmp";
  if (const char* tmp = std::getenv("TMPDIR");
      tmp != nullptr && *tmp == '/' && std::string(tmp).size() < 64) {
    base = tmp;
  }
  std::string templ = base + "/vocabpipe-run-XXXXXX";
  // mkdtemp creates the folder with mode 0700, owned by this user.
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot create a private folder in ", base,
                     " for the local coordinator's socket: ", std::strerror(errno)));
  }
  return SocketDir(templ);
}

// Worker daemons started for a local run: SIGTERM and reaped on scope exit (their rank
// processes die with them).
class LocalWorkers {
 public:
  LocalWorkers() = default;
  LocalWorkers(const LocalWorkers&) = delete;
  LocalWorkers& operator=(const LocalWorkers&) = delete;
  ~LocalWorkers() {
    for (pid_t pid : pids_) kill(pid, SIGTERM);
    for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
  }
  absl::Status Start(const std::string& binary, const std::string& address,
                     const std::string& device, const std::string& log) {
    auto pid = SpawnLogged({binary, "--coordinator", address, "--insecure", "--device", device,
                            "--exit-with-parent", "1"},
                           log);
    if (!pid.ok()) return pid.status();
    pids_.push_back(*pid);
    return absl::OkStatus();
  }

 private:
  std::vector<pid_t> pids_;
};

// A step event's merged line (StepMetrics.line_json) into metrics.jsonl and the progress line.
absl::Status RecordStep(const v1::StepMetrics& m, launch::StepRecorder& recorder) {
  nlohmann::json line = nlohmann::json::parse(m.line_json(), nullptr, false);
  if (line.is_discarded() || !line.is_object() || !line.contains("step")) {
    return absl::DataLossError(absl::StrCat("step ", m.step(), ": the event has no step line"));
  }
  return recorder.Record(line);
}

// What `--direct` would reject before starting anything is rejected here too, as invalid input
// (exit code 2) rather than as a failed job: the plan, the device, the data file.
absl::Status CheckRunnable(const v1::JobSpec& spec) {
  if (planner::NeedsLayoutChoice(spec)) {
    // parallel.world: some layout must plan (the coordinator chooses it again at submit, with
    // the workers' memory as the budget when the spec gives none).
    planner::LayoutOptions lo;
    lo.link = planner::DefaultLink(spec.device());
    if (auto layout = planner::ResolveLayout(spec, lo); !layout.ok()) return layout.status();
  } else if (auto plan = planner::BuildPlanFromSpec(spec); !plan.ok()) {
    return plan.status();
  }
  return CheckJobRunsHere(spec);
}

int RunLocalControlPlane(const v1::JobSpec& spec, const RunFlags& f, bool interactive,
                         std::ostream& out, std::ostream& err) {
  if (auto st = CheckRunnable(spec); !st.ok()) {
    err << "vocabpipe run: " << st.message() << "\n";
    return kExitUsage;
  }
  const std::string dir = spec.checkpoint().dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    err << "vocabpipe run: checkpoint.dir " << dir << ": " << ec.message() << "\n";
    return kExitFailed;
  }
  launch::StepRecorder recorder(dir, spec.train().steps(), f.resume, interactive && !f.json,
                                f.json ? err : out);
  if (auto st = recorder.Start(); !st.ok()) {
    err << "vocabpipe run: " << st.message() << "\n";
    return kExitFailed;
  }
  auto binary = FindWorkerBinary(f.worker_binary);
  if (!binary.ok()) {
    err << "vocabpipe run: " << binary.status().message() << "\n";
    return kExitFailed;
  }
  server::CoordinatorOptions options;
  options.db_path = (fs::path(dir) / "coordinator.db").string();
  options.heartbeat_interval = absl::Milliseconds(200);
  options.heartbeat_timeout = absl::Seconds(5);
  options.rank_timeout = absl::Seconds(f.timeout_seconds);
  auto coordinator = server::Coordinator::Open(options);
  if (!coordinator.ok()) {
    err << "vocabpipe run: " << coordinator.status().message() << "\n";
    return kExitFailed;
  }
  // The coordinator serves plaintext with every caller its admin: on a loopback port any local
  // user could list, register or cancel. A unix socket in a folder only this user can enter
  // keeps them out (connecting needs search permission on the folder).
  auto socket_dir = PrivateSocketDir();
  if (!socket_dir.ok()) {
    err << "vocabpipe run: " << socket_dir.status().message() << "\n";
    return kExitFailed;
  }
  const std::string address = absl::StrCat("unix:", socket_dir->path(), "/coordinator.sock");
  auto srv = server::CoordinatorServer::Start(coordinator->get(), address);
  if (!srv.ok()) {
    err << "vocabpipe run: " << srv.status().message() << "\n";
    return kExitFailed;
  }
  LocalWorkers workers;
  const int cuda_devices = spec.device() == "cpu" ? 0 : launch::CudaDeviceCount();
  // One daemon per rank: d replicas of the p-stage pipeline, each stage over t tensor ranks.
  const int ranks = LocalRanks(spec);
  for (int r = 0; r < ranks; ++r) {
    const std::string log = (fs::path(dir) / absl::StrCat("daemon_", r, ".log")).string();
    auto device = LocalDaemonDevice(spec, r, cuda_devices);
    if (!device.ok()) {
      err << "vocabpipe run: " << device.status().message() << "\n";
      return kExitUsage;
    }
    if (auto st = workers.Start(*binary, address, *device, log); !st.ok()) {
      err << "vocabpipe run: " << st.message() << "\n";
      return kExitFailed;
    }
  }

  // From here on, the same gRPC calls as `vocabpipe submit` + `vocabpipe watch`.
  Stubs s = Connect(address, grpc::InsecureChannelCredentials());  // this user's socket
  v1::SubmitJobResponse submitted;
  grpc::Status st = s.jobs->SubmitJob(CallContext().get(), SubmitRequest(spec, f), &submitted);
  if (!st.ok()) return ReportRpcError("run", st, address, err);
  v1::GetJobRequest get;
  get.set_job_id(submitted.job_id());
  v1::Job job;
  st = s.jobs->GetJob(CallContext().get(), get, &job);
  if (!st.ok()) return ReportRpcError("run", st, address, err);
  absl::Status write_error;
  FollowResult r = FollowJob(s, job, 0, [&](const v1::JobEvent& e) {
    if (e.has_step() && write_error.ok()) write_error = RecordStep(e.step(), recorder);
    if (f.json) {
      out << EventJson(e).dump() << "\n" << std::flush;
    } else if (!e.has_step()) {
      if (interactive) out << "\r\033[K";
      out << job.id() << ": " << StateName(e.state());
      if (!e.message().empty()) out << " — " << e.message();
      out << "\n" << std::flush;
    }
  });
  if (!r.status.ok()) return ReportRpcError("run", r.status, address, err);
  if (!write_error.ok()) {
    err << "vocabpipe run: " << write_error.message() << "\n";
    return kExitFailed;
  }
  double peak = 0;
  int counted = 0;
  for (const v1::WorkerInfo& w : (*coordinator)->ListWorkers()) {
    peak += w.peak_flops();
    ++counted;
  }
  runtime::RunSummary summary = recorder.Finish(counted > 0 ? peak / counted : 0);
  switch (r.last_state) {
    case v1::JOB_STATE_SUCCEEDED:
      if (!f.json) {
        PrintSummary(summary, LocalRanks(spec) > 1, spec.device() != "cpu", out);
      }
      return kExitOk;
    case v1::JOB_STATE_CANCELLED:
      err << "vocabpipe run: cancelled: " << r.last_reason << "\n";
      return kExitCancelled;
    default:
      err << "vocabpipe run: " << r.last_reason << " (logs: " << dir << "/rank_<R>.log, " << dir
          << "/daemon_<R>.log)\n";
      return kExitFailed;
  }
}

}  // namespace

int RunRunCommand(const Args& args, std::ostream& out, std::ostream& err) {
  if (WantsHelp(args)) {
    out << kUsage;
    return kExitOk;
  }
  RunFlags f;
  if (!ParseRunFlags(args, err, &f)) return kExitUsage;
  auto spec = spec::LoadJobSpecFile(f.spec_path);
  if (!spec.ok()) {
    err << spec.status().message() << "\n";
    return kExitUsage;
  }
  if (f.steps >= 0) spec->mutable_train()->set_steps(static_cast<int32_t>(f.steps));
  const bool interactive = isatty(STDOUT_FILENO) && &out == &std::cout;
  if (f.direct) return RunDirect(*spec, f, interactive, out, err);
  if (!f.coordinator.empty()) return SubmitAndWatch(*spec, f, out, err);
  return RunLocalControlPlane(*spec, f, interactive, out, err);
}

}  // namespace vp::cli
