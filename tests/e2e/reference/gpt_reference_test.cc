// Proves the standalone engine equals an independent PyTorch GPT-2 (Debian's python3-torch,
// float64): the step-0 loss and every parameter gradient, then the losses and final weights of
// a few AdamW steps, for tied/untied embeddings, both vocabulary algorithms, with and without
// clipping and with a V that needs padding; and once from a checkpoint in Hugging Face's sharded
// form (model-0000k-of-00003.safetensors + model.safetensors.index.json).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/token_stream.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/safetensors.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

namespace fs = std::filesystem;
using engine::vocab::OutputAlgorithm;

struct Case {
  std::string name;
  bool tied;
  OutputAlgorithm algorithm;
  float grad_clip;
  int vocab;
  bool sharded = false;  // the checkpoint in Hugging Face's sharded form (3 files + index)
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

class GptReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(GptReferenceTest, MatchesPyTorch) {
  if (!fs::exists("/usr/bin/python3")) GTEST_FAIL() << "/usr/bin/python3 missing (make deps)";
  const Case& c = GetParam();
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("vp_gpt_ref_", c.name, "_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);

  TrainerOptions opt;
  opt.model = {.layers = 2,
               .hidden = 32,
               .heads = 4,
               .vocab = c.vocab,
               .seq_len = 16,
               .ffn_hidden = 128,
               .tie_embeddings = c.tied};
  opt.microbatch_size = 2;
  opt.microbatches = 2;
  opt.algorithm = c.algorithm;
  opt.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  opt.lr = {.lr = 1e-3f, .min_lr = 0.0f, .warmup_steps = 0, .total_steps = 3, .cosine = false};
  opt.grad_clip = c.grad_clip;
  opt.seed = 7;
  constexpr int kSteps = 3;

  std::mt19937 rng(3);
  std::vector<uint16_t> tokens(700);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % c.vocab);
  const std::string data = (dir / "data.bin").string();
  vp::testing::WriteUint16TokenFile(data, tokens);
  const int b = opt.microbatch_size, m = opt.microbatches;
  const BatchFn batches = vp::testing::StreamBatches(tokens, b, m, opt.model.seq_len);

  auto trainer = StandaloneTrainer::Create(opt);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  ASSERT_TRUE(SaveCheckpoint(dir.string(), 0, (*trainer)->model(), (*trainer)->optimizer()).ok());
  if (c.sharded) {
    // The same checkpoint split into exactly 3 files: the smallest limit (in steps of a 24th of
    // the model) that gives 3. The reference reads the index and its files.
    const fs::path step_dir = CheckpointDir(dir.string(), 0);
    const int64_t total = static_cast<int64_t>(fs::file_size(step_dir / "model.safetensors"));
    int files = 0;
    for (int k = 8; k < 24 && files != 3; ++k) {
      ASSERT_TRUE(SaveCheckpoint(dir.string(), 0, (*trainer)->model(), (*trainer)->optimizer(),
                                 total * k / 24)
                      .ok());
      files = 0;
      for (const auto& e : fs::directory_iterator(step_dir)) {
        files += IsHfShardFileName(e.path().filename().string()) ? 1 : 0;
      }
    }
    ASSERT_EQ(files, 3);
    ASSERT_TRUE(fs::exists(step_dir / kHfIndexFile));
    ASSERT_FALSE(fs::exists(step_dir / "model.safetensors"));
  }

  const std::string out = (dir / "ref.safetensors").string();
  const std::string cmd = absl::StrCat(
      "/usr/bin/python3 ", VP_SOURCE_DIR, "/tests/e2e/reference/gpt2_reference.py --checkpoint ",
      CheckpointDir(dir.string(), 0), " --data ", data, " --out ", out, " --steps ", kSteps,
      " --microbatch-size ", b, " --microbatches ", m, " --lr 1e-3 --weight-decay 0.1",
      " --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip ", c.grad_clip);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto ref = ReadSafetensors(out);
  ASSERT_TRUE(ref.ok()) << ref.status();

  // Step 0: loss and every gradient.
  auto loss0 = (*trainer)->ComputeGradients(0, batches);
  ASSERT_TRUE(loss0.ok()) << loss0.status();
  EXPECT_NEAR(*loss0, ref->tensors.at("loss.0").data[0], 1e-5 * std::abs(*loss0));
  engine::RankModel& model = (*trainer)->model();
  for (const engine::ParamTensor& t : model.tensors()) {
    const Tensor& g = ref->tensors.at("grad." + t.name);
    const size_t count = static_cast<size_t>(t.valid_rows) * (t.count() / t.shape[0]);
    ASSERT_EQ(static_cast<size_t>(g.numel()), count) << t.name;
    float scale = 0;
    for (float x : g.data) scale = std::max(scale, std::abs(x));
    double worst = 0;
    for (size_t i = 0; i < count; ++i) {
      worst = std::max(worst, std::abs(double(model.grads()[t.offset + i]) - g.data[i]));
    }
    EXPECT_LE(worst, 1e-4 * scale + 1e-8) << "gradient of " << t.name;
  }

  // kSteps of AdamW: per-step losses and the final weights.
  for (int step = 0; step < kSteps; ++step) {
    auto r = (*trainer)->Step(step, batches);
    ASSERT_TRUE(r.ok()) << r.status();
    const double want = ref->tensors.at(absl::StrCat("loss.", step)).data[0];
    EXPECT_NEAR(r->loss, want, 1e-5 * want) << "step " << step;
  }
  for (const engine::ParamTensor& t : model.tensors()) {
    const Tensor& w = ref->tensors.at("final." + t.name);
    double worst = 0;
    for (size_t i = 0; i < static_cast<size_t>(w.numel()); ++i) {
      worst = std::max(worst, std::abs(double(model.params()[t.offset + i]) - w.data[i]));
    }
    // Three Adam steps of lr 1e-3 move a weight by at most ~3e-3; agreement to 2e-5 means the
    // updates agree to about 1%, even for near-zero gradients where Adam's m/√v is touchy.
    EXPECT_LE(worst, 2e-5) << "final " << t.name;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Standalone, GptReferenceTest,
    ::testing::Values(Case{"untied_vocab2", false, OutputAlgorithm::kAlgorithm2, 0.0f, 64},
                      Case{"tied_vocab2", true, OutputAlgorithm::kAlgorithm2, 0.0f, 64},
                      Case{"untied_vocab1_clip_oddV", false, OutputAlgorithm::kAlgorithm1, 0.05f,
                           67},
                      Case{"tied_vocab1_oddV", true, OutputAlgorithm::kAlgorithm1, 0.0f, 67},
                      Case{"untied_vocab2_sharded", false, OutputAlgorithm::kAlgorithm2, 0.0f, 64,
                           /*sharded=*/true}),
    CaseName);

}  // namespace
}  // namespace vp::runtime
