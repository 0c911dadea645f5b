// Activation recomputation changes what a rank keeps, not what it computes: a p = 2 pipeline
// (threads over real Gloo) with parallel.recompute selective or full gives per-step losses and
// final parameters bit-identical to the same pipeline with none, for 1f1b, vhalf, zbh1 and
// seq1f1b (k = 2, so full recomputation rebuilds the K/V cache of the earlier chunk), GPT-2 and
// Llama, and also at t = 2 (the recomputed passes repeat the tensor group's collectives).
// Bit-identical because the recomputed passes run the same kernels on the same inputs in the
// same thread partition (CPU fp32; the BLAS is deterministic for a fixed thread count).
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "tests/support/tensor_grid.h"
#include "tests/support/training_fixtures.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::runtime {
namespace {

using engine::Recompute;
using fixtures::Weights;
using planner::Schedule;
using planner::VocabMethod;

constexpr int kSteps = 3;

struct Case {
  Schedule schedule;
  int k = 1;  // sequence chunks
  bool llama = false;
  int t = 1;  // tensor ranks per stage
};

TrainerOptions Options(const Case& c, Recompute mode) {
  TrainerOptions o;
  o.model = {.layers = 4,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,
             .seq_len = 12,
             .ffn_hidden = 64,
             .tie_embeddings = false};
  if (c.llama) {
    o.model.architecture = engine::Architecture::kLlama;
    o.model.kv_heads = 2;
    o.model.ffn_hidden = 40;
  }
  o.model.recompute = mode;
  o.microbatch_size = 2;
  o.microbatches = 4;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-5f, .weight_decay = 0.1f};
  o.lr = {.lr = 3e-3f, .min_lr = 3e-4f, .warmup_steps = 1, .total_steps = kSteps, .cosine = true};
  o.grad_clip = 1.0f;
  o.seed = 7;
  return o;
}

struct TrainedRun {
  std::vector<double> losses;  // rank 0's, per step (every output-layer rank has them)
  Weights weights;
  std::vector<int64_t> peak_activations;  // per world rank, the last step's
};

// kSteps steps of the plan on t·p threads (rank = stage·t + tensor rank).
TrainedRun Train(const Case& c, Recompute mode) {
  constexpr int p = 2;
  const int t = c.t, world = p * t;
  TrainerOptions opt = Options(c, mode);
  opt.tensor.size = t;
  auto plan = fixtures::PlanFor(c.schedule, VocabMethod::kVocab2, p, c.k, opt);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {};
  const BatchFn batches = fixtures::Batches(opt);
  TrainedRun out;
  out.peak_activations.resize(world);
  std::mutex mu;
  std::vector<std::string> errors(world);
  fixtures::RunGrid(
      p, t, [&](int rank, int stage, int tp, comm::Communicator* pipe, comm::Communicator* tensor) {
        TrainerOptions mine = opt;
        mine.tensor.rank = tp;
        const auto pr = PipelineRank::Create(*plan, stage, mine, pipe, nullptr, tensor);
        errors[rank] = fixtures::TrainRank(pr, 0, kSteps, batches, [&](const RankStepResult& res) {
          std::lock_guard<std::mutex> l(mu);
          if (res.has_loss && rank == 0) out.losses.push_back(res.loss);
          out.peak_activations[rank] = res.peak_activations;
        });
        if (errors[rank].empty()) fixtures::Gather((*pr)->model(), &out.weights, &mu);
      });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

class RecomputeEquivalence : public testing::TestWithParam<Case> {};

TEST_P(RecomputeEquivalence, SelectiveAndFullAreBitIdenticalToNone) {
  const Case& c = GetParam();
  const TrainedRun none = Train(c, Recompute::kNone);
  ASSERT_EQ(none.losses.size(), static_cast<size_t>(kSteps));
  for (const Recompute mode : {Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(mode == Recompute::kFull ? "full" : "selective");
    const TrainedRun got = Train(c, mode);
    ASSERT_EQ(got.losses.size(), none.losses.size());
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_EQ(got.losses[step], none.losses[step]) << "step " << step;
    }
    ASSERT_EQ(got.weights.size(), none.weights.size());
    for (const auto& [name, w] : none.weights) {
      auto it = got.weights.find(name);
      ASSERT_NE(it, got.weights.end()) << name;
      EXPECT_EQ(it->second, w) << name << " differs";
    }
    // Every rank keeps less (the measured peak; memory_model_test checks it against the
    // planner's prediction).
    for (size_t r = 0; r < none.peak_activations.size(); ++r) {
      EXPECT_LT(got.peak_activations[r], none.peak_activations[r]) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, RecomputeEquivalence,
                         testing::Values(Case{Schedule::k1F1B}, Case{Schedule::kVHalf},
                                         Case{Schedule::kZBH1}, Case{Schedule::kSeq1F1B, 2},
                                         Case{Schedule::k1F1B, 1, /*llama=*/true},
                                         Case{Schedule::kSeq1F1B, 2, /*llama=*/true},
                                         Case{Schedule::kZBH1, 1, false, /*t=*/2}),
                         [](const testing::TestParamInfo<Case>& i) {
                           return absl::StrCat(planner::ScheduleName(i.param.schedule), "_k",
                                               i.param.k, i.param.llama ? "_llama" : "_gpt2", "_t",
                                               i.param.t);
                         });

}  // namespace
}  // namespace vp::runtime
