// The control-plane form of `vocabpipe plan` (main.cc routes here when --coordinator is given;
// without it planning stays offline):
//   vocabpipe plan JOB.yaml --coordinator HOST:PORT [--output text|json]
//       the coordinator's dry run (JobService.PlanJob): plan, candidate table, timeline
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/control_client.h"
#include "client/launcher.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"
#include "proto/spec/job_spec.h"

extern char** environ;

namespace vp::cli {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

namespace {

bool ReadSpecRequest(const std::string& cmd, const std::string& path, std::ostream& err,
                     v1::SubmitJobRequest* req) {
  std::ifstream f(path);
  if (!f) {
    err << "vocabpipe " << cmd << ": " << path << ": cannot read\n";
    return false;
  }
  // At most the spec limit (+1 to tell a longer file): never a whole large file in memory.
  std::string text(spec::kMaxJobSpecBytes + 1, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(f.gcount()));
  if (text.size() > spec::kMaxJobSpecBytes) {
    err << "vocabpipe " << cmd << ": " << path << ": larger than the job spec limit of "
        << spec::kMaxJobSpecBytes << " bytes\n";
    return false;
  }
  req->set_spec_text(std::move(text));
  std::error_code ec;
  req->set_base_dir(fs::absolute(path, ec).parent_path().string());
  return true;
}

}  // namespace

int RunRemotePlanCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe plan JOB.yaml --coordinator HOST:PORT [--output text|json]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  ControlArgs a;
  if (!ParseControlArgs("plan", args, {}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1) {
    err << "vocabpipe plan: give exactly one job file\n" << usage;
    return kExitUsage;
  }
  v1::SubmitJobRequest req;
  if (!ReadSpecRequest("plan", a.positional[0], err, &req)) return kExitUsage;
  Stubs s = Connect(a);
  v1::PlanJobResponse resp;
  grpc::Status st = s.jobs->PlanJob(CallContext().get(), req, &resp);
  if (!st.ok()) return ReportRpcError("plan", st, a.coordinator, err);
  if (a.json) {
    v1::Job as_job;  // reuse the job view of plan + candidates
    *as_job.mutable_plan() = resp.plan();
    *as_job.mutable_candidates() = resp.candidates();
    nlohmann::json j = JobJson(as_job);
    out << nlohmann::json{{"plan", j["plan"]}, {"candidates", j["candidates"]}}.dump(2) << "\n";
    return kExitOk;
  }
  const v1::PlanSummary& p = resp.plan();
  out << absl::StrFormat("plan: %s + %s, p=%d, m=%d, k=%d, predicted %.4g s/step (%s costs)\n",
                         p.schedule(), p.vocab(), p.pipeline(), p.microbatches(), p.seq_chunks(),
                         p.predicted_step_seconds(), p.costs_source());
  out << resp.table();
  return kExitOk;
}

}  // namespace vp::cli
