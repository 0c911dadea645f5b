// Planner inputs shared by the tests and the benches that need only the planner (no worker
// runtime): fixed unit costs, a shape-only input, and the Vocabulary Parallelism paper's 8-GPU
// model (planner_test checks the simulated MFU trends of the paper's Table 5; bench/planner
// prints them).
#pragma once

#include <cstdint>

#include "coordinator/planner/planner.h"

namespace vp::planner::fixtures {

// Fixed small pass costs for tests that compare orders or results, not timing: F = B = W = 1,
// S = T = `vocab_pass`, the input layer's passes `input_pass`, a point-to-point transfer and a
// collective `comm` each, a free optimizer step and free links.
inline Costs UnitCosts(double vocab_pass = 0.5, double input_pass = 0.1, double comm = 0) {
  Costs c;
  c.f = 1;
  c.b = 1;
  c.w = 1;
  c.s = vocab_pass;
  c.t = vocab_pass;
  c.input_f = input_pass;
  c.input_b = input_pass;
  c.comm = comm;
  c.collective = comm;
  c.opt = 0;
  return c;
}

// A plan's shape only (no model: bytes and MFU come out 0) with UnitCosts().
inline PlannerInput ShapeInput(int p, int m, int layers, Schedule schedule, VocabMethod vocab,
                               int seq_chunks = 1) {
  PlannerInput in;
  in.pipeline = p;
  in.microbatches = m;
  in.layers = layers;
  in.seq_chunks = seq_chunks;
  in.schedule = schedule;
  in.vocab = vocab;
  in.costs = UnitCosts();
  return in;
}

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
