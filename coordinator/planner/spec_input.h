// JobSpec -> PlannerInput: the one mapping of a job's model and parallel sections onto the
// planner's input, shared by `vocabpipe plan` (offline inspection) and `vocabpipe run` (the
// plan a pipeline run executes), so both see the same plan for the same spec.
#pragma once

#include "absl/status/statusor.h"
#include "coordinator/planner/plan.h"
#include "coordinator/planner/planner.h"
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
};

struct SpecPlan {
  PlannerInput input;  // what the plan was built from (schedule/vocab resolved)
  Plan plan;
};

// The plan a run of `spec` executes: PlannerInputFromSpec, FLOP-proportional costs at
// flops_per_second per rank (so Simulate predicts seconds when it is the real peak),
// parallel.schedule / parallel.vocab parsed, or chosen by ChoosePlan under
// parallel.memory_budget_bytes when "auto", then BuildPlan (which validates). Bad names are
// InvalidArgument naming the field. `measured`, when non-zero, is the engine's measured
// per-layer activation footprint, for the memory prediction (ModelShape).
absl::StatusOr<SpecPlan> BuildPlanFromSpec(const vocabpipe::v1::JobSpec& spec,
                                           double flops_per_second = 1e12,
                                           const LayerActivationBytes& measured = {});

}  // namespace vp::planner
