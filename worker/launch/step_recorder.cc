#include "worker/launch/step_recorder.h"

#include <fcntl.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/runlog/step_lines.h"
#include "worker/launch/run_dir.h"
#include "worker/runtime/checkpoint.h"

namespace vp::launch {

StepRecorder::StepRecorder(const std::string& dir, int64_t total_steps, bool resume,
                           bool interactive, std::ostream& progress)
    : dir_(dir),
      total_steps_(total_steps),
      resume_(resume),
      interactive_(interactive),
      progress_(progress) {
  summary_.metrics_path = MetricsPath(dir);
}

absl::Status StepRecorder::Start() {
  if (resume_) return absl::OkStatus();  // trimmed when the first step arrives
  auto f = OpenRunFile(dir_, "metrics.jsonl", O_WRONLY | O_CREAT | O_TRUNC);
  return f.status();
}

absl::Status StepRecorder::Record(const nlohmann::json& line) {
  const int64_t step = line.value("step", int64_t{0});
  const double seconds = line.value("step_seconds", 0.0);
  const double loss = line.value("loss", 0.0);
  if (!file_.valid()) {
    if (resume_) {
      if (auto st = KeepMetricsBefore(summary_.metrics_path, step); !st.ok()) return st;
    }
    auto f = OpenRunFile(dir_, "metrics.jsonl", O_WRONLY | O_CREAT | O_APPEND);
    if (!f.ok()) return f.status();
    file_ = std::move(*f);
    summary_.first_step = step;
    summary_.first_loss = loss;
  }
  const std::string json_line = line.dump() + "\n";
  if (auto st =
          safefs::WriteAll(file_.get(), json_line.data(), json_line.size(), summary_.metrics_path);
      !st.ok()) {
    return st;
  }
  summary_.final_loss = loss;
  if (auto it = line.find("val_loss"); it != line.end() && it->is_number()) {
    summary_.has_val_loss = true;
    summary_.final_val_loss = it->get<double>();
  }
  summary_.steps_run += 1;
  summary_.peak_memory_bytes =
      std::max(summary_.peak_memory_bytes, line.value("peak_memory_bytes", int64_t{0}));
  // Rank 0 merged the shards before the ranks reported the step (worker/launch/worker.h).
  if (line.contains("checkpoint_step")) {
    summary_.last_checkpoint = runtime::CheckpointDir(dir_, line["checkpoint_step"].get<int64_t>());
  }
  elapsed_ += seconds;
  if (summary_.steps_run > 1 || total_steps_ - step == 1) {
    timed_seconds_ += seconds;
    timed_tokens_ += line.value("tokens_per_s", 0.0) * seconds;
    timed_mfu_seconds_ += line.value("mfu", 0.0) * seconds;
  }
  if (line.value("mfu_over_peak", false)) summary_.peak_stale = true;
  const double eta = elapsed_ / static_cast<double>(summary_.steps_run) *
                     static_cast<double>(std::max<int64_t>(0, total_steps_ - step - 1));
  const std::string text = runlog::ProgressLine(line, total_steps_, eta);
  if (interactive_) {
    progress_ << "\r" << text << "\033[K" << std::flush;
    line_open_ = true;
  } else {
    progress_ << text << "\n" << std::flush;
  }
  if (auto it = line.find("sample"); it != line.end() && it->is_string()) {
    EndProgress();
    progress_ << "sample after step " << step + 1 << ":\n"
              << it->get<std::string>() << "\n---\n"
              << std::flush;
  }
  return absl::OkStatus();
}

void StepRecorder::EndProgress() {
  if (line_open_) progress_ << "\n" << std::flush;
  line_open_ = false;
}

runtime::RunSummary StepRecorder::Finish(double peak_flops_per_rank, std::string peak_source) {
  EndProgress();
  if (timed_seconds_ > 0) {
    summary_.tokens_per_s = timed_tokens_ / timed_seconds_;
    summary_.mfu = timed_mfu_seconds_ / timed_seconds_;
  }
  summary_.peak_flops = peak_flops_per_rank;
  summary_.peak_source = std::move(peak_source);
  if (total_steps_ == 0) summary_.last_checkpoint = runtime::CheckpointDir(dir_, 0);
  return summary_;
}

}  // namespace vp::launch
