// Forward-only evaluation through a pipeline plan (PipelineRank::Evaluate, p ranks as threads on
// real Gloo) against a separate forward-only pass: the standalone trainer's Evaluate over the
// same validation microbatches after the same training steps. For every vocabulary method and a
// few schedules (sequence chunks, interleaved and zero-bubble placements) the validation loss
// agrees within 1e-5 relative on every rank that holds output-layer rows, and training after
// the evaluation goes on exactly as without it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

using planner::Schedule;
using planner::VocabMethod;

constexpr int kTrainSteps = 2;
constexpr int kRounds = 2;  // evaluation rounds of m microbatches

struct Case {
  Schedule schedule;
  VocabMethod vocab;
  int p;
  int k;  // sequence chunks
  bool tied;
};

std::string Name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fixtures::CaseName(c.schedule, c.vocab, c.p, c.k, c.tied ? "_tied" : "");
}

TrainerOptions Options(const Case& c) {
  TrainerOptions o;
  o.model = {.layers = 4,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,
             .seq_len = 12,
             .ffn_hidden = 64,
             .tie_embeddings = c.tied};
  o.microbatch_size = 2;
  o.microbatches = 2 * c.p;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  o.lr = {.lr = 1e-3f, .min_lr = 1e-3f, .warmup_steps = 0, .total_steps = 10, .cosine = false};
  o.seed = 17;
  return o;
}

// Validation microbatch number i (i = 0, 1, ...) from a token stream of its own, as
// OpenValidationBatches numbers them: the standalone Evaluate asks for (0, i), the pipeline
// for round r and microbatch j, i = r·m + j.
BatchFn FlatValidation(const TrainerOptions& o) {
  auto tokens = std::make_shared<std::vector<int32_t>>(3001);
  std::mt19937 rng(99);
  for (auto& t : *tokens) t = static_cast<int32_t>(rng() % o.model.vocab);
  const int b = o.microbatch_size, s = o.model.seq_len;
  return [tokens, b, s](int64_t, int i, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < b; ++t) {
      const int64_t k = static_cast<int64_t>(i) * b + t;
      for (int x = 0; x < s; ++x) {
        inputs[t * s + x] = (*tokens)[(k * s + x) % tokens->size()];
        targets[t * s + x] = (*tokens)[(k * s + x + 1) % tokens->size()];
      }
    }
    return absl::OkStatus();
  };
}

class PipelineEvaluate : public testing::TestWithParam<Case> {};

TEST_P(PipelineEvaluate, EqualsTheStandaloneForwardOnlyPass) {
  const Case& c = GetParam();
  const TrainerOptions opt = Options(c);
  const BatchFn train = fixtures::Batches(opt);
  const BatchFn flat = FlatValidation(opt);
  const int m = opt.microbatches;
  const BatchFn by_round = [flat, m](int64_t round, int j, int32_t* in, int32_t* tg) {
    return flat(0, static_cast<int>(round) * m + j, in, tg);
  };

  // The reference: train, evaluate forward only, train one more step.
  auto standalone = StandaloneTrainer::Create(opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  for (int step = 0; step < kTrainSteps; ++step) {
    ASSERT_TRUE((*standalone)->Step(step, train).ok());
  }
  absl::StatusOr<double> want = (*standalone)->Evaluate(0, kRounds * m, flat);
  ASSERT_TRUE(want.ok()) << want.status();
  auto after = (*standalone)->Step(kTrainSteps, train);
  ASSERT_TRUE(after.ok());

  auto plan = fixtures::PlanFor(c.schedule, c.vocab, c.p, c.k, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();

  std::vector<RankEvalResult> evals(c.p);
  std::vector<RankStepResult> next(c.p);
  std::vector<std::string> errors(c.p);
  comm::testing::RunOnGlooRanks(c.p, [&](comm::GlooCommunicator& comm) {
    const int r = comm.rank();
    // A rank's share of the cores, as a worker process gets (runtime::WorkerThreads): the
    // thread count is per thread (kernels/cpu/blas.h), and p teams of all cores would spin
    // against each other.
    engine::cpu::SetBlasThreads(
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / c.p));
    auto rank = PipelineRank::Create(*plan, r, opt, &comm);
    if (!rank.ok()) {
      errors[r] = rank.status().ToString();
      return;
    }
    for (int step = 0; step < kTrainSteps; ++step) {
      if (auto res = (*rank)->Step(step, train); !res.ok()) {
        errors[r] = res.status().ToString();
        return;
      }
    }
    // A count that is not a multiple of m is refused before anything runs (on every rank).
    if ((*rank)->Evaluate(m + 1, by_round).ok()) {
      errors[r] = "Evaluate(m + 1) was accepted";
      return;
    }
    auto e = (*rank)->Evaluate(kRounds * m, by_round);
    if (!e.ok()) {
      errors[r] = e.status().ToString();
      return;
    }
    evals[r] = *e;
    auto res = (*rank)->Step(kTrainSteps, train);
    if (!res.ok()) {
      errors[r] = res.status().ToString();
      return;
    }
    next[r] = *res;
  });
  for (int r = 0; r < c.p; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  ASSERT_TRUE(evals[plan->x_owner].has_loss) << "the owner of X saw no validation loss";
  int seen = 0;
  for (int r = 0; r < c.p; ++r) {
    if (!evals[r].has_loss) continue;
    ++seen;
    EXPECT_NEAR(evals[r].loss, *want, 1e-5 * *want) << "rank " << r;
  }
  // Vocabulary-parallel methods: every rank holds output rows and sees the loss after C1.
  if (plan->vocab_sharded) {
    EXPECT_EQ(seen, c.p);
  }
  // The evaluation left the training state alone: the next step's loss is the reference's.
  ASSERT_TRUE(next[plan->x_owner].has_loss);
  EXPECT_NEAR(next[plan->x_owner].loss, after->loss, 1e-5 * after->loss);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (VocabMethod v : planner::AllVocabMethods())
    cases.push_back({Schedule::k1F1B, v, 2, 1, false});
  cases.push_back({Schedule::k1F1B, VocabMethod::kVocab1, 2, 1, true});
  cases.push_back({Schedule::kSeq1F1B, VocabMethod::kVocab2, 2, 2, false});
  cases.push_back({Schedule::kInterleaved, VocabMethod::kVocab1, 2, 1, false});
  cases.push_back({Schedule::kZBV, VocabMethod::kVocab2, 2, 1, false});
  cases.push_back({Schedule::k1F1B, VocabMethod::kVocab2, 4, 1, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Plans, PipelineEvaluate, testing::ValuesIn(AllCases()), Name);

}  // namespace
}  // namespace vp::runtime
