// The Vocabulary Parallelism paper's 8-GPU model as planner input, shared by planner_test (which
// checks the simulated MFU trends of the paper's Table 5) and bench/planner (which prints them).
#pragma once

#include <cstdint>

#include "coordinator/planner/planner.h"

namespace vp::planner::fixtures {

// 32 layers, h = 3072, 24 heads, s = 4096, 128 microbatches on p = 8, 1F1B, the A100's dense
// peak (312 TFLOPS), costs in proportion to FLOPs.
inline PlannerInput PaperEightGpuModel(int64_t vocab, VocabMethod method) {
  PlannerInput in;
  in.pipeline = 8;
  in.microbatches = 128;
  in.layers = 32;
  in.schedule = Schedule::k1F1B;
  in.vocab = method;
  in.model.hidden = 3072;
  in.model.heads = 24;
  in.model.seq_len = 4096;
  in.model.vocab = vocab;
  in.model.peak_flops = 312e12;
  in.costs = FlopProportionalCosts(in.pipeline, in.layers, in.model, in.model.peak_flops);
  return in;
}

}  // namespace vp::planner::fixtures
