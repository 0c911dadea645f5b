// Proves `vocabpipe run` trains a Llama model exactly like an independent PyTorch Llama
// (llama_reference.py beside this test: Debian's python3-torch, float64, written from the
// published equations): the step-0 loss, every parameter gradient, the losses of 5 AdamW steps
// and the weights after them; for multi-head and grouped-query attention, tied and untied
// embeddings, an odd vocabulary, and a 2-stage Seq1F1B run with k = 3 sequence chunks.
// It also checks that the exported checkpoint (LlamaForCausalLM layout) gives the reference's
// logits when loaded by the PyTorch model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/safetensors.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;
  int kv_heads;
  bool tied;
  int vocab;
  std::string parallel;  // the spec's parallel block beyond b and m
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

constexpr int kLayers = 2, kHidden = 32, kHeads = 4, kSeq = 12, kFfn = 40, kB = 2, kM = 2;
constexpr int kSteps = 5;
constexpr uint64_t kSeed = 7;

void WriteTokens(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
}

std::string Spec(const Case& c, const std::string& parallel, int steps, const std::string& run) {
  return absl::StrCat(
      "model: {architecture: llama, layers: ", kLayers, ", hidden: ", kHidden, ", heads: ", kHeads,
      ", kv_heads: ", c.kv_heads, ", vocab_size: ", c.vocab, ", seq_len: ", kSeq,
      ", ffn_hidden: ", kFfn, ", tie_embeddings: ", c.tied ? "true" : "false",
      ", rope_theta: 500}\n",  // a small base: every rotary pair turns within 12 positions
      "parallel: {microbatch_size: ", kB, ", microbatches: ", kM, parallel, "}\n",
      "train: {steps: ", steps, ", lr: 0.001, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, ",
      "eps: 1.0e-8, seed: ", kSeed, "}\n", "data: {path: data.bin}\n", "checkpoint: {dir: ", run,
      "}\n");
}

// max |a - b| over a tensor, and the largest |b| (the scale tolerances are relative to).
std::pair<double, double> Worst(const float* a, const Tensor& b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < b.data.size(); ++i) {
    worst = std::max(worst, std::abs(double(a[i]) - b.data[i]));
    scale = std::max(scale, std::abs(double(b.data[i])));
  }
  return {worst, scale};
}

class LlamaReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaReferenceTest, VocabpipeRunMatchesPyTorch) {
  if (!fs::exists("/usr/bin/python3")) GTEST_FAIL() << "/usr/bin/python3 missing (make deps)";
  const Case& c = GetParam();
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("vp_llama_ref_", c.name, "_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::mt19937 rng(3);
  std::vector<uint16_t> tokens(900);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % c.vocab);
  WriteTokens((dir / "data.bin").string(), tokens);

  // The initial weights, as `vocabpipe run` exports them (steps: 0).
  std::ofstream(dir / "init.yaml") << Spec(c, "", 0, "init");
  vp::testing::CliResult r = vp::testing::Vocabpipe("run --direct " + (dir / "init.yaml").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string init = CheckpointDir((dir / "init").string(), 0);
  std::ifstream config_file(fs::path(init) / "config.json");
  const std::string config((std::istreambuf_iterator<char>(config_file)), {});
  EXPECT_NE(config.find("\"LlamaForCausalLM\""), std::string::npos) << config;
  EXPECT_NE(config.find(absl::StrCat("\"num_key_value_heads\": ", c.kv_heads)), std::string::npos);

  const std::string ref_path = (dir / "ref.safetensors").string();
  const std::string cmd = absl::StrCat(
      "/usr/bin/python3 ", VP_SOURCE_DIR, "/tests/e2e/reference/llama_reference.py --checkpoint ",
      init, " --data ", (dir / "data.bin").string(), " --out ", ref_path, " --steps ", kSteps,
      " --microbatch-size ", kB, " --microbatches ", kM,
      " --lr 1e-3 --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto ref = ReadSafetensors(ref_path);
  ASSERT_TRUE(ref.ok()) << ref.status();

  // Every step-0 gradient: the engine's model loaded from that checkpoint, one step's
  // gradients (the run itself does not export gradients).
  TrainerOptions opt;
  opt.model = {.layers = kLayers,
               .hidden = kHidden,
               .heads = kHeads,
               .vocab = c.vocab,
               .seq_len = kSeq,
               .ffn_hidden = kFfn,
               .tie_embeddings = c.tied,
               .architecture = engine::Architecture::kLlama,
               .kv_heads = c.kv_heads,
               .rms_eps = 1e-5f,
               .rope_theta = 500.0f};
  opt.microbatch_size = kB;
  opt.microbatches = kM;
  opt.seed = kSeed;
  auto trainer = StandaloneTrainer::Create(opt);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  engine::RankModel& model = (*trainer)->model();
  ASSERT_TRUE(LoadCheckpoint(init, model, nullptr).ok());
  BatchFn batches = [&](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < kB; ++t) {
      const int64_t k = (step * kM + j) * kB + t;
      for (int i = 0; i < kSeq; ++i) {
        inputs[t * kSeq + i] = tokens[(k * kSeq + i) % tokens.size()];
        targets[t * kSeq + i] = tokens[(k * kSeq + i + 1) % tokens.size()];
      }
    }
    return absl::OkStatus();
  };
  auto loss0 = (*trainer)->ComputeGradients(0, batches);
  ASSERT_TRUE(loss0.ok()) << loss0.status();
  EXPECT_NEAR(*loss0, ref->tensors.at("loss.0").data[0], 1e-5 * *loss0);
  for (const engine::ParamTensor& t : model.tensors()) {
    const Tensor& g = ref->tensors.at("grad." + t.name);
    ASSERT_EQ(static_cast<size_t>(g.numel()), t.valid_rows * (t.count() / t.shape[0])) << t.name;
    auto [worst, scale] = Worst(model.grads() + t.offset, g);
    EXPECT_LE(worst, 1e-4 * scale + 1e-8) << "gradient of " << t.name;
  }

  // The run: 5 AdamW steps under the case's parallel settings.
  std::ofstream(dir / "run.yaml") << Spec(c, c.parallel, kSteps, "run");
  r = vp::testing::Vocabpipe("run --direct " + (dir / "run.yaml").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const auto metrics = vp::testing::ReadJsonl(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), static_cast<size_t>(kSteps));
  for (int step = 0; step < kSteps; ++step) {
    const double want = ref->tensors.at(absl::StrCat("loss.", step)).data[0];
    EXPECT_NEAR(double(metrics[step]["loss"]), want, 1e-5 * want) << "step " << step;
  }
  auto final_weights = ReadSafetensors(
      (fs::path(CheckpointDir((dir / "run").string(), kSteps)) / "model.safetensors").string());
  ASSERT_TRUE(final_weights.ok()) << final_weights.status();
  for (const auto& [name, w] : final_weights->tensors) {
    if (c.tied && name == "lm_head.weight") continue;  // wte's data under HF's second name
    auto it = ref->tensors.find("final." + name);
    ASSERT_NE(it, ref->tensors.end()) << name << " is not a LlamaForCausalLM tensor";
    auto [worst, scale] = Worst(w.data.data(), it->second);
    // 5 Adam steps of lr 1e-3 move a weight by at most ~5e-3; 3e-5 is agreement of the
    // updates to better than 1%.
    EXPECT_LE(worst, 3e-5) << "final " << name;
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Standalone, LlamaReferenceTest,
    ::testing::Values(Case{"mha_untied", 4, false, 64, ""}, Case{"gqa_untied_oddV", 2, false, 67, ""},
                    Case{"gqa_tied", 2, true, 64, ""}, Case{"mqa_tied_oddV", 1, true, 67, ""},
                    // Two pipeline ranks, Seq1F1B, each sequence in 3 chunks of 4 tokens.
                    Case{"gqa_seq1f1b_k3_p2", 2, false, 67,
                         ", pipeline: 2, schedule: seq1f1b, seq_chunks: 3, vocab: vocab2"}),
    CaseName);

}  // namespace
}  // namespace vp::runtime
