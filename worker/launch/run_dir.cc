#include "worker/launch/run_dir.h"

#include <fcntl.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

// A run file read by handle: a link in its place is refused, never followed.
absl::StatusOr<std::string> ReadRunFile(const safefs::Dir& dir, const std::string& name) {
  auto text = dir.ReadFile(name);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(dir.PathOf(name), ": cannot open"));
  }
  return text;
}

}  // namespace

absl::StatusOr<safefs::UniqueFd> OpenRunFile(const std::string& dir, const std::string& name,
                                             int flags) {
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) return folder.status();
  return folder->OpenFile(name, flags, 0644);
}

absl::StatusOr<safefs::UniqueFd> OpenRankLog(const std::string& dir, int rank) {
  return OpenRunFile(dir, absl::StrCat("rank_", rank, ".log"), O_WRONLY | O_CREAT | O_APPEND);
}

absl::Status WriteRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                           const planner::Plan& plan) {
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) return folder.status();
  // Slices a daemon left here would take precedence over plan.txt for their rank: drop them.
  auto names = folder->List();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    if (name.rfind("plan_rank_", 0) == 0 && fs::path(name).extension() == ".txt") {
      if (auto st = folder->Remove(name); !st.ok()) return st;
    }
  }
  if (auto st = folder->WriteFileAtomically("job.yaml", spec::JobSpecToYaml(spec)); !st.ok()) {
    return st;
  }
  return folder->WriteFileAtomically("plan.txt", planner::PlanToText(plan));
}

absl::Status WriteRankRunFiles(const std::string& dir, const vocabpipe::v1::JobSpec& spec,
                               const planner::Plan& slice, int rank) {
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) return folder.status();
  if (auto st = folder->WriteFileAtomically("job.yaml", spec::JobSpecToYaml(spec)); !st.ok()) {
    return st;
  }
  return folder->WriteFileAtomically(absl::StrCat("plan_rank_", rank, ".txt"),
                                     planner::PlanToText(slice));
}

namespace {

// plan_rank_0.txt .. plan_rank_<p-1>.txt merged into the plan they were cut from; NotFound
// when one of them is missing.
// With d data-parallel replicas the job rank of stage s's replica 0 is d·s
// (proto/plan/topology.h); its slice stands for the stage.
absl::StatusOr<planner::Plan> ReadWholePlanFromSlices(const safefs::Dir& folder, int p, int d) {
  std::vector<planner::Plan> slices;
  for (int stage = 0; stage < p; ++stage) {
    const std::string name = absl::StrCat("plan_rank_", stage * d, ".txt");
    if (folder.KindOf(name) == safefs::Kind::kMissing) {
      return absl::NotFoundError(absl::StrCat(folder.PathOf(name), ": missing"));
    }
    auto text = ReadRunFile(folder, name);
    if (!text.ok()) return text.status();
    auto slice = planner::PlanFromText(*text);
    if (!slice.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(folder.PathOf(name), ": ", slice.status().message()));
    }
    slices.push_back(std::move(*slice));
  }
  auto whole = planner::MergeRankSlices(slices);
  if (!whole.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(folder.PathOf("plan_rank_0.txt"), " .. ",
                                                   (p - 1) * d, ": ", whole.status().message()));
  }
  return whole;
}

}  // namespace

absl::StatusOr<RunFiles> ReadRunFiles(const std::string& dir, int rank) {
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) return folder.status();
  auto spec_text = ReadRunFile(*folder, "job.yaml");
  if (!spec_text.ok()) return spec_text.status();
  auto spec = spec::ParseJobSpec(*spec_text, dir);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(SpecPath(dir), ": ", spec.status().message()));
  }
  // Present means present under that name, link or not: a link is then refused by the read.
  auto present = [&](const std::string& name) {
    return folder->KindOf(name) != safefs::Kind::kMissing;
  };
  std::string plan_name = "plan.txt";
  const std::string rank_plan = absl::StrCat("plan_rank_", rank, ".txt");
  if (rank >= 0 && present(rank_plan)) {
    plan_name = rank_plan;
  } else if (rank < 0 && !present(plan_name) && present("plan_rank_0.txt")) {
    // A run of the control plane: each daemon left its rank's slice. With every slice here
    // the whole plan is rebuilt from them (the report times it); otherwise slice 0 serves
    // for the layout (export).
    auto whole = ReadWholePlanFromSlices(*folder, spec->parallel().pipeline(),
                                         std::max(1, spec->parallel().data()));
    if (whole.ok()) return RunFiles{std::move(*spec), std::move(*whole)};
    if (!absl::IsNotFound(whole.status())) return whole.status();
    plan_name = "plan_rank_0.txt";  // every slice has the whole layout
  }
  const std::string plan_path = folder->PathOf(plan_name);
  auto plan_text = ReadRunFile(*folder, plan_name);
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
  const fs::path p(path);
  auto folder = safefs::Dir::Open(p.parent_path().string());
  if (!folder.ok()) return folder.status();
  const std::string name = p.filename().string();
  std::string kept;
  auto text = folder->ReadFile(name, size_t{1} << 30);
  if (!text.ok() && !absl::IsNotFound(text.status())) return text.status();
  if (text.ok()) {
    for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
      nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.value("step", int64_t{-1}) < first_step) {
        absl::StrAppend(&kept, line, "\n");
      }
    }
  }
  return folder->WriteFileAtomically(name, kept);
}

}  // namespace vp::launch
