#include "coordinator/planner/spec_input.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace vp::planner {

PlannerInput PlannerInputFromSpec(const vocabpipe::v1::JobSpec& spec) {
  const auto& par = spec.parallel();
  const auto& model = spec.model();
  PlannerInput in;
  in.pipeline = par.pipeline();
  in.microbatches = par.microbatches();
  in.layers = model.layers();
  in.seq_chunks = par.seq_chunks();
  in.chunks_per_rank = par.has_chunks_per_rank() ? par.chunks_per_rank() : 2;
  in.max_pending_t = par.has_max_pending_t() ? par.max_pending_t() : 1;
  in.model.hidden = model.hidden();
  in.model.heads = model.heads();
  in.model.seq_len = model.seq_len();
  in.model.vocab = model.vocab_size();
  in.model.ffn = model.ffn_hidden();
  in.model.microbatch_size = par.microbatch_size();
  in.model.tie_embeddings = model.tie_embeddings();
  in.model.llama = model.architecture() == "llama";
  in.model.kv_heads = model.kv_heads();
  in.model.activation_bytes_per_element = spec.device().rfind("cuda", 0) == 0 ? 2 : 4;
  in.model.data_parallel = std::max(1, par.data());
  in.model.zero = par.zero() == 1;
  in.model.tensor_parallel = std::max(1, par.tensor());
  if (absl::StatusOr<Recompute> r = ParseRecompute(par.recompute()); r.ok()) {
    in.model.recompute = *r;
  }
  // NCCL runs transfers and collectives on two communication threads, Gloo on one.
  in.comm_lanes = spec.device().rfind("cuda", 0) == 0 ? 2 : 1;
  return in;
}

absl::StatusOr<SpecPlan> BuildPlanFromSpec(const vocabpipe::v1::JobSpec& spec,
                                           const SpecPlanOptions& options) {
  SpecPlan out;
  PlannerInput& in = out.input;
  in = PlannerInputFromSpec(spec);
  in.model.layer_activation_bytes = static_cast<double>(options.activations.kept);
  in.model.layer_backward_transient_bytes =
      static_cast<double>(options.activations.backward_transient);
  in.model.layer_held_for_w_bytes = static_cast<double>(options.activations.held_for_w);
  in.model.peak_flops = options.flops_per_second;
  in.costs = FlopProportionalCosts(in.pipeline, in.layers, in.model, options.flops_per_second);
  in.cancel = options.cancel;
  if (const Costs* m = options.measured_costs; m != nullptr) {
    // Measured seconds replace the estimate pass by pass: what the workers really spend is
    // what decides between a vocabulary-parallel plan and the plain schedule.
    // Tensor parallelism: a profile of the whole tensor group (BuildProfilingPlan; t workers
    // ran the stage together) is one tensor rank's passes, collectives included: taken as is.
    // A profile of the whole stage on one worker is divided by t, and the group's collectives
    // are added at the all-gather link the profile measured between t ranks
    // (docs/tensor-parallel.md).
    const int t = std::max(1, in.model.tensor_parallel);
    const double split = m->tensor_measured == t ? 1 : t;
    auto take = [split](double measured, double& cost) {
      if (measured > 0) cost = measured / split;
    };
    take(m->f, in.costs.f);
    take(m->b, in.costs.b);
    take(m->w, in.costs.w);
    take(m->s, in.costs.s);
    take(m->t, in.costs.t);
    take(m->input_f, in.costs.input_f);
    take(m->input_b, in.costs.input_b);
    if (m->opt > 0) in.costs.opt = m->opt / split;
    // ... and the tensor group's calls inside F, B, W at the measured link.
    if (split > 1 && (m->tensor.latency > 0 || m->tensor.bandwidth > 0)) {  // t > 1, one worker
      in.costs.tensor = m->tensor;
      const TensorCollectives tc = TensorCollectiveSeconds(in.model, m->tensor);
      const double stage_layers = static_cast<double>(in.layers) / std::max(1, in.pipeline);
      in.costs.f += tc.f * stage_layers;
      in.costs.b += tc.b * stage_layers;
      in.costs.w += tc.w * stage_layers;
    }
    // Recomputation: full runs the stage's F again (collectives included), so F's measured
    // time is its cost; selective the attention core, timed by the profile.
    if (in.model.recompute == Recompute::kFull) in.costs.recompute = in.costs.f;
    if (in.model.recompute == Recompute::kSelective) take(m->recompute, in.costs.recompute);
    if (m->comm > 0) in.costs.comm = m->comm;
    if (m->collective > 0) in.costs.collective = m->collective;
    in.costs.p2p = m->p2p;
    in.costs.broadcast = m->broadcast;
    in.costs.allreduce = m->allreduce;
  }
  const std::string& schedule = spec.parallel().schedule();
  const std::string& vocab = spec.parallel().vocab();
  const bool schedule_auto = schedule == "auto", vocab_auto = vocab == "auto";
  if (!schedule_auto) {
    absl::StatusOr<Schedule> s = ParseSchedule(schedule);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.schedule: ", s.status().message()));
    }
    in.schedule = *s;
  }
  if (!vocab_auto) {
    absl::StatusOr<VocabMethod> v = ParseVocab(vocab);
    if (!v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.vocab: ", v.status().message()));
    }
    in.vocab = *v;
  }
  const bool seq_chunks_auto = spec.parallel().seq_chunks() == 0;
  if (schedule_auto || vocab_auto || seq_chunks_auto) {
    absl::StatusOr<AutoChoice> choice = ChoosePlan(
        in, schedule_auto, vocab_auto, spec.parallel().memory_budget_bytes(), seq_chunks_auto);
    if (!choice.ok()) return choice.status();
    in = choice->chosen;
    out.candidates = std::move(choice->candidates);
  }
  absl::StatusOr<Plan> plan = BuildPlan(in);
  if (!plan.ok()) return plan.status();
  out.plan = std::move(*plan);
  in.cancel = nullptr;  // the caller's flag: the plan outlives it
  return out;
}

absl::StatusOr<ProfilingPlan> BuildProfilingPlan(const vocabpipe::v1::JobSpec& job) {
  const int p = std::max(1, job.parallel().pipeline());
  ProfilingPlan out;
  vocabpipe::v1::JobSpec& spec = out.stage_spec;
  spec = job;
  spec.mutable_model()->set_layers(std::max(1, (job.model().layers() + p - 1) / p));
  spec.mutable_model()->set_vocab_size(std::max(2, (job.model().vocab_size() + p - 1) / p));
  vocabpipe::v1::ParallelSpec* par = spec.mutable_parallel();
  par->set_pipeline(1);
  par->set_schedule("zbh1");
  par->set_vocab("vocab1");
  par->set_seq_chunks(1);
  par->set_microbatches(2);
  par->set_memory_budget_bytes(0);
  // One replica: the stage's passes are the same on every replica (data parallelism adds only
  // the gradient reduction at OPT, which the link model prices).
  par->set_data(1);
  par->set_zero(0);
  // Tensor parallelism: the stage at the job's t — its t tensor ranks profile it together
  // (ProfileTask.tensor_size), each on its V/(p·t) vocabulary rows, so every pass is timed on
  // a real tensor group with its collectives (PassCosts.tensor_measured).
  par->set_tensor(std::max(1, job.parallel().tensor()));
  auto built = BuildPlanFromSpec(spec);
  if (!built.ok()) {
    return absl::Status(built.status().code(),
                        absl::StrCat("profile plan: ", built.status().message()));
  }
  out.plan = std::move(built->plan);
  return out;
}

}  // namespace vp::planner
