// The control-plane forms of `vocabpipe plan` and `vocabpipe run` (main.cc routes here when a
// --coordinator or --control-plane flag is present; without them both stay offline/local):
//   vocabpipe plan JOB.yaml --coordinator HOST:PORT [--output text|json]
//       the coordinator's dry run (JobService.PlanJob): plan, candidate table, timeline
//   vocabpipe run JOB.yaml --coordinator HOST:PORT [--output text|json]
//       submit, then watch to the end (exit codes of watch)
//   vocabpipe run JOB.yaml --control-plane [--output text|json]
//       the same through an in-process coordinator (SQLite file in the job's checkpoint.dir)
//       and parallel.pipeline worker daemons started on this host
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/control_client.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"
#include "worker/launch/launcher.h"

extern char** environ;

namespace vp::cli {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

namespace {

bool ReadSpecRequest(const std::string& cmd, const std::string& path, std::ostream& err,
                     v1::SubmitJobRequest* req) {
  std::ifstream f(path);
  if (!f) {
    err << "vocabpipe " << cmd << ": " << path << ": cannot read\n";
    return false;
  }
  std::ostringstream text;
  text << f.rdbuf();
  req->set_spec_text(text.str());
  std::error_code ec;
  req->set_base_dir(fs::absolute(path, ec).parent_path().string());
  return true;
}

int SubmitAndWatch(const std::string& path, const std::string& address, bool json,
                   std::ostream& out, std::ostream& err) {
  v1::SubmitJobRequest req;
  if (!ReadSpecRequest("run", path, err, &req)) return kExitUsage;
  Stubs s = Connect(address);
  v1::SubmitJobResponse resp;
  grpc::Status st = s.jobs->SubmitJob(CallContext().get(), req, &resp);
  if (!st.ok()) return ReportRpcError("run", st, address, err);
  if (!json) out << "submitted " << resp.job_id() << " to " << address << "\n";
  Args watch = {resp.job_id(), "--coordinator", address};
  if (json) {
    watch.push_back("--output");
    watch.push_back("json");
  }
  return RunWatchCommand(watch, out, err);
}

// Worker daemons started for --control-plane: SIGTERM and reaped on scope exit.
class LocalWorkers {
 public:
  ~LocalWorkers() {
    for (pid_t pid : pids_) kill(pid, SIGTERM);
    for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
  }
  bool Start(const std::string& binary, const std::string& address, const std::string& log) {
    std::vector<std::string> args = {binary, "--coordinator", address, "--exit-with-parent", "1"};
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const bool ok = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) == 0;
    posix_spawn_file_actions_destroy(&fa);
    if (ok) pids_.push_back(pid);
    return ok;
  }

 private:
  std::vector<pid_t> pids_;
};

}  // namespace

int RunRemotePlanCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe plan JOB.yaml --coordinator HOST:PORT [--output text|json]\n";
  ControlArgs a;
  if (!ParseControlArgs("plan", args, {}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1) {
    err << "vocabpipe plan: give exactly one job file\n" << usage;
    return kExitUsage;
  }
  v1::SubmitJobRequest req;
  if (!ReadSpecRequest("plan", a.positional[0], err, &req)) return kExitUsage;
  Stubs s = Connect(a.coordinator);
  v1::PlanJobResponse resp;
  grpc::Status st = s.jobs->PlanJob(CallContext().get(), req, &resp);
  if (!st.ok()) return ReportRpcError("plan", st, a.coordinator, err);
  if (a.json) {
    v1::Job as_job;  // reuse the job view of plan + candidates
    *as_job.mutable_plan() = resp.plan();
    *as_job.mutable_candidates() = resp.candidates();
    nlohmann::json j = JobJson(as_job);
    out << nlohmann::json{{"plan", j["plan"]}, {"candidates", j["candidates"]}}.dump(2) << "\n";
    return kExitOk;
  }
  const v1::PlanSummary& p = resp.plan();
  out << absl::StrFormat("plan: %s + %s, p=%d, m=%d, k=%d, predicted %.4g s/step (%s costs)\n",
                         p.schedule(), p.vocab(), p.pipeline(), p.microbatches(), p.seq_chunks(),
                         p.predicted_step_seconds(), p.costs_source());
  out << resp.table();
  return kExitOk;
}

int RunRemoteRunCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe run JOB.yaml --coordinator HOST:PORT [--output text|json]\n"
      "       vocabpipe run JOB.yaml --control-plane [--output text|json]\n";
  Args rest;
  bool local = false;
  for (const std::string& x : args) {
    if (x == "--control-plane") {
      local = true;
    } else {
      rest.push_back(x);
    }
  }
  if (!local) {
    ControlArgs a;
    if (!ParseControlArgs("run", rest, {}, usage, err, &a)) return kExitUsage;
    if (a.positional.size() != 1) {
      err << "vocabpipe run: give exactly one job file\n" << usage;
      return kExitUsage;
    }
    return SubmitAndWatch(a.positional[0], a.coordinator, a.json, out, err);
  }
  // In-process coordinator: the address is ours, so --coordinator is not taken.
  rest.push_back("--coordinator");
  rest.push_back("in-process");
  ControlArgs a;
  if (!ParseControlArgs("run", rest, {}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1 || a.coordinator != "in-process") {
    err << "vocabpipe run: --control-plane takes one job file and no --coordinator\n" << usage;
    return kExitUsage;
  }
  v1::SubmitJobRequest req;
  if (!ReadSpecRequest("run", a.positional[0], err, &req)) return kExitUsage;
  auto spec = server::SpecFromRequest(req);
  if (!spec.ok()) {
    err << "vocabpipe run: invalid: " << spec.status().message() << "\n";
    return kExitUsage;
  }
  const std::string dir = spec->checkpoint().dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    err << "vocabpipe run: checkpoint.dir " << dir << ": " << ec.message() << "\n";
    return kExitFailed;
  }
  server::CoordinatorOptions options;
  options.db_path = (fs::path(dir) / "coordinator.db").string();
  options.heartbeat_interval = absl::Milliseconds(200);
  options.heartbeat_timeout = absl::Seconds(5);
  auto coordinator = server::Coordinator::Open(options);
  if (!coordinator.ok()) {
    err << "vocabpipe run: " << coordinator.status().message() << "\n";
    return kExitFailed;
  }
  auto srv = server::CoordinatorServer::Start(coordinator->get(), "127.0.0.1:0");
  if (!srv.ok()) {
    err << "vocabpipe run: " << srv.status().message() << "\n";
    return kExitFailed;
  }
  const std::string address = absl::StrCat("127.0.0.1:", (*srv)->port());
  auto binary = launch::FindWorkerBinary("");
  if (!binary.ok()) {
    err << "vocabpipe run: " << binary.status().message() << "\n";
    return kExitFailed;
  }
  LocalWorkers workers;
  for (int r = 0; r < spec->parallel().pipeline(); ++r) {
    const std::string log = (fs::path(dir) / absl::StrCat("daemon_", r, ".log")).string();
    if (!workers.Start(*binary, address, log)) {
      err << "vocabpipe run: cannot start " << *binary << "\n";
      return kExitFailed;
    }
  }
  return SubmitAndWatch(a.positional[0], address, a.json, out, err);
}

}  // namespace vp::cli
