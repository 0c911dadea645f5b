// The sampler: the GPT-2 and Llama decoders' key/value cache (Llama: rotated keys of 2 key/value
// heads for 4 query heads) gives the logits a full recompute of the
// prefix gives; a fixed seed reproduces a sample; temperature 0 and top-k pick what they
// promise; bad options and a too-long sample are refused naming the flag.
#include "worker/runtime/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <tuple>
#include <vector>

#include "worker/runtime/checkpoint.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {
namespace {

using ::testing::HasSubstr;

TrainerOptions Options(bool tied, bool llama = false) {
  TrainerOptions o;
  o.model = {.layers = 2,
             .hidden = 32,
             .heads = 4,
             .vocab = 37,
             .seq_len = 24,
             .ffn_hidden = 64,
             .tie_embeddings = tied};
  if (llama) {
    o.model.architecture = engine::Architecture::kLlama;
    o.model.kv_heads = 2;  // grouped-query attention: 2 query heads per key/value head
    o.model.rope_theta = 500.0f;
  }
  o.microbatch_size = 2;
  o.microbatches = 1;
  o.adamw = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f};
  o.lr = {.lr = 3e-3f, .min_lr = 3e-3f, .warmup_steps = 0, .total_steps = 100, .cosine = false};
  o.seed = 3;
  return o;
}

// A model trained a little on a repeating pattern, so its predictions are not uniform.
std::unique_ptr<StandaloneTrainer> Trained(bool tied, int steps, bool llama = false) {
  const TrainerOptions o = Options(tied, llama);
  auto t = StandaloneTrainer::Create(o);
  EXPECT_TRUE(t.ok());
  const int n = o.microbatch_size * o.model.seq_len;
  BatchFn batches = [&o, n](int64_t step, int, int32_t* in, int32_t* tg) {
    for (int i = 0; i < n; ++i) {
      in[i] = static_cast<int32_t>((step + i) * 7 % o.model.vocab);
      tg[i] = static_cast<int32_t>((step + i + 1) * 7 % o.model.vocab);
    }
    return absl::OkStatus();
  };
  for (int step = 0; step < steps; ++step) EXPECT_TRUE((*t)->Step(step, batches).ok());
  return std::move(*t);
}

// (tied embeddings, llama)
class SamplerTied : public testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(SamplerTied, CacheEqualsFullRecomputeAtEveryPosition) {
  auto t = Trained(std::get<0>(GetParam()), 20, std::get<1>(GetParam()));
  auto d = EngineDecoder::Create(t->model());
  ASSERT_TRUE(d.ok()) << d.status();
  const int V = (*d)->vocab_size(), s = (*d)->context();
  std::mt19937 rng(11);
  std::vector<int32_t> ids;
  for (int i = 0; i < s; ++i) ids.push_back(static_cast<int32_t>(rng() % V));
  // A 5-token prompt in one call, then one token per call up to the whole context.
  std::vector<float> cached(V), full(V);
  ASSERT_TRUE((*d)->Append({ids.data(), 5}, cached.data()).ok());
  for (int n = 5; n <= s; ++n) {
    if (n > 5) {
      ASSERT_TRUE((*d)->Append({ids.data() + n - 1, 1}, cached.data()).ok());
    }
    ASSERT_EQ((*d)->position(), n);
    ASSERT_TRUE((*d)->FullForward({ids.data(), static_cast<size_t>(n)}, full.data()).ok());
    double worst = 0, scale = 0;
    for (int v = 0; v < V; ++v) {
      worst = std::max(worst, double(std::abs(cached[v] - full[v])));
      scale = std::max(scale, double(std::abs(full[v])));
    }
    EXPECT_LE(worst, 1e-5 * std::max(1.0, scale)) << "after " << n << " tokens";
  }
  // The context is full: one more token is refused.
  absl::Status st = (*d)->Append({ids.data(), 1}, cached.data());
  EXPECT_TRUE(absl::IsOutOfRange(st)) << st;
  // Reset empties the cache: the first logits come back.
  (*d)->Reset();
  ASSERT_TRUE((*d)->Append({ids.data(), 5}, cached.data()).ok());
  ASSERT_TRUE((*d)->FullForward({ids.data(), 5}, full.data()).ok());
  for (int v = 0; v < V; ++v) EXPECT_NEAR(cached[v], full[v], 1e-5);
}

INSTANTIATE_TEST_SUITE_P(EmbeddingsAndArchitectures, SamplerTied,
                         testing::Combine(testing::Bool(), testing::Bool()));

class SamplerArch : public testing::TestWithParam<bool> {};  // llama

TEST_P(SamplerArch, FixedSeedReproducesTheSample) {
  auto t = Trained(false, 3, GetParam());  // barely trained: many tokens are likely
  auto d = EngineDecoder::Create(t->model());
  ASSERT_TRUE(d.ok());
  const std::vector<int32_t> prompt = {1, 2, 3};
  SampleOptions o{.max_tokens = 20, .temperature = 1.0f, .top_k = 0, .seed = 42};
  auto a = Generate(**d, prompt, o);
  auto b = Generate(**d, prompt, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(a->size(), 20u);
  o.seed = 43;
  auto c = Generate(**d, prompt, o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(*a, *c) << "another seed drew the same 20 tokens";
  // A second decoder on the same weights draws the same tokens.
  auto d2 = EngineDecoder::Create(t->model());
  ASSERT_TRUE(d2.ok());
  o.seed = 42;
  auto again = Generate(**d2, prompt, o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a);
}

INSTANTIATE_TEST_SUITE_P(Architectures, SamplerArch, testing::Bool());

// A saved Llama checkpoint loads by model_type into a decoder with the trained weights (the
// same logits as a decoder made from the model); a config.json that breaks a rule is refused
// naming the file and the key.
TEST(Sampler, LoadDecoderReadsALlamaCheckpoint) {
  namespace fs = std::filesystem;
  auto t = Trained(false, 5, /*llama=*/true);
  const fs::path dir =
      fs::temp_directory_path() / ("vp_sampler_llama_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ASSERT_TRUE(SaveCheckpoint(dir.string(), 5, t->model(), t->optimizer()).ok());
  const std::string step = CheckpointDir(dir.string(), 5);
  auto loaded = LoadDecoder(step);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto made = EngineDecoder::Create(t->model());
  ASSERT_TRUE(made.ok());
  const std::vector<int32_t> prompt = {4, 9, 30, 2};
  std::vector<float> a((*made)->vocab_size()), b((*loaded)->vocab_size());
  ASSERT_TRUE((*made)->Append(prompt, a.data()).ok());
  ASSERT_TRUE((*loaded)->Append(prompt, b.data()).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ((*loaded)->context(), 24);
  // The context error names Llama's key.
  std::vector<int32_t> many(30, 1);
  absl::Status st = (*loaded)->Append(many, b.data());
  EXPECT_THAT(std::string(st.message()), HasSubstr("max_position_embeddings"));

  const fs::path config = fs::path(step) / "config.json";
  std::stringstream text;
  text << std::ifstream(config).rdbuf();
  const std::string good = text.str();
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    std::ofstream(config) << s;
    return LoadDecoder(step).status();
  };
  EXPECT_THAT(std::string(with("\"rope_scaling\": null", "\"rope_scaling\": {}").message()),
              HasSubstr("config.json: rope_scaling is not supported"));
  EXPECT_THAT(
      std::string(with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3").message()),
      HasSubstr("num_key_value_heads"));
  EXPECT_THAT(std::string(with("\"hidden_size\": 32", "\"hidden_size\": \"32\"").message()),
              HasSubstr("config.json: hidden_size missing or not an integer"));
  fs::remove_all(dir);
}

TEST(Sampler, TemperatureZeroIsGreedy) {
  auto t = Trained(false, 20);
  auto d = EngineDecoder::Create(t->model());
  ASSERT_TRUE(d.ok());
  std::vector<int32_t> ids = {5, 12};
  auto got = Generate(**d, ids, {.max_tokens = 8, .temperature = 0.0f, .seed = 1});
  ASSERT_TRUE(got.ok());
  // Greedy by hand, with full recomputes.
  std::vector<float> logits((*d)->vocab_size());
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE((*d)->FullForward(ids, logits.data()).ok());
    const int32_t best =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ((*got)[i], best) << "token " << i;
    ids.push_back(best);
  }
}

TEST(Sampler, PickTokenKeepsTopKAndTheSoftmax) {
  std::mt19937_64 rng(7);
  const std::vector<float> logits = {0.0f, std::log(3.0f), -50.0f, 2.0f};
  EXPECT_EQ(PickToken(logits, {.temperature = 0.0f}, rng), 3);
  EXPECT_EQ(PickToken(logits, {.temperature = 5.0f, .top_k = 1}, rng), 3);
  for (int i = 0; i < 200; ++i) {
    const int32_t id = PickToken(logits, {.temperature = 2.0f, .top_k = 2}, rng);
    EXPECT_TRUE(id == 1 || id == 3) << id;
  }
  // Over {0, 1} alone (the other two masked by making them tiny): P(1) = 3/4 at T = 1.
  const std::vector<float> two = {0.0f, std::log(3.0f), -1e9f, -1e9f};
  int ones = 0;
  const int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) ones += PickToken(two, {.temperature = 1.0f}, rng) == 1;
  EXPECT_NEAR(double(ones) / kDraws, 0.75, 0.015);
}

TEST(Sampler, BadOptionsNameTheFlag) {
  EXPECT_THAT(std::string(ValidateSampleOptions({.max_tokens = 0}).message()),
              HasSubstr("--max-tokens: must be >= 1"));
  EXPECT_THAT(std::string(ValidateSampleOptions({.temperature = -1}).message()),
              HasSubstr("--temperature"));
  EXPECT_THAT(std::string(ValidateSampleOptions({.temperature = NAN}).message()),
              HasSubstr("--temperature"));
  EXPECT_THAT(std::string(ValidateSampleOptions({.top_k = -2}).message()),
              HasSubstr("--top-k: must be >= 0"));
  auto t = Trained(false, 0);
  auto d = EngineDecoder::Create(t->model());
  ASSERT_TRUE(d.ok());
  const std::vector<int32_t> prompt(10, 1);
  auto r = Generate(**d, prompt, {.max_tokens = 16});  // 10 + 16 − 1 > 24
  EXPECT_TRUE(absl::IsOutOfRange(r.status()));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--max-tokens"));
  EXPECT_TRUE(Generate(**d, prompt, {.max_tokens = 15}).ok());  // 10 + 15 − 1 = 24 fits
  const std::vector<int32_t> bad = {1, 99};
  EXPECT_FALSE(Generate(**d, bad, {.max_tokens = 1}).ok());
}

}  // namespace
}  // namespace vp::runtime
