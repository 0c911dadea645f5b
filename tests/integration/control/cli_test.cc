// The control-plane CLI (vocabpipe submit/status/watch/cancel/workers) against real daemons:
// output formats, the VOCABPIPE_COORDINATOR variable and the documented exit codes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/integration/control/control_harness.h"
#include "tests/support/vocabpipe_cli.h"

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;

class ControlCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("vp_control_cli_");
    ASSERT_EQ(SynthData(dir_ / "data.bin").code, 0);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::string WriteSpec(const std::string& name, int steps, const std::string& extra = "") {
    const fs::path path = dir_ / (name + ".yaml");
    std::ofstream(path) << "name: " << name << "\n"
                        << "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
                        << "parallel: {pipeline: 2, microbatch_size: 2, microbatches: 4}\n"
                        << "train: {steps: " << steps << ", lr: 0.003, threads: 1" << extra << "}\n"
                        << "data: {path: data.bin, val_path: data.bin}\n";
    return path.string();
  }
  fs::path dir_;
};

TEST_F(ControlCliTest, SubmitWatchStatusWorkersCancel) {
  CoordinatorProcess c(dir_, dir_ / "c.db", {"--no-profile"});
  ASSERT_TRUE(c.up());
  const std::string flag = " --coordinator " + c.address() + " --insecure";
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{Bin("worker/main/vocabpipe-worker"), "--coordinator", c.address(),
                                 "--insecure", "--exit-with-parent", "1"},
        dir_ / absl::StrCat("w", i, ".log")));
  }
  ASSERT_TRUE(WaitFor(
      [&] {
        auto r = Vocabpipe("workers --output json" + flag);
        return r.code == 0 && nlohmann::json::parse(r.output, nullptr, false).size() == 2;
      },
      std::chrono::seconds(20)));

  // An evaluation after the last step: watch shows its validation loss.
  CliResult submit = Vocabpipe("submit " + WriteSpec("cli", 3, ", eval_every: 3") + flag);
  ASSERT_EQ(submit.code, 0) << submit.output;
  EXPECT_EQ(submit.output, "job-1\n");
  // The address from the environment instead of the flag.
  CliResult watch = Vocabpipe("VOCABPIPE_COORDINATOR=" + c.address(), "watch job-1 --insecure");
  ASSERT_NE(watch.code, -1) << "could not run vocabpipe watch";  // popen failed or a signal
  EXPECT_EQ(watch.code, 0) << watch.output;
  const std::string& watched = watch.output;
  EXPECT_THAT(watched, HasSubstr("job-1: RUNNING"));
  EXPECT_THAT(watched, HasSubstr("step 3/3"));
  EXPECT_THAT(watched, HasSubstr("tok/s | MFU"));
  EXPECT_THAT(watched, HasSubstr("step 3/3 [########################] 100% | loss "));
  EXPECT_THAT(watched, HasSubstr(" | val "));
  EXPECT_THAT(watched, HasSubstr("  rank 1 ["));
  EXPECT_THAT(watched, HasSubstr("job-1: SUCCEEDED"));

  CliResult st = Vocabpipe("status job-1 --output json" + flag);
  ASSERT_EQ(st.code, 0) << st.output;
  const nlohmann::json j = nlohmann::json::parse(st.output);
  EXPECT_EQ(j["id"], "job-1");
  EXPECT_EQ(j["state"], "SUCCEEDED");
  EXPECT_EQ(j["step"], 3);
  EXPECT_GT(double(j["loss"]), 0);
  EXPECT_GT(double(j["mfu"]), 0);
  EXPECT_EQ(j["plan"]["schedule"], "1f1b");
  EXPECT_EQ(j["plan"]["vocab"], "vocab2");
  EXPECT_EQ(j["plan"]["seq_chunks"], 1);
  ASSERT_EQ(j["stages"].size(), 2u);
  for (const auto& s : j["stages"]) {
    EXPECT_GT(int64_t(s["peak_memory_bytes"]), 0);
    EXPECT_GT(double(s["busy_seconds"]), 0);
  }
  CliResult list = Vocabpipe("status --output json" + flag);
  ASSERT_EQ(list.code, 0);
  EXPECT_EQ(nlohmann::json::parse(list.output).size(), 1u);

  // Cancel a long job once it runs; watch then exits 5.
  ASSERT_EQ(Vocabpipe("submit " + WriteSpec("long", 100000) + flag).output, "job-2\n");
  ASSERT_TRUE(WaitFor(
      [&] {
        auto r = Vocabpipe("status job-2 --output json" + flag);
        return r.code == 0 && nlohmann::json::parse(r.output)["step"] >= 1;
      },
      std::chrono::seconds(30)));
  CliResult cancel = Vocabpipe("cancel job-2 --reason enough" + flag);
  EXPECT_EQ(cancel.code, 0) << cancel.output;
  EXPECT_THAT(cancel.output, HasSubstr("CANCELLED"));
  EXPECT_EQ(Vocabpipe("watch job-2 --output json" + flag).code, 5);
  auto free_list = nlohmann::json::parse(Vocabpipe("workers --output json" + flag).output);
  for (const auto& w : free_list) EXPECT_EQ(w["job_id"], "");
}

TEST_F(ControlCliTest, ExitCodes) {
  CoordinatorProcess c(dir_, dir_ / "c.db", {"--no-profile"});
  ASSERT_TRUE(c.up());
  const std::string flag = " --coordinator " + c.address() + " --insecure";
  CliResult bad = Vocabpipe("submit " + WriteSpec("bad", 1, ", lr: -1") + flag);
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("train.lr"));
  EXPECT_EQ(Vocabpipe("status job-42" + flag).code, 3);
  EXPECT_EQ(Vocabpipe("cancel job-42" + flag).code, 3);
  EXPECT_EQ(Vocabpipe("status --output yaml" + flag).code, 2);
  unsetenv("VOCABPIPE_COORDINATOR");
  CliResult nowhere = Vocabpipe("workers");  // no flag, no variable
  EXPECT_EQ(nowhere.code, 2);
  EXPECT_THAT(nowhere.output, HasSubstr("VOCABPIPE_COORDINATOR"));
  CliResult down = Vocabpipe("workers --insecure --coordinator 127.0.0.1:1");
  EXPECT_EQ(down.code, 4) << down.output;
  EXPECT_THAT(down.output, HasSubstr("unreachable"));
}

}  // namespace

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;

class ControlCliRunTest : public ControlCliTest {};

TEST_F(ControlCliRunTest, RunThroughAnInProcessControlPlane) {
  // `vocabpipe run` goes through the control plane by default.
  CliResult run = Vocabpipe("run " + WriteSpec("local", 2) + " --output json");
  ASSERT_EQ(run.code, 0) << run.output;
  std::vector<nlohmann::json> events;
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) events.push_back(j);
  }
  int steps = 0;
  for (const auto& e : events) steps += e.contains("step");
  EXPECT_EQ(steps, 2);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["state"], "SUCCEEDED");
  // The job record is in the run folder's database; the shards next to it.
  EXPECT_TRUE(fs::exists(dir_ / "runs" / "local" / "coordinator.db"));
  EXPECT_TRUE(fs::exists(dir_ / "runs" / "local" / "step_2" / "rank_1"));
  // metrics.jsonl from the step events (each carries its merged line), the merged checkpoint
  // from rank 0.
  auto metrics = ReadJsonl(dir_ / "runs" / "local" / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(metrics[i]["step"], i);
    EXPECT_EQ(metrics[i]["stages"].size(), 2u);
    EXPECT_TRUE(metrics[i].contains("loss"));
    EXPECT_GT(double(metrics[i]["stages"][1]["predicted_memory_total"]), 0.0);
  }
  EXPECT_EQ(metrics[1]["checkpoint_step"], 2);
  EXPECT_TRUE(fs::exists(dir_ / "runs" / "local" / "step_2" / "DONE"));
}

TEST_F(ControlCliRunTest, PlanOnTheCoordinator) {
  CoordinatorProcess c(dir_, dir_ / "c.db");
  ASSERT_TRUE(c.up());
  CliResult plan = Vocabpipe("plan " + WriteSpec("p", 1) + " --coordinator " + c.address() +
                             " --insecure --output json");
  ASSERT_EQ(plan.code, 0) << plan.output;
  const auto j = nlohmann::json::parse(plan.output);
  EXPECT_EQ(j["plan"]["schedule"], "1f1b");
  EXPECT_EQ(j["plan"]["pipeline"], 2);
  EXPECT_EQ(j["candidates"].size(), 1u);
  CliResult text =
      Vocabpipe("plan " + WriteSpec("p", 1) + " --coordinator " + c.address() + " --insecure");
  EXPECT_EQ(text.code, 0);
  EXPECT_THAT(text.output, HasSubstr("plan: 1f1b + vocab2"));
}

}  // namespace
