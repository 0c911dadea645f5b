#include "worker/daemon/profile.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/spec_input.h"
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

absl::StatusOr<v1::PassCosts> ProfilePasses(const v1::JobSpec& job, int cuda_device) {
  const int p = std::max(1, job.parallel().pipeline());
  const int layers = job.model().layers();
  const int stage_layers = std::max(1, (layers + p - 1) / p);
  const int shard_vocab = std::max(2, (job.model().vocab_size() + p - 1) / p);
  v1::JobSpec spec = job;
  spec.mutable_model()->set_layers(stage_layers);
  spec.mutable_model()->set_vocab_size(shard_vocab);
  v1::ParallelSpec* par = spec.mutable_parallel();
  par->set_pipeline(1);
  par->set_schedule("zbh1");
  par->set_vocab("vocab1");
  par->set_seq_chunks(1);
  par->set_microbatches(2);
  par->set_memory_budget_bytes(0);

  auto sp = planner::BuildPlanFromSpec(spec);
  if (!sp.ok())
    return absl::Status(sp.status().code(), absl::StrCat("profile plan: ", sp.status().message()));
  const planner::Plan& plan = sp->plan;
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

}  // namespace vp::daemon
