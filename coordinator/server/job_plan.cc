#include "coordinator/server/job_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/planner/layout.h"
#include "coordinator/planner/spec_input.h"

namespace vp::server {
namespace v1 = vocabpipe::v1;
namespace {

vocabpipe::v1::PlanCandidate CandidateRow(const planner::Candidate& c) {
  vocabpipe::v1::PlanCandidate row;
  row.set_schedule(std::string(planner::ScheduleName(c.schedule)));
  row.set_vocab(std::string(planner::VocabName(c.vocab)));
  row.set_seq_chunks(c.seq_chunks);
  row.set_ok(c.ok);
  row.set_error(c.error);
  row.set_predicted_step_seconds(c.step_time);
  row.set_bubble_ratio(c.bubble_ratio);
  row.set_peak_memory_bytes(c.peak_bytes);
  row.set_fits(c.fits);
  return row;
}

}  // namespace

void MergeSlowestLink(const vocabpipe::v1::PassCosts& worker, vocabpipe::v1::PassCosts* merged) {
  auto slower_bandwidth = [](double a, double b) {
    return a > 0 && b > 0 ? std::min(a, b) : std::max(a, b);
  };
  merged->set_p2p_latency(std::max(merged->p2p_latency(), worker.p2p_latency()));
  merged->set_p2p_bandwidth(slower_bandwidth(merged->p2p_bandwidth(), worker.p2p_bandwidth()));
  merged->set_broadcast_latency(std::max(merged->broadcast_latency(), worker.broadcast_latency()));
  merged->set_broadcast_bandwidth(
      slower_bandwidth(merged->broadcast_bandwidth(), worker.broadcast_bandwidth()));
  merged->set_allreduce_latency(std::max(merged->allreduce_latency(), worker.allreduce_latency()));
  merged->set_allreduce_bandwidth(
      slower_bandwidth(merged->allreduce_bandwidth(), worker.allreduce_bandwidth()));
  merged->set_tensor_latency(std::max(merged->tensor_latency(), worker.tensor_latency()));
  merged->set_tensor_bandwidth(
      slower_bandwidth(merged->tensor_bandwidth(), worker.tensor_bandwidth()));
}

absl::StatusOr<JobPlan> PlanForJob(const vocabpipe::v1::JobSpec& requested,
                                   const vocabpipe::v1::PassCosts* profiled,
                                   double flops_per_second, const std::atomic<bool>* cancel) {
  JobPlan out;
  out.spec = requested;
  if (planner::NeedsLayoutChoice(requested)) {
    planner::LayoutOptions lo;
    lo.flops_per_second = flops_per_second;
    lo.link = planner::DefaultLink(requested.device());
    lo.cancel = cancel;
    absl::StatusOr<planner::ResolvedLayout> resolved = planner::ResolveLayout(requested, lo);
    if (!resolved.ok()) return resolved.status();
    out.spec = resolved->spec;
    const planner::LayoutCandidate& c = resolved->chosen;
    out.layout = absl::StrFormat(
        "layout %s of %d candidates for %d ranks (predicted %.4g s a step, %.4g tokens/s, peak "
        "%.1f MiB a rank)",
        planner::LayoutName(c), resolved->candidates.size(), requested.parallel().world(),
        c.step_seconds, c.tokens_per_second, c.peak_bytes / 1048576.0);
    out.layout_table = planner::LayoutTable(*resolved);
  }
  const vocabpipe::v1::JobSpec& spec = out.spec;
  planner::Costs measured;
  if (profiled != nullptr) {
    measured = {.f = profiled->f(),
                .b = profiled->b(),
                .w = profiled->w(),
                .s = profiled->s(),
                .t = profiled->t(),
                .input_f = profiled->input_f(),
                .input_b = profiled->input_b(),
                .comm = profiled->comm(),
                .collective = profiled->collective(),
                .opt = profiled->opt(),
                .p2p = {profiled->p2p_latency(), profiled->p2p_bandwidth()},
                .broadcast = {profiled->broadcast_latency(), profiled->broadcast_bandwidth()},
                .allreduce = {profiled->allreduce_latency(), profiled->allreduce_bandwidth()},
                .tensor = {profiled->tensor_latency(), profiled->tensor_bandwidth()},
                .recompute = profiled->recompute_selective(),
                .tensor_measured = std::max(1, profiled->tensor_measured())};
  }
  planner::SpecPlanOptions options;
  options.flops_per_second = flops_per_second;
  options.measured_costs = profiled != nullptr ? &measured : nullptr;
  options.cancel = cancel;
  if (profiled != nullptr) {
    options.activations = {.kept = profiled->layer_activation_kept_bytes(),
                           .backward_transient = profiled->layer_activation_transient_bytes(),
                           .held_for_w = profiled->layer_activation_held_for_w_bytes()};
  }
  auto built = planner::BuildPlanFromSpec(spec, options);
  if (!built.ok()) return built.status();
  out.input = std::move(built->input);
  out.plan = std::move(built->plan);
  const planner::PlannerInput& in = out.input;
  for (const planner::Candidate& c : built->candidates) {
    vocabpipe::v1::PlanCandidate row = CandidateRow(c);
    row.set_chosen(c.ok && c.schedule == in.schedule && c.vocab == in.vocab &&
                   c.seq_chunks == in.seq_chunks);
    out.candidates.push_back(std::move(row));
  }
  if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
    return absl::CancelledError("planner: stopped before it finished (its deadline passed)");
  }
  auto sim = planner::Simulate(out.plan, in);
  if (!sim.ok()) return sim.status();
  out.sim = std::move(*sim);
  if (out.candidates.empty()) {
    planner::Candidate c;
    c.schedule = in.schedule;
    c.vocab = in.vocab;
    c.seq_chunks = in.seq_chunks;
    c.ok = true;
    c.step_time = out.sim.step_time;
    c.bubble_ratio = out.sim.bubble_ratio;
    for (const planner::RankStats& r : out.sim.ranks) {
      c.peak_bytes = std::max(c.peak_bytes, r.state_bytes + r.peak_activation_bytes);
    }
    const int64_t budget = spec.parallel().memory_budget_bytes();
    c.fits = budget == 0 || c.peak_bytes <= budget;
    vocabpipe::v1::PlanCandidate row = CandidateRow(c);
    row.set_chosen(true);
    out.candidates.push_back(std::move(row));
  }
  vocabpipe::v1::PlanSummary& s = out.summary;
  s.set_schedule(std::string(planner::ScheduleName(in.schedule)));
  s.set_vocab(std::string(planner::VocabName(in.vocab)));
  s.set_seq_chunks(in.seq_chunks);
  s.set_pipeline(in.pipeline);
  s.set_microbatches(in.microbatches);
  s.set_predicted_step_seconds(out.sim.step_time);
  s.set_costs_source(profiled != nullptr ? "profiled" : "flops");
  s.set_model_flops_per_step(out.sim.model_flops);
  out.table = planner::RenderTable(out.plan, out.sim);
  return out;
}

absl::StatusOr<vocabpipe::v1::ProfileTask> MakeProfileTask(const std::string& job_id,
                                                           const vocabpipe::v1::JobSpec& spec) {
  auto profiling = planner::BuildProfilingPlan(spec);
  if (!profiling.ok()) return profiling.status();
  vocabpipe::v1::ProfileTask task;
  task.set_job_id(job_id);
  *task.mutable_spec() = spec;
  *task.mutable_stage_spec() = std::move(profiling->stage_spec);
  task.set_plan_text(planner::PlanToText(profiling->plan));
  return task;
}

}  // namespace vp::server
