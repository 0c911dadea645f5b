// Forward-only evaluation on the standalone trainer: its loss is the loss a training step's
// forward computes on the same batches, and it changes no parameter, gradient or optimizer
// state and leaves no activation behind.
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

TrainerOptions Options(bool tied, engine::vocab::OutputAlgorithm algorithm) {
  TrainerOptions o;
  o.model = {.layers = 2,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,
             .seq_len = 12,
             .ffn_hidden = 64,
             .tie_embeddings = tied};
  o.microbatch_size = 2;
  o.microbatches = 3;
  o.algorithm = algorithm;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  o.lr = {.lr = 1e-3f, .min_lr = 1e-3f, .warmup_steps = 0, .total_steps = 10, .cosine = false};
  o.seed = 5;
  return o;
}

// Deterministic batches: microbatch j of step t from a fixed stream of ids.
BatchFn Batches(const TrainerOptions& o, uint32_t salt) {
  return [o, salt](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    std::mt19937 rng(static_cast<uint32_t>(step * 1000 + j) ^ salt);
    const int n = o.microbatch_size * o.model.seq_len;
    for (int i = 0; i < n; ++i) {
      inputs[i] = static_cast<int32_t>(rng() % o.model.vocab);
      targets[i] = static_cast<int32_t>(rng() % o.model.vocab);
    }
    return absl::OkStatus();
  };
}

class EvaluateTest
    : public ::testing::TestWithParam<std::tuple<bool, engine::vocab::OutputAlgorithm>> {};

TEST_P(EvaluateTest, EqualsTheTrainingForwardAndChangesNothing) {
  const auto [tied, algorithm] = GetParam();
  const TrainerOptions o = Options(tied, algorithm);
  auto trainer = StandaloneTrainer::Create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  StandaloneTrainer& t = **trainer;
  const BatchFn train = Batches(o, 1), val = Batches(o, 2);
  // Train a little so the weights are not the initial ones.
  for (int64_t step = 0; step < 3; ++step) ASSERT_TRUE(t.Step(step, train).ok());

  engine::RankModel& m = t.model();
  const size_t np = m.param_count();
  const std::vector<float> params(m.params(), m.params() + np);
  const std::vector<float> grads(m.grads(), m.grads() + np);
  const int64_t activations = t.memory().current(engine::MemoryCategory::kActivations);

  absl::StatusOr<double> eval = t.Evaluate(7, o.microbatches, val);
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_GT(*eval, 0.0);
  EXPECT_EQ(std::memcmp(m.params(), params.data(), np * sizeof(float)), 0) << "params changed";
  EXPECT_EQ(std::memcmp(m.grads(), grads.data(), np * sizeof(float)), 0) << "grads changed";
  EXPECT_EQ(m.stack(0).live_slots(), 0);
  // Nothing held beyond what the step held (the output layer's spare workspace, which the
  // evaluation drops at its end).
  EXPECT_LE(t.memory().current(engine::MemoryCategory::kActivations), activations);

  // Evaluating again gives the same number, and training continues as if nothing happened.
  absl::StatusOr<double> again = t.Evaluate(7, o.microbatches, val);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *eval);

  // The separate pass: the forward of a training step (ComputeGradients) on the same batches
  // computes the same per-token losses, summed the same way.
  absl::StatusOr<double> forward = t.ComputeGradients(7, val);
  ASSERT_TRUE(forward.ok());
  EXPECT_EQ(*eval, *forward);

  // Fewer batches: the mean over just those.
  absl::StatusOr<double> one = t.Evaluate(7, 1, val);
  ASSERT_TRUE(one.ok());
  EXPECT_NE(*one, *eval);
  EXPECT_FALSE(t.Evaluate(7, 0, val).ok());
}

TEST(Evaluate, DoesNotChangeTheTrainingTrajectory) {
  const TrainerOptions o = Options(false, engine::vocab::OutputAlgorithm::kAlgorithm2);
  auto a = StandaloneTrainer::Create(o);
  auto b = StandaloneTrainer::Create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  const BatchFn train = Batches(o, 1), val = Batches(o, 2);
  for (int64_t step = 0; step < 4; ++step) {
    absl::StatusOr<StepResult> ra = (*a)->Step(step, train);
    ASSERT_TRUE((*b)->Evaluate(step, 2, val).ok());
    absl::StatusOr<StepResult> rb = (*b)->Step(step, train);
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_EQ(ra->loss, rb->loss) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    TiedAndAlgorithms, EvaluateTest,
    ::testing::Combine(::testing::Bool(),
                       ::testing::Values(engine::vocab::OutputAlgorithm::kAlgorithm1,
                                         engine::vocab::OutputAlgorithm::kAlgorithm2)));

}  // namespace
}  // namespace vp::runtime
