// A real Prometheus server (the Debian `prometheus` package, installed by scripts/setup.sh)
// scrapes a MetricsExporter every second; its query API must return the recorded value with
// our labels intact next to the `job`/`instance` labels Prometheus adds itself.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/metrics/metrics.h"
#include "tests/integration/metrics/http.h"

extern char** environ;

namespace vp::metrics {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrometheus = "/usr/bin/prometheus";

// A temporary directory, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "vp_prometheus_XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

// The Prometheus server process: SIGTERM on destruction, SIGKILL if it lingers past 5 s.
struct Server {
  pid_t pid = -1;
  ~Server() {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  bool running() const { return pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0; }
};

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// GET a Prometheus API path; the parsed body, or null when not (yet) answered.
nlohmann::json ApiGet(int port, const std::string& path) {
  absl::StatusOr<testing::HttpResponse> r = testing::HttpGet(port, path);
  if (!r.ok() || r->status != 200) return nullptr;
  return nlohmann::json::parse(r->body, nullptr, /*allow_exceptions=*/false);
}

TEST(RealPrometheus, ScrapesExporterAndAnswersQuery) {
  if (access(kPrometheus, X_OK) != 0) {
    GTEST_SKIP() << kPrometheus << " is missing: install the Debian `prometheus` package "
                 << "(scripts/setup.sh does) to run this test";
  }
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Create("127.0.0.1:0");
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  const nlohmann::json step = {{"step", 7},
                               {"step_seconds", 0.25},
                               {"mfu", 0.4321},
                               {"loss", 5.5},
                               {"tokens_per_s", 1000},
                               {"stages",
                                {{{"rank", 0},
                                  {"seconds", 0.25},
                                  {"busy_seconds", 0.2},
                                  {"memory", {{"total", 1 << 20}}}}}}};
  ASSERT_TRUE((*exporter)->RecordStep("job-42", "vhalf", "vocab-1", step).ok());

  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const int web_port = testing::FreePort();
  ASSERT_GT(web_port, 0);
  const fs::path config = dir.path / "prometheus.yml";
  {
    std::ofstream f(config);
    f << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: vocabpipe-test\n    scrape_interval: 1s\n"
      << "    scrape_timeout: 1s\n    static_configs:\n"
      << "      - targets: ['127.0.0.1:" << (*exporter)->port() << "']\n";
  }
  const fs::path log = dir.path / "prometheus.log";
  const std::vector<std::string> args = {
      kPrometheus, "--config.file=" + config.string(),
      "--storage.tsdb.path=" + (dir.path / "data").string(),
      "--web.listen-address=127.0.0.1:" + std::to_string(web_port), "--log.level=warn"};
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  Server server;
  const int rc = posix_spawn(&server.pid, kPrometheus, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_EQ(rc, 0) << "posix_spawn " << kPrometheus;

  // Poll until the target is up and the query returns our value; bounded at 15 s.
  const auto deadline = Clock::now() + std::chrono::seconds(15);
  bool target_up = false;
  nlohmann::json sample;
  while (Clock::now() < deadline && server.running()) {
    if (!target_up) {
      const nlohmann::json targets = ApiGet(web_port, "/api/v1/targets");
      if (targets.is_object() && targets.contains("data")) {
        for (const nlohmann::json& t : targets["data"].value("activeTargets", nlohmann::json())) {
          target_up = target_up || t.value("health", "") == "up";
        }
      }
    }
    if (target_up) {
      const nlohmann::json q = ApiGet(web_port, "/api/v1/query?query=vocabpipe_mfu_ratio");
      if (q.is_object() && q.value("status", "") == "success" && !q["data"]["result"].empty()) {
        sample = q["data"]["result"][0];
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_TRUE(server.running()) << "prometheus exited early:\n" << ReadFile(log);
  ASSERT_TRUE(target_up) << "target never up within 15 s:\n" << ReadFile(log);
  ASSERT_TRUE(sample.is_object()) << "no vocabpipe_mfu_ratio sample within 15 s:\n"
                                  << ReadFile(log);

  // Instant-vector sample: {"metric": {labels}, "value": [time, "0.4321"]}.
  EXPECT_DOUBLE_EQ(std::stod(sample["value"][1].get<std::string>()), 0.4321);
  const nlohmann::json& labels = sample["metric"];
  EXPECT_EQ(labels.value("training_job", ""), "job-42");
  EXPECT_EQ(labels.value("schedule", ""), "vhalf");
  EXPECT_EQ(labels.value("vocab", ""), "vocab-1");
  // Prometheus's own labels, and none of ours renamed to exported_*.
  EXPECT_EQ(labels.value("job", ""), "vocabpipe-test");
  EXPECT_EQ(labels.value("instance", ""), "127.0.0.1:" + std::to_string((*exporter)->port()));
  for (const auto& [key, value] : labels.items()) {
    EXPECT_FALSE(key.starts_with("exported_")) << key;
  }

  // A per-stage series and a derived figure come through too.
  const nlohmann::json q =
      ApiGet(web_port, "/api/v1/query?query=vocabpipe_stage_memory_bytes%7Bkind%3D%22total%22%7D");
  ASSERT_TRUE(q.is_object()) << ReadFile(log);
  ASSERT_EQ(q["data"]["result"].size(), 1u) << q.dump();
  EXPECT_EQ(q["data"]["result"][0]["metric"].value("stage", ""), "0");
  EXPECT_EQ(std::stod(q["data"]["result"][0]["value"][1].get<std::string>()), 1 << 20);
}

}  // namespace
}  // namespace vp::metrics
