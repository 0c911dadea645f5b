// Issue 36: what the coordinator stores and exports per training step grows linearly with the
// job's ranks, and a finished job's series leave the exposition. Drives a Coordinator directly
// (a SQLite file, the Prometheus observer without a listener) with N simulated workers that
// take their ranks and report K steps each, for N = 4, 8 and 16: one `steps` row a step
// whatever N, its bytes and the exported series an affine function of N (equal increments for
// equal steps of N). Counts, not timings (bench/control/scale_bench measures the time).
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/metrics/metrics.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/prometheus_observer.h"

namespace vp::server {
namespace {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

constexpr int kSteps = 6;

struct Counts {
  int64_t step_rows = 0;
  double step_bytes = 0;    // bytes of the stored step records, per step
  int series_running = 0;   // exported samples while the job runs
  int series_finished = 0;  // ... and once it has finished
  int series_idle = 0;      // before it was submitted
};

// Samples of the exposition (comment lines left out).
int Series(PrometheusObserver& o) {
  const std::vector<std::string> lines =
      absl::StrSplit(o.exporter().Scrape(), '\n', absl::SkipEmpty());
  return static_cast<int>(
      std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l[0] != '#'; }));
}

Counts RunJob(int n) {
  Counts out;
  const fs::path dir =
      fs::path(::testing::TempDir()) / absl::StrCat("scale_linear_", getpid(), "_", n);
  fs::create_directories(dir);
  auto exporter = metrics::MetricsExporter::Create("");
  EXPECT_TRUE(exporter.ok()) << exporter.status();
  if (!exporter.ok()) return out;
  auto observer = std::make_shared<PrometheusObserver>(std::move(*exporter), /*keep_finished=*/0);
  CoordinatorOptions options;
  options.db_path = (dir / "jobs.db").string();
  options.profile = false;
  options.heartbeat_timeout = absl::Hours(1);
  options.observer = observer;
  auto c = Coordinator::Open(options);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return out;
  std::vector<std::string> workers;
  for (int i = 0; i < n; ++i) {
    v1::RegisterWorkerRequest reg;
    reg.set_device("cpu");
    reg.set_memory_bytes(int64_t{16} << 30);
    reg.set_address(absl::StrCat("10.77.0.", i / 4));  // 4 workers a simulated host
    reg.set_hostname(absl::StrCat("sim-", i / 4));
    reg.set_threads(1);
    reg.set_peak_flops(1e10);
    reg.set_rank_hint(i);
    auto r = (*c)->RegisterWorker(reg);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return out;
    workers.push_back(r->worker_id());
  }
  out.series_idle = Series(*observer);
  v1::SubmitJobRequest submit;
  submit.set_spec_text(absl::StrCat(
      "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n",
      "parallel: {pipeline: 2, data: ", n / 2, ", microbatch_size: 2, microbatches: 2}\n",
      "train: {steps: ", kSteps, "}\ndata: {path: data.bin}\ncheckpoint: {dir: run}\n"));
  submit.set_base_dir(dir.string());
  auto spec = SpecFromRequest(submit);
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return out;
  auto id = (*c)->Submit(*spec);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return out;
  // Every worker beats until it has its RunTask (planning runs on its own thread).
  std::map<std::string, v1::RunTask> tasks;
  for (int round = 0; round < 200 && static_cast<int>(tasks.size()) < n; ++round) {
    for (const std::string& w : workers) {
      if (tasks.count(w)) continue;
      v1::HeartbeatRequest beat;
      beat.set_worker_id(w);
      auto r = (*c)->Heartbeat(beat);
      EXPECT_TRUE(r.ok()) << r.status();
      for (const v1::WorkerCommand& cmd : r->commands()) {
        if (cmd.has_run()) tasks[w] = cmd.run();
      }
    }
    if (static_cast<int>(tasks.size()) < n)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(static_cast<int>(tasks.size()), n);
  if (static_cast<int>(tasks.size()) != n) return out;
  for (int step = 0; step < kSteps; ++step) {  // steps count from 0, job.step() is the next
    for (const auto& [w, task] : tasks) {
      v1::ReportMetricsRequest rep;
      rep.set_worker_id(w);
      rep.set_job_id(task.job_id());
      rep.set_attempt(task.attempt());
      rep.set_rank(task.rank());
      rep.add_step_json(
          absl::StrCat(R"({"step":)", step, R"(,"rank":)", task.rank(),
                       R"(,"has_loss":true,"loss":3.5,"grad_norm":1.0,"lr":0.001,"seconds":1.0,)",
                       R"("busy_seconds":0.9,"comm_seconds":0.05,"memory":{"total":1048576}})"));
      EXPECT_TRUE((*c)->ReportMetrics(rep).ok());
    }
  }
  out.series_running = Series(*observer);
  for (const auto& [w, task] : tasks) {
    v1::ReportTaskRequest done;
    done.set_worker_id(w);
    done.set_job_id(task.job_id());
    done.set_rank(task.rank());
    done.set_attempt(task.attempt());
    done.set_ok(true);
    EXPECT_TRUE((*c)->ReportTask(done).ok());
  }
  auto job = (*c)->GetJob(*id);
  EXPECT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->reason();
  EXPECT_EQ(job->step(), kSteps);
  out.series_finished = Series(*observer);
  c->reset();
  // What the job store holds for the job's steps.
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open_v2(options.db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr),
            SQLITE_OK);
  sqlite3_stmt* q = nullptr;
  EXPECT_EQ(
      sqlite3_prepare_v2(db, "SELECT COUNT(*), SUM(LENGTH(record)) FROM steps", -1, &q, nullptr),
      SQLITE_OK);
  if (sqlite3_step(q) == SQLITE_ROW) {
    out.step_rows = sqlite3_column_int64(q, 0);
    out.step_bytes = sqlite3_column_double(q, 1) / kSteps;
  }
  sqlite3_finalize(q);
  sqlite3_close(db);
  fs::remove_all(dir);
  return out;
}

TEST(ScaleLinearity, StepRowsBytesAndSeriesAreLinearInTheRanks) {
  const Counts c4 = RunJob(4), c8 = RunJob(8), c16 = RunJob(16);
  for (const auto& [n, c] : {std::pair{4, &c4}, std::pair{8, &c8}, std::pair{16, &c16}}) {
    std::printf(
        "N %2d: %lld step rows, %.0f bytes a step, series %d idle / %d running / %d finished\n", n,
        static_cast<long long>(c->step_rows), c->step_bytes, c->series_idle, c->series_running,
        c->series_finished);
  }
  for (const Counts* c : {&c4, &c8, &c16}) {
    EXPECT_EQ(c->step_rows, kSteps);  // one row a step, whatever N
    EXPECT_GT(c->step_bytes, 0);
  }
  // Bytes a step: affine in N (the merged record holds each rank's stage entry). From 4 to 8
  // ranks and from 8 to 16 the increments are 1 : 2, up to the digits of larger rank numbers.
  const double b_first = c8.step_bytes - c4.step_bytes, b_second = c16.step_bytes - c8.step_bytes;
  EXPECT_GT(b_first, 0);
  EXPECT_NEAR(b_second / b_first, 2.0, 0.2)
      << c4.step_bytes << " " << c8.step_bytes << " " << c16.step_bytes;
  // Exported series while running: exactly affine in N (a fixed set a rank).
  const int s_first = c8.series_running - c4.series_running;
  const int s_second = c16.series_running - c8.series_running;
  EXPECT_GT(s_first, 0);
  EXPECT_EQ(s_second, 2 * s_first)
      << c4.series_running << " " << c8.series_running << " " << c16.series_running;
  // A finished job's series leave the exposition (keep_finished 0): nothing accumulates.
  for (const Counts* c : {&c4, &c8, &c16}) {
    EXPECT_LE(c->series_finished, c->series_idle + 8) << "idle " << c->series_idle;
  }
}

}  // namespace
}  // namespace vp::server
