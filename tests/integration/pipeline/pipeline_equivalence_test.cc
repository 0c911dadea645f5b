// A pipelined run must train exactly like the plain single-process model: for every schedule
// and vocabulary method the planner supports, per-step losses over 10 steps equal the
// standalone trainer's within 1e-5 relative, and the final weights (gathered from all ranks
// by tensor name and global row) match within 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "tests/support/gloo_threads.h"
#include "tests/support/training_fixtures.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

using fixtures::Batches;
using fixtures::Gather;
using fixtures::Weights;

using planner::Schedule;
using planner::VocabMethod;

constexpr int kSteps = 10;
// The Llama cases exercise the same schedules and vocabulary methods on other layers: fewer
// steps (still through warm-up, clipping and the cosine decay) keep the suite quick.
constexpr int kLlamaSteps = 4;

struct Case {
  Schedule schedule;
  VocabMethod vocab;
  int p;
  int k;  // sequence chunks
  bool tied;
  bool llama = false;  // Llama layers (GQA 4 -> 2, RoPE, SwiGLU, RMSNorm) instead of GPT-2's
};

std::string Name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fixtures::CaseName(c.schedule, c.vocab, c.p, c.k,
                            absl::StrCat(c.tied ? "_tied" : "", c.llama ? "_llama" : ""));
}

TrainerOptions Options(const Case& c) {
  TrainerOptions o;
  o.model = {.layers = 8,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,
             .seq_len = 12,
             .ffn_hidden = 64,
             .tie_embeddings = c.tied};
  if (c.llama) {
    o.model.architecture = engine::Architecture::kLlama;
    o.model.kv_heads = 2;
    o.model.ffn_hidden = 40;
    o.model.rope_theta = 500.0f;  // every rotary pair turns within the 12 positions
  }
  o.microbatch_size = 2;
  o.microbatches = 2 * c.p;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  o.lr = {.lr = 1e-3f,
          .min_lr = 1e-4f,
          .warmup_steps = 2,
          .total_steps = c.llama ? kLlamaSteps : kSteps,
          .cosine = true};
  o.grad_clip = 1.0f;
  o.seed = 11;
  return o;
}

class PipelineEquivalence : public testing::TestWithParam<Case> {};

TEST_P(PipelineEquivalence, MatchesStandaloneTraining) {
  const Case& c = GetParam();
  const TrainerOptions opt = Options(c);
  const BatchFn batches = Batches(opt);
  const int steps = opt.lr.total_steps;

  // The reference: one process, whole model.
  auto standalone = StandaloneTrainer::Create(opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  std::vector<double> want;
  for (int step = 0; step < steps; ++step) {
    auto r = (*standalone)->Step(step, batches);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(r->loss);
  }
  Weights want_w;
  std::mutex mu;
  Gather((*standalone)->model(), &want_w, &mu);

  auto plan = fixtures::PlanFor(c.schedule, c.vocab, c.p, c.k, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();

  std::vector<std::vector<double>> got(c.p);
  std::vector<std::vector<char>> has(c.p);
  Weights got_w;
  std::vector<std::string> errors(c.p);
  comm::testing::RunOnGlooRanks(c.p, [&](comm::GlooCommunicator& comm) {
    const int r = comm.rank();
    // A rank's share of the cores, as a worker process gets (runtime::WorkerThreads): the
    // thread count is per thread (kernels/cpu/blas.h), and p teams of all cores would spin
    // against each other.
    engine::cpu::SetBlasThreads(
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / c.p));
    const auto rank = PipelineRank::Create(*plan, r, opt, &comm);
    errors[r] = fixtures::TrainRank(rank, 0, steps, batches, [&](const RankStepResult& res) {
      got[r].push_back(res.loss);
      has[r].push_back(res.has_loss);
    });
    if (errors[r].empty()) Gather((*rank)->model(), &got_w, &mu);
  });
  for (int r = 0; r < c.p; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  const int owner = plan->x_owner;
  ASSERT_EQ(got[owner].size(), static_cast<size_t>(steps));
  for (int step = 0; step < steps; ++step) {
    ASSERT_TRUE(has[owner][step]);
    EXPECT_NEAR(got[owner][step], want[step], 1e-5 * want[step]) << "step " << step;
    for (int r = 0; r < c.p; ++r) {  // every rank that saw the loss agrees
      if (has[r][step]) {
        EXPECT_NEAR(got[r][step], want[step], 1e-5 * want[step]) << "rank " << r;
      }
    }
  }
  fixtures::ExpectWeightsNear(want_w, got_w, 1e-5);
  if (auto copy = got_w.find("tied_copy.wte"); copy != got_w.end()) {
    EXPECT_EQ(copy->second, got_w.at(engine::EmbeddingTensorName(opt.model)))
        << "tied copies diverged";
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int p : {2, 4}) {
    for (Schedule s : planner::AllSchedules()) {
      const bool seq = s == Schedule::kSeq1F1B || s == Schedule::kSeq1F1BInterleaved;
      for (VocabMethod v : planner::AllVocabMethods()) {
        cases.push_back({s, v, p, seq ? 2 : 1, false});
        // Tied embeddings: every method on 1F1B and on V-Half (rank 0 holds both ends).
        if (s == Schedule::k1F1B || s == Schedule::kVHalf) cases.push_back({s, v, p, 1, true});
      }
    }
    for (VocabMethod v : {VocabMethod::kVocab1, VocabMethod::kVocab2, VocabMethod::kBaseline}) {
      cases.push_back({Schedule::kSeq1F1B, v, p, 3, false});
    }
    // Llama: every schedule x vocabulary method (RoPE positions across sequence chunks, GQA),
    // Seq1F1B with k = 3, and tied embeddings where rank 0 holds both ends (V-Half).
    for (Schedule s : planner::AllSchedules()) {
      const bool seq = s == Schedule::kSeq1F1B || s == Schedule::kSeq1F1BInterleaved;
      for (VocabMethod v : planner::AllVocabMethods()) {
        cases.push_back({s, v, p, seq ? 2 : 1, false, true});
      }
    }
    cases.push_back({Schedule::kSeq1F1B, VocabMethod::kVocab2, p, 3, false, true});
    cases.push_back({Schedule::kVHalf, VocabMethod::kVocab2, p, 1, true, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Plans, PipelineEquivalence, testing::ValuesIn(AllCases()), Name);

}  // namespace
}  // namespace vp::runtime
