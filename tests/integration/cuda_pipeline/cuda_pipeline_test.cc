// A CUDA pipeline rank must train like the CPU ranks: fp32 losses and final weights within 1e-4
// of the CPU pipeline for p = 1 and for p = 2 ranks emulated on one GPU (threads, Gloo through
// host memory: NCCL refuses two ranks on one device), over vocab1, vocab2, baseline (tied) and
// Seq1F1B; the bf16 loss curve within 2e-2 of the fp32 CPU one. Without a GPU the device-free
// checks run and the rest skip with "no CUDA device".
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "tests/support/gloo_threads.h"
#include "tests/support/training_fixtures.h"
#include "worker/comm/nccl/staged_communicator.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/runtime/cuda/cuda_pipeline_rank.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::runtime {
namespace {

using fixtures::Batches;
using fixtures::Gather;
using fixtures::Weights;

using planner::Schedule;
using planner::VocabMethod;

constexpr int kSteps = 4;

struct Case {
  Schedule schedule;
  VocabMethod vocab;
  int p;
  int k;
  bool tied;
};

TrainerOptions Options(const Case& c) {
  TrainerOptions o;
  o.model = {.layers = 4,
             .hidden = 32,
             .heads = 4,
             .vocab = 67,
             .seq_len = 16,
             .ffn_hidden = 64,
             .tie_embeddings = c.tied};
  o.microbatch_size = 2;
  o.microbatches = 2 * c.p;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  o.lr = {.lr = 1e-3f, .min_lr = 1e-4f, .warmup_steps = 1, .total_steps = kSteps, .cosine = true};
  o.grad_clip = 1.0f;
  o.seed = 11;
  return o;
}

absl::StatusOr<planner::Plan> Plan(const Case& c, const TrainerOptions& o) {
  planner::PlannerInput in;
  in.pipeline = c.p;
  in.microbatches = o.microbatches;
  in.layers = o.model.layers;
  in.seq_chunks = c.k;
  in.schedule = c.schedule;
  in.vocab = c.vocab;
  in.costs = {.f = 1, .b = 1, .w = 1, .s = 0.5, .t = 0.5, .input_f = 0.1, .input_b = 0.1};
  in.model = {.hidden = o.model.hidden,
              .heads = o.model.heads,
              .seq_len = o.model.seq_len,
              .vocab = o.model.vocab,
              .ffn = o.model.ffn_hidden,
              .microbatch_size = o.microbatch_size,
              .tie_embeddings = o.model.tie_embeddings};
  return planner::BuildPlan(in);
}

struct RunResult {
  std::vector<double> losses;  // from the rank that sees them
  Weights weights;
  std::vector<std::string> errors;
};

// p ranks in threads over Gloo; cuda: each rank on device 0 with a staged communicator.
RunResult RunRanks(const Case& c, const planner::Plan& plan, bool cuda, DevicePrecision precision) {
  const TrainerOptions opt = Options(c);
  const BatchFn batches = Batches(opt);
  RunResult out;
  out.errors.resize(c.p);
  std::vector<std::vector<double>> losses(c.p);
  std::vector<std::vector<char>> has(c.p);
  std::mutex mu;
  comm::testing::RunOnGlooRanks(c.p, [&](comm::GlooCommunicator& gloo) {
    const int r = gloo.rank();
    comm::StagedCommunicator staged(&gloo);
    absl::StatusOr<std::unique_ptr<PipelineRank>> rank =
        cuda ? CreateCudaPipelineRank(plan, r, opt,
                                      {.device = 0, .precision = precision, .untagged_p2p = false},
                                      &staged, &staged)
             : PipelineRank::Create(plan, r, opt, &gloo);
    if (!rank.ok()) {
      out.errors[r] = rank.status().ToString();
      return;
    }
    for (int step = 0; step < kSteps; ++step) {
      auto res = (*rank)->Step(step, batches);
      if (!res.ok()) {
        out.errors[r] = res.status().ToString();
        return;
      }
      losses[r].push_back(res->loss);
      has[r].push_back(res->has_loss);
    }
    if (auto st = (*rank)->PullState(); !st.ok()) {
      out.errors[r] = st.ToString();
      return;
    }
    Gather((*rank)->model(), &out.weights, &mu);
  });
  for (int r = 0; r < c.p; ++r) {
    if (!has[r].empty() && has[r][0]) {
      out.losses = losses[r];
      break;
    }
  }
  return out;
}

#define SKIP_WITHOUT_DEVICE() \
  if (engine::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device"

TEST(CudaPipeline, WithoutADeviceCreateFailsClearly) {
  const Case c{Schedule::k1F1B, VocabMethod::kVocab1, 1, 1, false};
  const TrainerOptions opt = Options(c);
  auto plan = Plan(c, opt);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto self = comm::MakeSelfCommunicator();
  // A communicator of the wrong size is rejected before any device work.
  comm::testing::RunOnGlooRanks(2, [&](comm::GlooCommunicator& gloo) {
    auto rank = CreateCudaPipelineRank(*plan, gloo.rank(), opt, {}, &gloo, &gloo);
    EXPECT_EQ(rank.status().code(), absl::StatusCode::kInvalidArgument) << rank.status();
  });
  if (engine::cuda::DeviceCount() != 0) GTEST_SKIP() << "a CUDA device is present";
  auto rank = CreateCudaPipelineRank(*plan, 0, opt, {}, self.get(), self.get());
  ASSERT_FALSE(rank.ok());
  EXPECT_EQ(rank.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(rank.status().message().find("no CUDA device"), std::string::npos) << rank.status();
}

class CudaMatchesCpu : public testing::TestWithParam<Case> {};

TEST_P(CudaMatchesCpu, Fp32LossesAndWeights) {
  SKIP_WITHOUT_DEVICE();
  const Case& c = GetParam();
  auto plan = Plan(c, Options(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const RunResult want = RunRanks(c, *plan, /*cuda=*/false, DevicePrecision::kFp32);
  const RunResult got = RunRanks(c, *plan, /*cuda=*/true, DevicePrecision::kFp32);
  for (int r = 0; r < c.p; ++r) {
    ASSERT_EQ(want.errors[r], "") << "cpu rank " << r;
    ASSERT_EQ(got.errors[r], "") << "cuda rank " << r;
  }
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-4 * want.losses[i]) << "step " << i;
  }
  for (const auto& [name, w] : want.weights) {
    auto it = got.weights.find(name);
    ASSERT_NE(it, got.weights.end()) << name;
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(it->second[i] - w[i])));
    }
    EXPECT_LE(worst, 1e-4) << name;
  }
}

TEST_P(CudaMatchesCpu, Bf16LossCurveWithinTolerance) {
  SKIP_WITHOUT_DEVICE();
  const Case& c = GetParam();
  auto plan = Plan(c, Options(c));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const RunResult want = RunRanks(c, *plan, /*cuda=*/false, DevicePrecision::kFp32);
  const RunResult got = RunRanks(c, *plan, /*cuda=*/true, DevicePrecision::kBf16);
  for (int r = 0; r < c.p; ++r) ASSERT_EQ(got.errors[r], "") << "cuda rank " << r;
  ASSERT_EQ(got.losses.size(), want.losses.size());
  // bf16 parameters and activations (8-bit mantissa) against fp32: a relative loss tolerance.
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 2e-2 * want.losses[i]) << "step " << i;
  }
}

std::string Name(const testing::TestParamInfo<Case>& info) {
  std::string s = absl::StrCat(planner::ScheduleName(info.param.schedule), "_",
                               planner::VocabName(info.param.vocab), "_p", info.param.p, "_k",
                               info.param.k, info.param.tied ? "_tied" : "");
  for (char& ch : s) {
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return s;
}

INSTANTIATE_TEST_SUITE_P(Plans, CudaMatchesCpu,
                         testing::Values(Case{Schedule::k1F1B, VocabMethod::kVocab2, 1, 1, false},
                                         Case{Schedule::k1F1B, VocabMethod::kVocab1, 2, 1, false},
                                         Case{Schedule::k1F1B, VocabMethod::kVocab2, 2, 1, true},
                                         Case{Schedule::k1F1B, VocabMethod::kBaseline, 2, 1, true},
                                         Case{Schedule::kSeq1F1B, VocabMethod::kVocab2, 2, 2,
                                              false},
                                         Case{Schedule::kZBV, VocabMethod::kVocab1, 2, 1, false}),
                         Name);

}  // namespace
}  // namespace vp::runtime
