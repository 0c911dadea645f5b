// Tensor parallelism inside the pipeline trains exactly like the plain single-process model:
// t = 2 × p = 2 (4 ranks as threads over real Gloo, each in a pipeline group and a tensor group)
// for every schedule family × Vocab-1 / Vocab-2, and d = 2 × t = 2 × p = 2 (8 ranks) against one
// process with twice the microbatches. Per-step losses within 1e-5 relative and every parameter
// after 3 steps (the tensor ranks' slices placed back into whole tensors) within 1e-5. A
// checkpoint of (tp, pp) shards merges into the one-process export and resumes at t = 1.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "tests/support/gloo_threads.h"
#include "tests/support/tensor_grid.h"
#include "tests/support/training_fixtures.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/safetensors.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

using fixtures::Batches;
using fixtures::Gather;
using fixtures::RunGrid;
using fixtures::Weights;
using planner::Schedule;
using planner::VocabMethod;

constexpr int kSteps = 3;

struct Case {
  Schedule schedule;
  VocabMethod vocab;
  int k = 1;  // sequence chunks
  int d = 1;  // replicas
  bool tied = false;
  bool llama = false;
};

TrainerOptions Options(const Case& c, int microbatches) {
  TrainerOptions o;
  o.model = {.layers = 8,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,  // a multiple of no p·t here
             .seq_len = 12,
             .ffn_hidden = 64,
             .tie_embeddings = c.tied};
  if (c.llama) {
    o.model.architecture = engine::Architecture::kLlama;
    o.model.kv_heads = 2;
    o.model.ffn_hidden = 40;
    o.model.rope_theta = 500.0f;
  }
  o.microbatch_size = 2;
  o.microbatches = microbatches;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-5f, .weight_decay = 0.1f};
  o.lr = {.lr = 3e-3f, .min_lr = 3e-4f, .warmup_steps = 1, .total_steps = kSteps, .cosine = true};
  o.grad_clip = 1.0f;  // the global norm counts each tensor rank's slices and the replicated
                       // tensors once
  o.seed = 11;
  return o;
}

class TensorParallelEquivalence : public testing::TestWithParam<Case> {};

TEST_P(TensorParallelEquivalence, MatchesOneProcess) {
  const Case& c = GetParam();
  constexpr int p = 2, t = 2, m = 4;
  // The reference: one process, the whole model, every replica's microbatches.
  const TrainerOptions ref_opt = Options(c, c.d * m);
  const BatchFn all = Batches(ref_opt);
  auto standalone = StandaloneTrainer::Create(ref_opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  std::vector<double> want;
  for (int step = 0; step < kSteps; ++step) {
    auto r = (*standalone)->Step(step, all);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(r->loss);
  }
  Weights want_w;
  std::mutex mu;
  Gather((*standalone)->model(), &want_w, &mu);

  TrainerOptions opt = Options(c, m);
  opt.tensor.size = t;
  opt.data.replicas = c.d;
  auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, c.k, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (size_t q = 0; q + 1 < plan->seq_bounds.size(); ++q) {
    ASSERT_EQ((plan->seq_bounds[q + 1] - plan->seq_bounds[q]) % t, 0) << "chunk " << q;
  }

  // Ranks numbered as planner::Topology: the tensor axis innermost.
  const int world = c.d * p * t;
  std::vector<std::vector<double>> got(world);
  std::vector<std::vector<char>> has(world);
  std::vector<std::string> errors(world);
  Weights got_w;
  fixtures::RunJobGrid(
      c.d, p, t,
      [&](int rank, const planner::RankCoord& coord, comm::Communicator* pipe,
          comm::Communicator* data, comm::Communicator* tensor) {
        const int replica = coord.replica, stage = coord.stage;
        TrainerOptions mine = opt;
        mine.tensor.rank = coord.tensor;
        mine.data.replica = replica;
        // Replica r's j-th microbatch is the reference's r·m + j.
        const BatchFn batches = [&, replica](int64_t step, int j, int32_t* in, int32_t* out) {
          return all(step, replica * m + j, in, out);
        };
        const auto pr = PipelineRank::Create(*plan, stage, mine, pipe, data, tensor);
        errors[rank] = fixtures::TrainRank(pr, 0, kSteps, batches, [&](const RankStepResult& res) {
          got[rank].push_back(res.loss);
          has[rank].push_back(res.has_loss);
        });
        if (errors[rank].empty() && replica == 0) {
          Gather((*pr)->model(), &got_w, &mu);
        }
      });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  int checked = 0;
  for (int r = 0; r < world; ++r) {
    for (int step = 0; step < kSteps; ++step) {
      if (!has[r][step]) continue;
      ++checked;
      EXPECT_NEAR(got[r][step], want[step], 1e-5 * want[step]) << "rank " << r << " step " << step;
    }
  }
  EXPECT_GE(checked, t * kSteps);  // at least the last stage's tensor ranks saw every loss
  fixtures::ExpectWeightsNear(want_w, got_w, 1e-5);
}

// Saved at (d, t, p) = (1, 2, 2) after 2 steps: the (tp, pp) shards merge into the one-process
// model's Hugging Face export, and a (1, 1, 2) pipeline resumed from them trains step 3 as the
// one process does.
TEST(TensorParallelCheckpoint, MergesToTheOneProcessExportAndResumesAtAnotherShape) {
  constexpr int p = 2, m = 4, saved_steps = 2;
  const Case c{Schedule::k1F1B, VocabMethod::kVocab2};
  const TrainerOptions ref_opt = Options(c, m);
  const BatchFn batches = Batches(ref_opt);
  auto standalone = StandaloneTrainer::Create(ref_opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  std::vector<double> want;
  Weights at_save, at_end;
  std::mutex mu;
  for (int step = 0; step < kSteps; ++step) {
    auto r = (*standalone)->Step(step, batches);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(r->loss);
    if (step + 1 == saved_steps) Gather((*standalone)->model(), &at_save, &mu);
  }
  Gather((*standalone)->model(), &at_end, &mu);

  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("vp_tp_ckpt_", getpid())).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // (1, 2, 2): two steps, then every rank saves its shard (rank stage·t + tp of 4).
  {
    TrainerOptions opt = Options(c, m);
    opt.tensor.size = 2;
    auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, 1, opt);
    ASSERT_TRUE(plan.ok()) << plan.status();
    RunGrid(p, 2, [&](int rank, int stage, int tp, comm::Communicator* pc, comm::Communicator* tc) {
      TrainerOptions mine = opt;
      mine.tensor.rank = tp;
      auto pr = PipelineRank::Create(*plan, stage, mine, pc, nullptr, tc);
      ASSERT_TRUE(pr.ok()) << pr.status();
      for (int step = 0; step < saved_steps; ++step) ASSERT_TRUE((*pr)->Step(step, batches).ok());
      EXPECT_TRUE(launch::SaveRankShard(dir, saved_steps, rank, 4, (*pr)->model(),
                                        (*pr)->optimizer(), "tp-run")
                      .ok());
    });
  }
  const absl::Status merge = launch::MergeShards(dir, saved_steps, 4, ref_opt.model);
  ASSERT_TRUE(merge.ok()) << merge;
  auto merged = runtime::ReadSafetensors(
      (std::filesystem::path(dir) / absl::StrCat("step_", saved_steps) / "model.safetensors")
          .string());
  ASSERT_TRUE(merged.ok()) << merged.status();
  Weights merged_w;
  for (const auto& [name, tensor] : merged->tensors) merged_w[name] = tensor.data;
  fixtures::ExpectWeightsNear(at_save, merged_w, 1e-5);
  // (1, 1, 2): resumed from the 4 shards, one more step.
  TrainerOptions opt = Options(c, m);
  auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, 1, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<double> got(p, -1);
  std::vector<char> has(p, 0);
  Weights got_w;
  RunGrid(p, 1, [&](int, int stage, int, comm::Communicator* pc, comm::Communicator*) {
    auto pr = PipelineRank::Create(*plan, stage, opt, pc);
    ASSERT_TRUE(pr.ok()) << pr.status();
    const absl::Status loaded =
        launch::LoadFromShards(dir, saved_steps, 4, (*pr)->model(), &(*pr)->optimizer());
    ASSERT_TRUE(loaded.ok()) << loaded;
    for (int step = saved_steps; step < kSteps; ++step) {
      auto r = (*pr)->Step(step, batches);
      ASSERT_TRUE(r.ok()) << r.status();
      got[stage] = r->loss;
      has[stage] = r->has_loss;
    }
    Gather((*pr)->model(), &got_w, &mu);
  });
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(has[plan->x_owner]);
  EXPECT_NEAR(got[plan->x_owner], want[kSteps - 1], 1e-5 * want[kSteps - 1]);
  fixtures::ExpectWeightsNear(at_end, got_w, 1e-5);
}

// The reverse: saved by a (1, 1, 2) pipeline, resumed at (1, 2, 2): every tensor rank cuts its
// slices (weights and AdamW moments) out of the whole saved tensors.
TEST(TensorParallelCheckpoint, WholeTensorsResumeAsSlices) {
  constexpr int p = 2, m = 4, saved_steps = 2;
  const Case c{Schedule::kVHalf, VocabMethod::kVocab1};
  const TrainerOptions ref_opt = Options(c, m);
  const BatchFn batches = Batches(ref_opt);
  auto standalone = StandaloneTrainer::Create(ref_opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  std::vector<double> want;
  for (int step = 0; step < kSteps; ++step) {
    auto r = (*standalone)->Step(step, batches);
    ASSERT_TRUE(r.ok()) << r.status();
    want.push_back(r->loss);
  }
  Weights at_end;
  std::mutex mu;
  Gather((*standalone)->model(), &at_end, &mu);
  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("vp_tp_ckpt2_", getpid())).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    TrainerOptions opt = Options(c, m);
    auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, 1, opt);
    ASSERT_TRUE(plan.ok()) << plan.status();
    RunGrid(p, 1, [&](int rank, int stage, int, comm::Communicator* pc, comm::Communicator*) {
      auto pr = PipelineRank::Create(*plan, stage, opt, pc);
      ASSERT_TRUE(pr.ok()) << pr.status();
      for (int step = 0; step < saved_steps; ++step) ASSERT_TRUE((*pr)->Step(step, batches).ok());
      EXPECT_TRUE(launch::SaveRankShard(dir, saved_steps, rank, p, (*pr)->model(),
                                        (*pr)->optimizer(), "run")
                      .ok());
    });
  }
  TrainerOptions opt = Options(c, m);
  opt.tensor.size = 2;
  auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, 1, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<double> got(2 * p, -1);
  std::vector<char> has(2 * p, 0);
  Weights got_w;
  RunGrid(p, 2, [&](int rank, int stage, int tp, comm::Communicator* pc, comm::Communicator* tc) {
    TrainerOptions mine = opt;
    mine.tensor.rank = tp;
    auto pr = PipelineRank::Create(*plan, stage, mine, pc, nullptr, tc);
    ASSERT_TRUE(pr.ok()) << pr.status();
    const absl::Status loaded =
        launch::LoadFromShards(dir, saved_steps, p, (*pr)->model(), &(*pr)->optimizer());
    ASSERT_TRUE(loaded.ok()) << loaded;
    for (int step = saved_steps; step < kSteps; ++step) {
      auto r = (*pr)->Step(step, batches);
      ASSERT_TRUE(r.ok()) << r.status();
      got[rank] = r->loss;
      has[rank] = r->has_loss;
    }
    Gather((*pr)->model(), &got_w, &mu);
  });
  std::filesystem::remove_all(dir);
  int checked = 0;
  for (int r = 0; r < 2 * p; ++r) {
    if (!has[r]) continue;
    ++checked;
    EXPECT_NEAR(got[r], want[kSteps - 1], 1e-5 * want[kSteps - 1]) << "rank " << r;
  }
  EXPECT_GE(checked, 2);
  fixtures::ExpectWeightsNear(at_end, got_w, 1e-5);
}

// Forward-only evaluation at t = 2 × p = 2 (Seq1F1B, k = 2: the embedding rows of two chunks):
// every rank that saw the losses reports the one-process mean, the tensor ranks' shares summed.
TEST(TensorParallelEvaluate, EqualsTheOneProcessForwardOnlyPass) {
  constexpr int p = 2, m = 4, rounds = 2;
  const Case c{Schedule::kSeq1F1B, VocabMethod::kVocab2, 2};
  const TrainerOptions ref_opt = Options(c, m);
  const BatchFn train = Batches(ref_opt);
  auto standalone = StandaloneTrainer::Create(ref_opt);
  ASSERT_TRUE(standalone.ok()) << standalone.status();
  ASSERT_TRUE((*standalone)->Step(0, train).ok());
  // Evaluation batches: the training stream from step 2 on.
  const BatchFn flat = [train, m](int64_t, int j, int32_t* in, int32_t* tg) {
    return train(2 + j / m, j % m, in, tg);
  };
  absl::StatusOr<double> want = (*standalone)->Evaluate(0, rounds * m, flat);
  ASSERT_TRUE(want.ok()) << want.status();
  const BatchFn by_round = [flat, m](int64_t round, int j, int32_t* in, int32_t* tg) {
    return flat(0, static_cast<int>(round) * m + j, in, tg);
  };
  TrainerOptions opt = Options(c, m);
  opt.tensor.size = 2;
  auto plan = fixtures::PlanFor(c.schedule, c.vocab, p, c.k, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<RankEvalResult> evals(2 * p);
  RunGrid(p, 2, [&](int rank, int stage, int tp, comm::Communicator* pc, comm::Communicator* tc) {
    TrainerOptions mine = opt;
    mine.tensor.rank = tp;
    auto pr = PipelineRank::Create(*plan, stage, mine, pc, nullptr, tc);
    ASSERT_TRUE(pr.ok()) << pr.status();
    ASSERT_TRUE((*pr)->Step(0, train).ok());
    auto e = (*pr)->Evaluate(rounds * m, by_round);
    ASSERT_TRUE(e.ok()) << e.status();
    evals[rank] = *e;
  });
  int checked = 0;
  for (int r = 0; r < 2 * p; ++r) {
    if (!evals[r].has_loss) continue;
    ++checked;
    EXPECT_NEAR(evals[r].loss, *want, 1e-5 * *want) << "rank " << r;
  }
  EXPECT_GE(checked, 2);
}

std::string Name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fixtures::CaseName(
      c.schedule, c.vocab, 2, c.k,
      absl::StrCat("_t2_d", c.d, c.tied ? "_tied" : "", c.llama ? "_llama" : ""));
}

INSTANTIATE_TEST_SUITE_P(
    Plans, TensorParallelEquivalence,
    testing::Values(
        Case{Schedule::k1F1B, VocabMethod::kVocab1}, Case{Schedule::k1F1B, VocabMethod::kVocab2},
        Case{Schedule::kVHalf, VocabMethod::kVocab1}, Case{Schedule::kVHalf, VocabMethod::kVocab2},
        Case{Schedule::kZBV, VocabMethod::kVocab1}, Case{Schedule::kZBV, VocabMethod::kVocab2},
        Case{Schedule::kSeq1F1B, VocabMethod::kVocab1, 2},
        Case{Schedule::kSeq1F1B, VocabMethod::kVocab2, 2},
        Case{Schedule::k1F1B, VocabMethod::kVocab2, 1, 1, /*tied=*/true},
        Case{Schedule::k1F1B, VocabMethod::kVocab2, 1, 1, false, /*llama=*/true},
        Case{Schedule::k1F1B, VocabMethod::kVocab2, 1, 2},
        Case{Schedule::kVHalf, VocabMethod::kVocab2, 1, 2}),
    Name);

}  // namespace
}  // namespace vp::runtime
