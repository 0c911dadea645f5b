// Greedy decoding (temperature 0) of a saved checkpoint equals an independent PyTorch GPT-2 or
// Llama (gpt2_sample_reference.py / llama_sample_reference.py, Debian's python3-torch, float64,
// full recompute of the prefix at every token; Llama with grouped-query attention): the first
// logits agree, and so does every picked token as long as the reference's best logit leads the
// second by more than float32 rounding can move it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/sampler.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

namespace fs = std::filesystem;

// (tied embeddings, llama)
class SampleReference : public testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(SampleReference, GreedyTokensMatchPyTorch) {
  if (!fs::exists("/usr/bin/python3")) GTEST_FAIL() << "/usr/bin/python3 missing (make deps)";
  const auto [tied, llama] = GetParam();
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("vp_sample_ref_", tied, "_", llama, "_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);

  TrainerOptions opt;
  opt.model = {.layers = 2,
               .hidden = 32,
               .heads = 4,
               .vocab = 53,
               .seq_len = 32,
               .ffn_hidden = 128,
               .tie_embeddings = tied};
  if (llama) {
    opt.model.architecture = engine::Architecture::kLlama;
    opt.model.kv_heads = 2;  // grouped-query attention: 2 query heads per key/value head
    opt.model.rope_theta = 1000.0f;
  }
  opt.microbatch_size = 2;
  opt.microbatches = 1;
  opt.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f};
  opt.lr = {.lr = 3e-3f, .min_lr = 3e-3f, .warmup_steps = 0, .total_steps = 40, .cosine = false};
  opt.seed = 9;
  auto trainer = StandaloneTrainer::Create(opt);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  // Training on a pattern (token i is followed by 5i + 1 mod V) makes the argmax clear.
  const int n = opt.microbatch_size * opt.model.seq_len, V = opt.model.vocab;
  BatchFn batches = [n, V](int64_t step, int, int32_t* in, int32_t* tg) {
    int32_t x = static_cast<int32_t>(step % V);
    for (int i = 0; i < n; ++i) {
      in[i] = x;
      x = (5 * x + 1) % V;
      tg[i] = x;
    }
    return absl::OkStatus();
  };
  for (int step = 0; step < 40; ++step) ASSERT_TRUE((*trainer)->Step(step, batches).ok());
  ASSERT_TRUE(SaveCheckpoint(dir.string(), 40, (*trainer)->model(), (*trainer)->optimizer()).ok());
  const std::string step_dir = CheckpointDir(dir.string(), 40);

  const std::vector<int32_t> prompt = {3, 16, 28};
  constexpr int kTokens = 12;
  const std::string out = (dir / "ref.json").string();
  const std::string cmd =
      absl::StrCat("/usr/bin/python3 ", VP_SOURCE_DIR, "/tests/e2e/reference/",
                   llama ? "llama" : "gpt2", "_sample_reference.py --checkpoint ", step_dir,
                   " --prompt ", absl::StrJoin(prompt, ","), " --tokens ", kTokens, " --out ", out);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  const nlohmann::json ref = nlohmann::json::parse(f);

  auto decoder = LoadDecoder(step_dir);
  ASSERT_TRUE(decoder.ok()) << decoder.status();
  std::vector<float> logits(V);
  ASSERT_TRUE((*decoder)->Append(prompt, logits.data()).ok());
  for (int v = 0; v < V; ++v) {
    const double want = ref["logits"][v].get<double>();
    EXPECT_NEAR(logits[v], want, 1e-4 * std::max(1.0, std::abs(want))) << "logit " << v;
  }

  auto got = Generate(**decoder, prompt, {.max_tokens = kTokens, .temperature = 0.0f});
  ASSERT_TRUE(got.ok()) << got.status();
  int compared = 0;
  for (int i = 0; i < kTokens; ++i) {
    EXPECT_EQ((*got)[i], ref["tokens"][i].get<int>()) << "token " << i;
    ++compared;
    // A near-tie may legitimately go either way in float32; what follows it is not compared.
    if (ref["margins"][i].get<double>() < 1e-3) break;
  }
  EXPECT_GE(compared, 6) << "the reference's argmax was too close to call too early";
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(EmbeddingsAndArchitectures, SampleReference,
                         testing::Combine(testing::Bool(), testing::Bool()));

}  // namespace
}  // namespace vp::runtime
