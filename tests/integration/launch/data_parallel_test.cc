// Data parallelism (parallel.data) on real vocabpipe-worker processes over Gloo on loopback:
// d replicas of a p-stage pipeline with m microbatches each must train exactly like one
// process with d·m microbatches — the same per-step losses, gradient norms and final weights —
// for every schedule family and vocabulary method, with and without ZeRO-1.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"
#include "tests/support/weights.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using vp::testing::ExpectSameWeights;
using vp::testing::ReadJsonl;
using vp::testing::Vocabpipe;

constexpr int kSteps = 3;

// The job: GPT-2, 4 layers (two V-shape chunks per rank at p = 2), V = 64, s = 16, b = 2.
// AdamW's eps is 1e-5 (see launch_test.cc: with a tiny eps Adam turns the summation-order
// noise of gradients that are zero in exact arithmetic into lr-sized steps).
struct Job {
  std::string name;
  int pipeline = 1, data = 1, microbatches = 8, zero = 0, seq_chunks = 1, tensor = 1;
  std::string schedule = "1f1b", vocab = "vocab2";
  double grad_clip = 0;
  int steps = kSteps, every = 0;
  int eval_every = 0, eval_batches = 0;  // 0: no evaluation
  std::string lr = "0.003";
  std::string init_from = "";  // a Hugging Face folder; "" for random init
};

std::string SpecText(const Job& j) {
  return absl::StrCat(
      "model: {layers: 4, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16",
      j.init_from.empty() ? "" : absl::StrCat(", init_from: ", j.init_from), "}\n",
      "parallel: {pipeline: ", j.pipeline, ", data: ", j.data, ", zero: ", j.zero,
      ", tensor: ", j.tensor, ", microbatch_size: 2, microbatches: ", j.microbatches,
      ", vocab: ", j.vocab, ", schedule: ", j.schedule, ", seq_chunks: ", j.seq_chunks, "}\n",
      "train: {steps: ", j.steps, ", lr: ", j.lr,
      ", eps: 1.0e-5, threads: 1, grad_clip: ", j.grad_clip,
      j.eval_every > 0
          ? absl::StrCat(", eval_every: ", j.eval_every, ", eval_batches: ", j.eval_batches)
          : "",
      "}\n", "data: {path: data.bin, shuffle: true", j.eval_every > 0 ? ", val_path: data.bin" : "",
      "}\ncheckpoint: {dir: ", j.name, ", every: ", j.every, "}\n");
}

// One folder for the suite: the token file and the one-process reference (m = 8), shared by
// every test (the reference is the plain model whatever the schedule or vocabulary method).
class DataParallelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / absl::StrCat("vp_data_parallel_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    auto r = Vocabpipe(absl::StrCat("data synth --vocab 64 --tokens 20000 --out ",
                                    (dir_ / "data.bin").string(), " --seed 5"));
    ASSERT_EQ(r.code, 0) << r.output;
    r = Run({.name = "reference"});
    ASSERT_EQ(r.code, 0) << r.output;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static vp::testing::CliResult Run(const Job& job, const std::string& flags = "") {
    const fs::path spec = dir_ / (job.name + ".yaml");
    std::ofstream(spec) << SpecText(job);
    return Vocabpipe(absl::StrCat("run --direct ", spec.string(), " --timeout 20 ", flags));
  }

  // Per-step losses and grad norms to 1e-5 relative, and the merged final weights.
  static void ExpectMatches(const std::string& name, const std::string& reference,
                            double tol = 1e-5) {
    auto a = ReadJsonl(dir_ / name / "metrics.jsonl");
    auto b = ReadJsonl(dir_ / reference / "metrics.jsonl");
    ASSERT_EQ(a.size(), size_t(kSteps)) << name;
    ASSERT_EQ(b.size(), size_t(kSteps)) << reference;
    for (int i = 0; i < kSteps; ++i) {
      const double la = a[i]["loss"], lb = b[i]["loss"];
      EXPECT_LE(std::abs(la - lb), tol * std::abs(lb))
          << name << " step " << i << ": " << la << " vs " << lb;
      const double ga = a[i]["grad_norm"], gb = b[i]["grad_norm"];
      EXPECT_LE(std::abs(ga - gb), 10 * tol * gb)
          << name << " step " << i << ": " << ga << " vs " << gb;
    }
    const std::string last = absl::StrCat("step_", kSteps);
    ExpectSameWeights(dir_ / name / last / "model.safetensors",
                      dir_ / reference / last / "model.safetensors", tol);
  }

  static fs::path dir_;
};
fs::path DataParallelTest::dir_;

// d = 2 × p = 2 for each schedule family × vocabulary method.
class EverySchedule : public DataParallelTest,
                      public ::testing::WithParamInterface<std::tuple<std::string, std::string>> {};

TEST_P(EverySchedule, TwoReplicasOfTwoStagesMatchOneProcessWithTwiceTheMicrobatches) {
  const auto& [schedule, vocab] = GetParam();
  Job job{.name = absl::StrCat("d2p2_", schedule, "_", vocab),
          .pipeline = 2,
          .data = 2,
          .microbatches = 4,
          .schedule = schedule,
          .vocab = vocab};
  if (schedule == "seq1f1b") job.seq_chunks = 2;
  auto r = Run(job);
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectMatches(job.name, "reference");
  // The step line names every one of the 4 ranks with its stage and replica.
  auto lines = ReadJsonl(dir_ / job.name / "metrics.jsonl");
  ASSERT_EQ(lines.back()["stages"].size(), 4u);
  for (int rank = 0; rank < 4; ++rank) {
    const auto& s = lines.back()["stages"][rank];
    EXPECT_EQ(int(s["rank"]), rank);
    EXPECT_EQ(int(s["stage"]), rank / 2);
    EXPECT_EQ(int(s["replica"]), rank % 2);
  }
}

INSTANTIATE_TEST_SUITE_P(DataParallel, EverySchedule,
                         ::testing::Combine(::testing::Values("1f1b", "vhalf", "zbv", "seq1f1b"),
                                            ::testing::Values("vocab1", "vocab2", "baseline")),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "_",
                                               std::get<1>(info.param));
                         });

TEST_F(DataParallelTest, FourReplicasOfOneStageMatchOneProcess) {
  const Job job{.name = "d4p1", .pipeline = 1, .data = 4, .microbatches = 2};
  auto r = Run(job);
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectMatches(job.name, "reference");
}

// The replicas read different microbatches: two replicas of m = 4 are not one pipeline of
// m = 4 (a loader that gave every replica the same samples, or a missing gradient reduction,
// would make them so). The half-batch run ends far from the reference — a hundred times the
// tolerance the replicas meet — so the matches above are not a property of any run.
TEST_F(DataParallelTest, HalfTheMicrobatchesEndsElsewhere) {
  const Job half{.name = "half", .pipeline = 1, .data = 1, .microbatches = 4};
  auto r = Run(half);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string last = absl::StrCat("step_", kSteps);
  const double worst = vp::testing::WorstRelativeDifference(
      dir_ / "half" / last / "model.safetensors", dir_ / "reference" / last / "model.safetensors");
  EXPECT_GT(worst, 1e-3);
}

TEST_F(DataParallelTest, ZeroOneEqualsZeroZeroWithItsShareOfTheOptimizerState) {
  const Job plain{.name = "zero0", .pipeline = 2, .data = 2, .microbatches = 4, .zero = 0};
  const Job zero{.name = "zero1", .pipeline = 2, .data = 2, .microbatches = 4, .zero = 1};
  auto r = Run(plain);
  ASSERT_EQ(r.code, 0) << r.output;
  r = Run(zero);
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectMatches("zero1", "zero0", 1e-6);
  // Each rank's optimizer bytes (the memory metrics) are its share of the stage's: half, to
  // within one element of each of m and v (the ranges are balanced, not padded).
  auto a = ReadJsonl(dir_ / "zero0/metrics.jsonl").back()["stages"];
  auto b = ReadJsonl(dir_ / "zero1/metrics.jsonl").back()["stages"];
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (int rank = 0; rank < 4; ++rank) {
    const int64_t whole = a[rank]["memory"]["optimizer"], share = b[rank]["memory"]["optimizer"];
    EXPECT_GT(whole, 0);
    EXPECT_LE(std::abs(2 * share - whole), int64_t{2 * 2 * 4}) << "rank " << rank;
    // Without ZeRO each stage's model chunk was summed by the plan's GRAD_SYNC on the data
    // thread (overlapping the backward); under ZeRO-1 OPT reduce-scatters everything instead.
    EXPECT_TRUE(a[rank]["comm"].contains("GRAD_SYNC")) << "rank " << rank << ": " << a[rank];
    EXPECT_FALSE(b[rank]["comm"].contains("GRAD_SYNC")) << "rank " << rank << ": " << b[rank];
    // The planner's memory model (state divided under ZeRO-1) stays within 10% of the peak.
    for (const auto* stages : {&a, &b}) {
      const auto& s = (*stages)[rank];
      EXPECT_NEAR(double(s["predicted_memory_total"]) / double(s["memory"]["total"]), 1.0, 0.1)
          << "rank " << rank << (stages == &a ? " zero 0" : " zero 1");
    }
  }
}

// Evaluation is split over the replicas (replica r runs every d-th round of m batches) and
// their sums added: the validation loss equals one process evaluating every batch. Three
// rounds of 4 over two replicas: one replica runs two, the other one. The learning rate is
// negligible (AdamW moves a weight by about lr), so the one process with m = 4 and the
// replicas, which train on twice the samples a step, evaluate the same model.
TEST_F(DataParallelTest, ReplicasSplitTheEvaluationAndReportTheOneProcessLoss) {
  const Job one{.name = "eval_one",
                .pipeline = 1,
                .data = 1,
                .microbatches = 4,
                .eval_every = 3,
                .eval_batches = 12,
                .lr = "1.0e-12"};
  Job replicas = one;
  replicas.name = "eval_d2p2";
  replicas.pipeline = 2;
  replicas.data = 2;
  auto r = Run(one);
  ASSERT_EQ(r.code, 0) << r.output;
  r = Run(replicas);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto a = ReadJsonl(dir_ / "eval_one/metrics.jsonl").back();
  const auto b = ReadJsonl(dir_ / "eval_d2p2/metrics.jsonl").back();
  ASSERT_TRUE(a.contains("val_loss")) << a;
  ASSERT_TRUE(b.contains("val_loss")) << b;
  const double la = a["val_loss"], lb = b["val_loss"];
  EXPECT_GT(la, 1.0);  // ln 64 ≈ 4.2 at the start: a real loss, not a partial sum
  EXPECT_LE(std::abs(la - lb), 1e-5 * la) << la << " vs " << lb;
}

TEST_F(DataParallelTest, ClippedGradNormIsTheOneProcessNorm) {
  // A clip far below the norm: clipping acts every step, so a norm counted twice (or halved)
  // would change the trajectory as well as the figure.
  const Job ref{.name = "clip_reference", .grad_clip = 0.05};
  const Job dp{.name = "clip_d2p2", .pipeline = 2, .data = 2, .microbatches = 4, .grad_clip = 0.05};
  const Job dz{.name = "clip_d2p2_zero",
               .pipeline = 2,
               .data = 2,
               .microbatches = 4,
               .zero = 1,
               .grad_clip = 0.05};
  for (const Job& j : {ref, dp, dz}) {
    auto r = Run(j);
    ASSERT_EQ(r.code, 0) << j.name << ": " << r.output;
  }
  auto lines = ReadJsonl(dir_ / "clip_reference/metrics.jsonl");
  ASSERT_GT(double(lines[0]["grad_norm"]), 0.5);  // clipping is active
  ExpectMatches("clip_d2p2", "clip_reference");
  ExpectMatches("clip_d2p2_zero", "clip_reference");
}

// Saved by two replicas of a two-stage pipeline (ZeRO-1: each replica writes its optimizer
// range), resumed with the same global batch (d·m = 8) by one replica of the same pipeline, by
// four replicas of a one-stage model and by one four-stage pipeline — the shards re-split by
// tensor name and vocabulary row — and under ZeRO-1 at d = 4 × p = 1, 2 × 2 and 4 × 2, with the
// losses and final weights of the uninterrupted run.
TEST_F(DataParallelTest, SavedAtTwoReplicasOfTwoStagesResumesAtOtherShapes) {
  const Job full{
      .name = "resume_full", .pipeline = 2, .data = 2, .microbatches = 4, .zero = 1, .every = 1};
  auto r = Run(full);
  ASSERT_EQ(r.code, 0) << r.output;
  // Each replica wrote its own range of each stage's optimizer state; there is no whole copy.
  for (int stage = 0; stage < 2; ++stage) {
    const fs::path shard = dir_ / "resume_full" / "step_3" / absl::StrCat("rank_", stage);
    EXPECT_TRUE(fs::exists(shard / "optimizer-0-of-2.safetensors")) << shard;
    EXPECT_TRUE(fs::exists(shard / "optimizer-1-of-2.safetensors")) << shard;
    EXPECT_FALSE(fs::exists(shard / "optimizer.safetensors")) << shard;
  }
  // Resumed without ZeRO (each rank reads the whole state from the ranges), and with it at
  // other replica counts (each reads only its new range, whose bounds cut the saved pieces).
  for (const auto& [name, data, pipeline, microbatches, zero] :
       {std::tuple{"resume_d1p2", 1, 2, 8, 0}, std::tuple{"resume_d4p1", 4, 1, 2, 0},
        std::tuple{"resume_d1p4", 1, 4, 8, 0}, std::tuple{"resume_d4p1_zero", 4, 1, 2, 1},
        std::tuple{"resume_d2p2_zero", 2, 2, 4, 1}, std::tuple{"resume_d4p2_zero", 4, 2, 2, 1}}) {
    Job part = full;
    part.name = name;
    r = Run(part, "--steps 1");
    ASSERT_EQ(r.code, 0) << r.output;
    Job resumed = part;
    resumed.data = data;
    resumed.pipeline = pipeline;
    resumed.microbatches = microbatches;
    resumed.zero = zero;
    r = Run(resumed, "--resume");
    ASSERT_EQ(r.code, 0) << name << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("step 2/3")) << name;
    ExpectMatches(name, "resume_full");
  }
}

// Tensor parallelism in worker processes: t = 2 × p = 2 (4 processes) trains like one process
// (losses, grad norms, the merged weights), and its checkpoint resumes at (1, 1, 2); a
// (1, 1, 2) checkpoint resumes at (1, 2, 2).
TEST_F(DataParallelTest, TensorRanksMatchOneProcessAndResumeAtOtherShapes) {
  const Job tp{.name = "t2p2", .pipeline = 2, .microbatches = 8, .tensor = 2};
  auto r = Run(tp);
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectMatches(tp.name, "reference");
  for (int shard = 0; shard < 4; ++shard) {
    EXPECT_TRUE(
        fs::exists(dir_ / tp.name / "step_3" / absl::StrCat("rank_", shard) / "MANIFEST.json"))
        << shard;
  }
  auto lines = ReadJsonl(dir_ / tp.name / "metrics.jsonl");
  ASSERT_EQ(lines.back()["stages"].size(), 4u);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(int(lines.back()["stages"][rank]["stage"]), rank / 2);
    EXPECT_EQ(int(lines.back()["stages"][rank]["tensor"]), rank % 2);
  }
  // init_from at t = 2: each tensor rank cuts its slices from the whole Hugging Face tensors,
  // so the initial model (steps: 0 saves it) is the reference's final one.
  Job init{.name = "t2p2_init", .pipeline = 2, .microbatches = 8, .tensor = 2};
  init.steps = 0;
  init.init_from = (dir_ / "reference" / "step_3").string();
  r = Run(init);
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectSameWeights(dir_ / init.name / "step_0" / "model.safetensors",
                    dir_ / "reference" / "step_3" / "model.safetensors", 0);
  for (const auto& [name, from_t, to_t] :
       {std::tuple{"resume_t2_to_t1", 2, 1}, std::tuple{"resume_t1_to_t2", 1, 2}}) {
    Job part{.name = name, .pipeline = 2, .microbatches = 8, .tensor = from_t};
    part.every = 1;
    r = Run(part, "--steps 1");
    ASSERT_EQ(r.code, 0) << r.output;
    Job resumed = part;
    resumed.tensor = to_t;
    r = Run(resumed, "--resume");
    ASSERT_EQ(r.code, 0) << name << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("step 2/3")) << name;
    ExpectMatches(name, "reference");
  }
}

}  // namespace
