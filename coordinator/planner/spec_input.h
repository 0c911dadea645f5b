// JobSpec -> PlannerInput: the one mapping of a job's model and parallel sections onto the
// planner's input, shared by `vocabpipe plan` (offline inspection) and `vocabpipe run` (the
// plan a pipeline run executes), so both see the same plan for the same spec.
#pragma once

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
#include "proto/plan/plan.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::planner {

// Model shape and parallel sizes of a validated spec (defaults applied): p, m, L, k, chunks
// per rank, max pending T, the model shape (4-byte activations on CPU, 2 on CUDA). Schedule,
// vocabulary method and costs keep PlannerInput's defaults: the caller decides how to pick
// them (flags, "auto").
PlannerInput PlannerInputFromSpec(const vocabpipe::v1::JobSpec& spec);

// A layer's activation bytes per microbatch as the runtime measured them (0: not measured).
struct LayerActivationBytes {
  int64_t kept = 0;
  int64_t backward_transient = 0;
  int64_t held_for_w = 0;  // from a split B until its W
};

// What the run knows beyond the spec.
struct SpecPlanOptions {
  // FLOP-proportional pass costs are seconds at this peak (so MFU is defined).
  double flops_per_second = 1e12;
  // The engine's measured per-layer activation footprint, for the memory prediction.
  LayerActivationBytes activations;
  // Per-pass costs profiled on the job's workers (seconds): each entry > 0 replaces the
  // FLOP-proportional estimate of that pass. Null: none.
  const Costs* measured_costs = nullptr;
  // PlannerInput::cancel: polled between the planner's steps (null: never stops early).
  const std::atomic<bool>* cancel = nullptr;
};

struct SpecPlan {
  PlannerInput input;  // what the plan was built from (schedule/vocab resolved)
  Plan plan;
  // Every candidate the auto choice weighed; empty when neither schedule nor vocab is "auto".
  std::vector<Candidate> candidates;
};

// The plan a run of `spec` executes: PlannerInputFromSpec, costs (FLOP-proportional, replaced
// by measured ones where given), parallel.schedule / parallel.vocab parsed, or chosen by
// ChoosePlan under parallel.memory_budget_bytes when "auto", then BuildPlan (which validates).
// Bad names are InvalidArgument naming the field.
absl::StatusOr<SpecPlan> BuildPlanFromSpec(const vocabpipe::v1::JobSpec& spec,
                                           const SpecPlanOptions& options = {});

// What a worker times for the coordinator's planner (worker/daemon/profile.h): the job cut to
// one pipeline stage's layers (ceil(L/p)) and one vocabulary shard (ceil(V/p) rows) on one
// pipeline rank — at the job's parallel.tensor, so under tensor parallelism the stage's t
// tensor ranks run it together (ProfileTask.tensor_size) — scheduled with split backward (zbh1: B and W are separate passes) and a
// vocabulary-parallel output layer (vocab1: S and T passes), 2 microbatches. The planner
// builds it so that only the planner plans; the worker only runs it.
struct ProfilingPlan {
  vocabpipe::v1::JobSpec stage_spec;
  Plan plan;
};
absl::StatusOr<ProfilingPlan> BuildProfilingPlan(const vocabpipe::v1::JobSpec& job);

}  // namespace vp::planner
