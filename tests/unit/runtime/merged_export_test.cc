// The merged Hugging Face export of a pipeline run's shards (worker/launch/shard_checkpoint.h)
// and the readers of both of its forms: the streaming merge must write exactly the bytes the
// former in-memory merge wrote (kept below as the reference), the sharded form must hold the
// same tensors, and init_from, the standalone loader and the resume must read either form back
// to identical parameters.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/launch/shard_checkpoint.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/safetensors.h"

namespace vp::launch {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadBytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// The merge as it was before it streamed: every rank's whole model.safetensors read into
// memory, vocabulary shards concatenated, one WriteSafetensors. The test's golden.
std::string InMemoryMerge(const fs::path& run, int64_t step, int world,
                          const engine::ModelConfig& config, const fs::path& out) {
  std::vector<runtime::SafetensorsFile> files(world);
  std::map<std::string, std::vector<std::pair<int64_t, const runtime::Tensor*>>> sharded;
  std::map<std::string, const runtime::Tensor*> whole;
  std::vector<std::string> order;
  for (int r = 0; r < world; ++r) {
    auto f = runtime::ReadSafetensors(
        (run / absl::StrCat("step_", step) / absl::StrCat("rank_", r) / "model.safetensors")
            .string());
    EXPECT_TRUE(f.ok()) << f.status();
    files[r] = std::move(*f);
    for (const auto& [name, tensor] : files[r].tensors) {
      if (config.tie_embeddings && name == "lm_head.weight") continue;
      if (!sharded.contains(name) && !whole.contains(name)) order.push_back(name);
      auto meta = files[r].metadata.find("vocab_shard." + name);
      if (meta != files[r].metadata.end()) {
        std::vector<std::string> parts = absl::StrSplit(meta->second, ' ');
        int64_t begin = 0;
        EXPECT_TRUE(absl::SimpleAtoi(parts[0], &begin));
        sharded[name].emplace_back(begin, &tensor);
      } else {
        whole.emplace(name, &tensor);
      }
    }
  }
  std::map<std::string, runtime::Tensor> merged;
  for (auto& [name, pieces] : sharded) {
    std::sort(pieces.begin(), pieces.end());
    runtime::Tensor t;
    int64_t rows = 0;
    for (const auto& [begin, piece] : pieces) {
      t.data.insert(t.data.end(), piece->data.begin(), piece->data.end());
      rows += piece->shape[0];
    }
    t.shape = {rows, pieces.front().second->shape[1]};
    merged.emplace(name, std::move(t));
  }
  std::vector<runtime::TensorView> views;
  for (const std::string& name : order) {
    auto m = merged.find(name);
    const runtime::Tensor* t = m != merged.end() ? &m->second : whole.at(name);
    views.push_back({name, t->shape, t->data.data()});
  }
  if (config.tie_embeddings) {
    const runtime::Tensor& wte = merged.at(engine::EmbeddingTensorName(config));
    views.push_back({"lm_head.weight", wte.shape, wte.data.data()});
  }
  EXPECT_TRUE(runtime::WriteSafetensors(out.string(), views,
                                        {{"format", "pt"}, {"step", absl::StrCat(step)}})
                  .ok());
  return ReadBytes(out);
}

// One rank of a 2-rank vocabulary-parallel GPT-2: rank r holds layer r, a half of the (padded)
// vocabulary rows of wte and lm_head, wpe on rank 0 and ln_f on rank 1.
struct Rank {
  std::unique_ptr<engine::RankModel> model;
  std::optional<engine::AdamW> optimizer;  // AdamW is made by Create only
};

engine::ModelConfig Config(bool tied) {
  return {.layers = 2,
          .hidden = 32,
          .heads = 2,
          .vocab = 67,  // padded per rank
          .seq_len = 16,
          .ffn_hidden = 64,
          .tie_embeddings = tied};
}

std::unique_ptr<engine::RankModel> MakeModel(const engine::ModelConfig& cfg,
                                             const engine::RankLayout& layout, uint64_t seed) {
  auto model = engine::RankModel::Create(cfg, layout, 1, {0, cfg.seq_len},
                                         engine::vocab::OutputAlgorithm::kAlgorithm2, nullptr);
  EXPECT_TRUE(model.ok()) << model.status();
  (*model)->Init(seed);
  return std::move(*model);
}

engine::RankLayout PipelineLayout(int r) {
  engine::RankLayout l;
  l.rank = r;
  l.world = 2;
  l.chunks = {{r, 1}};
  l.holds_first_group = r == 0;
  l.holds_last_group = r == 1;
  l.vocab_sharded = true;
  return l;
}

Rank MakeRank(const engine::ModelConfig& cfg, int r, uint64_t seed) {
  Rank rank;
  rank.model = MakeModel(cfg, PipelineLayout(r), seed);
  auto opt =
      engine::AdamW::Create(nullptr, rank.model->param_count(), {}, rank.model->DecayRanges());
  EXPECT_TRUE(opt.ok()) << opt.status();
  rank.optimizer = std::move(*opt);
  // Moments as a step would leave them: distinct, finite values.
  for (size_t i = 0; i < rank.model->param_count(); ++i) {
    rank.optimizer->m().data()[i] = 1e-3f * static_cast<float>(i % 97) + seed;
    rank.optimizer->v().data()[i] = 1e-4f * static_cast<float>(i % 89) + seed;
  }
  rank.optimizer->set_step(7);
  return rank;
}

std::vector<float> Params(const engine::RankModel& m) {
  return {m.params(), m.params() + m.param_count()};
}

std::vector<std::string> ShardFiles(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (runtime::IsHfShardFileName(e.path().filename().string())) {
      out.push_back(e.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

class MergedExportTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    run_ = fs::temp_directory_path() /
           absl::StrCat("vp_merged_export_", GetParam() ? "tied_" : "untied_", getpid());
    fs::remove_all(run_);
    fs::create_directories(run_);
    cfg_ = Config(GetParam());
    for (int r = 0; r < 2; ++r) {
      ranks_.push_back(MakeRank(cfg_, r, 11 + r));
      ASSERT_TRUE(
          SaveRankShard(run_.string(), kStep, r, 2, *ranks_[r].model, *ranks_[r].optimizer, "run-a")
              .ok());
    }
  }
  void TearDown() override { fs::remove_all(run_); }
  fs::path StepDir() const { return run_ / absl::StrCat("step_", kStep); }

  static constexpr int64_t kStep = 3;
  fs::path run_;
  engine::ModelConfig cfg_;
  std::vector<Rank> ranks_;
};

TEST_P(MergedExportTest, SingleFileIsByteIdenticalToTheInMemoryMerge) {
  const std::string golden = InMemoryMerge(run_, kStep, 2, cfg_, run_ / "golden.safetensors");
  ASSERT_GT(golden.size(), 50000u);
  ASSERT_TRUE(MergeShards(run_.string(), kStep, 2, cfg_).ok());
  EXPECT_EQ(ReadBytes(StepDir() / "model.safetensors"), golden);
  EXPECT_FALSE(fs::exists(StepDir() / runtime::kHfIndexFile));
  EXPECT_TRUE(fs::exists(StepDir() / "DONE"));
}

TEST_P(MergedExportTest, ShardedFormHoldsTheSameTensorsAndLoadsBackEverywhere) {
  ASSERT_TRUE(MergeShards(run_.string(), kStep, 2, cfg_).ok());
  auto single = runtime::ReadSafetensors((StepDir() / "model.safetensors").string());
  ASSERT_TRUE(single.ok()) << single.status();
  uint64_t total = 0;
  for (const auto& [name, t] : single->tensors) total += t.data.size() * sizeof(float);

  // The smallest limit (in steps of total/24) that makes exactly 3 files.
  int64_t limit = 0;
  for (int k = 8; k < 24 && limit == 0; ++k) {
    const int64_t candidate = static_cast<int64_t>(total) * k / 24;
    ASSERT_TRUE(MergeShards(run_.string(), kStep, 2, cfg_, candidate).ok());
    if (ShardFiles(StepDir()).size() == 3) limit = candidate;
  }
  ASSERT_GT(limit, 0) << "no limit gave 3 files";
  EXPECT_EQ(ShardFiles(StepDir()), (std::vector<std::string>{"model-00001-of-00003.safetensors",
                                                             "model-00002-of-00003.safetensors",
                                                             "model-00003-of-00003.safetensors"}));
  // The sharded form replaces the single file (and earlier exports' other shard files).
  EXPECT_FALSE(fs::exists(StepDir() / "model.safetensors"));
  const nlohmann::json index = nlohmann::json::parse(ReadBytes(StepDir() / runtime::kHfIndexFile));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  ASSERT_EQ(index["weight_map"].size(), single->tensors.size());
  size_t seen = 0;
  for (const std::string& file : ShardFiles(StepDir())) {
    auto part = runtime::ReadSafetensors((StepDir() / file).string());
    ASSERT_TRUE(part.ok()) << part.status();
    uint64_t bytes = 0;
    for (const auto& [name, t] : part->tensors) {
      EXPECT_EQ(index["weight_map"][name], file) << name;
      EXPECT_EQ(t.shape, single->tensors.at(name).shape) << name;
      EXPECT_EQ(t.data, single->tensors.at(name).data) << name;
      bytes += t.data.size() * sizeof(float);
      ++seen;
    }
    // At most the limit, unless one tensor alone is larger.
    if (part->tensors.size() > 1) {
      EXPECT_LE(bytes, static_cast<uint64_t>(limit)) << file;
    }
  }
  EXPECT_EQ(seen, single->tensors.size());

  // init_from: every rank reads its slice from the sharded folder, identical to its own state.
  for (int r = 0; r < 2; ++r) {
    auto fresh = MakeModel(cfg_, PipelineLayout(r), 99);
    ASSERT_NE(Params(*fresh), Params(*ranks_[r].model));
    ASSERT_TRUE(runtime::InitFromHfDir(StepDir().string(), *fresh).ok());
    EXPECT_EQ(Params(*fresh), Params(*ranks_[r].model)) << "rank " << r;
  }
  // The standalone loader (the sampler's, a standalone resume's) reads the sharded form too,
  // and gets what it gets from the single file.
  auto whole_sharded = MakeModel(cfg_, engine::RankLayout::Standalone(cfg_), 5);
  ASSERT_TRUE(runtime::LoadCheckpoint(StepDir().string(), *whole_sharded, nullptr).ok());
  // Exporting again with the default limit brings back the single file and drops the shards.
  ASSERT_TRUE(MergeShards(run_.string(), kStep, 2, cfg_).ok());
  EXPECT_TRUE(ShardFiles(StepDir()).empty());
  EXPECT_FALSE(fs::exists(StepDir() / runtime::kHfIndexFile));
  auto whole_single = MakeModel(cfg_, engine::RankLayout::Standalone(cfg_), 6);
  ASSERT_TRUE(runtime::LoadCheckpoint(StepDir().string(), *whole_single, nullptr).ok());
  EXPECT_EQ(Params(*whole_sharded), Params(*whole_single));
}

TEST_P(MergedExportTest, ResumeReadsTheShardsBackExactly) {
  for (int r = 0; r < 2; ++r) {
    Rank fresh = MakeRank(cfg_, r, 40 + r);
    ASSERT_TRUE(LoadRankShard(run_.string(), kStep, r, 2, *fresh.model, &*fresh.optimizer).ok());
    EXPECT_EQ(Params(*fresh.model), Params(*ranks_[r].model)) << "rank " << r;
    // The moments of every saved element (vocabulary shards without their padding rows).
    for (const engine::ParamTensor& t : fresh.model->tensors()) {
      const size_t n = static_cast<size_t>(t.valid_rows) * (t.count() / t.shape[0]);
      EXPECT_TRUE(std::equal(fresh.optimizer->m().data() + t.offset,
                             fresh.optimizer->m().data() + t.offset + n,
                             ranks_[r].optimizer->m().data() + t.offset))
          << t.name;
      EXPECT_TRUE(std::equal(fresh.optimizer->v().data() + t.offset,
                             fresh.optimizer->v().data() + t.offset + n,
                             ranks_[r].optimizer->v().data() + t.offset))
          << t.name;
    }
    EXPECT_EQ(fresh.optimizer->step(), 7);
  }
}

// ZeRO-1 shards: three replicas each write their range of rank 1's moments; the shard then
// loads into a whole AdamW exactly as the one-file form does, and into another replica count's
// range (its bounds cut the saved pieces); a manifest listing both forms or an incomplete set
// is refused.
TEST_P(MergedExportTest, ZeroRangesLoadLikeTheWholeFile) {
  const fs::path run = run_ / "zero";
  fs::create_directories(run);
  Rank& src = ranks_[1];
  const size_t n = src.model->param_count();
  constexpr int kReplicas = 3;
  ASSERT_TRUE(PrepareShardSave(run.string(), kStep, 1).ok());
  for (int r = 0; r < kReplicas; ++r) {
    const size_t begin = n * r / kReplicas, end = n * (r + 1) / kReplicas;
    auto shard =
        engine::AdamW::CreateShard(nullptr, n, {}, src.model->DecayRanges(), begin, end - begin);
    ASSERT_TRUE(shard.ok()) << shard.status();
    std::copy(src.optimizer->m().data() + begin, src.optimizer->m().data() + end,
              shard->m().data());
    std::copy(src.optimizer->v().data() + begin, src.optimizer->v().data() + end,
              shard->v().data());
    shard->set_step(src.optimizer->step());
    ASSERT_TRUE(SaveOptimizerRange(run.string(), kStep, 1, *src.model, *shard, r, kReplicas).ok());
  }
  ASSERT_TRUE(
      SaveRankShard(run.string(), kStep, 1, 2, *src.model, *src.optimizer, "run-z", kReplicas)
          .ok());
  const fs::path shard_dir = run / absl::StrCat("step_", kStep) / "rank_1";
  EXPECT_FALSE(fs::exists(shard_dir / "optimizer.safetensors"));
  ASSERT_TRUE(VerifyRankShard(run.string(), kStep, 1, 2).ok());

  // Every element a tensor saves comes back (padding rows of a vocabulary shard are not saved
  // and stay zero), and the AdamW step too.
  auto fresh = MakeModel(cfg_, PipelineLayout(1), 99);
  auto whole = engine::AdamW::Create(nullptr, n, {}, fresh->DecayRanges());
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE(LoadRankShard(run.string(), kStep, 1, 2, *fresh, &*whole).ok());
  EXPECT_EQ(whole->step(), 7);
  for (const engine::ParamTensor& t : fresh->tensors()) {
    const size_t saved = static_cast<size_t>(t.valid_rows) * (t.count() / t.shape[0]);
    for (size_t i = t.offset; i < t.offset + saved; ++i) {
      ASSERT_EQ(whole->m().data()[i], src.optimizer->m().data()[i]) << t.name << " " << i;
      ASSERT_EQ(whole->v().data()[i], src.optimizer->v().data()[i]) << t.name << " " << i;
    }
  }
  // Replica 1 of 2 reads its range only.
  const size_t begin = n / 2;
  auto half = engine::AdamW::CreateShard(nullptr, n, {}, fresh->DecayRanges(), begin, n - begin);
  ASSERT_TRUE(half.ok());
  ASSERT_TRUE(LoadRankShard(run.string(), kStep, 1, 2, *fresh, &*half).ok());
  for (size_t i = 0; i < n - begin; ++i) {
    ASSERT_EQ(half->m().data()[i], whole->m().data()[begin + i]) << i;
  }

  // The manifest must list the optimizer state once and completely.
  const fs::path manifest = shard_dir / "MANIFEST.json";
  const std::string good = ReadBytes(manifest);
  for (const std::string edit : {"both", "incomplete"}) {
    nlohmann::json m = nlohmann::json::parse(good);
    if (edit == "both") {
      m["files"]["optimizer.safetensors"] = m["files"]["optimizer-0-of-3.safetensors"];
    } else {
      m["files"].erase("optimizer-2-of-3.safetensors");
    }
    std::ofstream(manifest, std::ios::trunc) << m.dump(2);
    const absl::StatusOr<std::string> st = VerifyRankShard(run.string(), kStep, 1, 2);
    ASSERT_FALSE(st.ok()) << edit;
    EXPECT_EQ(st.status().code(), absl::StatusCode::kDataLoss) << st.status();
    EXPECT_THAT(st.status().message(),
                HasSubstr(edit == "both" ? "optimizer state once" : "optimizer-2-of-3"))
        << st.status();
  }
}

INSTANTIATE_TEST_SUITE_P(Embeddings, MergedExportTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

// A sharded folder's index is external input: a bad one is refused naming the index and the
// rule, never echoing its text, and nothing of the model changes.
TEST(HfIndex, BadIndexIsRefusedNamingTheRule) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("vp_hf_index_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const engine::ModelConfig cfg = Config(false);
  auto model = MakeModel(cfg, engine::RankLayout::Standalone(cfg), 3);
  auto opt = engine::AdamW::Create(nullptr, model->param_count(), {}, model->DecayRanges());
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE(runtime::SaveCheckpoint(dir.string(), 0, *model, *opt, 40000).ok());
  const fs::path step = dir / "step_0";
  ASSERT_GE(ShardFiles(step).size(), 3u);
  const std::string good = ReadBytes(step / runtime::kHfIndexFile);
  {  // the standalone save's sharded form loads back
    auto back = MakeModel(cfg, engine::RankLayout::Standalone(cfg), 4);
    ASSERT_TRUE(runtime::LoadCheckpoint(step.string(), *back, nullptr).ok());
    EXPECT_EQ(Params(*back), Params(*model));
  }
  struct Case {
    std::string index, rule;
  };
  nlohmann::json escape = nlohmann::json::parse(good);
  escape["weight_map"]["transformer.wte.weight"] = "../secret-escape.safetensors";
  nlohmann::json wrong = nlohmann::json::parse(good);
  wrong["weight_map"]["transformer.wte.weight"] = ShardFiles(step).back();
  nlohmann::json missing = nlohmann::json::parse(good);
  missing["weight_map"]["transformer.wte.weight"] = "model-00009-of-00009.safetensors";
  for (const Case& c : std::vector<Case>{
           {"{\"secret-text\": 1", "not a JSON object"},
           {"{\"weight_map\": [\"secret-text\"]}", "weight_map must be an object"},
           {escape.dump(), "one path component ending in .safetensors"},
           {wrong.dump(), "the tensor is not in the file it is mapped to"},
           {missing.dump(), "names a file missing from"},
       }) {
    std::ofstream(step / runtime::kHfIndexFile, std::ios::trunc) << c.index;
    auto back = MakeModel(cfg, engine::RankLayout::Standalone(cfg), 4);
    const std::vector<float> before = Params(*back);
    const absl::Status st = runtime::InitFromHfDir(step.string(), *back);
    EXPECT_FALSE(st.ok()) << c.rule;
    EXPECT_THAT(st.message(), HasSubstr("model.init_from: "));
    EXPECT_THAT(st.message(), HasSubstr(runtime::kHfIndexFile)) << st.message();
    EXPECT_THAT(st.message(), HasSubstr(c.rule)) << st.message();
    EXPECT_THAT(st.message(), Not(HasSubstr("secret"))) << st.message();
    EXPECT_EQ(Params(*back), before);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace vp::launch
