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
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/grpc/auth.h"
#include "proto/plan/plan.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/daemon/log_tail.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/transformer/transformer.h"
#include "worker/launch/grpc_store.h"
#include "worker/launch/job_rank.h"
#include "worker/launch/planner_inputs.h"
#include "worker/runtime/job_options.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::daemon {
namespace v1 = vocabpipe::v1;

namespace {

// Per group: the fastest of kCommReps timed calls after one warm-up. The two sizes alternate
// within each repetition, so a stall of a few milliseconds lands on both sizes' calls rather
// than on every call of one size (timed one size after the other, a profile here once put
// 4 ms on every 512-byte call and 0.07 ms on the 128 KiB ones).
constexpr int kCommReps = 7;
// Some fresh groups keep one call kind at one size ~3.4 ms slow in every repetition (Gloo's
// all-reduce on loopback; 2 profiles in 12 here), so the profile times several groups, each
// on new connections, and keeps the median of each (size, kind).
constexpr int kCommGroups = 3;

// One group of `ranks` Gloo ranks (threads of this process on loopback, fresh connections):
// [size][kind] the fastest of kCommReps calls, the slowest rank's for a collective and the
// receiver's for a send/recv. Kinds: 0 all-reduce, 1 broadcast, 2 send/recv.
using GroupTimes = std::array<std::array<double, 4>, 2>;  // [size][all-reduce, broadcast,
                                                          // send/recv, all-gather]

absl::StatusOr<GroupTimes> TimeOneGroup(int ranks, const std::array<size_t, 2>& sizes,
                                        size_t floats_large, int group) {
  auto store = comm::MakeHashStore();
  std::vector<absl::StatusOr<std::unique_ptr<comm::GlooCommunicator>>> comms;
  for (int r = 0; r < ranks; ++r) comms.emplace_back(absl::UnknownError("not connected"));
  // [rank][size][kind]: the fastest call.
  std::vector<GroupTimes> best(ranks);
  std::vector<absl::Status> errors(ranks);
  auto body = [&](int rank) {
    comms[rank] = comm::ConnectGloo({.rank = rank,
                                     .size = ranks,
                                     .store = store,
                                     .prefix = absl::StrCat("profile-comm-", group),
                                     .hostname = "127.0.0.1",
                                     .timeout = absl::Seconds(30)});
    if (!comms[rank].ok()) return;
    comm::Communicator& c = **comms[rank];
    std::vector<float> buf(floats_large, 1.0f);
    uint64_t tag = 0;
    for (auto& size_best : best[rank]) size_best.fill(1e30);
    for (int i = 0; i <= kCommReps; ++i) {
      for (int z = 0; z < 2; ++z) {
        const size_t n = sizes[z];
        // A barrier first, so every call starts with all ranks ready (what the planner's
        // latency means: the call itself, not waiting for a late peer).
        if (absl::Status st = c.Barrier(); !st.ok()) {
          errors[rank] = st;
          return;
        }
        const auto t0 = std::chrono::steady_clock::now();
        absl::Status st = c.AllReduce(buf.data(), n, comm::ReduceOp::kSum);
        const auto t1 = std::chrono::steady_clock::now();
        if (st.ok()) st = c.Barrier();
        const auto t2 = std::chrono::steady_clock::now();
        if (st.ok()) st = c.Broadcast(buf.data(), n, 0);
        const auto t3 = std::chrono::steady_clock::now();
        if (st.ok()) st = c.Barrier();
        // Send/recv between ranks 0 and 1 (a stage and the next; the others wait).
        const auto t4 = std::chrono::steady_clock::now();
        if (st.ok() && rank == 0) st = c.Send(buf.data(), n, 1, tag);
        if (st.ok() && rank == 1) st = c.Recv(buf.data(), n, 0, tag);
        ++tag;
        const auto t5 = std::chrono::steady_clock::now();
        // An all-gather of the n floats (each rank's n/ranks of them): a tensor group's call.
        if (st.ok()) st = c.Barrier();
        const auto t6 = std::chrono::steady_clock::now();
        if (st.ok()) st = c.AllGather(buf.data(), n);
        const auto t7 = std::chrono::steady_clock::now();
        if (!st.ok()) {
          errors[rank] = st;
          return;
        }
        if (i == 0) continue;  // warm-up
        auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
        best[rank][z][0] = std::min(best[rank][z][0], sec(t0, t1));
        best[rank][z][1] = std::min(best[rank][z][1], sec(t2, t3));
        best[rank][z][2] = std::min(best[rank][z][2], sec(t4, t5));
        best[rank][z][3] = std::min(best[rank][z][3], sec(t6, t7));
      }
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < ranks; ++r) others.emplace_back(body, r);
  body(0);
  for (std::thread& t : others) t.join();
  for (int r = 0; r < ranks; ++r) {
    if (!comms[r].ok()) return comms[r].status();
    if (!errors[r].ok()) return errors[r];
  }
  // A collective ends when its slowest rank is done; the receiver's time covers a transfer.
  GroupTimes out{};
  for (int z = 0; z < 2; ++z) {
    for (int r = 0; r < ranks; ++r) {
      out[z][0] = std::max(out[z][0], best[r][z][0]);
      out[z][1] = std::max(out[z][1], best[r][z][1]);
      out[z][3] = std::max(out[z][3], best[r][z][3]);
    }
    out[z][2] = best[1][z][2];
  }
  return out;
}

}  // namespace

LinkFit FitLink(double bytes_small, double seconds_small, double bytes_large,
                double seconds_large) {
  LinkFit fit;
  const double per_byte =
      bytes_large > bytes_small
          ? std::max(0.0, (seconds_large - seconds_small) / (bytes_large - bytes_small))
          : 0.0;
  // A larger call that finished sooner means the small call was disturbed: the latency is at
  // most the large call's time, which both measurements agree with.
  fit.latency = std::max(0.0, std::min(seconds_small, seconds_large) - bytes_small * per_byte);
  fit.bandwidth = per_byte > 0 ? 1 / per_byte : 0;
  return fit;
}

absl::StatusOr<CommProfile> ProfileCommunication(int ranks, size_t floats_small,
                                                 size_t floats_large) {
  if (ranks < 2 || ranks > 64 || floats_small < 1 || floats_large <= floats_small) {
    return absl::InvalidArgumentError(
        "profile communication: need 2..64 ranks and two sizes, small < large");
  }
  const std::array<size_t, 2> sizes = {floats_small, floats_large};
  // The median over fresh groups of each (size, kind)'s time.
  std::vector<GroupTimes> groups;
  for (int g = 0; g < kCommGroups; ++g) {
    auto t = TimeOneGroup(ranks, sizes, floats_large, g);
    if (!t.ok()) return t.status();
    groups.push_back(*t);
  }
  auto median = [&](int z, int kind) {
    std::vector<double> v;
    for (const GroupTimes& t : groups) v.push_back(t[z][kind]);
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  CommProfile out;
  for (int z = 0; z < 2; ++z) {
    out.allreduce_seconds[z] = median(z, 0);
    out.broadcast_seconds[z] = median(z, 1);
    out.p2p_seconds[z] = median(z, 2);
    out.allgather_seconds[z] = median(z, 3);
    out.bytes[z] = static_cast<double>(sizes[z]) * sizeof(float);
  }
  auto fit = [&](const std::array<double, 2>& t) {
    return FitLink(out.bytes[0], t[0], out.bytes[1], t[1]);
  };
  out.allreduce = fit(out.allreduce_seconds);
  out.broadcast = fit(out.broadcast_seconds);
  out.p2p = fit(out.p2p_seconds);
  out.allgather = fit(out.allgather_seconds);
  return out;
}

absl::StatusOr<v1::PassCosts> ProfilePasses(const v1::ProfileTask& task, int cuda_device,
                                            const ProfileGroup& group) {
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
    return absl::InvalidArgumentError(
        absl::StrCat("profile task: plan_text: the profiling plan must have 1 rank, not ",
                     parsed->ranks.size()));
  }
  const planner::Plan& plan = *parsed;
  // Tensor parallelism: this worker is one tensor rank of the stage's group, which runs the
  // stage at t together.
  const int t = std::max(1, task.tensor_size());
  if (std::max(1, spec.parallel().tensor()) != t) {
    return absl::InvalidArgumentError(absl::StrCat(
        "profile task: stage_spec.parallel.tensor (", spec.parallel().tensor(),
        ") must equal tensor_size (", t, "): a tensor-parallel stage is profiled by its group"));
  }
  if (t > 1) {
    if (task.tensor_rank() < 0 || task.tensor_rank() >= t) {
      return absl::InvalidArgumentError(absl::StrCat(
          "profile task: tensor_rank ", task.tensor_rank(), " is not in [0, ", t, ")"));
    }
    if (!absl::StartsWith(task.store_prefix(), "vocabpipe/")) {
      return absl::InvalidArgumentError(
          "profile task: store_prefix must name the attempt's run (vocabpipe/ATTEMPT/...)");
    }
    if (group.store == nullptr) {
      return absl::FailedPreconditionError(
          "profile task: a tensor group's profile needs the coordinator's store (--store)");
    }
    if (cuda_device >= 0 || spec.device().rfind("cuda", 0) == 0) {
      return absl::UnimplementedError(
          "profile task: parallel.tensor > 1 runs on device cpu only in this version");
    }
  }
  auto topt = runtime::TrainerOptionsFromSpec(spec, &plan);
  if (!topt.ok()) return topt.status();
  topt->data = {};  // one replica of one stage, whatever an older coordinator's stage_spec says
  topt->tensor = {.size = t, .rank = t > 1 ? task.tensor_rank() : 0};
  // B and W are timed without recomputation; its cost is reported apart (recompute_selective,
  // or F's own time for full) so that the planner can weigh every mode.
  topt->model.recompute = engine::Recompute::kNone;
  engine::cpu::SetBlasThreads(runtime::WorkerThreads(job));  // the share one rank of the job gets
  std::unique_ptr<comm::Communicator> self = comm::MakeSelfCommunicator();
  std::unique_ptr<comm::GlooCommunicator> tensor_group;  // outlives the rank (declared first)
  if (t > 1) {
    auto gloo = comm::ConnectGloo({.rank = task.tensor_rank(),
                                   .size = t,
                                   .store = group.store,
                                   .prefix = task.store_prefix(),
                                   .hostname = group.hostname,
                                   .timeout = group.timeout});
    if (!gloo.ok()) {
      return absl::Status(
          gloo.status().code(),
          absl::StrCat("profile: connecting the tensor group: ", gloo.status().message()));
    }
    tensor_group = std::move(*gloo);
  }
  auto rank =
      t > 1 ? runtime::PipelineRank::Create(plan, 0, *topt, self.get(), nullptr, tensor_group.get())
            : launch::CreateLocalRank(spec, plan, *topt, self.get(), cuda_device);
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
  if (t > 1) costs.set_tensor_measured(t);  // one tensor rank's passes, collectives inside
  // Communication, only when the job has more than one rank (nothing to send otherwise): the
  // link model of each call kind between p ranks on this host, fitted at the job's two real
  // sizes (b·s floats: C1's vectors; b·s·h: an activation, X, ∇X, the embedding). A one-stage
  // job with d replicas still sums its gradients over them: its all-reduce link is measured
  // between d ranks (at most 64 here), so the planner prices the reduction.
  const int replicas = std::max(1, job.parallel().data());
  const int link_ranks = p > 1 ? p : std::min(replicas, 64);
  if (link_ranks > 1) {
    auto link = ProfileCommunication(link_ranks, static_cast<size_t>(tokens),
                                     static_cast<size_t>(tokens) * job.model().hidden());
    if (!link.ok()) return link.status();
    costs.set_p2p_latency(link->p2p.latency);
    costs.set_p2p_bandwidth(link->p2p.bandwidth);
    costs.set_broadcast_latency(link->broadcast.latency);
    costs.set_broadcast_bandwidth(link->broadcast.bandwidth);
    costs.set_allreduce_latency(link->allreduce.latency);
    costs.set_allreduce_bandwidth(link->allreduce.bandwidth);
  }
  // Tensor parallelism: the all-gather link of a tensor group (t ranks of this host), fitted at
  // b·s and b·s·h floats; a reduce-scatter moves the same bytes.
  const int tensor = std::max(1, job.parallel().tensor());
  if (tensor > 1) {
    auto link = ProfileCommunication(tensor, static_cast<size_t>(tokens),
                                     static_cast<size_t>(tokens) * job.model().hidden());
    if (!link.ok()) return link.status();
    costs.set_tensor_latency(link->allgather.latency);
    costs.set_tensor_bandwidth(link->allgather.bandwidth);
  }
  auto layer_bytes = launch::MeasureJobLayerActivations(job);
  if (!layer_bytes.ok()) return layer_bytes.status();
  costs.set_layer_activation_kept_bytes(layer_bytes->kept);
  costs.set_layer_activation_transient_bytes(layer_bytes->backward_transient);
  costs.set_layer_activation_held_for_w_bytes(layer_bytes->held_for_w);
  // The attention core of the stage's L/p layers, which selective recomputation adds to B (timed
  // only for such a job: at large s it is seconds of CPU work).
  if (job.parallel().recompute() == "selective") {
    costs.set_recompute_selective(
        engine::TimeAttentionCoreSeconds(topt->model, job.parallel().microbatch_size()) * layers /
        p);
  }
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
    // The run secret stays out of the file (the child reads it from its environment).
    v1::ProfileTask on_disk = task;
    on_disk.clear_store_secret();
    std::ofstream f(task_path, std::ios::binary);
    if (!on_disk.SerializeToOstream(&f) || !f.flush()) {
      return absl::InternalError("profile: cannot write the task file");
    }
  }
  std::vector<std::string> args = {options.worker_binary, "--profile-task", task_path,
                                   "--profile-out", out_path};
  if (options.cuda_device >= 0) {
    args.push_back("--cuda-device");
    args.push_back(std::to_string(options.cuda_device));
  }
  if (task.tensor_size() > 1 && !options.store_address.empty()) {
    // A tensor group's profile meets in the coordinator's store, over the daemon's own channel
    // security (as a rank does).
    const std::vector<std::string> store =
        launch::StoreFlags(options.store_address, options.hostname, options.tls, options.insecure);
    args.insert(args.end(), store.begin(), store.end());
  }
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The environment, with the run secret of a tensor group's profile (built before the fork,
  // which may only call async-signal-safe functions).
  const std::string secret_prefix = absl::StrCat(auth::kRunSecretEnv, "=");
  const std::string secret_var = secret_prefix + task.store_secret();
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string_view(*e).rfind(secret_prefix, 0) != 0) envp.push_back(*e);
  }
  if (!task.store_secret().empty()) envp.push_back(const_cast<char*>(secret_var.c_str()));
  envp.push_back(nullptr);
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
      setrlimit(RLIMIT_DATA, &rl);
    }
    dup2(log, STDOUT_FILENO);
    dup2(log, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
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

int ProfileCommMain(int argc, char** argv) {
  int ranks = 0;
  size_t small = 0, large = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--profile-comm") {
      if (!absl::SimpleAtoi(v, &ranks)) ranks = 0;
    } else if (a == "--floats") {
      const size_t comma = v.find(',');
      if (comma == std::string::npos || !absl::SimpleAtoi(v.substr(0, comma), &small) ||
          !absl::SimpleAtoi(v.substr(comma + 1), &large)) {
        small = large = 0;
      }
    } else {
      std::cerr << "vocabpipe-worker: unknown flag " << a << std::endl;
      return 2;
    }
  }
  if (ranks < 2 || small < 1 || large <= small) {
    std::cerr << "usage: vocabpipe-worker --profile-comm RANKS --floats SMALL,LARGE "
                 "(RANKS >= 2, 1 <= SMALL < LARGE)"
              << std::endl;
    return 2;
  }
  absl::StatusOr<CommProfile> prof = ProfileCommunication(ranks, small, large);
  if (!prof.ok()) {
    std::cerr << "profile communication: " << prof.status().message() << std::endl;
    return 1;
  }
  auto kind = [&](const char* name, const LinkFit& fit, const std::array<double, 2>& t) {
    return absl::StrCat("\"", name, "\":{\"latency\":", fit.latency,
                        ",\"bandwidth\":", fit.bandwidth, ",\"seconds\":[", t[0], ",", t[1], "]}");
  };
  std::cout << "{\"ranks\":" << ranks << ",\"bytes\":[" << prof->bytes[0] << "," << prof->bytes[1]
            << "]," << kind("p2p", prof->p2p, prof->p2p_seconds) << ","
            << kind("broadcast", prof->broadcast, prof->broadcast_seconds) << ","
            << kind("allreduce", prof->allreduce, prof->allreduce_seconds) << "}" << std::endl;
  return 0;
}

int ProfileChildMain(int argc, char** argv) {
  std::string task_path, out_path, store_address;
  int cuda_device = -1;
  bool insecure = false;
  auth::TlsFiles tls;
  ProfileGroup group;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--insecure") {
      insecure = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::cerr << "vocabpipe-worker: " << a << " needs a value" << std::endl;
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--profile-task") {
      task_path = v;
    } else if (a == "--profile-out") {
      out_path = v;
    } else if (a == "--cuda-device") {
      if (!absl::SimpleAtoi(v, &cuda_device) || cuda_device < 0) return 2;
    } else if (a == "--store") {
      store_address = v;
    } else if (auth::SetTlsFlag(a, v, tls)) {
      // --tls-ca, --tls-cert or --tls-key: stored
    } else if (a == "--hostname") {
      group.hostname = v;
    } else {
      std::cerr << "vocabpipe-worker: unknown flag " << a << std::endl;
      return 2;
    }
  }
  if (task_path.empty() || out_path.empty()) {
    std::cerr << "usage: vocabpipe-worker --profile-task FILE --profile-out FILE "
                 "[--cuda-device N] [--store HOST:PORT (--tls-ca F --tls-cert F --tls-key F | "
                 "--insecure) --hostname IP]"
              << std::endl;
    return 2;
  }
  std::string secret;
  if (const char* env = std::getenv(auth::kRunSecretEnv)) secret = env;
  unsetenv(auth::kRunSecretEnv);
  if (!store_address.empty()) {
    auto credentials = launch::StoreCredentials(store_address, tls, insecure);
    if (!credentials.ok()) {
      std::cerr << credentials.status().message() << std::endl;
      return 2;
    }
    group.store = std::make_shared<launch::GrpcStore>(store_address,
                                                      absl::ToChronoMilliseconds(group.timeout),
                                                      std::move(*credentials), std::move(secret));
  }
  std::string bytes;
  v1::ProfileTask task;
  if (!ReadFileTo(task_path, &bytes, 8 << 20) || !task.ParseFromString(bytes)) {
    std::cerr << "profile: cannot read the task file" << std::endl;
    return 1;
  }
  absl::StatusOr<v1::PassCosts> costs = ProfilePasses(task, cuda_device, group);
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
