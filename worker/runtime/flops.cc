#include "worker/runtime/flops.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/plan/flops.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/memory.h"

namespace vp::runtime {

// The formulas are proto/plan/flops.h, shared with the planner's predicted MFU.
double TransformerLayerFlops(const engine::ModelConfig& c, int b) {
  if (c.llama()) return flops::LlamaLayer(b, c.seq_len, c.hidden, c.ffn_hidden, c.kv_dim());
  return flops::TransformerLayer(b, c.seq_len, c.hidden, c.ffn_hidden);
}

double OutputLayerFlops(const engine::ModelConfig& c, int b) {
  return flops::OutputLayer(b, c.seq_len, c.hidden, static_cast<double>(c.vocab));
}

double InputLayerFlops(const engine::ModelConfig& c, int b) {
  return flops::InputLayer(b, c.seq_len, c.hidden);
}

double ModelFlopsPerMicrobatch(const engine::ModelConfig& c, int b) {
  return c.layers * TransformerLayerFlops(c, b) + OutputLayerFlops(c, b) + InputLayerFlops(c, b);
}

double MeasureCpuPeakFlops(int repeats) {
  constexpr int n = 1024;
  engine::Buffer a(nullptr, engine::MemoryCategory::kActivations, n * n);
  engine::Buffer b(nullptr, engine::MemoryCategory::kActivations, n * n);
  engine::Buffer c(nullptr, engine::MemoryCategory::kActivations, n * n);
  for (size_t i = 0; i < a.size(); ++i) {
    a.data()[i] = static_cast<float>(i % 7) * 0.01f;
    b.data()[i] = static_cast<float>(i % 5) * 0.01f;
  }
  double best = 0;
  for (int rep = 0; rep <= std::max(1, repeats); ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    engine::cpu::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::max(best, 2.0 * n * n * n / s);  // rep 0 warms caches and threads
  }
  return best;
}

namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// "model name" of the first CPU in /proc/cpuinfo ("unknown CPU" when absent).
std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  return "unknown CPU";
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown host";
  return name;
}

}  // namespace

std::string CpuPeakCachePath() {
  namespace fs = std::filesystem;
  if (const std::string dir = Env("VOCABPIPE_CACHE_DIR"); !dir.empty()) {
    return (fs::path(dir) / "cpu_peak.json").string();
  }
  if (const std::string xdg = Env("XDG_CACHE_HOME"); !xdg.empty()) {
    return (fs::path(xdg) / "vocabpipe" / "cpu_peak.json").string();
  }
  const std::string home = Env("HOME");
  return (fs::path(home.empty() ? "/tmp" : home) / ".cache" / "vocabpipe" / "cpu_peak.json")
      .string();
}

CpuPeak CpuPeakFlops() {
  namespace fs = std::filesystem;
  const std::string path = CpuPeakCachePath();
  const std::string key =
      absl::StrCat(HostName(), " | ", CpuModel(), " | ", engine::cpu::BlasThreads(), " threads");
  nlohmann::json cache = nlohmann::json::object();
  {
    std::ifstream f(path);
    if (f) {
      nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
      if (!j.is_discarded() && j.is_object()) cache = std::move(j);
    }
  }
  const bool remeasure = Env("VOCABPIPE_MEASURE_PEAK") == "1";
  if (auto it = cache.find(key); !remeasure && it != cache.end() && it->is_object()) {
    // Fields of the wrong type (a hand-edited file) count as missing: measured again.
    const auto flops = it->find("flops");
    const auto measured = it->find("measured");
    if (flops != it->end() && flops->is_number() && flops->get<double>() > 0) {
      const std::string when = measured != it->end() && measured->is_string()
                                   ? measured->get<std::string>()
                                   : std::string("in an earlier run");
      return {.flops = flops->get<double>(), .cached = true, .source = "cached, measured " + when};
    }
  }
  CpuPeak peak{.flops = MeasureCpuPeakFlops(), .cached = false, .source = "measured now"};
  // Stored atomically (a temporary file renamed over the cache): ranks starting together may
  // both measure; the last one's entry stays.
  cache[key] = {
      {"flops", peak.flops},
      {"measured", absl::FormatTime("%Y-%m-%d %H:%M UTC", absl::Now(), absl::UTCTimeZone())}};
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const std::string tmp = absl::StrCat(path, ".", getpid(), ".tmp");
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << cache.dump(2) << "\n";
    if (!f) {
      fs::remove(tmp, ec);
      return peak;
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp, ec);
  return peak;
}

double ClampedMfu(double flops_per_second, double peak, bool* over_peak) {
  if (!(peak > 0) || !(flops_per_second >= 0)) return 0;
  const double mfu = flops_per_second / peak;
  if (mfu > 1) {
    if (over_peak != nullptr) *over_peak = true;
    return 1;
  }
  return mfu;
}

}  // namespace vp::runtime
