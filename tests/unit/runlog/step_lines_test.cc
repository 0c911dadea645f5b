// The metrics.jsonl vocabulary: rank lines are checked field by field, and p rank lines merge
// into one step line (what the launcher writes and the coordinator stores with the event).
#include "proto/runlog/step_lines.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using vp::runlog::CheckRankLine;
using vp::runlog::MergeRankLines;
using vp::runlog::StepContext;

json RankLine(int rank, int64_t step, double seconds, double busy, int64_t total) {
  return {{"step", step},
          {"rank", rank},
          {"seconds", seconds},
          {"busy_seconds", busy},
          {"busy", {{"F", busy / 2}, {"B", busy / 2}}},
          {"comm", {{"C1", 0.001}}},
          {"comm_seconds", 0.001},
          {"compute_wait_seconds", 0.0},
          {"memory", {{"parameters", total / 2}, {"total", total}}},
          {"lr", 1e-3},
          {"grad_norm", 0.5},
          {"has_loss", false}};
}

TEST(CheckRankLine, AcceptsAWorkerLine) {
  EXPECT_TRUE(CheckRankLine(RankLine(0, 3, 0.1, 0.08, 1000), "line").ok());
}

TEST(CheckRankLine, NamesTheFieldAndTheRule) {
  struct Case {
    std::string key;
    json value;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"step", -1, "line.step: required, an integer >= 0"},
           {"rank", "0", "line.rank: required, an integer >= 0"},
           {"seconds", nullptr, "line.seconds: required, a number >= 0"},
           {"busy_seconds", -0.5, "line.busy_seconds: must be a number >= 0"},
           {"lr", "fast", "line.lr: must be a number"},
           {"has_loss", 1, "line.has_loss: must be true or false"},
           {"busy", json{{"F", -1}}, "line.busy.F: must be a number >= 0"},
           {"comm", 3, "line.comm: must be an object"},
           {"memory", json{{"total", 1.5}}, "line.memory.total: must be an integer >= 0"},
           {"checkpoint_step", -2, "line.checkpoint_step: must be an integer >= 0"},
           {"checkpoint_seconds", -0.1, "line.checkpoint_seconds: must be a number >= 0"},
           {"val_loss", "low", "line.val_loss: must be a number"},
           {"eval_seconds", -1, "line.eval_seconds: must be a number >= 0"},
       }) {
    json line = RankLine(0, 3, 0.1, 0.08, 1000);
    line[c.key] = c.value;
    absl::Status st = CheckRankLine(line, "line");
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << c.key;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.message)) << c.key;
  }
  json no_loss = RankLine(1, 0, 0.1, 0.1, 10);
  no_loss["has_loss"] = true;
  EXPECT_THAT(std::string(CheckRankLine(no_loss, "x").message()),
              HasSubstr("x.loss: required (a number) when has_loss is true"));
  EXPECT_FALSE(CheckRankLine(json::array(), "x").ok());
}

TEST(MergeRankLines, TakesTheSlowestRankTheLossOwnerAndThePeaks) {
  json r0 = RankLine(0, 7, 0.10, 0.06, 1000);
  json r1 = RankLine(1, 7, 0.12, 0.10, 3000);
  r1["has_loss"] = true;
  r1["loss"] = 2.5;
  r1["lr"] = 2e-3;
  const StepContext ctx{.tokens_per_step = 1200,
                        .model_flops_per_step = 6e9,
                        .peak_flops_per_rank = 1e11,
                        .predicted_memory = {1100, 2900}};
  auto merged = MergeRankLines({r0, r1}, ctx);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const json& m = *merged;
  EXPECT_EQ(m["step"], 7);
  EXPECT_DOUBLE_EQ(m["loss"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(m["lr"].get<double>(), 2e-3);  // from the rank that has the loss
  EXPECT_DOUBLE_EQ(m["step_seconds"].get<double>(), 0.12);
  EXPECT_DOUBLE_EQ(m["tokens_per_s"].get<double>(), 1200 / 0.12);
  EXPECT_DOUBLE_EQ(m["mfu"].get<double>(), 6e9 / 0.12 / 2e11);
  EXPECT_EQ(m["peak_memory_bytes"], 3000);
  EXPECT_DOUBLE_EQ(m["memory_max_over_min"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(m["busy_max_over_mean"].get<double>(), 0.10 / 0.08);
  ASSERT_EQ(m["stages"].size(), 2u);
  EXPECT_EQ(m["stages"][1]["predicted_memory_total"], 2900);
  EXPECT_EQ(m["stages"][1]["memory"]["total"], 3000);
  EXPECT_DOUBLE_EQ(m["stages"][0]["busy"]["F"].get<double>(), 0.03);
  EXPECT_FALSE(m.contains("checkpoint_step"));  // nobody saved
}

// A step faster than the ranks' peak means the peak is stale: MFU stays at 100% and the line
// says so; every line names the peak it was measured against.
TEST(MergeRankLines, MfuNeverAboveOneAndNamesItsPeak) {
  const StepContext ctx{.tokens_per_step = 1200,
                        .model_flops_per_step = 6e9,
                        .peak_flops_per_rank = 1e10,
                        .predicted_memory = {}};
  auto fast = MergeRankLines({RankLine(0, 3, 0.1, 0.1, 10), RankLine(1, 3, 0.2, 0.1, 10)}, ctx);
  ASSERT_TRUE(fast.ok()) << fast.status();
  EXPECT_DOUBLE_EQ((*fast)["mfu"].get<double>(), 1.0);  // 6e9 / 0.2 / 2e10 = 1.5
  EXPECT_TRUE((*fast)["mfu_over_peak"].get<bool>());
  EXPECT_DOUBLE_EQ((*fast)["mfu_peak_flops"].get<double>(), 1e10);
  auto slow = MergeRankLines({RankLine(0, 3, 0.1, 0.1, 10), RankLine(1, 3, 0.6, 0.1, 10)}, ctx);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_DOUBLE_EQ((*slow)["mfu"].get<double>(), 0.5);
  EXPECT_FALSE(slow->contains("mfu_over_peak"));
}

TEST(MergeRankLines, CheckpointStepOnlyWhenEveryRankSavedIt) {
  json r0 = RankLine(0, 4, 0.1, 0.1, 10), r1 = RankLine(1, 4, 0.1, 0.1, 10);
  r0["checkpoint_step"] = 5;
  auto one = MergeRankLines({r0, r1}, {});
  ASSERT_TRUE(one.ok());
  EXPECT_FALSE(one->contains("checkpoint_step"));
  r1["checkpoint_step"] = 5;
  r0["checkpoint_seconds"] = 0.25;
  r1["checkpoint_seconds"] = 0.5;
  auto both = MergeRankLines({r0, r1}, {});
  ASSERT_TRUE(both.ok());
  EXPECT_EQ((*both)["checkpoint_step"], 5);
  // The step was held by the slowest rank's save; each stage keeps its own.
  EXPECT_DOUBLE_EQ((*both)["checkpoint_seconds"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ((*both)["stages"][0]["checkpoint_seconds"].get<double>(), 0.25);
  EXPECT_EQ((*both)["mfu"], 0.0);  // no peak known
  EXPECT_FALSE(both->contains("loss"));
}

TEST(MergeRankLines, RejectsLinesOfDifferentStepsOrRanks) {
  EXPECT_THAT(
      std::string(MergeRankLines({RankLine(0, 1, 0.1, 0.1, 1), RankLine(1, 2, 0.1, 0.1, 1)}, {})
                      .status()
                      .message()),
      HasSubstr("rank 1 reported step 2, the others step 1"));
  EXPECT_THAT(
      std::string(MergeRankLines({RankLine(1, 1, 0.1, 0.1, 1), RankLine(0, 1, 0.1, 0.1, 1)}, {})
                      .status()
                      .message()),
      HasSubstr("line 0 is from rank 1"));
  EXPECT_FALSE(MergeRankLines({}, {}).ok());
}

TEST(ProgressLine, ShowsStepLossBalanceAndEta) {
  json r0 = RankLine(0, 2, 0.2, 0.1, 1 << 20);
  r0["has_loss"] = true;
  r0["loss"] = 3.25;
  const StepContext ctx{.tokens_per_step = 1000,
                        .model_flops_per_step = 0,
                        .peak_flops_per_rank = 0,
                        .predicted_memory = {}};
  auto m = MergeRankLines({r0}, ctx);
  ASSERT_TRUE(m.ok());
  const std::string line = vp::runlog::ProgressLine(*m, 10, 3725);
  EXPECT_THAT(line, HasSubstr("step 3/10 | loss 3.2500 | lr 1.00e-03 | 5000 tok/s"));
  EXPECT_THAT(line, HasSubstr("busy max/mean 1.00"));
  EXPECT_THAT(line, HasSubstr("(max 1.0 MiB) | ETA 01:02:05"));
}

TEST(MergeRankLines, CarriesTheValidationLossOfAnEvaluatedStep) {
  json r0 = RankLine(0, 9, 0.1, 0.1, 10), r1 = RankLine(1, 9, 0.1, 0.1, 10);
  auto none = MergeRankLines({r0, r1}, {});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->contains("val_loss"));
  EXPECT_THAT(vp::runlog::ProgressLine(*none, 10, 0), ::testing::Not(HasSubstr("val")));
  r1["val_loss"] = 4.125;
  r1["eval_seconds"] = 0.3;
  auto merged = MergeRankLines({r0, r1}, {});
  ASSERT_TRUE(merged.ok());
  EXPECT_DOUBLE_EQ((*merged)["val_loss"].get<double>(), 4.125);
  EXPECT_THAT(vp::runlog::ProgressLine(*merged, 10, 0), HasSubstr("| val 4.1250 |"));
}

}  // namespace
