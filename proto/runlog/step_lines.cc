#include "proto/runlog/step_lines.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vp::runlog {
namespace {

using json = nlohmann::json;

absl::Status Bad(const std::string& where, const std::string& field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(where, ".", field, ": ", rule));
}

bool IsNonNegativeInteger(const json& v) {
  return v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0);
}

bool IsNonNegativeNumber(const json& v) { return v.is_number() && v.get<double>() >= 0; }

// An optional object whose values pass `ok`.
template <typename Pred>
absl::Status CheckMap(const json& line, const char* key, const std::string& where, Pred ok,
                      const char* rule) {
  auto it = line.find(key);
  if (it == line.end()) return absl::OkStatus();
  if (!it->is_object()) return Bad(where, key, "must be an object");
  for (const auto& [name, v] : it->items()) {
    if (!ok(v)) return Bad(where, absl::StrCat(key, ".", name), rule);
  }
  return absl::OkStatus();
}

double Number(const json& line, const char* key) {
  auto it = line.find(key);
  return it != line.end() && it->is_number() ? it->get<double>() : 0.0;
}

json ObjectOrEmpty(const json& line, const char* key) {
  auto it = line.find(key);
  return it != line.end() && it->is_object() ? *it : json::object();
}

// A rank's peak memory as status shows it: memory.footprint (the process's real peak, for
// ranks that measure it), else memory.total (the engine's accounting).
int64_t MemoryFootprint(const json& line) {
  auto it = line.find("memory");
  if (it == line.end() || !it->is_object()) return 0;
  for (const char* key : {"footprint", "total"}) {
    auto t = it->find(key);
    if (t != it->end() && t->is_number_integer()) return t->get<int64_t>();
  }
  return 0;
}

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  return absl::StrFormat("%02d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
}

}  // namespace

absl::Status CheckRankLine(const json& line, const std::string& where) {
  if (!line.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  for (const char* key : {"step", "rank"}) {
    auto it = line.find(key);
    if (it == line.end() || !IsNonNegativeInteger(*it)) {
      return Bad(where, key, "required, an integer >= 0");
    }
  }
  for (const char* key : {"stage", "replica", "tensor"}) {  // data or tensor parallelism only
    if (auto it = line.find(key); it != line.end() && !IsNonNegativeInteger(*it)) {
      return Bad(where, key, "must be an integer >= 0");
    }
  }
  if (auto it = line.find("seconds"); it == line.end() || !IsNonNegativeNumber(*it)) {
    return Bad(where, "seconds", "required, a number >= 0");
  }
  for (const char* key : {"busy_seconds", "compute_wait_seconds", "comm_seconds", "grad_norm",
                          "eval_seconds", "data_parallel_seconds"}) {
    if (auto it = line.find(key); it != line.end() && !IsNonNegativeNumber(*it)) {
      return Bad(where, key, "must be a number >= 0");
    }
  }
  if (auto it = line.find("val_loss"); it != line.end() && !it->is_number()) {
    return Bad(where, "val_loss", "must be a number");
  }
  if (auto it = line.find("sample"); it != line.end() && !it->is_string()) {
    return Bad(where, "sample", "must be a string");
  }
  if (auto it = line.find("lr"); it != line.end() && !it->is_number()) {
    return Bad(where, "lr", "must be a number");
  }
  if (auto it = line.find("checkpoint_step"); it != line.end() && !IsNonNegativeInteger(*it)) {
    return Bad(where, "checkpoint_step", "must be an integer >= 0");
  }
  if (auto it = line.find("checkpoint_seconds"); it != line.end() && !IsNonNegativeNumber(*it)) {
    return Bad(where, "checkpoint_seconds", "must be a number >= 0");
  }
  if (auto it = line.find("has_loss"); it != line.end()) {
    if (!it->is_boolean()) return Bad(where, "has_loss", "must be true or false");
    if (it->get<bool>()) {
      auto loss = line.find("loss");
      if (loss == line.end() || !loss->is_number()) {
        return Bad(where, "loss", "required (a number) when has_loss is true");
      }
    }
  }
  for (const char* key : {"busy", "comm"}) {
    if (auto st = CheckMap(line, key, where, IsNonNegativeNumber, "must be a number >= 0");
        !st.ok()) {
      return st;
    }
  }
  return CheckMap(line, "memory", where, IsNonNegativeInteger, "must be an integer >= 0 (bytes)");
}

absl::StatusOr<json> MergeRankLines(const std::vector<json>& ranks, const StepContext& context) {
  const int p = static_cast<int>(ranks.size());
  if (p == 0) return absl::InvalidArgumentError("ranks: no rank lines to merge");
  const int64_t step = ranks.front().value("step", int64_t{-1});
  double seconds = 0, busy_max = 0, busy_sum = 0, checkpoint_seconds = 0;
  int64_t mem_max = 0, mem_min = INT64_MAX, checkpoint_step = -1;
  bool all_saved = true;
  const json* loss_rank = nullptr;
  const json* val_rank = nullptr;     // the first rank that reports the step's validation loss
  const json* sample_rank = nullptr;  // the rank that drew the step's sample (rank 0)
  json stages = json::array();
  for (int r = 0; r < p; ++r) {
    const json& line = ranks[r];
    if (line.value("step", int64_t{-1}) != step) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, " reported step ",
                                                     line.value("step", int64_t{-1}),
                                                     ", the others step ", step));
    }
    if (line.value("rank", int64_t{-1}) != r) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", r, " is from rank ", line.value("rank", int64_t{-1})));
    }
    const double s = Number(line, "seconds"), busy = Number(line, "busy_seconds");
    seconds = std::max(seconds, s);
    busy_max = std::max(busy_max, busy);
    busy_sum += busy;
    const int64_t mem = MemoryFootprint(line);
    mem_max = std::max(mem_max, mem);
    mem_min = std::min(mem_min, mem);
    if (loss_rank == nullptr && line.value("has_loss", false)) loss_rank = &line;
    if (val_rank == nullptr && line.contains("val_loss")) val_rank = &line;
    if (sample_rank == nullptr && line.contains("sample")) sample_rank = &line;
    const int64_t saved = line.value("checkpoint_step", int64_t{-1});
    if (saved < 0 || (checkpoint_step >= 0 && saved != checkpoint_step)) all_saved = false;
    checkpoint_step = saved;
    checkpoint_seconds = std::max(checkpoint_seconds, Number(line, "checkpoint_seconds"));
    const int64_t predicted =
        r < static_cast<int>(context.predicted_memory.size()) ? context.predicted_memory[r] : 0;
    stages.push_back({{"rank", r},
                      {"seconds", s},
                      {"busy_seconds", busy},
                      {"busy", ObjectOrEmpty(line, "busy")},
                      {"compute_wait_seconds", Number(line, "compute_wait_seconds")},
                      {"comm_seconds", Number(line, "comm_seconds")},
                      {"comm", ObjectOrEmpty(line, "comm")},
                      {"memory", ObjectOrEmpty(line, "memory")},
                      {"predicted_memory_total", predicted}});
    if (line.contains("checkpoint_seconds")) {
      stages.back()["checkpoint_seconds"] = Number(line, "checkpoint_seconds");
    }
    // Data or tensor parallelism: the rank's pipeline stage, replica and tensor rank (absent
    // for one replica of one tensor rank a stage).
    for (const char* key : {"stage", "replica", "tensor"}) {
      if (line.contains(key)) stages.back()[key] = line.value(key, int64_t{0});
    }
    if (line.contains("data_parallel_seconds")) {
      stages.back()["data_parallel_seconds"] = Number(line, "data_parallel_seconds");
    }
  }
  const json& head = loss_rank != nullptr ? *loss_rank : ranks.front();
  const double secs = std::max(seconds, 1e-9);
  // MFU against the ranks' peaks, never above 1: a faster step means the peak is stale.
  const double peak = context.peak_flops_per_rank * p;
  const double mfu = peak > 0 ? context.model_flops_per_step / secs / peak : 0.0;
  json out = {{"step", step},
              {"lr", Number(head, "lr")},
              {"grad_norm", Number(head, "grad_norm")},
              {"tokens_per_s", context.tokens_per_step / secs},
              {"mfu", std::min(mfu, 1.0)},
              {"mfu_peak_flops", context.peak_flops_per_rank},
              {"peak_memory_bytes", mem_max},
              {"step_seconds", seconds},
              {"busy_max_over_mean", busy_sum > 0 ? busy_max / (busy_sum / p) : 0.0},
              {"memory_max_over_min", mem_min > 0 ? static_cast<double>(mem_max) / mem_min : 0.0},
              {"stages", std::move(stages)}};
  if (loss_rank != nullptr) out["loss"] = Number(*loss_rank, "loss");
  if (val_rank != nullptr) out["val_loss"] = Number(*val_rank, "val_loss");
  if (sample_rank != nullptr) out["sample"] = (*sample_rank)["sample"];
  if (all_saved) {
    out["checkpoint_step"] = checkpoint_step;
    // The time the step was held by the save: the slowest rank's.
    out["checkpoint_seconds"] = checkpoint_seconds;
  }
  if (mfu > 1) out["mfu_over_peak"] = true;
  return out;
}

std::string ProgressLine(const json& step_line, int64_t total_steps, double eta_seconds) {
  const std::string val = step_line.contains("val_loss")
                              ? absl::StrFormat(" | val %.4f", Number(step_line, "val_loss"))
                              : std::string();
  return absl::StrFormat(
      "step %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | MFU %.1f%% | busy max/mean %.2f | "
      "mem max/min %.2f (max %.1f MiB) | ETA %s",
      step_line.value("step", int64_t{0}) + 1, total_steps, Number(step_line, "loss"), val,
      Number(step_line, "lr"), Number(step_line, "tokens_per_s"), 100.0 * Number(step_line, "mfu"),
      Number(step_line, "busy_max_over_mean"), Number(step_line, "memory_max_over_min"),
      Number(step_line, "peak_memory_bytes") / 1048576.0, FormatDuration(eta_seconds));
}

}  // namespace vp::runlog
