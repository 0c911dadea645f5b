// Choosing the whole parallel layout of a job (parallel.world, docs/recompute.md "Choosing the
// layout"): every (data d, tensor t, pipeline p) with d·t·p = world that the spec's rules allow,
// each recomputation mode asked for, and within each the schedule × vocabulary method the
// auto choice picks; each candidate planned, simulated and ranked by predicted step time among
// those whose predicted per-rank peak fits the memory budget.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/spec_input.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::planner {

// One layout the choice weighed.
struct LayoutCandidate {
  int data = 1, tensor = 1, pipeline = 1;  // d, t, p
  int microbatches = 1;                    // per replica: the step's microbatches / d
  Recompute recompute = Recompute::kNone;
  std::string schedule = "";  // as planned (the auto choice's pick where it was auto)
  std::string vocab = "";
  int seq_chunks = 1;
  bool planned = false;  // a plan was built and simulated
  bool fits = false;     // planned and its predicted peak is within the budget
  std::string why = "";  // planned == false: the rule or planner error that refused it
  double step_seconds = 0, tokens_per_second = 0;
  int64_t peak_bytes = 0;  // the largest rank's state + activations
};

struct LayoutOptions {
  // FLOP-proportional pass costs at this peak where nothing was profiled.
  double flops_per_second = 1e12;
  // The engine's measured per-layer activation bytes under each recomputation mode (indexed by
  // Recompute; zeros: the planner's estimate for the mode).
  std::array<LayerActivationBytes, 3> activations{};
  // Pass costs profiled for the whole model on one rank (p = t = d = 1): scaled to each
  // layout's stage (F, B, W, S, T, the optimizer and the recomputation by 1/p; the tensor split
  // as BuildPlanFromSpec does). Null: FLOP-proportional costs.
  const Costs* whole_model_costs = nullptr;
  // Without a profile: every link (point-to-point, broadcast, all-reduce, the tensor group's
  // all-gather) priced at this (DefaultLink: an estimate per device kind), so that data and
  // tensor parallelism are not free.
  LinkCost link;
  const std::atomic<bool>* cancel = nullptr;
};

// The link the layout choice prices communication at before anything is profiled: cpu (Gloo
// over TCP) 100 µs and 1 GB/s a call; cuda (NCCL inside a node) 20 µs and 50 GB/s.
LinkCost DefaultLink(const std::string& device);

struct ResolvedLayout {
  // The chosen layout as a plain spec: world 0, data/tensor/pipeline/recompute set,
  // microbatches per replica, schedule and vocab as the spec had them (auto stays auto: the
  // job's planning picks them with its profiled costs).
  vocabpipe::v1::JobSpec spec;
  LayoutCandidate chosen;
  // Every candidate: fitting ones by predicted step time first, then the rest.
  std::vector<LayoutCandidate> candidates;
};

// True when the spec asks for a layout choice (parallel.world > 0).
bool NeedsLayoutChoice(const vocabpipe::v1::JobSpec& spec);

// The layout of a validated spec with parallel.world: the fastest candidate that fits
// parallel.memory_budget_bytes (0: any). FailedPrecondition when none fits, naming the
// smallest predicted peak and its layout; InvalidArgument when no layout is valid at all.
absl::StatusOr<ResolvedLayout> ResolveLayout(const vocabpipe::v1::JobSpec& spec,
                                             const LayoutOptions& options = {});

// "d 1 × t 1 × p 4, 1f1b/vocab2 k 1, recompute none" (the candidate's layout in one line).
std::string LayoutName(const LayoutCandidate& c);
// The candidates as a table: layout, predicted step time, tokens/s, peak bytes per rank, and
// whether it fits or why it was refused; the chosen one marked.
std::string LayoutTable(const ResolvedLayout& resolved);

}  // namespace vp::planner
