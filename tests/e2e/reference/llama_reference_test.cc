// Proves `vocabpipe run` trains a Llama model exactly like an independent PyTorch Llama
// (llama_reference.py beside this test: Debian's python3-torch, float64, written from the
// published equations): the step-0 loss, every parameter gradient, the losses of 5 AdamW steps
// and the weights after them; for multi-head and grouped-query attention, tied and untied
// embeddings, an odd vocabulary, and a 2-stage Seq1F1B run with k = 3 sequence chunks (whose
// step-0 gradients, gathered from the two pipeline ranks, are compared with PyTorch's directly).
// It also checks that the exported checkpoint (LlamaForCausalLM layout) gives the reference's
// logits when loaded by the PyTorch model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/gloo_threads.h"
#include "tests/support/token_stream.h"
#include "tests/support/training_fixtures.h"
#include "tests/support/vocabpipe_cli.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/pipeline_rank.h"
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
  // A pipeline case: the run's parallel settings, beside b and m (p = 1: standalone).
  int pipeline = 1;
  planner::Schedule schedule = planner::Schedule::k1F1B;
  int seq_chunks = 1;
  planner::VocabMethod vocab_method = planner::VocabMethod::kVocab2;
};

// The spec's parallel block beyond b and m.
std::string Parallel(const Case& c) {
  if (c.pipeline == 1) return "";
  return absl::StrCat(", pipeline: ", c.pipeline, ", schedule: ", planner::ScheduleName(c.schedule),
                      ", seq_chunks: ", c.seq_chunks,
                      ", vocab: ", planner::VocabName(c.vocab_method));
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int kLayers = 2, kHidden = 32, kHeads = 4, kSeq = 12, kFfn = 40, kB = 2, kM = 2;
constexpr int kSteps = 5;
constexpr uint64_t kSeed = 7;

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
  vp::testing::WriteUint16TokenFile((dir / "data.bin").string(), tokens);

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
  const BatchFn batches = vp::testing::StreamBatches(tokens, kB, kM, kSeq);
  // Logits of step 0's first microbatch: the engine's forward on the loaded checkpoint (input
  // layer, layer stack, final RMSNorm, x · lm_headᵀ) against PyTorch's on the same folder.
  {
    std::vector<int32_t> in(kB * kSeq), tgt(kB * kSeq);
    ASSERT_TRUE(batches(0, 0, in.data(), tgt.data()).ok());
    const int n = kB * kSeq;
    auto self = comm::MakeSelfCommunicator();
    auto emb = model.input_layer().Forward(in.data(), n);
    ASSERT_TRUE(emb.ok()) << emb.status();
    ASSERT_TRUE(model.input_layer().ForwardReduce(*emb, *self).ok());
    std::vector<float> x(static_cast<size_t>(n) * kHidden), xn(x.size()), rstd(n);
    ASSERT_TRUE(model.stack(0).Forward({0, 0}, emb->output(), x.data()).ok());
    model.stack(0).DiscardMicrobatch(0);
    engine::cpu::RmsNormForward(xn.data(), rstd.data(), x.data(), model.lnf_weight(), n, kHidden,
                                opt.model.rms_eps);
    const engine::ParamTensor* head =
        model.Find(c.tied ? "model.embed_tokens.weight" : "lm_head.weight");
    ASSERT_NE(head, nullptr);
    std::vector<float> logits(static_cast<size_t>(n) * c.vocab);
    engine::cpu::Gemm(false, true, n, c.vocab, kHidden, 1.0f, xn.data(), kHidden,
                      model.params() + head->offset, kHidden, 0.0f, logits.data(), c.vocab);
    const Tensor& want = ref->tensors.at("logits");
    ASSERT_EQ(want.data.size(), logits.size());
    auto [worst, scale] = Worst(logits.data(), want);
    EXPECT_LE(worst, 1e-5 * scale + 1e-6) << "logits (largest " << scale << ")";
  }

  auto loss0 = (*trainer)->ComputeGradients(0, batches);
  ASSERT_TRUE(loss0.ok()) << loss0.status();
  EXPECT_NEAR(*loss0, ref->tensors.at("loss.0").data[0], 1e-5 * *loss0);
  for (const engine::ParamTensor& t : model.tensors()) {
    const Tensor& g = ref->tensors.at("grad." + t.name);
    ASSERT_EQ(static_cast<size_t>(g.numel()), t.valid_rows * (t.count() / t.shape[0])) << t.name;
    auto [worst, scale] = Worst(model.grads() + t.offset, g);
    EXPECT_LE(worst, 1e-4 * scale + 1e-8) << "gradient of " << t.name;
  }

  // A pipeline case's step-0 gradients straight from its ranks: p ranks as threads over Gloo,
  // each rank's slice started from the same checkpoint, one step of the case's plan, then every
  // rank's gradients gathered by tensor name (vocabulary shards put back at their global rows)
  // and compared with PyTorch's. The step's optimizer update comes after the gradients and
  // leaves them in place (grad_clip is 0, so they are not scaled).
  if (c.pipeline > 1) {
    auto plan = fixtures::PlanFor(c.schedule, c.vocab_method, c.pipeline, c.seq_chunks, opt);
    ASSERT_TRUE(plan.ok()) << plan.status();
    fixtures::Weights grads;
    std::mutex mu;
    std::vector<std::string> errors(c.pipeline);
    std::vector<RankStepResult> results(c.pipeline);
    comm::testing::RunOnGlooRanks(c.pipeline, [&](comm::GlooCommunicator& comm) {
      const int r = comm.rank();
      auto rank = PipelineRank::Create(*plan, r, opt, &comm);
      if (!rank.ok()) {
        errors[r] = rank.status().ToString();
        return;
      }
      if (auto st = InitFromHfDir(init, (*rank)->model()); !st.ok()) {
        errors[r] = st.ToString();
        return;
      }
      auto step = (*rank)->Step(0, batches);
      if (!step.ok()) {
        errors[r] = step.status().ToString();
        return;
      }
      results[r] = *step;
      fixtures::GatherBuffer((*rank)->model(), (*rank)->model().grads(), 1.0f, &grads, &mu);
    });
    for (int r = 0; r < c.pipeline; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    const RankStepResult& owner = results[plan->x_owner];
    ASSERT_TRUE(owner.has_loss);
    EXPECT_NEAR(owner.loss, ref->tensors.at("loss.0").data[0], 1e-5 * owner.loss);
    for (const engine::ParamTensor& t : model.tensors()) {
      auto it = grads.find(t.name);
      ASSERT_NE(it, grads.end()) << t.name << " is on no pipeline rank";
      const Tensor& g = ref->tensors.at("grad." + t.name);
      ASSERT_EQ(it->second.size(), static_cast<size_t>(g.numel())) << t.name;
      auto [worst, scale] = Worst(it->second.data(), g);
      EXPECT_LE(worst, 1e-4 * scale + 1e-8) << "pipeline gradient of " << t.name;
    }
  }

  // The run: 5 AdamW steps under the case's parallel settings.
  std::ofstream(dir / "run.yaml") << Spec(c, Parallel(c), kSteps, "run");
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
    ::testing::Values(Case{"mha_untied", 4, false, 64}, Case{"gqa_untied_oddV", 2, false, 67},
                      Case{"gqa_tied", 2, true, 64}, Case{"mqa_tied_oddV", 1, true, 67},
                      // Two pipeline ranks, Seq1F1B, each sequence in 3 chunks of 4 tokens.
                      Case{"gqa_seq1f1b_k3_p2", 2, false, 67, 2, planner::Schedule::kSeq1F1B, 3,
                           planner::VocabMethod::kVocab2}),
    CaseName);

// model.init_from: a Hugging Face LlamaForCausalLM folder written here (names, shapes and
// config.json as Hugging Face writes them, random weights) starts a 2-rank vocab2 run; the run
// reproduces the PyTorch reference started from the same folder, and its exported step_0
// equals the folder's tensors. Then the checks: a wrong shape, a wrong size in config.json, a
// missing tensor and the wrong architecture are refused naming the tensor or key.
class InitFromTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("vp_init_from_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "hf");
    std::mt19937 rng(9);
    std::vector<uint16_t> tokens(900);
    for (auto& t : tokens) t = static_cast<uint16_t>(rng() % kVocab);
    vp::testing::WriteUint16TokenFile((dir_ / "data.bin").string(), tokens);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes hf/ with every LlamaForCausalLM tensor (kv_heads 2, untied), `skip` left out and
  // `bad` given one row too many.
  void WriteHf(const std::string& skip = "", const std::string& bad = "",
               int config_layers = kLayers) {
    const int64_t h = kHidden, kv = 2 * (kHidden / kHeads), f = kFfn;
    std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
        {"model.embed_tokens.weight", {kVocab, h}},
        {"model.norm.weight", {h}},
        {"lm_head.weight", {kVocab, h}}};
    for (int l = 0; l < kLayers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      for (auto& [n, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
               {"input_layernorm.weight", {h}},
               {"self_attn.q_proj.weight", {h, h}},
               {"self_attn.k_proj.weight", {kv, h}},
               {"self_attn.v_proj.weight", {kv, h}},
               {"self_attn.o_proj.weight", {h, h}},
               {"post_attention_layernorm.weight", {h}},
               {"mlp.gate_proj.weight", {f, h}},
               {"mlp.up_proj.weight", {f, h}},
               {"mlp.down_proj.weight", {h, f}}}) {
        specs.push_back({p + n, shape});
      }
    }
    std::mt19937 rng(21);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    data_.clear();
    std::vector<TensorView> views;
    for (auto& [name, shape] : specs) {
      if (name == skip) continue;
      if (name == bad) shape[0] += 1;
      size_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<float>& v = data_[name];
      v.resize(n);
      for (float& x : v) x = shape.size() == 1 ? 1.0f + normal(rng) : normal(rng);
    }
    for (auto& [name, shape] : specs) {
      if (name != skip) views.push_back({name, shape, data_[name].data()});
    }
    ASSERT_TRUE(WriteSafetensors((dir_ / "hf" / "model.safetensors").string(), views, {}).ok());
    std::ofstream(dir_ / "hf" / "config.json") << absl::StrCat(
        R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": )",
        kHidden, R"(, "intermediate_size": )", kFfn, R"(, "num_hidden_layers": )", config_layers,
        R"(, "num_attention_heads": )", kHeads, R"(, "num_key_value_heads": 2, "vocab_size": )",
        kVocab, R"(, "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500.0,)",
        R"( "tie_word_embeddings": false, "torch_dtype": "float32"})");
  }

  vp::testing::CliResult Run(const std::string& parallel, int steps, const std::string& run,
                             const std::string& arch = "llama") {
    const fs::path spec = dir_ / (run + ".yaml");
    std::ofstream(spec) << absl::StrCat(
        "model: {architecture: ", arch, ", layers: ", kLayers, ", hidden: ", kHidden,
        ", heads: ", kHeads, arch == "llama" ? ", kv_heads: 2, rope_theta: 500" : "",
        ", vocab_size: ", kVocab, ", seq_len: ", kSeq, ", ffn_hidden: ", kFfn, ", init_from: hf}\n",
        "parallel: {microbatch_size: ", kB, ", microbatches: ", kM, parallel, "}\n",
        "train: {steps: ", steps,
        ", lr: 0.001, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1.0e-8}\n",
        "data: {path: data.bin}\ncheckpoint: {dir: ", run, "}\n");
    return vp::testing::Vocabpipe("run --direct " + spec.string());
  }

  static constexpr int kVocab = 67;
  fs::path dir_;
  std::map<std::string, std::vector<float>> data_;
};

TEST_F(InitFromTest, HuggingFaceFolderStartsAPipelineRunThatMatchesPyTorch) {
  WriteHf();
  // Exported as loaded: step_0 holds exactly the folder's tensors.
  vp::testing::CliResult r = Run("", 0, "init");
  ASSERT_EQ(r.code, 0) << r.output;
  auto init = ReadSafetensors(
      (fs::path(CheckpointDir((dir_ / "init").string(), 0)) / "model.safetensors").string());
  ASSERT_TRUE(init.ok()) << init.status();
  ASSERT_EQ(init->tensors.size(), data_.size());
  for (const auto& [name, v] : data_) EXPECT_EQ(init->tensors.at(name).data, v) << name;

  // Two ranks (vocabulary shards sliced from the [V, h] tensors), 3 steps, against PyTorch.
  r = Run(", pipeline: 2, schedule: 1f1b, vocab: vocab2", 3, "run");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string ref_path = (dir_ / "ref.safetensors").string();
  const std::string cmd = absl::StrCat(
      "/usr/bin/python3 ", VP_SOURCE_DIR, "/tests/e2e/reference/llama_reference.py --checkpoint ",
      (dir_ / "hf").string(), " --data ", (dir_ / "data.bin").string(), " --out ", ref_path,
      " --steps 3 --seq-len ", kSeq, " --microbatch-size ", kB, " --microbatches ", kM,
      " --lr 1e-3 --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto ref = ReadSafetensors(ref_path);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto metrics = vp::testing::ReadJsonl(dir_ / "run" / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 3u);
  for (int step = 0; step < 3; ++step) {
    const double want = ref->tensors.at(absl::StrCat("loss.", step)).data[0];
    EXPECT_NEAR(double(metrics[step]["loss"]), want, 1e-5 * want) << "step " << step;
  }
}

TEST_F(InitFromTest, Gpt2FolderIsAcceptedToo) {
  // A GPT2LMHeadModel folder (a step_0 export, seed 1) starts a run with another seed (2): the
  // new run's step_0 is the folder's weights, not its own init.
  auto spec = [&](const std::string& run, int seed, const std::string& init) {
    const fs::path path = dir_ / (run + ".yaml");
    std::ofstream(path) << absl::StrCat(
        "model: {layers: 2, hidden: 32, heads: 4, vocab_size: ", kVocab, ", seq_len: ", kSeq,
        init.empty() ? "" : ", init_from: " + init, "}\n",
        "parallel: {microbatch_size: 2, microbatches: 2}\ntrain: {steps: 0, seed: ", seed,
        "}\ndata: {path: data.bin}\ncheckpoint: {dir: ", run, "}\n");
    return vp::testing::Vocabpipe("run --direct " + path.string());
  };
  vp::testing::CliResult r = spec("a", 1, "");
  ASSERT_EQ(r.code, 0) << r.output;
  r = spec("b", 2, "a/step_0");
  ASSERT_EQ(r.code, 0) << r.output;
  r = spec("c", 2, "");
  ASSERT_EQ(r.code, 0) << r.output;
  auto read = [&](const char* run) {
    return ReadSafetensors((dir_ / run / "step_0" / "model.safetensors").string());
  };
  auto a = read("a"), b = read("b"), c = read("c");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_EQ(a->tensors.size(), b->tensors.size());
  for (const auto& [name, t] : a->tensors) EXPECT_EQ(b->tensors.at(name).data, t.data) << name;
  EXPECT_NE(c->tensors.at("transformer.wte.weight").data,
            a->tensors.at("transformer.wte.weight").data);  // the seeds do differ
}

TEST_F(InitFromTest, RefusesFoldersThatDoNotFitTheModel) {
  WriteHf("", "model.layers.1.self_attn.k_proj.weight");
  vp::testing::CliResult r = Run("", 1, "bad_shape");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("model.init_from: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.layers.1.self_attn.k_proj.weight"), std::string::npos) << r.output;

  WriteHf("model.norm.weight");
  r = Run("", 1, "missing");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("tensor model.norm.weight is missing"), std::string::npos) << r.output;

  WriteHf("", "", kLayers + 1);
  r = Run("", 1, "config");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("num_hidden_layers is 3 but model.layers is 2"), std::string::npos)
      << r.output;

  WriteHf();
  r = Run("", 1, "arch", "gpt2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("model_type must be \"gpt2\" to match model.architecture"),
            std::string::npos)
      << r.output;
  // Nothing was trained from a refused folder.
  EXPECT_FALSE(fs::exists(dir_ / "bad_shape" / "step_1"));
}

}  // namespace
}  // namespace vp::runtime
