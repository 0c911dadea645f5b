#include "worker/launch/run_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "proto/spec/job_spec.h"
#include "worker/runtime/checkpoint.h"

namespace vp::launch {
namespace fs = std::filesystem;

std::string SpecPath(const std::string& dir) { return (fs::path(dir) / "job.yaml").string(); }
std::string PlanPath(const std::string& dir) { return (fs::path(dir) / "plan.txt").string(); }
std::string RankPlanPath(const std::string& dir, int rank) {
  return (fs::path(dir) / absl::StrCat("plan_rank_", rank, ".txt")).string();
}
std::string StoreDir(const std::string& dir) { return (fs::path(dir) / "store").string(); }
std::string RankPidPath(const std::string& dir, int rank) {
  return (fs::path(dir) / absl::StrCat("rank_", rank, ".pid")).string();
}
std::string RankLogPath(const std::string& dir, int rank) {
  return (fs::path(dir) / absl::StrCat("rank_", rank, ".log")).string();
}
std::string RankMetricsPath(const std::string& dir, int rank) {
  return (fs::path(dir) / absl::StrCat("rank_", rank, ".jsonl")).string();
}
std::string MetricsPath(const std::string& dir) {
  return (fs::path(dir) / "metrics.jsonl").string();
}
std::string ShardDir(const std::string& dir, int64_t step, int rank) {
  return (fs::path(dir) / absl::StrCat("step_", step) / absl::StrCat("rank_", rank)).string();
}

namespace {

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

absl::Status WriteRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                           const planner::Plan& plan) {
  // Slices a daemon left here would take precedence over plan.txt for their rank: drop them.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("plan_rank_", 0) == 0 && entry.path().extension() == ".txt") {
      fs::remove(entry.path(), ec);
    }
  }
  if (auto st = runtime::WriteTextFileAtomically(SpecPath(dir), spec::JobSpecToYaml(spec));
      !st.ok())
    return st;
  return runtime::WriteTextFileAtomically(PlanPath(dir), planner::PlanToText(plan));
}

absl::Status WriteRankRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                               const planner::Plan& slice, int rank) {
  if (auto st = runtime::WriteTextFileAtomically(SpecPath(dir), spec::JobSpecToYaml(spec));
      !st.ok())
    return st;
  return runtime::WriteTextFileAtomically(RankPlanPath(dir, rank), planner::PlanToText(slice));
}

absl::StatusOr<RunFiles> ReadRunFiles(const std::string& dir, int rank) {
  auto spec_text = ReadTextFile(SpecPath(dir));
  if (!spec_text.ok()) return spec_text.status();
  auto spec = spec::ParseJobSpec(*spec_text, dir);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(SpecPath(dir), ": ", spec.status().message()));
  }
  std::string plan_path = PlanPath(dir);
  if (rank >= 0 && fs::exists(RankPlanPath(dir, rank))) {
    plan_path = RankPlanPath(dir, rank);
  } else if (rank < 0 && !fs::exists(plan_path) && fs::exists(RankPlanPath(dir, 0))) {
    plan_path = RankPlanPath(dir, 0);  // every slice has the whole layout
  }
  auto plan_text = ReadTextFile(plan_path);
  if (!plan_text.ok()) return plan_text.status();
  auto plan = planner::PlanFromText(*plan_text);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(plan_path, ": ", plan.status().message()));
  }
  if (plan->pipeline != spec->parallel().pipeline()) {
    return absl::InvalidArgumentError(absl::StrCat(plan_path, ": pipeline ", plan->pipeline,
                                                   " differs from the spec's parallel.pipeline ",
                                                   spec->parallel().pipeline()));
  }
  return RunFiles{std::move(*spec), std::move(*plan)};
}

absl::Status KeepMetricsBefore(const std::string& path, int64_t first_step) {
  std::vector<std::string> keep;
  {
    std::ifstream f(path);
    for (std::string line; std::getline(f, line);) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.value("step", int64_t{-1}) < first_step) {
        keep.push_back(line);
      }
    }
  }
  std::ofstream f(path, std::ios::trunc);
  for (const std::string& line : keep) f << line << "\n";
  if (!f) return absl::InternalError(absl::StrCat(path, ": cannot rewrite"));
  return absl::OkStatus();
}

}  // namespace vp::launch
