// The coordinator's plan for a job: the planner input from the spec, per-pass costs (profiled
// on the job's workers when available, else FLOP-proportional), schedule and vocabulary method
// as the spec names them or chosen by planner::ChoosePlan under the memory budget ("auto"),
// and the candidate table the job record shows.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/planner.h"
#include "proto/plan/plan.h"
#include "vocabpipe/v1/job.pb.h"
#include "vocabpipe/v1/service.pb.h"

namespace vp::server {

struct JobPlan {
  // What was planned: the spec given, or under parallel.world the layout the planner chose (a
  // plain spec: world 0, the axes and recompute set, microbatches per replica).
  vocabpipe::v1::JobSpec spec;
  // parallel.world: the chosen layout in one line with its predictions, and every candidate
  // (planner::LayoutTable). Empty otherwise.
  std::string layout;
  std::string layout_table;
  planner::PlannerInput input;
  planner::Plan plan;
  planner::SimResult sim;
  vocabpipe::v1::PlanSummary summary;
  // Every candidate the auto choice weighed (a single row when nothing is "auto").
  std::vector<vocabpipe::v1::PlanCandidate> candidates;
  std::string table;  // planner::RenderTable of the chosen plan
};

// Costs in seconds. `profiled` (null: none) replaces the FLOP-proportional pass costs; its
// zero entries keep the FLOP estimate. flops_per_second sets the FLOP-proportional scale.
// Errors: InvalidArgument naming the field (parallel.schedule, parallel.vocab, ...).
// cancel (null: never): polled between the planner's steps; once set the planner stops with
// Cancelled (the coordinator's planning deadline).
// A spec with parallel.world first has its layout chosen (planner::ResolveLayout, with
// FLOP-proportional costs and planner::DefaultLink for the device), then the chosen one planned.
absl::StatusOr<JobPlan> PlanForJob(const vocabpipe::v1::JobSpec& requested,
                                   const vocabpipe::v1::PassCosts* profiled,
                                   double flops_per_second,
                                   const std::atomic<bool>* cancel = nullptr);

// Folds one worker's profiled link model into `merged`, keeping the slowest: the larger
// latency and the smaller bandwidth (0 means the size is free, so any measured one is slower).
void MergeSlowestLink(const vocabpipe::v1::PassCosts& worker, vocabpipe::v1::PassCosts* merged);

// What a worker runs to time the job's passes: the job, its one-stage cut and the planner's
// 1-rank plan of it (planner::BuildProfilingPlan), so workers never plan.
absl::StatusOr<vocabpipe::v1::ProfileTask> MakeProfileTask(const std::string& job_id,
                                                           const vocabpipe::v1::JobSpec& spec);

}  // namespace vp::server
