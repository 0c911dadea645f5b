// MetricsExporter: steps recorded, then /metrics scraped over HTTP from the exposer.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/metrics/metrics.h"
#include "tests/integration/metrics/http.h"

namespace vp::metrics {
namespace {

using testing::Find;
using testing::HttpGet;
using testing::ParseExposition;
using testing::Sample;
using Labels = std::map<std::string, std::string>;

// One merged step of a 2-stage run, shaped like a line of metrics.jsonl.
nlohmann::json StepJson(int64_t step, double step_seconds, double mfu, double loss) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "busy_max_over_mean": 1.09, "grad_norm": 1.19, "lr": 0.0003, "memory_max_over_min": 1.04,
    "peak_memory_bytes": 11649536, "tokens_per_s": 4000.0,
    "stages": [
      {"rank": 0, "seconds": 0.05, "busy_seconds": 0.03,
       "busy": {"F": 0.01, "S": 0.015, "T": 0.005},
       "compute_wait_seconds": 0.02, "comm_seconds": 0.04, "comm": {"C1": 0.025, "SEND_ACT": 0.015},
       "memory": {"activations": 2395648, "gradients": 2313472, "optimizer": 4626944,
                  "parameters": 2313472, "total": 11649536},
       "predicted_memory_total": 11500000},
      {"rank": 1, "seconds": 0.06, "busy_seconds": 0.024,
       "busy": {"F": 0.004, "S": 0.012, "T": 0.008},
       "compute_wait_seconds": 0.03, "comm_seconds": 0.035, "comm": {"C1": 0.02, "RECV_ACT": 0.015},
       "memory": {"activations": 2035200, "gradients": 2297600, "optimizer": 4595200,
                  "parameters": 2297600, "total": 11225600},
       "predicted_memory_total": 11300000}
    ]})");
  j.update({{"step", step}, {"step_seconds", step_seconds}, {"mfu", mfu}, {"loss", loss}});
  return j;
}

std::vector<Sample> ScrapeHttp(const MetricsExporter& exporter) {
  absl::StatusOr<testing::HttpResponse> r = HttpGet(exporter.port(), "/metrics");
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  EXPECT_EQ(r->status, 200) << r->body;
  return ParseExposition(r->body);
}

std::unique_ptr<MetricsExporter> Listening() {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> e = MetricsExporter::Create("127.0.0.1:0");
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Without a listener: no HTTP server to stop (civetweb takes ~2 s to stop).
std::unique_ptr<MetricsExporter> Quiet() {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> e = MetricsExporter::Create("");
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

const Labels kJob = {{"training_job", "job-1"}, {"schedule", "1f1b"}, {"vocab", "vocab-2"}};

Labels StageLabels(int stage, std::map<std::string, std::string> extra = {}) {
  extra["training_job"] = "job-1";
  extra["stage"] = std::to_string(stage);
  extra["replica"] = "0";  // one replica: every rank is replica 0 of its stage
  extra["tensor"] = "0";   // and tensor rank 0 (t = 1)
  extra["rank"] = std::to_string(stage);
  return extra;
}

TEST(MetricsExporter, ScrapeOverHttpHasRecordedStepFigures) {
  auto exporter = Listening();
  ASSERT_NE(exporter, nullptr);
  ASSERT_GT(exporter->port(), 0);
  ASSERT_TRUE(exporter->RecordStep("job-1", "1f1b", "vocab-2", StepJson(0, 0.06, 0.07, 9.5)).ok());
  nlohmann::json evaluated = StepJson(1, 0.08, 0.09, 9.0);
  evaluated["val_loss"] = 9.25;  // an evaluation followed this step
  ASSERT_TRUE(exporter->RecordStep("job-1", "1f1b", "vocab-2", evaluated).ok());

  const std::vector<Sample> s = ScrapeHttp(*exporter);
  EXPECT_EQ(Find(s, "vocabpipe_val_loss", kJob), 9.25);
  // Gauges hold the latest step.
  EXPECT_EQ(Find(s, "vocabpipe_mfu_ratio", kJob), 0.09);
  EXPECT_EQ(Find(s, "vocabpipe_loss", kJob), 9.0);
  EXPECT_EQ(Find(s, "vocabpipe_learning_rate", kJob), 0.0003);
  EXPECT_EQ(Find(s, "vocabpipe_grad_norm", kJob), 1.19);
  EXPECT_EQ(Find(s, "vocabpipe_tokens_per_second", kJob), 4000.0);
  EXPECT_EQ(Find(s, "vocabpipe_last_step", kJob), 1);
  EXPECT_EQ(Find(s, "vocabpipe_last_step_duration_seconds", kJob), 0.08);
  EXPECT_EQ(Find(s, "vocabpipe_peak_memory_bytes", kJob), 11649536);
  EXPECT_EQ(Find(s, "vocabpipe_stage_busy_imbalance", kJob), 1.09);
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_imbalance", kJob), 1.04);
  EXPECT_EQ(Find(s, "vocabpipe_job_info", kJob), 1);
  // Counters sum the steps: tokens = tokens_per_s x step seconds.
  EXPECT_EQ(Find(s, "vocabpipe_steps_total", kJob), 2);
  EXPECT_NEAR(Find(s, "vocabpipe_tokens_total", kJob).value_or(-1), 4000 * (0.06 + 0.08), 1e-9);
  EXPECT_EQ(Find(s, "vocabpipe_step_duration_seconds_count", kJob), 2);
  EXPECT_NEAR(Find(s, "vocabpipe_step_duration_seconds_sum", kJob).value_or(-1), 0.14, 1e-12);
  Labels le = kJob;
  le["le"] = "0.05";
  EXPECT_EQ(Find(s, "vocabpipe_step_duration_seconds_bucket", le), 0);
  le["le"] = "0.1";
  EXPECT_EQ(Find(s, "vocabpipe_step_duration_seconds_bucket", le), 2);
  // Bubble of the last step: 1 - (0.03 + 0.024) / (2 x 0.08).
  EXPECT_NEAR(Find(s, "vocabpipe_pipeline_bubble_ratio", kJob).value_or(-1), 1 - 0.054 / 0.16,
              1e-12);

  // Per stage.
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", StageLabels(1, {{"kind", "activations"}})),
            2035200);
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", StageLabels(0, {{"kind", "total"}})), 11649536);
  EXPECT_EQ(Find(s, "vocabpipe_stage_predicted_memory_bytes", StageLabels(0, {{"kind", "total"}})),
            11500000);
  EXPECT_NEAR(Find(s, "vocabpipe_pass_seconds_total", StageLabels(0, {{"pass", "S"}})).value_or(-1),
              2 * 0.015, 1e-12);
  EXPECT_NEAR(Find(s, "vocabpipe_pass_seconds_total", StageLabels(1, {{"pass", "T"}})).value_or(-1),
              2 * 0.008, 1e-12);
  EXPECT_NEAR(
      Find(s, "vocabpipe_comm_seconds_total", StageLabels(1, {{"kind", "RECV_ACT"}})).value_or(-1),
      2 * 0.015, 1e-12);
  EXPECT_NEAR(Find(s, "vocabpipe_stage_busy_seconds_total", StageLabels(1)).value_or(-1), 2 * 0.024,
              1e-12);
  EXPECT_NEAR(Find(s, "vocabpipe_stage_compute_wait_seconds_total", StageLabels(0)).value_or(-1),
              2 * 0.02, 1e-12);
  EXPECT_NEAR(Find(s, "vocabpipe_stage_busy_ratio", StageLabels(0)).value_or(-1), 0.03 / 0.08,
              1e-12);
  // A pass a stage never ran has no series.
  EXPECT_FALSE(Find(s, "vocabpipe_pass_seconds_total", StageLabels(0, {{"pass", "B"}})));

  // Prometheus owns `job` and `instance`; no series of ours may carry them.
  int ours = 0;
  for (const Sample& sample : s) {
    EXPECT_EQ(sample.labels.count("job"), 0u) << sample.name;
    EXPECT_EQ(sample.labels.count("instance"), 0u) << sample.name;
    ours += sample.name.starts_with("vocabpipe_");
  }

  absl::StatusOr<testing::HttpResponse> r = HttpGet(exporter->port(), "/metrics");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->body.find("# TYPE vocabpipe_step_duration_seconds histogram"), std::string::npos);
  EXPECT_NE(r->body.find("# TYPE vocabpipe_pass_seconds_total counter"), std::string::npos);
  EXPECT_NE(r->body.find("# TYPE vocabpipe_mfu_ratio gauge"), std::string::npos);
  // The HTTP body holds Scrape()'s series (plus the exposer's own exposer_* series).
  EXPECT_EQ(ours, static_cast<int>(ParseExposition(exporter->Scrape()).size()));
  EXPECT_GT(ours, 40);
  EXPECT_EQ(HttpGet(exporter->port(), "/nothing")->status, 404);
}

TEST(MetricsExporter, MalformedStepIsRejectedAndRecordsNothing) {
  auto e = MetricsExporter::Create("");
  ASSERT_TRUE(e.ok());
  MetricsExporter& exporter = **e;
  EXPECT_EQ(exporter.port(), 0);
  struct Case {
    nlohmann::json step;
    std::string field;
  };
  nlohmann::json negative_pass = StepJson(0, 0.1, 0.1, 1);
  negative_pass["stages"][1]["busy"]["S"] = -1.0;
  nlohmann::json string_mfu = StepJson(0, 0.1, 0.1, 1);
  string_mfu["mfu"] = "high";
  nlohmann::json no_step = StepJson(0, 0.1, 0.1, 1);
  no_step.erase("step");
  nlohmann::json no_duration = {{"step", 3}, {"mfu", 0.5}};
  const std::vector<Case> cases = {{nlohmann::json::array(), "step:"},
                                   {negative_pass, "step.stages[1].busy.S"},
                                   {string_mfu, "step.mfu"},
                                   {no_step, "step.step"},
                                   {no_duration, "step.step_seconds"}};
  for (const Case& c : cases) {
    absl::Status st = exporter.RecordStep("bad", "1f1b", "vocab-1", c.step);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(st.message().find(c.field), std::string::npos) << st.message();
  }
  for (const Sample& s : ParseExposition(exporter.Scrape())) {
    EXPECT_NE(s.labels.count("training_job") ? s.labels.at("training_job") : "", "bad") << s.name;
  }
  EXPECT_EQ(exporter.RecordStep("", "1f1b", "vocab-1", StepJson(0, 0.1, 0.1, 1)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsExporter, StepSecondsDerivedFromSlowestStage) {
  auto e = MetricsExporter::Create("");
  ASSERT_TRUE(e.ok());
  nlohmann::json step = StepJson(0, 0, 0.2, 3);
  step.erase("step_seconds");
  ASSERT_TRUE((*e)->RecordStep("job-1", "1f1b", "vocab-2", step).ok());
  const std::vector<Sample> s = ParseExposition((*e)->Scrape());
  EXPECT_EQ(Find(s, "vocabpipe_last_step_duration_seconds", kJob), 0.06);
}

// Data parallelism: the rank lines name their stage and replica, and every per-rank series
// carries both, so two replicas of stage 0 are two series of stage="0"; a bad coordinate is
// refused like any other malformed field.
TEST(MetricsExporter, ReplicasOfAStageAreLabelledByStageAndReplica) {
  auto e = MetricsExporter::Create("");
  ASSERT_TRUE(e.ok());
  nlohmann::json step = StepJson(0, 0.06, 0.2, 3);
  step["stages"][0].update({{"stage", 0}, {"replica", 0}});
  step["stages"][1].update({{"stage", 0}, {"replica", 1}});
  ASSERT_TRUE((*e)->RecordStep("job-1", "1f1b", "vocab-2", step).ok());
  const std::vector<Sample> s = ParseExposition((*e)->Scrape());
  const Labels replica1 = {{"training_job", "job-1"}, {"stage", "0"}, {"replica", "1"},
                           {"tensor", "0"},           {"rank", "1"},  {"kind", "total"}};
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", replica1), 11225600);
  Labels replica0 = replica1;
  replica0["replica"] = "0";
  replica0["rank"] = "0";
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", replica0), 11649536);
  nlohmann::json bad = StepJson(1, 0.06, 0.2, 3);
  bad["stages"][1]["replica"] = -1;
  const absl::Status st = (*e)->RecordStep("job-1", "1f1b", "vocab-2", bad);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("stages[1].replica"));
}

// Tensor parallelism: the two tensor ranks of a stage are two series of stage="0", told apart
// by tensor="0" / tensor="1"; a bad tensor rank is refused.
TEST(MetricsExporter, TensorRanksOfAStageAreLabelledByTensor) {
  auto e = MetricsExporter::Create("");
  ASSERT_TRUE(e.ok());
  nlohmann::json step = StepJson(0, 0.06, 0.2, 3);
  step["stages"][0].update({{"stage", 0}, {"replica", 0}, {"tensor", 0}});
  step["stages"][1].update({{"stage", 0}, {"replica", 0}, {"tensor", 1}});
  ASSERT_TRUE((*e)->RecordStep("job-1", "1f1b", "vocab-2", step).ok());
  const std::vector<Sample> s = ParseExposition((*e)->Scrape());
  Labels tensor1 = {{"training_job", "job-1"}, {"stage", "0"}, {"replica", "0"},
                    {"tensor", "1"},           {"rank", "1"},  {"kind", "total"}};
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", tensor1), 11225600);
  Labels tensor0 = tensor1;
  tensor0["tensor"] = "0";
  tensor0["rank"] = "0";
  EXPECT_EQ(Find(s, "vocabpipe_stage_memory_bytes", tensor0), 11649536);
  nlohmann::json bad = StepJson(1, 0.06, 0.2, 3);
  bad["stages"][1]["tensor"] = -1;
  const absl::Status st = (*e)->RecordStep("job-1", "1f1b", "vocab-2", bad);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("stages[1].tensor"));
}

TEST(MetricsExporter, ScheduleAndVocabAreFixedByFirstStep) {
  auto e = MetricsExporter::Create("");
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->RecordStep("job-1", "1f1b", "vocab-2", StepJson(0, 0.1, 0.1, 1)).ok());
  absl::Status st = (*e)->RecordStep("job-1", "vhalf", "vocab-2", StepJson(1, 0.1, 0.1, 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("schedule"), std::string::npos) << st.message();
  st = (*e)->RecordStep("job-1", "1f1b", "naive", StepJson(1, 0.1, 0.1, 1));
  EXPECT_NE(st.message().find("vocab"), std::string::npos) << st.message();
  EXPECT_EQ(Find(ParseExposition((*e)->Scrape()), "vocabpipe_steps_total", kJob), 1);
}

TEST(MetricsExporter, JobStateGaugeIsOneHot) {
  auto exporter = Quiet();
  ASSERT_NE(exporter, nullptr);
  ASSERT_TRUE(exporter->SetJobState("job-1", "RUNNING").ok());
  ASSERT_TRUE(exporter->SetJobState("job-1", "SUCCEEDED").ok());
  ASSERT_TRUE(exporter->SetJobState("job-2", "PENDING").ok());
  EXPECT_EQ(exporter->SetJobState("job-1", "").code(), absl::StatusCode::kInvalidArgument);
  const std::vector<Sample> s = ParseExposition(exporter->Scrape());
  for (std::string_view state : kJobStates) {
    const Labels l = {{"training_job", "job-1"}, {"state", std::string(state)}};
    EXPECT_EQ(Find(s, "vocabpipe_job_state", l), state == "SUCCEEDED" ? 1 : 0) << state;
  }
  EXPECT_EQ(Find(s, "vocabpipe_job_state", {{"training_job", "job-2"}, {"state", "PENDING"}}), 1);
}

TEST(MetricsExporter, ReplicaGaugesFollowTheJobAndLeaveWithIt) {
  auto exporter = Quiet();
  ASSERT_NE(exporter, nullptr);
  const Labels job = {{"training_job", "job-1"}};
  ASSERT_TRUE(exporter->SetJobReplicas("job-1", 2, 2).ok());
  ASSERT_TRUE(exporter->SetJobReplicas("job-1", 1, 2).ok());  // an elastic job shrank
  std::vector<Sample> s = ParseExposition(exporter->Scrape());
  EXPECT_EQ(Find(s, "vocabpipe_job_data_replicas", job), 1);
  EXPECT_EQ(Find(s, "vocabpipe_job_requested_data_replicas", job), 2);
  EXPECT_EQ(exporter->SetJobReplicas("", 1, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(exporter->SetJobReplicas("job-1", 0, 2).code(), absl::StatusCode::kInvalidArgument);
  exporter->RemoveJob("job-1");
  s = ParseExposition(exporter->Scrape());
  EXPECT_FALSE(Find(s, "vocabpipe_job_data_replicas", job).has_value());
  EXPECT_FALSE(Find(s, "vocabpipe_job_requested_data_replicas", job).has_value());
}

TEST(MetricsExporter, WorkerCounts) {
  auto exporter = Quiet();
  ASSERT_NE(exporter, nullptr);
  exporter->SetWorkerCount("idle", 3);
  exporter->SetWorkerCount("busy", 5);
  exporter->SetWorkerCount("idle", 2);
  const std::vector<Sample> s = ParseExposition(exporter->Scrape());
  EXPECT_EQ(Find(s, "vocabpipe_workers", {{"state", "idle"}}), 2);
  EXPECT_EQ(Find(s, "vocabpipe_workers", {{"state", "busy"}}), 5);
}

TEST(MetricsExporter, RemoveJobDropsOnlyThatJob) {
  auto exporter = Quiet();
  ASSERT_NE(exporter, nullptr);
  ASSERT_TRUE(exporter->RecordStep("job-1", "1f1b", "vocab-2", StepJson(0, 0.1, 0.1, 1)).ok());
  ASSERT_TRUE(exporter->SetJobState("job-1", "RUNNING").ok());
  ASSERT_TRUE(exporter->RecordStep("job-2", "vhalf", "vocab-1", StepJson(0, 0.1, 0.3, 1)).ok());
  exporter->RemoveJob("job-1");
  exporter->RemoveJob("no-such-job");
  std::vector<Sample> s = ParseExposition(exporter->Scrape());
  int job2 = 0;
  for (const Sample& sample : s) {
    auto it = sample.labels.find("training_job");
    ASSERT_NE(it, sample.labels.end()) << sample.name;
    EXPECT_NE(it->second, "job-1") << sample.name;
    job2 += it->second == "job-2";
  }
  EXPECT_GT(job2, 20);
  // The id starts afresh, under new labels.
  ASSERT_TRUE(exporter->RecordStep("job-1", "vhalf", "vocab-1", StepJson(5, 0.1, 0.2, 1)).ok());
  s = ParseExposition(exporter->Scrape());
  const Labels fresh = {{"training_job", "job-1"}, {"schedule", "vhalf"}, {"vocab", "vocab-1"}};
  EXPECT_EQ(Find(s, "vocabpipe_steps_total", fresh), 1);
  EXPECT_EQ(Find(s, "vocabpipe_mfu_ratio", fresh), 0.2);
}

TEST(MetricsExporter, ConcurrentRecordersScrapersAndRemovals) {
  auto exporter = Listening();
  ASSERT_NE(exporter, nullptr);
  constexpr int kThreads = 4, kSteps = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&exporter, t] {
      for (int i = 0; i < kSteps; ++i) {
        EXPECT_TRUE(
            exporter->RecordStep("job-1", "1f1b", "vocab-2", StepJson(i, 0.1, 0.1, 1)).ok());
        EXPECT_TRUE(exporter->RecordStep("tmp", "1f1b", "vocab-2", StepJson(i, 0.1, 0.1, 1)).ok());
        EXPECT_TRUE(exporter->SetJobState("tmp", t % 2 ? "RUNNING" : "PENDING").ok());
        if (i % 10 == 0) exporter->RemoveJob("tmp");
      }
    });
  }
  threads.emplace_back([&exporter] {
    for (int i = 0; i < 10; ++i) EXPECT_FALSE(ScrapeHttp(*exporter).empty());
  });
  for (std::thread& t : threads) t.join();
  const std::vector<Sample> s = ScrapeHttp(*exporter);
  EXPECT_EQ(Find(s, "vocabpipe_steps_total", kJob), kThreads * kSteps);
  EXPECT_NEAR(Find(s, "vocabpipe_pass_seconds_total", StageLabels(0, {{"pass", "S"}})).value_or(-1),
              kThreads * kSteps * 0.015, 1e-9);
}

TEST(MetricsExporter, AddressInUseIsUnavailable) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  absl::StatusOr<std::unique_ptr<MetricsExporter>> e = MetricsExporter::Create(taken);
  close(fd);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable) << e.status();
  EXPECT_NE(e.status().message().find(taken), std::string::npos) << e.status();
}

}  // namespace
}  // namespace vp::metrics
