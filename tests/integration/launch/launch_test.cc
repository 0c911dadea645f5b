// `vocabpipe run` with parallel.pipeline > 1: the real CLI binary in a child process starts real
// vocabpipe-worker processes that train over Gloo on loopback. Compared against the standalone
// run of the same spec (pipeline 1), which must give the same losses and weights.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/commands.h"
#include "proto/safefs/run_owner.h"
#include "tests/support/vocabpipe_cli.h"
#include "tests/support/weights.h"
#include "worker/runtime/safetensors.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using Result = vp::testing::CliResult;
using vp::testing::Vocabpipe;

using vp::testing::ExpectSameWeights;
using vp::testing::ReadJsonl;

std::string ReadFile(const fs::path& path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// Every test runs both ways `vocabpipe run` can run a pipeline job: "control-plane" (the
// default: an in-process coordinator and one worker daemon per rank over gRPC) and "direct"
// (--direct: the launcher starts the rank processes itself). The standalone reference is
// always `--direct` with pipeline 1, the plain single-process trainer.
class LaunchTest : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string name = testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = fs::temp_directory_path() / absl::StrCat("vp_launch_", name, "_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    Result r = Vocabpipe(absl::StrCat("data synth --vocab 64 --tokens 20000 --out ",
                                      (dir_ / "data.bin").string(), " --seed 5"));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  void TearDown() override { fs::remove_all(dir_); }

  bool direct() const { return GetParam() == "direct"; }
  // `vocabpipe run` of the pipeline job in this test's mode.
  std::string Run() const { return direct() ? "run --direct " : "run "; }

  // A tiny job: V = 64 (padded per rank), s = 16, m = 4 microbatches of b = 2. AdamW's eps is
  // 1e-5, not 1e-8: with a tiny eps Adam divides gradients that are zero in exact arithmetic
  // (the attention key bias, padding-adjacent rows) by their own rounding noise, so float
  // summation order — which differs between p ranks and one — becomes an lr-sized step.
  // The losses are compared at the default eps in TwoRanksDefaultEpsLossesMatch.
  std::string Spec(const std::string& name, int pipeline, int layers, const std::string& vocab,
                   bool tied, int steps = 5, int every = 0, double eps = 1e-5,
                   const std::string& schedule = "1f1b") {
    const fs::path path = dir_ / (name + ".yaml");
    std::ofstream(path) << absl::StrCat(
        "model: {layers: ", layers, ", hidden: 32, heads: 2, vocab_size: 64, seq_len: 16",
        tied ? ", tie_embeddings: true" : "", "}\n", "parallel: {pipeline: ", pipeline,
        ", microbatch_size: 2, microbatches: 4, vocab: ", vocab, ", schedule: ", schedule, "}\n",
        "train: {steps: ", steps, ", lr: 0.003, eps: ", eps, ", threads: 1}\n",
        "data: {path: data.bin}\ncheckpoint: {dir: ", name, ", every: ", every, "}\n");
    return path.string();
  }

  // The spec file with train.max_restarts: 0 (through the control plane a failed rank ends
  // the run instead of restarting it).
  static std::string NoRestarts(const std::string& path) {
    std::string text = ReadFile(path);
    const std::string from = "threads: 1}";
    text.replace(text.find(from), from.size(), "threads: 1, max_restarts: 0}");
    std::ofstream(path) << text;
    return path;
  }

  // Runs the spec at p and at 1 and compares per-step losses and the final weights.
  void ExpectMatchesStandalone(int pipeline, int layers, const std::string& vocab, bool tied,
                               const std::string& schedule = "1f1b") {
    const std::string p = Spec("pipe", pipeline, layers, vocab, tied, 5, 0, 1e-5, schedule);
    const std::string one = Spec("one", 1, layers, vocab, tied);
    Result rp = Vocabpipe(Run() + p + " --timeout 10");
    ASSERT_EQ(rp.code, 0) << rp.output;
    Result r1 = Vocabpipe("run --direct " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    EXPECT_THAT(rp.output, HasSubstr("step 5/5 | loss"));
    EXPECT_THAT(rp.output, HasSubstr("busy max/mean"));
    auto mp = ReadJsonl(dir_ / "pipe" / "metrics.jsonl");
    auto m1 = ReadJsonl(dir_ / "one" / "metrics.jsonl");
    ASSERT_EQ(mp.size(), 5u);
    ASSERT_EQ(m1.size(), 5u);
    for (size_t i = 0; i < 5; ++i) {
      const double a = mp[i]["loss"], b = m1[i]["loss"];
      EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "step " << i << ": " << a << " vs " << b;
      EXPECT_NEAR(double(mp[i]["grad_norm"]), double(m1[i]["grad_norm"]),
                  1e-4 * double(m1[i]["grad_norm"]))
          << "step " << i;
      // The launcher's per-stage figures: one entry per rank.
      ASSERT_TRUE(mp[i]["stages"].is_array());
      ASSERT_EQ(mp[i]["stages"].size(), size_t(pipeline));
      int64_t max_total = 0;
      for (int r = 0; r < pipeline; ++r) {
        const auto& s = mp[i]["stages"][r];
        EXPECT_EQ(int(s["rank"]), r);
        EXPECT_GT(double(s["busy_seconds"]), 0.0);
        EXPECT_GT(int64_t(s["memory"]["parameters"]), 0);
        // The stage's figure in status: the rank's real footprint (its process's peak resident
        // memory, never below the engine's accounting).
        ASSERT_TRUE(s["memory"].contains("footprint")) << s.dump();
        EXPECT_GE(int64_t(s["memory"]["footprint"]), int64_t(s["memory"]["total"]));
        EXPECT_GE(int64_t(s["memory"]["process"]), int64_t(s["memory"]["footprint"]) / 2);
        max_total = std::max(max_total, int64_t(s["memory"]["footprint"]));
        // The planner's prediction (with the engine's measured layer activation size) is
        // within 10% of the allocator's measured peak.
        EXPECT_NEAR(double(s["predicted_memory_total"]) / double(s["memory"]["total"]), 1.0, 0.1)
            << "rank " << r << " step " << i;
      }
      EXPECT_EQ(int64_t(mp[i]["peak_memory_bytes"]), max_total);
      EXPECT_GT(double(mp[i]["tokens_per_s"]), 0.0);
      EXPECT_GE(double(mp[i]["busy_max_over_mean"]), 1.0);
    }
    // Rank 0 merged the final shards into the standalone layout.
    ASSERT_TRUE(fs::exists(dir_ / "pipe/step_5/DONE"));
    for (int r = 0; r < pipeline; ++r) {
      EXPECT_TRUE(fs::exists(dir_ / "pipe/step_5" / absl::StrCat("rank_", r) / "DONE")) << r;
    }
    ExpectSameWeights(dir_ / "pipe/step_5/model.safetensors", dir_ / "one/step_5/model.safetensors",
                      1e-5);
    EXPECT_EQ(ReadFile(dir_ / "pipe/step_5/config.json"),
              ReadFile(dir_ / "one/step_5/config.json"));
  }

  fs::path dir_;
};

// Bit rot: one byte in the middle of a file flipped in place.
void FlipAByteInTheMiddle(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(fs::file_size(file) / 2);
  f.seekg(at);
  char c = 0;
  f.get(c);
  f.seekp(at);
  f.put(static_cast<char>(c ^ 0x10));
}

TEST_P(LaunchTest, TwoRanksVocab2MatchStandalone) {
  ExpectMatchesStandalone(2, 2, "vocab2", false);
}

TEST_P(LaunchTest, FourRanksVocab1TiedMatchStandalone) {
  ExpectMatchesStandalone(4, 4, "vocab1", true);
}

// The schedules of issue 14 on real worker processes: V-Half and V-Min (building blocks) and
// the aligned interlaced 1F1B block; the planner's predicted memory per rank is checked
// against the allocator's peak as in every ExpectMatchesStandalone.
TEST_P(LaunchTest, TwoRanksVHalfVocab1MatchStandalone) {
  ExpectMatchesStandalone(2, 4, "vocab1", false, "vhalf");
}

TEST_P(LaunchTest, TwoRanksVMinVocab2MatchStandalone) {
  ExpectMatchesStandalone(2, 4, "vocab2", false, "vmin");
}

TEST_P(LaunchTest, TwoRanksInterlacedMatchStandalone) {
  ExpectMatchesStandalone(2, 2, "interlaced", false);
}

TEST_P(LaunchTest, TwoRanksBaselineTiedMatchStandalone) {
  // Baseline keeps whole vocabulary layers on the first and last rank; with tied embeddings
  // the last rank's output copy must not appear twice in the merged checkpoint.
  ExpectMatchesStandalone(2, 2, "baseline", true);
}

TEST_P(LaunchTest, TwoRanksDefaultEpsLossesMatch) {
  const std::string p = Spec("pipe", 2, 2, "vocab2", false, 5, 0, 1e-8);
  const std::string one = Spec("one", 1, 2, "vocab2", false, 5, 0, 1e-8);
  ASSERT_EQ(Vocabpipe(Run() + p).code, 0);
  ASSERT_EQ(Vocabpipe("run --direct " + one).code, 0);
  auto mp = ReadJsonl(dir_ / "pipe" / "metrics.jsonl");
  auto m1 = ReadJsonl(dir_ / "one" / "metrics.jsonl");
  ASSERT_EQ(mp.size(), 5u);
  ASSERT_EQ(m1.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const double a = mp[i]["loss"], b = m1[i]["loss"];
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "step " << i;
  }
}

TEST_P(LaunchTest, CheckpointsMergedInTheBackgroundEqualTheStandaloneOnes) {
  // Rank 0 merges each step's shards on a background thread while the ranks train on; with a
  // save after every step, merges overlap the next steps. Each merged checkpoint must still be
  // complete (DONE, config.json) and equal the standalone trainer's
  // checkpoint of the same step.
  const std::string pipe = Spec("pipe", 2, 2, "vocab2", true, /*steps=*/5, /*every=*/1);
  const std::string one = Spec("one", 1, 2, "vocab2", true, /*steps=*/5, /*every=*/1);
  Result rp = Vocabpipe(Run() + pipe);
  ASSERT_EQ(rp.code, 0) << rp.output;
  Result r1 = Vocabpipe("run --direct " + one);
  ASSERT_EQ(r1.code, 0) << r1.output;
  for (int step = 1; step <= 5; ++step) {
    const fs::path dir = dir_ / absl::StrCat("pipe/step_", step);
    EXPECT_TRUE(fs::exists(dir / "DONE")) << step;
    EXPECT_EQ(ReadFile(dir / "config.json"),
              ReadFile(dir_ / absl::StrCat("one/step_", step, "/config.json")));
    ExpectSameWeights(dir / "model.safetensors",
                      dir_ / absl::StrCat("one/step_", step, "/model.safetensors"), 1e-5);
  }
}

TEST_P(LaunchTest, ExportRebuildsTheMergedCheckpoint) {
  // Checkpoint every 2 steps: shards at steps 2 and 4.
  const std::string spec = Spec("exp", 2, 2, "interlaced", false, /*steps=*/4, /*every=*/2);
  Result r = Vocabpipe(Run() + spec);
  ASSERT_EQ(r.code, 0) << r.output;
  const fs::path run = dir_ / "exp";
  const std::string merged = ReadFile(run / "step_4/model.safetensors");
  ASSERT_FALSE(merged.empty());
  fs::remove(run / "step_4/model.safetensors");
  fs::remove(run / "step_4/DONE");
  fs::remove(run / "step_2/DONE");
  // The data has a tokenizer now: export copies it next to the merged checkpoint.
  fs::remove(run / "step_4/tokenizer.model");
  {
    std::ofstream tok(dir_ / "tokenizer.model", std::ios::binary);
    tok << "tokenizer bytes \x01\x02";
  }

  std::ostringstream out, err;
  EXPECT_EQ(vp::cli::RunExportCommand({run.string()}, out, err), 0) << err.str();
  EXPECT_THAT(out.str(), HasSubstr("exported step 4 of 2 ranks"));
  EXPECT_EQ(ReadFile(run / "step_4/tokenizer.model"), ReadFile(dir_ / "tokenizer.model"));
  fs::remove(dir_ / "tokenizer.model");
  EXPECT_EQ(ReadFile(run / "step_4/model.safetensors"), merged);  // bit-identical re-merge
  EXPECT_TRUE(fs::exists(run / "step_4/DONE"));

  std::ostringstream out2, err2;
  EXPECT_EQ(vp::cli::RunExportCommand({run.string(), "--step", "2"}, out2, err2), 0) << err2.str();
  EXPECT_TRUE(fs::exists(run / "step_2/DONE"));
  auto w2 = vp::runtime::ReadSafetensors((run / "step_2/model.safetensors").string());
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_EQ(w2->tensors.at("transformer.wte.weight").shape, (std::vector<int64_t>{64, 32}));

  // A step whose shards are missing, and a folder that is no run: clear errors.
  std::ostringstream out3, err3;
  EXPECT_EQ(vp::cli::RunExportCommand({run.string(), "--step", "3"}, out3, err3), 1);
  EXPECT_THAT(err3.str(), HasSubstr("rank 0 has not saved step 3"));
  std::ostringstream out4, err4;
  EXPECT_EQ(vp::cli::RunExportCommand({dir_.string()}, out4, err4), 2);
  EXPECT_THAT(err4.str(), HasSubstr("is not a pipeline run directory"));
}

TEST_P(LaunchTest, ResumeContinuesFromTheShards) {
  const std::string full = Spec("full", 2, 2, "vocab2", false, /*steps=*/6, /*every=*/3);
  const std::string part = Spec("part", 2, 2, "vocab2", false, /*steps=*/6, /*every=*/3);
  ASSERT_EQ(Vocabpipe(Run() + full).code, 0);
  Result first = Vocabpipe(Run() + part + " --steps 3");
  ASSERT_EQ(first.code, 0) << first.output;
  Result resumed = Vocabpipe(Run() + part + " --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("step 4/6"));
  EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr("step 3/6")));
  auto a = ReadJsonl(dir_ / "full/metrics.jsonl");
  auto b = ReadJsonl(dir_ / "part/metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(int(b[i]["step"]), i);
    EXPECT_DOUBLE_EQ(double(a[i]["loss"]), double(b[i]["loss"])) << "step " << i;
  }
  ExpectSameWeights(dir_ / "part/step_6/model.safetensors", dir_ / "full/step_6/model.safetensors",
                    0.0);
}

TEST_P(LaunchTest, CorruptNewestCheckpointFallsBackToThePreviousOne) {
  // Checkpoints at 2 and 4; a byte flipped inside rank 1's newest shard must be caught by its
  // manifest, and the resume must continue from step 2 and still end where an uninterrupted
  // run ends.
  const std::string full = Spec("full", 2, 2, "vocab2", false, /*steps=*/6, /*every=*/2);
  const std::string part = Spec("part", 2, 2, "vocab2", false, /*steps=*/6, /*every=*/2);
  ASSERT_EQ(Vocabpipe(Run() + full).code, 0);
  Result first = Vocabpipe(Run() + part + " --steps 4");
  ASSERT_EQ(first.code, 0) << first.output;
  const fs::path shard = dir_ / "part/step_4/rank_1/model.safetensors";
  const fs::path manifest = dir_ / "part/step_4/rank_1/MANIFEST.json";
  ASSERT_TRUE(fs::exists(manifest));
  const nlohmann::json m = nlohmann::json::parse(ReadFile(manifest));
  EXPECT_EQ(m["step"], 4);
  EXPECT_EQ(m["rank"], 1);
  EXPECT_EQ(m["world"], 2);
  EXPECT_FALSE(m["run_id"].get<std::string>().empty());
  EXPECT_EQ(m["files"]["model.safetensors"]["sha256"].get<std::string>().size(), 64u);
  FlipAByteInTheMiddle(shard);  // of the tensor data: the header still parses
  Result resumed = Vocabpipe(Run() + part + " --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("checkpoint of step 4 skipped"));
  EXPECT_THAT(resumed.output, HasSubstr("does not match its SHA-256"));
  EXPECT_THAT(resumed.output, HasSubstr("step 3/6"));
  EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr("step 2/6")));
  auto a = ReadJsonl(dir_ / "full/metrics.jsonl");
  auto b = ReadJsonl(dir_ / "part/metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_DOUBLE_EQ(double(a[i]["loss"]), double(b[i]["loss"])) << "step " << i;
  }
  ExpectSameWeights(dir_ / "part/step_6/model.safetensors", dir_ / "full/step_6/model.safetensors",
                    0.0);
}

TEST_P(LaunchTest, ResumeWhoseOnlyCheckpointIsCorruptFailsNamingTheFile) {
  // One checkpoint (step 2) and a byte flipped inside rank 1's shard: no step verifies, but
  // training was saved, so the resume must refuse (exit 1, naming the file) instead of
  // silently training again from step 0. Through the control plane the worker refuses the
  // task, so the job fails at once instead of restarting.
  const std::string part = Spec("part", 2, 2, "vocab2", false, /*steps=*/4, /*every=*/2);
  Result first = Vocabpipe(Run() + part + " --steps 2");
  ASSERT_EQ(first.code, 0) << first.output;
  const fs::path shard = dir_ / "part/step_2/rank_1/model.safetensors";
  FlipAByteInTheMiddle(shard);
  Result resumed = Vocabpipe(Run() + part + " --resume");
  EXPECT_EQ(resumed.code, 1) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("rank_1/model.safetensors"));
  EXPECT_THAT(resumed.output, HasSubstr("does not match its SHA-256"));
  EXPECT_THAT(resumed.output, HasSubstr("no checkpoint to resume from"));
  EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr("step 1/4")));
  EXPECT_FALSE(fs::exists(dir_ / "part/step_4"));
  EXPECT_TRUE(fs::exists(shard));  // left in place for the operator
}

TEST_P(LaunchTest, KeepLastRemovesOlderCheckpoints) {
  const fs::path path = Spec("keep", 2, 2, "vocab2", false, /*steps=*/8, /*every=*/2);
  {  // checkpoint.keep_last: 2
    std::string text = ReadFile(path);
    const std::string from = "every: 2}";
    text.replace(text.find(from), from.size(), "every: 2, keep_last: 2}");
    std::ofstream(path) << text;
  }
  Result r = Vocabpipe(Run() + path.string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "keep/step_2"));
  EXPECT_FALSE(fs::exists(dir_ / "keep/step_4"));
  EXPECT_TRUE(fs::exists(dir_ / "keep/step_6/rank_1/MANIFEST.json"));
  EXPECT_TRUE(fs::exists(dir_ / "keep/step_8/DONE"));
  EXPECT_TRUE(fs::exists(dir_ / "keep/step_8/rank_0/MANIFEST.json"));
}

// `vocabpipe run SPEC --timeout T [--direct]` in a child process whose output goes to `log`.
pid_t StartRun(const std::string& spec, const std::string& timeout, const fs::path& log,
               bool direct) {
  const std::string bin = absl::StrCat(VP_BINARY_DIR, "/client/vocabpipe");
  std::vector<std::string> argv = {bin, "run", spec, "--timeout", timeout};
  if (direct) argv.push_back("--direct");
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, bin.c_str(), &actions, nullptr, args.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// Waits until the file has content (a worker reported a step), at most 30 s.
bool WaitForReport(const fs::path& jsonl) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    if (fs::exists(jsonl) && fs::file_size(jsonl) > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Waits for the launcher to exit within `limit`; kills it (and fails) otherwise. Returns the
// wait status.
int WaitExit(pid_t launcher, std::chrono::seconds limit, const fs::path& log) {
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(launcher, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - start < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    kill(launcher, SIGKILL);
    waitpid(launcher, &status, 0);
    ADD_FAILURE() << "vocabpipe run did not exit within " << limit.count() << " s\n"
                  << ReadFile(log);
  }
  return status;
}

// Starts `vocabpipe run` and returns once rank 1 of run folder `run` has reported a step;
// -1 (after recording a failure and stopping the run) if it never does.
pid_t StartRunUntilRank1Reports(const std::string& spec, const std::string& timeout,
                                const fs::path& log, const std::string& run, bool direct) {
  const pid_t launcher = StartRun(spec, timeout, log, direct);
  if (launcher <= 0) return -1;
  if (!WaitForReport(log.parent_path() / run / "rank_1.jsonl")) {
    kill(launcher, SIGKILL);
    waitpid(launcher, nullptr, 0);
    ADD_FAILURE() << "rank 1 never reported a step\n" << ReadFile(log);
    return -1;
  }
  return launcher;
}

TEST_P(LaunchTest, KilledWorkerFailsTheRunNamingTheRank) {
  const std::string spec = NoRestarts(Spec("kill", 2, 2, "vocab2", false, /*steps=*/100000));
  const fs::path log = dir_ / "launcher.out";
  // Once rank 1 has reported a step, SIGKILL it.
  const pid_t launcher = StartRunUntilRank1Reports(spec, "5", log, "kill", direct());
  ASSERT_GT(launcher, 0);
  const pid_t victim = std::stoi(ReadFile(dir_ / "kill/rank_1.pid"));
  const pid_t survivor = std::stoi(ReadFile(dir_ / "kill/rank_0.pid"));
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  // Exit within the timeout (5 s) plus the launcher's SIGTERM grace (2 s) and slack.
  const int status = WaitExit(launcher, std::chrono::seconds(12), log);
  const std::string output = ReadFile(log);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 1) << output;
  if (direct()) {
    EXPECT_THAT(output, HasSubstr("vocabpipe run: rank 1 failed: killed by signal 9"));
  } else {
    EXPECT_THAT(output,
                ::testing::ContainsRegex("vocabpipe run: rank 1 [^\\n]*killed by signal 9"));
    EXPECT_THAT(output, HasSubstr("FAILED"));
  }
  EXPECT_NE(kill(survivor, 0), 0) << "rank 0 outlived the run";
  // Steps every rank finished before the kill are in the metrics.
  EXPECT_FALSE(ReadJsonl(dir_ / "kill/metrics.jsonl").empty());
}

TEST_P(LaunchTest, SigtermedRankSavesAnEmergencyCheckpointThatTheResumeContinuesFrom) {
  // Graceful preemption of a rank process (Slurm sends SIGTERM to the job's processes): the
  // ranks agree on a step, both save it and exit with code 75. Directly, the launcher names the
  // step and `run --resume` continues from it; through the control plane the job restarts on
  // its own. Either way the losses and final weights equal an uninterrupted run's.
  const std::string full = Spec("full", 2, 2, "vocab2", false, /*steps=*/150);
  const std::string part = Spec("part", 2, 2, "vocab2", false, /*steps=*/150);
  ASSERT_EQ(Vocabpipe(Run() + full).code, 0);
  const fs::path log = dir_ / "launcher.out";
  const pid_t launcher = StartRunUntilRank1Reports(part, "5", log, "part", direct());
  ASSERT_GT(launcher, 0);
  ASSERT_EQ(kill(std::stoi(ReadFile(dir_ / "part/rank_1.pid")), SIGTERM), 0);
  const int status = WaitExit(launcher, std::chrono::seconds(60), log);
  std::string output = ReadFile(log);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(output, m, std::regex("emergency checkpoint of step ([0-9]+)")))
      << output;
  const int saved = std::stoi(m[1]);
  ASSERT_LT(saved, 150) << output;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(
        fs::exists(dir_ / absl::StrCat("part/step_", saved, "/rank_", r, "/MANIFEST.json")));
  }
  EXPECT_TRUE(fs::exists(dir_ / absl::StrCat("part/step_", saved, "/model.safetensors")));
  if (direct()) {
    EXPECT_EQ(WEXITSTATUS(status), 1) << output;
    EXPECT_THAT(output, HasSubstr("exit code 75"));
    Result resumed = Vocabpipe(Run() + part + " --resume");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_THAT(resumed.output, HasSubstr(absl::StrCat("step ", saved + 1, "/150")));
    EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr(absl::StrCat("step ", saved, "/150"))));
  } else {
    EXPECT_EQ(WEXITSTATUS(status), 0) << output;  // restarted from the saved step, succeeded
    EXPECT_THAT(output, HasSubstr("restart 1 of 3"));
  }
  auto a = ReadJsonl(dir_ / "full/metrics.jsonl");
  auto b = ReadJsonl(dir_ / "part/metrics.jsonl");
  ASSERT_EQ(a.size(), 150u);
  ASSERT_EQ(b.size(), 150u);
  for (int i = 0; i < 150; ++i) {
    EXPECT_EQ(int(b[i]["step"]), i);
    EXPECT_DOUBLE_EQ(double(a[i]["loss"]), double(b[i]["loss"])) << "step " << i;
  }
  ExpectSameWeights(dir_ / "part/step_150/model.safetensors",
                    dir_ / "full/step_150/model.safetensors", 0.0);
}

TEST_P(LaunchTest, StuckWorkerIsTimedOutAndKilled) {
  // A rank that stops answering (SIGSTOP: alive, holding its sockets open) must not hang the
  // run: its peer's Gloo call times out, the launcher names that failure and SIGKILLs the
  // stuck rank after waiting the timeout for it.
  const std::string spec = NoRestarts(Spec("stuck", 2, 2, "vocab2", false, /*steps=*/100000));
  const fs::path log = dir_ / "launcher.out";
  const pid_t launcher = StartRunUntilRank1Reports(spec, "2", log, "stuck", direct());
  ASSERT_GT(launcher, 0);
  const pid_t stuck = std::stoi(ReadFile(dir_ / "stuck/rank_1.pid"));
  ASSERT_EQ(kill(stuck, SIGSTOP), 0);
  // Gloo timeout 2 s + launcher wait 2.5 s + SIGTERM grace 2 s, with slack.
  const int status = WaitExit(launcher, std::chrono::seconds(14), log);
  const std::string output = ReadFile(log);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 1) << output;
  EXPECT_THAT(output, HasSubstr("Timed out"));
  if (direct()) {
    EXPECT_THAT(output, HasSubstr("rank 0 failed: exit code 1"));
    EXPECT_THAT(output, HasSubstr("then rank 1: killed by signal 9"));
  } else {
    EXPECT_THAT(output, ::testing::ContainsRegex("vocabpipe run: rank 0 [^\\n]*exit code 1"));
  }
  EXPECT_NE(kill(stuck, 0), 0) << "the stuck rank outlived the run";
}

TEST_P(LaunchTest, SecondJobInTheSameRunDirectoryIsRefused) {
  const std::string spec = NoRestarts(Spec("busy", 2, 2, "vocab2", false, /*steps=*/100000));
  const fs::path log = dir_ / "launcher.out";
  const pid_t launcher = StartRunUntilRank1Reports(spec, "5", log, "busy", direct());
  ASSERT_GT(launcher, 0);
  const std::string job_yaml = ReadFile(dir_ / "busy/job.yaml");
  // Another job (other steps) naming the same checkpoint.dir.
  const std::string other = NoRestarts(Spec("busy", 2, 2, "vocab2", false, /*steps=*/3));
  Result second = Vocabpipe(Run() + other + " --timeout 5");
  EXPECT_NE(second.code, 0) << second.output;
  EXPECT_THAT(second.output,
              HasSubstr("checkpoint.dir " + (dir_ / "busy").string() + " is in use by run "));
  // The first job's files are untouched and it is still running.
  EXPECT_EQ(ReadFile(dir_ / "busy/job.yaml"), job_yaml);
  EXPECT_EQ(waitpid(launcher, nullptr, WNOHANG), 0) << ReadFile(log);
  // End it the way a failure does (its launcher then stops the other rank).
  ASSERT_EQ(kill(std::stoi(ReadFile(dir_ / "busy/rank_1.pid")), SIGKILL), 0);
  WaitExit(launcher, std::chrono::seconds(15), log);
  const pid_t rank0 = std::stoi(ReadFile(dir_ / "busy/rank_0.pid"));
  for (int i = 0; i < 100 && kill(rank0, 0) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Once it is gone, the directory is free again.
  Result third = Vocabpipe(Run() + other + " --timeout 10");
  EXPECT_EQ(third.code, 0) << third.output;
}

// A link planted in the run folder where a rank's log belongs is refused, naming it, before
// anything runs; its target is neither written nor truncated. Without it the run goes on and
// the folder gets its owner: the account that runs it.
TEST_P(LaunchTest, ALinkPlantedInTheRunFolderIsRefused) {
  const std::string spec = NoRestarts(Spec("evil", 2, 2, "vocab2", false, /*steps=*/2));
  const fs::path victim = dir_ / "victim.txt";
  std::ofstream(victim) << "not a log\n";
  const auto mtime = fs::last_write_time(victim);
  fs::create_directories(dir_ / "evil");
  fs::create_symlink(victim, dir_ / "evil" / "rank_0.log");
  Result refused = Vocabpipe(Run() + spec + " --timeout 10");
  EXPECT_NE(refused.code, 0) << refused.output;
  EXPECT_THAT(refused.output,
              HasSubstr((dir_ / "evil" / "rank_0.log").string() + " is a symbolic link"));
  EXPECT_EQ(ReadFile(victim), "not a log\n");
  EXPECT_EQ(fs::last_write_time(victim), mtime);
  EXPECT_FALSE(fs::exists(dir_ / "evil" / "job.yaml"));
  fs::remove(dir_ / "evil" / "rank_0.log");
  Result ok = Vocabpipe(Run() + spec + " --timeout 10");
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_EQ(ReadFile(dir_ / "evil" / "OWNER"), vp::safefs::LocalUserName() + "\n");
  EXPECT_FALSE(fs::is_symlink(dir_ / "evil" / "rank_0.log"));
}

INSTANTIATE_TEST_SUITE_P(Modes, LaunchTest, testing::Values("control-plane", "direct"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
