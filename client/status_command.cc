// vocabpipe status [JOB] [--coordinator HOST:PORT] [--output text|json] [--limit N]: one job's
// record (state, step, loss, MFU, plan, per-stage memory and busy time, candidate table), or
// every job, newest first.
#include <iomanip>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/control_client.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

namespace {

void PrintJob(const v1::Job& job, std::ostream& out) {
  out << job.id() << " (" << job.spec().name() << "): " << StateName(job.state());
  if (!job.reason().empty()) out << " — " << job.reason();
  out << "\n";
  out << absl::StrFormat("  step %d/%d", job.step(), job.total_steps());
  if (job.has_loss()) out << absl::StrFormat(" | loss %.4f", job.loss());
  if (job.tokens_per_second() > 0) {
    out << absl::StrFormat(" | %.0f tok/s | MFU %.2f%%", job.tokens_per_second(), 100 * job.mfu());
  }
  out << "\n";
  if (!job.plan().schedule().empty()) {
    const v1::PlanSummary& p = job.plan();
    out << absl::StrFormat("  plan: %s + %s, p=%d, m=%d, k=%d, predicted %.4g s/step (%s costs)\n",
                           p.schedule(), p.vocab(), p.pipeline(), p.microbatches(), p.seq_chunks(),
                           p.predicted_step_seconds(), p.costs_source());
  }
  if (!job.layout().empty()) {
    // parallel.world: the layout the planner chose at submit, and what it weighed.
    out << "  " << job.layout() << "\n";
    for (absl::string_view line : absl::StrSplit(job.layout_table(), '\n', absl::SkipEmpty())) {
      out << "    " << line << "\n";
    }
  }
  const bool replicated = job.spec().parallel().data() > 1;
  if (job.requested_data() > 1) {
    // train.elastic: the shape it runs at now, of the one asked for.
    out << absl::StrFormat(
        "  data parallel (elastic): %d of %d replicas, m=%d each (global batch %d × %d)%s, "
        "%d resizes\n",
        job.spec().parallel().data(), job.requested_data(), job.spec().parallel().microbatches(),
        job.requested_data(), job.requested_microbatches(),
        job.spec().parallel().zero() == 1 ? ", ZeRO-1" : "", job.resizes());
  } else if (replicated) {
    out << absl::StrFormat("  data parallel: %d replicas of the pipeline%s\n",
                           job.spec().parallel().data(),
                           job.spec().parallel().zero() == 1 ? ", ZeRO-1" : "");
  }
  for (const v1::StageStats& s : job.stages()) {
    // With replicas, each rank's (replica, stage): the rank is replica + d · stage.
    const std::string where =
        replicated ? absl::StrFormat(" (replica %d stage %d)", s.replica(), s.stage()) : "";
    out << absl::StrFormat("  rank %d%s %-10s peak %8.1f MiB  busy %.4f s\n", s.rank(), where,
                           s.worker_id(), s.peak_memory_bytes() / 1048576.0, s.busy_seconds());
  }
  if (job.candidates_size() > 1) {
    out << "  candidates (predicted step time, peak memory):\n";
    int not_built = 0;
    for (const v1::PlanCandidate& c : job.candidates()) {
      if (!c.ok()) {
        ++not_built;
        continue;
      }
      out << absl::StrFormat("   %s %-20s %-10s k=%d ", c.chosen() ? "*" : " ", c.schedule(),
                             c.vocab(), c.seq_chunks());
      out << absl::StrFormat("%.4g s  %.1f MiB%s\n", c.predicted_step_seconds(),
                             c.peak_memory_bytes() / 1048576.0, c.fits() ? "" : "  (over budget)");
    }
    if (not_built > 0) {
      out << "    (" << not_built << " more do not fit this shape; --output json lists why)\n";
    }
  }
}

}  // namespace

int RunStatusCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe status [JOB] [--coordinator HOST:PORT] [--output text|json] "
      "[--limit N]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  ControlArgs a;
  if (!ParseControlArgs("status", args, {"--limit"}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() > 1) {
    err << "vocabpipe status: at most one job id\n" << usage;
    return kExitUsage;
  }
  Stubs s = Connect(a);
  if (a.positional.size() == 1) {
    v1::GetJobRequest req;
    req.set_job_id(a.positional[0]);
    v1::Job job;
    grpc::Status st = s.jobs->GetJob(CallContext().get(), req, &job);
    if (!st.ok()) return ReportRpcError("status", st, a.coordinator, err);
    if (a.json) {
      out << JobJson(job).dump(2) << "\n";
    } else {
      PrintJob(job, out);
    }
    return kExitOk;
  }
  int limit = 0;
  if (auto it = a.values.find("--limit"); it != a.values.end()) {
    if (!absl::SimpleAtoi(it->second, &limit) || limit < 0) {
      err << "vocabpipe status: --limit needs an integer >= 0\n";
      return kExitUsage;
    }
  }
  // The coordinator answers in pages (newest first): follow them to the end or to --limit.
  v1::ListJobsResponse resp;
  v1::ListJobsRequest req;
  do {
    if (limit > 0) req.set_limit(limit - resp.jobs_size());
    v1::ListJobsResponse page;
    grpc::Status st = s.jobs->ListJobs(CallContext().get(), req, &page);
    if (!st.ok()) return ReportRpcError("status", st, a.coordinator, err);
    for (v1::Job& job : *page.mutable_jobs()) *resp.add_jobs() = std::move(job);
    req.set_page_token(page.next_page_token());
  } while (!req.page_token().empty() && (limit == 0 || resp.jobs_size() < limit));
  if (a.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const v1::Job& job : resp.jobs()) list.push_back(JobJson(job));
    out << list.dump(2) << "\n";
    return kExitOk;
  }
  out << absl::StrFormat("%-10s %-16s %-10s %-11s %-9s %s\n", "ID", "NAME", "STATE", "STEP", "LOSS",
                         "REASON");
  for (const v1::Job& job : resp.jobs()) {
    out << absl::StrFormat("%-10s %-16s %-10s %-11s %-9s %s\n", job.id(), job.spec().name(),
                           StateName(job.state()), absl::StrCat(job.step(), "/", job.total_steps()),
                           job.has_loss() ? absl::StrFormat("%.4f", job.loss()) : "-",
                           job.reason());
  }
  return kExitOk;
}

}  // namespace vp::cli
