// vocabpipe watch JOB [--after-event N] [--coordinator HOST:PORT] [--output text|json]:
// follows a job to its end. Text: state changes, and per step a progress bar (step, loss,
// validation loss where evaluated, tokens/s, MFU, ETA) with one memory bar per pipeline stage;
// json: one event object per line. A dropped stream (coordinator restart) is resumed after the last
// event seen, for up to 60 s. Exit code: 0 SUCCEEDED, 1 FAILED, 5 CANCELLED (others:
// control_client.h).
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/control_client.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

namespace {

std::string Bar(double fraction, int width) {
  fraction = std::clamp(fraction, 0.0, 1.0);
  const int full = static_cast<int>(fraction * width + 0.5);
  return absl::StrCat("[", std::string(full, '#'), std::string(width - full, '-'), "]");
}

std::string Clock(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60)
                   : absl::StrFormat("%d:%02d", s / 60, s % 60);
}

class Progress {
 public:
  explicit Progress(int64_t total_steps) : total_(total_steps) {}

  void Step(const v1::StepMetrics& m, std::ostream& out) {
    seconds_ += m.seconds();
    ++seen_;
    const double mean = seen_ > 0 ? seconds_ / seen_ : 0;
    const double eta = mean * std::max<int64_t>(0, total_ - m.step());
    out << absl::StrFormat("step %*d/%d %s %3.0f%%", Digits(), m.step(), total_,
                           Bar(total_ > 0 ? double(m.step()) / total_ : 1.0, 24),
                           total_ > 0 ? 100.0 * m.step() / total_ : 100.0);
    if (m.has_loss()) out << absl::StrFormat(" | loss %.4f", m.loss());
    if (m.has_val_loss()) out << absl::StrFormat(" | val %.4f", m.val_loss());
    out << absl::StrFormat(" | %.0f tok/s | MFU %.2f%% | ETA %s\n", m.tokens_per_second(),
                           100 * m.mfu(), Clock(eta));
    int64_t peak = 1;
    for (const v1::StageStats& s : m.stages()) peak = std::max(peak, s.peak_memory_bytes());
    for (const v1::StageStats& s : m.stages()) {
      // With data parallelism a rank is (replica, stage); one replica: the rank is the stage.
      const std::string where =
          s.replica() > 0 || s.stage() != s.rank()
              ? absl::StrFormat(" (replica %d stage %d)", s.replica(), s.stage())
              : "";
      out << absl::StrFormat("  rank %d%s %s %8.1f MiB  busy %.3f s\n", s.rank(), where,
                             Bar(double(s.peak_memory_bytes()) / peak, 16),
                             s.peak_memory_bytes() / 1048576.0, s.busy_seconds());
    }
  }

 private:
  int Digits() const { return static_cast<int>(std::to_string(total_).size()); }
  int64_t total_;
  double seconds_ = 0;
  int64_t seen_ = 0;
};

}  // namespace

int RunWatchCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe watch JOB [--after-event N] [--coordinator HOST:PORT] "
      "[--output text|json]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  ControlArgs a;
  if (!ParseControlArgs("watch", args, {"--after-event"}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1) {
    err << "vocabpipe watch: give exactly one job id\n" << usage;
    return kExitUsage;
  }
  int64_t after = 0;
  if (auto it = a.values.find("--after-event"); it != a.values.end()) {
    if (!absl::SimpleAtoi(it->second, &after) || after < 0) {
      err << "vocabpipe watch: --after-event needs an integer >= 0\n";
      return kExitUsage;
    }
  }
  Stubs s = Connect(a);
  v1::GetJobRequest get;
  get.set_job_id(a.positional[0]);
  v1::Job job;
  grpc::Status st = s.jobs->GetJob(CallContext().get(), get, &job);
  if (!st.ok()) return ReportRpcError("watch", st, a.coordinator, err);
  Progress progress(job.total_steps());

  FollowResult r = FollowJob(s, job, after, [&](const v1::JobEvent& e) {
    if (a.json) {
      out << EventJson(e).dump() << "\n";
    } else if (e.has_step()) {
      progress.Step(e.step(), out);
    } else {
      out << job.id() << ": " << StateName(e.state());
      if (!e.message().empty()) out << " — " << e.message();
      out << "\n";
    }
    out.flush();
  });
  if (!r.status.ok()) return ReportRpcError("watch", r.status, a.coordinator, err);
  const v1::JobState last = r.last_state;
  switch (last) {
    case v1::JOB_STATE_SUCCEEDED:
      return kExitOk;
    case v1::JOB_STATE_CANCELLED:
      return kExitCancelled;
    default:
      return kExitFailed;
  }
}

}  // namespace vp::cli
