// End-to-end: the real `vocabpipe` binary in a child process, on files in a temp folder.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"
#include "worker/data/token_file.h"
#include "worker/runtime/safetensors.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using Result = vp::testing::CliResult;
using vp::testing::Vocabpipe;

class CliRunTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("vp_cli_", testing::UnitTest::GetInstance()->current_test_info()->name(),
                        "_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a job spec into the test's folder.
  std::string WriteSpec(const std::string& name, const std::string& body) {
    const fs::path path = dir_ / (name + ".yaml");
    std::ofstream(path) << body;
    return path.string();
  }

  double Synth(int vocab, int tokens) {
    Result r = Vocabpipe(absl::StrCat("data synth --vocab ", vocab, " --tokens ", tokens, " --out ",
                                      (dir_ / "data.bin").string(), " --seed 5"));
    EXPECT_EQ(r.code, 0) << r.output;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.output, m, std::regex("entropy rate ([0-9.]+)"))) << r.output;
    return std::stod(m[1]);
  }

  fs::path dir_;
};

constexpr char kSmallModel[] = R"(
model: {layers: 2, hidden: 64, heads: 4, vocab_size: 64, seq_len: 32}
parallel: {microbatch_size: 4, microbatches: 2}
data: {path: data.bin}
)";

TEST_F(CliRunTest, TrainingApproachesTheEntropyFloor) {
  const double floor = Synth(64, 60000);
  const std::string spec = WriteSpec("floor", absl::StrCat(kSmallModel, R"(
train: {steps: 300, lr: 0.003, warmup_steps: 10, lr_schedule: cosine, min_lr: 0.0003}
checkpoint: {dir: run}
)"));
  Result r = Vocabpipe("run " + spec);
  ASSERT_EQ(r.code, 0) << r.output;
  auto metrics = vp::testing::ReadJsonl(dir_ / "run" / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 300u);
  for (const char* key :
       {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes"}) {
    EXPECT_TRUE(metrics.back().contains(key)) << key;
  }
  const double first = metrics.front()["loss"];
  double last = 0;
  for (size_t i = metrics.size() - 10; i < metrics.size(); ++i) last += double(metrics[i]["loss"]);
  last /= 10;
  // The initial loss is about ln 64 = 4.16; the chain's floor is ~1 nat. After 300 steps the
  // model must have closed most of the gap, and can never beat the floor by more than noise.
  EXPECT_NEAR(first, std::log(64.0), 0.2);
  EXPECT_LT(last - floor, 0.35 * (first - floor))
      << "first " << first << " last " << last << " floor " << floor;
  EXPECT_GT(last, floor - 0.1);
  EXPECT_GT(double(metrics.back()["mfu"]), 0.0);
  EXPECT_TRUE(fs::exists(dir_ / "run" / "step_300" / "DONE"));
}

TEST_F(CliRunTest, ZeroStepsSavesTheInitialModelInHuggingFaceLayout) {
  Synth(50, 5000);
  // V = 50 is padded internally (to a multiple of 8p); the checkpoint has exactly 50 rows.
  const std::string spec = WriteSpec("zero", R"(
model: {layers: 3, hidden: 32, heads: 2, vocab_size: 50, seq_len: 16, tie_embeddings: true}
train: {steps: 0}
data: {path: data.bin}
checkpoint: {dir: zero}
)");
  Result r = Vocabpipe("run " + spec);
  ASSERT_EQ(r.code, 0) << r.output;
  auto f = vp::runtime::ReadSafetensors((dir_ / "zero/step_0/model.safetensors").string());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors.at("transformer.wte.weight").shape, (std::vector<int64_t>{50, 32}));
  EXPECT_EQ(f->tensors.at("lm_head.weight").data, f->tensors.at("transformer.wte.weight").data);
  EXPECT_EQ(f->tensors.at("transformer.wpe.weight").shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(f->tensors.at("transformer.h.2.attn.c_attn.weight").shape,
            (std::vector<int64_t>{32, 96}));
  EXPECT_EQ(f->tensors.at("transformer.h.2.mlp.c_proj.weight").shape,
            (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(f->tensors.at("transformer.ln_f.bias").shape, (std::vector<int64_t>{32}));
  auto config = nlohmann::json::parse(std::ifstream(dir_ / "zero/step_0/config.json"));
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_layer"], 3);
  EXPECT_EQ(config["vocab_size"], 50);
  EXPECT_EQ(config["tie_word_embeddings"], true);
}

TEST_F(CliRunTest, BadSpecIsRejectedWithTheFieldPath) {
  Synth(64, 2000);
  Result r = Vocabpipe("run " + WriteSpec("bad", R"(
model: {layers: 2, hidden: 64, heads: 5, vocab_size: 64, seq_len: 32}
train: {lr: -1, stepz: 3}
data: {path: data.bin}
)"));
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("train.stepz: unknown field"));
  Result r2 = Vocabpipe("run " + WriteSpec("bad2", R"(
model: {layers: 2, hidden: 64, heads: 5, vocab_size: 64, seq_len: 32}
train: {lr: -1}
data: {path: data.bin}
)"));
  EXPECT_EQ(r2.code, 2);
  EXPECT_THAT(r2.output, HasSubstr("model.heads: must divide model.hidden"));
  EXPECT_THAT(r2.output, HasSubstr("train.lr"));
}

TEST_F(CliRunTest, OutOfRangeTokensAreRejectedWithTheirOffset) {
  Synth(100, 2000);  // ids up to 99, but the model has only 64
  // vocabpipe's writers record the vocabulary bound (100) in the header: refused from the header
  // alone, before anything runs.
  Result r = Vocabpipe("run " + WriteSpec("oor", kSmallModel));
  EXPECT_EQ(r.code, 2);  // invalid input, not a failure while running
  EXPECT_THAT(r.output, HasSubstr("data.bin: written for a vocabulary of 100 tokens"));
  EXPECT_THAT(r.output, HasSubstr("larger than model.vocab_size 64"));
  // Without a recorded bound (header[3] = 0, as llm.c writes it) the rank checks the ids it reads
  // and fails naming the first bad one's offset.
  {
    std::fstream f(dir_ / "data.bin", std::ios::in | std::ios::out | std::ios::binary);
    const int32_t zero = 0;
    f.seekp(12);
    f.write(reinterpret_cast<const char*>(&zero), 4);
  }
  Result r2 = Vocabpipe("run " +
                        WriteSpec("oor2", absl::StrCat(kSmallModel, "train: {max_restarts: 0}\n")));
  EXPECT_NE(r2.code, 0);
  EXPECT_THAT(r2.output, HasSubstr("data.bin: token"));
  EXPECT_THAT(r2.output, HasSubstr("byte offset"));
  EXPECT_THAT(r2.output, HasSubstr("not < vocab size 64"));
}

// From text: train a tokenizer, tokenize, train on the shards. A model whose vocab_size is not
// the tokenizer's (tokenizer.model beside the shards) is refused, naming both sizes.
TEST_F(CliRunTest, TrainsOnTokenizedTextAndRefusesAMismatchedVocabulary) {
  std::string text;
  for (int i = 0; i < 200; ++i) {
    text += absl::StrCat("Verse ", i, ": and the evening and the morning were the day.\n");
    if (i % 4 == 3) text += "\n";
  }
  std::ofstream(dir_ / "corpus.txt") << text;
  const std::string corpus = (dir_ / "corpus.txt").string();
  const std::string tok = (dir_ / "tok.model").string();
  Result t = Vocabpipe("data train-tokenizer " + corpus + " --vocab-size 320 --out " + tok);
  ASSERT_EQ(t.code, 0) << t.output;
  Result k = Vocabpipe("data tokenize --tokenizer " + tok + " " + corpus + " --out " +
                       (dir_ / "verses").string() + " --val-fraction 0.1");
  ASSERT_EQ(k.code, 0) << k.output;
  EXPECT_THAT(k.output, HasSubstr("50 documents (45 train, 5 val)"));
  const std::string body = R"(
parallel: {microbatch_size: 2, microbatches: 1}
train: {steps: 2}
data: {path: verses/verses_train_000000.bin}
)";
  const std::string bad =
      WriteSpec("bad", "model: {layers: 1, hidden: 32, heads: 2, vocab_size: 400, seq_len: 16}" +
                           body + "checkpoint: {dir: bad}\n");
  for (const char* mode : {"", " --direct"}) {
    Result r = Vocabpipe("run " + bad + mode);
    EXPECT_EQ(r.code, 2) << mode << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("model.vocab_size: 400 does not match the tokenizer"));
    EXPECT_THAT(r.output, HasSubstr("tokenizer.model has 320 tokens"));
  }
  const std::string good =
      WriteSpec("good", "model: {layers: 1, hidden: 32, heads: 2, vocab_size: 320, seq_len: 16}" +
                            body + "checkpoint: {dir: good}\n");
  Result r = Vocabpipe("run " + good + " --direct");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "good" / "metrics.jsonl")) << r.output;
}

// Text → validation loss and samples → `vocabpipe sample`: both run paths write val_loss and
// sample lines (GPT-2 and Llama), every checkpoint carries the tokenizer, a fixed seed reproduces a
// sample, and bad input (an empty validation file, a tokenizer of another size, a non-UTF-8 prompt,
// a sample longer than the context) is refused naming the field, the flag or the file.
TEST_F(CliRunTest, ValidationLossSamplesAndTheSampleCommand) {
  std::string text;
  for (int i = 0; i < 240; ++i) {
    text += absl::StrCat("Verse ", i % 17, ": and the evening and the morning were the day.\n");
    if (i % 4 == 3) text += "\n";
  }
  std::ofstream(dir_ / "corpus.txt") << text;
  const std::string corpus = (dir_ / "corpus.txt").string();
  const std::string tok = (dir_ / "tok.model").string();
  ASSERT_EQ(Vocabpipe("data train-tokenizer " + corpus + " --vocab-size 320 --out " + tok).code, 0);
  Result k = Vocabpipe("data tokenize --tokenizer " + tok + " " + corpus + " --out " +
                       (dir_ / "v").string() + " --val-fraction 0.1");
  ASSERT_EQ(k.code, 0) << k.output;
  const std::string model =
      "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 320, seq_len: 24}\n";
  const std::string train =
      "train: {steps: 4, lr: 0.003, eval_every: 2, eval_batches: 2, sample_every: 4, "
      "sample_tokens: 8}\ndata: {path: v/v_train_000000.bin, val_path: v/v_val_000000.bin}\n";
  // p = 1 standalone (--direct) and p = 2 rank processes through the control plane.
  for (const auto& [run, mode, par] :
       {std::tuple{"p1", " --direct", "parallel: {microbatch_size: 2, microbatches: 2}\n"},
        std::tuple{
            "p2", "",
            "parallel: {pipeline: 2, vocab: vocab1, microbatch_size: 2, microbatches: 2}\n"}}) {
    const std::string spec =
        WriteSpec(run, model + par + train + absl::StrCat("checkpoint: {dir: ", run, "}\n"));
    Result r = Vocabpipe("run " + spec + mode);
    ASSERT_EQ(r.code, 0) << run << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("| val ")) << run;
    EXPECT_THAT(r.output, HasSubstr("sample after step 4:")) << run;
    EXPECT_THAT(r.output, HasSubstr("validation loss")) << run;
    auto metrics = vp::testing::ReadJsonl(dir_ / run / "metrics.jsonl");
    ASSERT_EQ(metrics.size(), 4u) << run;
    EXPECT_FALSE(metrics[0].contains("val_loss"));
    EXPECT_TRUE(metrics[1].contains("val_loss")) << run;
    EXPECT_TRUE(metrics[3].contains("val_loss")) << run;
    EXPECT_TRUE(metrics[3].contains("sample")) << run;
    EXPECT_TRUE(fs::exists(dir_ / run / "step_4" / "tokenizer.model")) << run;
  }

  const std::string args = " --prompt 'Verse 3' --max-tokens 10 --temperature 0.8 --top-k 20";
  // A Llama model (grouped-query attention, 4 query heads on 2 key/value heads) trained by two
  // rank processes samples the same way: in training, and from its exported step folder.
  {
    const std::string spec =
        WriteSpec("llama",
                  "model: {architecture: llama, layers: 2, hidden: 32, heads: 4, kv_heads: 2, "
                  "vocab_size: 320, seq_len: 24}\n"
                  "parallel: {pipeline: 2, vocab: vocab2, microbatch_size: 2, microbatches: 2}\n" +
                      train + "checkpoint: {dir: llama}\n");
    Result r = Vocabpipe("run " + spec);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("sample after step 4:"));
    EXPECT_TRUE(fs::exists(dir_ / "llama" / "step_4" / "tokenizer.model"));
    Result a = Vocabpipe("sample " + (dir_ / "llama").string() + args + " --seed 5");
    Result b = Vocabpipe("sample " + (dir_ / "llama").string() + args + " --seed 5");
    ASSERT_EQ(a.code, 0) << a.output;
    EXPECT_EQ(a.output, b.output);
    EXPECT_EQ(a.output.rfind("Verse 3", 0), 0u) << a.output;
  }

  const std::string step = (dir_ / "p2" / "step_4").string();
  Result a = Vocabpipe("sample " + step + args + " --seed 5");
  Result b = Vocabpipe("sample " + (dir_ / "p2").string() + args + " --seed 5");  // run folder
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_EQ(a.output, b.output);
  EXPECT_EQ(a.output.rfind("Verse 3", 0), 0u) << a.output;

  // Bad input.
  Result r = Vocabpipe("sample " + step + " --max-tokens 40");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("--max-tokens"));
  r = Vocabpipe("sample " + step + " --prompt \"$(printf 'caf\\351')\"");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--prompt"));
  ASSERT_EQ(Vocabpipe("data train-tokenizer " + corpus + " --vocab-size 330 --out " +
                      (dir_ / "other.model").string())
                .code,
            0);
  r = Vocabpipe("sample " + step + " --tokenizer " + (dir_ / "other.model").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("other.model: the tokenizer has 330 tokens but the model's "
                                  "vocab_size is 320"));
  std::ofstream(dir_ / "v" / "empty.bin").close();
  const std::string empty =
      WriteSpec("empty", model + "parallel: {microbatch_size: 2, microbatches: 1}\n" +
                             "train: {steps: 2, eval_every: 1}\n"
                             "data: {path: v/v_train_000000.bin, val_path: v/empty.bin}\n"
                             "checkpoint: {dir: empty}\n");
  r = Vocabpipe("run " + empty + " --direct");
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.output, HasSubstr("data.val_path: "));
  EXPECT_THAT(r.output, HasSubstr("empty.bin"));
}

TEST_F(CliRunTest, CudaJobOnAHostWithoutAGpuIsRejectedBeforeStarting) {
  Synth(64, 2000);
  const std::string spec = WriteSpec("gpu", R"(
model: {layers: 2, hidden: 32, heads: 4, vocab_size: 64, seq_len: 16}
parallel: {pipeline: 2, microbatches: 2}
train: {steps: 1}
data: {path: data.bin}
checkpoint: {dir: gpu}
device: cuda
)");
  for (const char* mode : {"", " --direct"}) {
    Result r = Vocabpipe("run " + spec + mode);
    // This machine and CI have no GPU (a CUDA build says "no CUDA device on this host", a build
    // without CUDA "built without CUDA"); with one, the job would run.
    if (r.code == 0) GTEST_SKIP() << "a CUDA device is present";
    EXPECT_EQ(r.code, 2) << mode << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr("device: cuda")) << mode;
    EXPECT_FALSE(std::filesystem::exists(dir_ / "gpu/rank_0.jsonl")) << mode;
  }
}

TEST_F(CliRunTest, PipelineRunsTrainWithWorkerProcesses) {
  Synth(64, 2000);
  const std::string p2 = WriteSpec("p2b", R"(
model: {layers: 2, hidden: 64, heads: 4, vocab_size: 64, seq_len: 32}
parallel: {pipeline: 2, microbatches: 4}
train: {steps: 2, threads: 1}
data: {path: data.bin}
checkpoint: {dir: p2run}
)");
  Result r2 = Vocabpipe("run " + p2);
  EXPECT_EQ(r2.code, 0) << r2.output;
  EXPECT_THAT(r2.output, HasSubstr("step 2/2 | loss"));
  auto metrics = vp::testing::ReadJsonl(dir_ / "p2run" / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_EQ(metrics.back()["stages"].size(), 2u);
  EXPECT_TRUE(fs::exists(dir_ / "p2run" / "step_2" / "DONE"));
}

// A corpus in three shards (a folder, a glob, or a list) trains exactly as the same tokens in one
// file: the same per-step losses, bit for bit, sequential and shuffled, at p = 1 and p = 2.
TEST_F(CliRunTest, ThreeShardsTrainExactlyAsTheirConcatenation) {
  Synth(64, 6000);
  auto whole = vp::data::TokenFile::Load((dir_ / "data.bin").string(), 64);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::span<const uint32_t> t = whole->tokens();
  fs::create_directories(dir_ / "shards");
  // Unequal shards, the middle one shorter than a sample (s + 1 = 33 tokens).
  const size_t cuts[] = {0, 1000, 1020, t.size()};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        vp::data::WriteTokenFile((dir_ / "shards" / absl::StrCat("c_00", i, ".bin")).string(),
                                 t.subspan(cuts[i], cuts[i + 1] - cuts[i]))
            .ok());
  }
  const std::string data_forms[] = {
      "{path: shards}", "{path: shards/c_*.bin}",
      "{paths: [shards/c_000.bin, shards/c_001.bin, shards/c_002.bin]}"};
  int form = 0;
  for (int p : {1, 2}) {
    for (bool shuffle : {false, true}) {
      const std::string model = absl::StrCat(R"(
model: {layers: 2, hidden: 64, heads: 4, vocab_size: 64, seq_len: 32}
parallel: {pipeline: )",
                                             p, R"(, microbatch_size: 2, microbatches: 2}
train: {steps: 4, threads: 1, lr: 0.003}
)");
      const std::string tag = absl::StrCat("p", p, shuffle ? "s" : "q");
      const std::string shuffled = shuffle ? ", shuffle: true" : "";
      const std::string one =
          WriteSpec(tag + "one", absl::StrCat(model, "data: {path: data.bin", shuffled, "}\n",
                                              "checkpoint: {dir: ", tag, "one}\n"));
      std::string sharded_data = data_forms[form++ % 3];
      sharded_data.insert(sharded_data.size() - 1, shuffled);
      const std::string many = WriteSpec(
          tag + "many",
          absl::StrCat(model, "data: ", sharded_data, "\ncheckpoint: {dir: ", tag, "many}\n"));
      Result a = Vocabpipe("run --direct " + one), b = Vocabpipe("run --direct " + many);
      ASSERT_EQ(a.code, 0) << a.output;
      ASSERT_EQ(b.code, 0) << b.output;
      auto ma = vp::testing::ReadJsonl(dir_ / (tag + "one") / "metrics.jsonl");
      auto mb = vp::testing::ReadJsonl(dir_ / (tag + "many") / "metrics.jsonl");
      ASSERT_EQ(ma.size(), 4u);
      ASSERT_EQ(mb.size(), 4u);
      for (size_t i = 0; i < ma.size(); ++i) {
        EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>())
            << tag << " " << sharded_data << " step " << i;
      }
    }
  }
}

// A line "Name:   1234 kB" of /proc/PID/status, in bytes (0 when unreadable).
int64_t ProcStatusBytes(pid_t pid, const std::string& name) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(name + ":", 0) == 0) return std::stoll(line.substr(name.size() + 1)) * 1024;
  }
  return 0;
}

size_t LineCount(const fs::path& path) {
  std::ifstream f(path);
  size_t n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

// Runs `vocabpipe run --direct SPEC` (p = 1: the training runs in that process) in a child and
// samples its resident memory (VmRSS, every 2 ms) from outside while it trains: until the
// metrics file holds `steps` lines (after that come the final save and the exit, whose library
// teardown is not training). Returns the largest sample, -1 when the run failed.
int64_t RunAndSampleTrainingRss(const std::string& spec, const fs::path& metrics, size_t steps) {
  const std::string binary = absl::StrCat(VP_BINARY_DIR, "/client/vocabpipe");
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(binary.c_str(), binary.c_str(), "run", "--direct", spec.c_str(), nullptr);
    _exit(127);
  }
  if (pid < 0) return -1;
  int64_t max_rss = 0;
  while (LineCount(metrics) < steps) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return -1;  // ended before its last step
    max_rss = std::max(max_rss, ProcStatusBytes(pid, "VmRSS"));
    usleep(2000);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return -1;
  }
  return max_rss;
}

// The corpus stays out of a rank's memory: with 40M tokens (80 MB on disk, read shuffled) the
// process's resident memory while it trains is within 25 MB of the same run on 1M tokens
// (loading the file whole, as before the shards were memory-mapped, cost ~6 bytes per token:
// 240 MB); and the peak each step reports (peak_memory_bytes: the process's own high-water mark)
// is within 10% of what is measured from outside.
TEST_F(CliRunTest, ResidentMemoryDoesNotGrowWithTheCorpus) {
  std::mt19937 rng(3);
  int64_t measured[2] = {0, 0};
  const int64_t sizes[2] = {1 << 20, 40 << 20};
  constexpr size_t kSteps = 8;
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("corpus", i);
    {
      std::vector<uint32_t> tokens(static_cast<size_t>(sizes[i]));
      for (uint32_t& t : tokens) t = rng() % 64;
      ASSERT_TRUE(vp::data::WriteTokenFile((dir_ / (name + ".bin")).string(), tokens).ok());
    }
    const std::string spec = WriteSpec(name, absl::StrCat(R"(
model: {layers: 2, hidden: 64, heads: 4, vocab_size: 64, seq_len: 32}
parallel: {microbatch_size: 4, microbatches: 2}
train: {steps: )",
                                                          kSteps, R"(, threads: 1}
data: {path: )",
                                                          name, R"(.bin, shuffle: true}
checkpoint: {dir: )",
                                                          name, R"(run}
)"));
    const fs::path metrics = dir_ / (name + "run") / "metrics.jsonl";
    measured[i] = RunAndSampleTrainingRss(spec, metrics, kSteps);
    ASSERT_GT(measured[i], 0) << name;
    const auto lines = vp::testing::ReadJsonl(metrics);
    ASSERT_EQ(lines.size(), kSteps);
    const int64_t reported = lines.back()["peak_memory_bytes"].get<int64_t>();
    for (const auto& line : lines) EXPECT_GT(line["memory"]["process"].get<int64_t>(), 0);
    EXPECT_NEAR(double(reported) / double(measured[i]), 1.0, 0.1)
        << name << ": reported " << reported << ", measured " << measured[i];
    fs::remove(dir_ / (name + ".bin"));
  }
  EXPECT_LT(measured[1] - measured[0], 25 << 20)
      << "1M tokens: " << measured[0] << " bytes, 40M tokens: " << measured[1] << " bytes";
}

// Tests that run both ways: through the control plane (the default) and --direct.
class CliRunModeTest : public CliRunTest, public testing::WithParamInterface<std::string> {
 protected:
  bool direct() const { return GetParam() == "direct"; }
  std::string Run() const { return direct() ? "run --direct " : "run "; }
};

TEST_P(CliRunModeTest, ResumeReproducesTheUninterruptedRun) {
  Synth(64, 20000);
  const std::string full = WriteSpec("full", absl::StrCat(kSmallModel, R"(
train: {steps: 6, lr: 0.003}
checkpoint: {dir: full, every: 3}
)"));
  const std::string part = WriteSpec("part", absl::StrCat(kSmallModel, R"(
train: {steps: 6, lr: 0.003}
checkpoint: {dir: part, every: 3}
)"));
  ASSERT_EQ(Vocabpipe(Run() + full).code, 0);
  Result first_half = Vocabpipe(Run() + part + " --steps 3");
  ASSERT_EQ(first_half.code, 0) << first_half.output;
  Result resumed = Vocabpipe(Run() + part + " --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  auto a = vp::testing::ReadJsonl(dir_ / "full" / "metrics.jsonl");
  auto b = vp::testing::ReadJsonl(dir_ / "part" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(int(b[i]["step"]), i);
    EXPECT_DOUBLE_EQ(double(a[i]["loss"]), double(b[i]["loss"])) << "step " << i;
  }
  auto wa = vp::runtime::ReadSafetensors((dir_ / "full/step_6/model.safetensors").string());
  auto wb = vp::runtime::ReadSafetensors((dir_ / "part/step_6/model.safetensors").string());
  ASSERT_TRUE(wa.ok() && wb.ok());
  for (const auto& [name, t] : wa->tensors) EXPECT_EQ(t.data, wb->tensors.at(name).data) << name;
}

// checkpoint.max_shard_bytes at its 1 MiB minimum on a 3.7 MB model: the Hugging Face export
// is sharded (files + index). A resume — p = 1 from that export, p = 2 from the rank shards with
// the sharded export beside them — continues exactly as the uninterrupted run whose checkpoints
// are single files, and both final exports hold the same tensors.
TEST_F(CliRunTest, ResumeWithAShardedExportReproducesTheUninterruptedRun) {
  Synth(2048, 20000);
  for (const int p : {1, 2}) {
    const std::string model = absl::StrCat(R"(
model: {layers: 2, hidden: 128, heads: 4, vocab_size: 2048, seq_len: 16}
parallel: {pipeline: )",
                                           p, R"(, microbatch_size: 2, microbatches: 2}
data: {path: data.bin}
train: {steps: 4, lr: 0.003, threads: 1}
)");
    const std::string full = WriteSpec(absl::StrCat("full", p), absl::StrCat(model, R"(
checkpoint: {dir: full)",
                                                                             p, R"(, every: 2}
)"));
    const std::string part =
        WriteSpec(absl::StrCat("part", p), absl::StrCat(model, R"(
checkpoint: {dir: part)",
                                                        p, R"(, every: 2, max_shard_bytes: 1048576}
)"));
    ASSERT_EQ(Vocabpipe("run --direct " + full).code, 0);
    Result first_half = Vocabpipe("run --direct " + part + " --steps 2");
    ASSERT_EQ(first_half.code, 0) << first_half.output;
    const fs::path step2 = dir_ / absl::StrCat("part", p) / "step_2";
    ASSERT_TRUE(fs::exists(step2 / "model.safetensors.index.json")) << "p = " << p;
    ASSERT_FALSE(fs::exists(step2 / "model.safetensors"));
    Result resumed = Vocabpipe("run --direct " + part + " --resume");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    auto a = vp::testing::ReadJsonl(dir_ / absl::StrCat("full", p) / "metrics.jsonl");
    auto b = vp::testing::ReadJsonl(dir_ / absl::StrCat("part", p) / "metrics.jsonl");
    ASSERT_EQ(a.size(), 4u);
    ASSERT_EQ(b.size(), 4u);
    for (int i = 0; i < 4; ++i) {
      EXPECT_DOUBLE_EQ(double(a[i]["loss"]), double(b[i]["loss"])) << "p = " << p << " step " << i;
      if (p > 1 && (i + 1) % 2 == 0) {  // the time the save held the step, on saved steps
        EXPECT_GE(double(b[i]["checkpoint_seconds"]), 0.0) << b[i].dump();
      }
    }
    // The final exports: one file against the sharded form, tensor for tensor.
    auto single = vp::runtime::ReadSafetensors(
        (dir_ / absl::StrCat("full", p) / "step_4/model.safetensors").string());
    ASSERT_TRUE(single.ok()) << single.status();
    const fs::path step4 = dir_ / absl::StrCat("part", p) / "step_4";
    const auto index = nlohmann::json::parse(std::ifstream(step4 / "model.safetensors.index.json"));
    std::set<std::string> files;
    for (const auto& [name, file] : index["weight_map"].items()) files.insert(file);
    EXPECT_GE(files.size(), 3u) << "p = " << p;
    size_t seen = 0;
    for (const std::string& file : files) {
      EXPECT_TRUE(std::regex_match(file, std::regex("model-0000[1-9]-of-0000[3-9].safetensors")))
          << file;
      auto part_file = vp::runtime::ReadSafetensors((step4 / file).string());
      ASSERT_TRUE(part_file.ok()) << part_file.status();
      for (const auto& [name, t] : part_file->tensors) {
        EXPECT_EQ(index["weight_map"][name], file) << name;
        EXPECT_EQ(t.data, single->tensors.at(name).data) << "p = " << p << " " << name;
        ++seen;
      }
    }
    EXPECT_EQ(seen, single->tensors.size());
  }
}

TEST_P(CliRunModeTest, CorruptCheckpointIsRejectedAndLeftInPlace) {
  Synth(64, 20000);
  const std::string spec = WriteSpec("ck", absl::StrCat(kSmallModel, R"(
train: {steps: 2}
checkpoint: {dir: ck}
)"));
  ASSERT_EQ(Vocabpipe(Run() + spec).code, 0);
  // What a resume reads: the standalone trainer the Hugging Face checkpoint, a run through the
  // control plane (rank processes) the rank's shard.
  const fs::path model =
      dir_ / (direct() ? "ck/step_2/model.safetensors" : "ck/step_2/rank_0/model.safetensors");
  const auto size = fs::file_size(model);
  fs::resize_file(model, size - 64);
  Result r = Vocabpipe(Run() + spec + " --resume --steps 4");
  EXPECT_EQ(fs::file_size(model), size - 64);  // nothing overwritten
  // Both ways refuse to resume rather than start over from step 0 on top of lost training.
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("model.safetensors"));
  if (direct()) {
    // The standalone trainer's Hugging Face checkpoint has no manifest: the load finds the
    // truncated tensor data.
    EXPECT_THAT(r.output, HasSubstr("tensor"));
  } else {
    // The rank shard's manifest no longer matches; the only saved step is corrupt.
    EXPECT_THAT(r.output, HasSubstr("does not match its SHA-256"));
    EXPECT_THAT(r.output, HasSubstr("no checkpoint to resume from"));
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1/4")));
  }
  EXPECT_FALSE(fs::exists(dir_ / "ck/step_4"));
}

INSTANTIATE_TEST_SUITE_P(Modes, CliRunModeTest, testing::Values("control_plane", "direct"));

}  // namespace
