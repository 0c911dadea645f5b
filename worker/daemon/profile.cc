#include "worker/daemon/profile.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/plan/plan.h"
#include "worker/daemon/log_tail.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/planner_inputs.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::daemon {
namespace v1 = vocabpipe::v1;

namespace {

// Times one all-reduce and one send/recv of `count` floats between two Gloo ranks of this
// process on loopback (best of 5 after a warm-up): what a vocabulary collective and a P2P
// activation transfer cost at least between workers of this host.
absl::Status ProfileCommunication(size_t count, double* collective, double* p2p) {
  auto store = comm::MakeHashStore();
  std::array<absl::StatusOr<std::unique_ptr<comm::GlooCommunicator>>, 2> comms = {
      absl::UnknownError("not connected"), absl::UnknownError("not connected")};
  std::array<std::vector<double>, 2> all_reduce_s, p2p_s;
  auto body = [&](int rank) {
    comms[rank] = comm::ConnectGloo({.rank = rank,
                                     .size = 2,
                                     .store = store,
                                     .prefix = "profile",
                                     .hostname = "127.0.0.1",
                                     .timeout = absl::Seconds(10)});
    if (!comms[rank].ok()) return;
    comm::Communicator& c = **comms[rank];
    std::vector<float> buf(count, 1.0f);
    for (int i = 0; i < 6; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!c.AllReduce(buf.data(), count, comm::ReduceOp::kSum).ok()) return;
      const auto t1 = std::chrono::steady_clock::now();
      absl::Status st =
          rank == 0 ? c.Send(buf.data(), count, 1, i) : c.Recv(buf.data(), count, 0, i);
      if (!st.ok()) return;
      const auto t2 = std::chrono::steady_clock::now();
      if (i == 0) continue;  // warm-up
      all_reduce_s[rank].push_back(std::chrono::duration<double>(t1 - t0).count());
      p2p_s[rank].push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  };
  std::thread other(body, 1);
  body(0);
  other.join();
  for (int r = 0; r < 2; ++r) {
    if (!comms[r].ok()) return comms[r].status();
    if (all_reduce_s[r].size() != 5) return absl::InternalError("profile: a transfer failed");
  }
  // The receiver's time covers the whole transfer; the all-reduce ends together on both.
  *collective = *std::min_element(all_reduce_s[0].begin(), all_reduce_s[0].end());
  *p2p = *std::min_element(p2p_s[1].begin(), p2p_s[1].end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::PassCosts> ProfilePasses(const v1::ProfileTask& task, int cuda_device) {
  const v1::JobSpec& job = task.spec();
  const v1::JobSpec& spec = task.stage_spec();
  const int p = std::max(1, job.parallel().pipeline());
  const int layers = job.model().layers();
  const int stage_layers = spec.model().layers();
  const int shard_vocab = spec.model().vocab_size();
  // The coordinator's planner cut the job to one stage and planned it; check that it did.
  if (spec.parallel().pipeline() != 1 || stage_layers < 1 || stage_layers > layers ||
      shard_vocab < 2 || shard_vocab > std::max(2, job.model().vocab_size())) {
    return absl::InvalidArgumentError(
        "profile task: stage_spec must be one rank with at most the job's layers and vocabulary");
  }
  auto parsed = planner::PlanFromText(task.plan_text());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile task: plan_text: ", parsed.status().message()));
  }
  if (parsed->ranks.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile task: plan_text: the profiling plan must have 1 rank, not ", parsed->ranks.size()));
  }
  const planner::Plan& plan = *parsed;
  auto topt = runtime::TrainerOptionsFromSpec(spec, &plan);
  if (!topt.ok()) return topt.status();
  engine::cpu::SetBlasThreads(runtime::WorkerThreads(job));  // the share one rank of the job gets
  std::unique_ptr<comm::Communicator> self = comm::MakeSelfCommunicator();
  auto rank = launch::CreateLocalRank(spec, plan, *topt, self.get(), cuda_device);
  if (!rank.ok()) return rank.status();

  const int64_t tokens =
      static_cast<int64_t>(job.parallel().microbatch_size()) * job.model().seq_len();
  // Synthetic tokens: timing does not depend on their values, only on the shapes.
  runtime::BatchFn batches = [&](int64_t step, int mb, int32_t* inputs, int32_t* targets) {
    for (int64_t i = 0; i < tokens; ++i) {
      inputs[i] = static_cast<int32_t>((i * 31 + mb * 7 + step) % shard_vocab);
      targets[i] = static_cast<int32_t>((i * 17 + mb * 3 + step + 1) % shard_vocab);
    }
    return absl::OkStatus();
  };
  // Step 0 warms caches and allocations up; each pass kind then keeps its fastest of three
  // timed steps, so one preemption on a shared host does not pass for the pass's cost (the
  // auto choice compares methods whose predicted steps differ by a few percent).
  runtime::RankStepResult r;
  constexpr int kTimedSteps = 3;
  for (int step = 0; step <= kTimedSteps; ++step) {
    auto res = (*rank)->Step(step, batches);
    if (!res.ok())
      return absl::Status(res.status().code(),
                          absl::StrCat("profile step: ", res.status().message()));
    if (step == 1) {
      r = *res;
    } else if (step > 1) {
      for (size_t i = 0; i < r.busy.size(); ++i) r.busy[i] = std::min(r.busy[i], res->busy[i]);
    }
  }
  std::array<int, planner::kNumActionKinds> count{};
  for (const planner::Action& a : plan.ranks[0].actions) ++count[static_cast<int>(a.kind)];
  auto per_pass = [&](planner::ActionKind k) {
    const int i = static_cast<int>(k);
    return count[i] > 0 ? r.busy[i] / count[i] : 0.0;
  };
  // The profile ran ceil(L/p) layers; the planner's F, B, W are L/p layers.
  const double layer_scale = static_cast<double>(layers) / p / stage_layers;
  v1::PassCosts costs;
  costs.set_f(per_pass(planner::ActionKind::kF) * layer_scale);
  costs.set_b(per_pass(planner::ActionKind::kB) * layer_scale);
  costs.set_w(per_pass(planner::ActionKind::kW) * layer_scale);
  costs.set_s(per_pass(planner::ActionKind::kS));
  costs.set_t(per_pass(planner::ActionKind::kT));
  costs.set_input_f(per_pass(planner::ActionKind::kIF));
  costs.set_input_b(per_pass(planner::ActionKind::kIB));
  costs.set_opt(per_pass(planner::ActionKind::kOpt));
  // Communication, only when the job has more than one rank (nothing to send otherwise).
  if (p > 1) {
    double collective = 0, p2p = 0;
    const size_t count = static_cast<size_t>(tokens) * job.model().hidden();
    if (auto st = ProfileCommunication(count, &collective, &p2p); !st.ok()) return st;
    costs.set_collective(collective);
    costs.set_comm(p2p);
  }
  auto layer_bytes = launch::MeasureJobLayerActivations(job);
  if (!layer_bytes.ok()) return layer_bytes.status();
  costs.set_layer_activation_kept_bytes(layer_bytes->kept);
  costs.set_layer_activation_transient_bytes(layer_bytes->backward_transient);
  if (!(costs.f() > 0) || !(costs.s() > 0) || !(costs.t() > 0)) {
    return absl::InternalError(absl::StrCat("profile: a pass was not timed (F ", costs.f(),
                                            " s, S ", costs.s(), " s, T ", costs.t(), " s)"));
  }
  return costs;
}

namespace {

bool ReadFileTo(const std::string& path, std::string* out, size_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out->assign(max_bytes + 1, '\0');
  f.read(out->data(), static_cast<std::streamsize>(out->size()));
  out->resize(static_cast<size_t>(f.gcount()));
  return !f.bad() && out->size() <= max_bytes;
}

// A private temporary folder, removed with its files when this goes out of scope.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "vp-profile-XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

absl::StatusOr<v1::PassCosts> ProfileInChild(const v1::ProfileTask& task,
                                             const ProfileChildOptions& options,
                                             const std::function<void(int)>& on_pid) {
  TempDir tmp;
  if (tmp.path().empty()) return absl::InternalError("profile: cannot create a temporary folder");
  const std::string task_path = tmp.path() + "/task.pb", out_path = tmp.path() + "/costs.pb",
                    log_path = tmp.path() + "/stderr.log";
  {
    std::ofstream f(task_path, std::ios::binary);
    if (!task.SerializeToOstream(&f) || !f.flush()) {
      return absl::InternalError("profile: cannot write the task file");
    }
  }
  std::vector<std::string> args = {options.worker_binary, "--profile-task", task_path,
                                   "--profile-out", out_path};
  if (options.cuda_device >= 0) {
    args.push_back("--cuda-device");
    args.push_back(std::to_string(options.cuda_device));
  }
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log < 0) return absl::InternalError("profile: cannot create the child's log");
  const rlim_t limit = static_cast<rlim_t>(options.memory_limit_bytes);
  const pid_t pid = fork();
  if (pid == 0) {                      // child: only async-signal-safe calls until exec
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the daemon's profiling thread
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (limit > 0) {
      const struct rlimit rl = {limit, limit};
      setrlimit(RLIMIT_AS, &rl);
    }
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log);
  if (pid < 0) return absl::InternalError("profile: fork failed");
  if (on_pid) on_pid(pid);
  int status = 0;
  const absl::Time deadline = absl::Now() + options.timeout;
  bool timed_out = false;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) break;
    if (!timed_out && absl::Now() > deadline) {  // stuck (e.g. spinning on a failed allocation)
      timed_out = true;
      kill(pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (on_pid) on_pid(-1);
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat("profiling process took longer than ",
                                                    absl::FormatDuration(options.timeout),
                                                    " and was killed"));
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    std::string why = absl::StrCat("profiling process killed by signal ", sig, " (",
                                   sigabbrev_np(sig) != nullptr ? sigabbrev_np(sig) : "?", ")");
    const std::string last = LastLogLine(log_path, 500);
    if (!last.empty()) absl::StrAppend(&why, ": ", last);
    return absl::InternalError(why);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string last = LastLogLine(log_path, 500);
    if (last.empty())
      last = absl::StrCat("profiling process exited with code ", WEXITSTATUS(status));
    return absl::InternalError(last);
  }
  std::string bytes;
  v1::PassCosts costs;
  if (!ReadFileTo(out_path, &bytes, 1 << 20) || !costs.ParseFromString(bytes)) {
    return absl::InternalError("profile: the profiling process wrote no costs");
  }
  return costs;
}

int ProfileChildMain(int argc, char** argv) {
  std::string task_path, out_path;
  int cuda_device = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--profile-task") {
      task_path = v;
    } else if (a == "--profile-out") {
      out_path = v;
    } else if (a == "--cuda-device") {
      if (!absl::SimpleAtoi(v, &cuda_device) || cuda_device < 0) return 2;
    } else {
      std::cerr << "vocabpipe-worker: unknown flag " << a << std::endl;
      return 2;
    }
  }
  if (task_path.empty() || out_path.empty()) {
    std::cerr << "usage: vocabpipe-worker --profile-task FILE --profile-out FILE "
                 "[--cuda-device N]"
              << std::endl;
    return 2;
  }
  std::string bytes;
  v1::ProfileTask task;
  if (!ReadFileTo(task_path, &bytes, 8 << 20) || !task.ParseFromString(bytes)) {
    std::cerr << "profile: cannot read the task file" << std::endl;
    return 1;
  }
  absl::StatusOr<v1::PassCosts> costs = ProfilePasses(task, cuda_device);
  if (!costs.ok()) {
    // One line: the daemon reports the child's last line.
    std::string message(costs.status().message());
    std::replace(message.begin(), message.end(), '\n', ';');
    std::cerr << message << std::endl;
    return 1;
  }
  std::ofstream f(out_path, std::ios::binary);
  if (!costs->SerializeToOstream(&f) || !f.flush()) {
    std::cerr << "profile: cannot write the costs" << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace vp::daemon
