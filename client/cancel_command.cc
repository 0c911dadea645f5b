// vocabpipe cancel JOB [--reason TEXT] [--coordinator HOST:PORT] [--output text|json]: stops a
// job; its workers are free again.
#include "client/control_client.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

int RunCancelCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe cancel JOB [--reason TEXT] [--coordinator HOST:PORT] "
      "[--output text|json]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  ControlArgs a;
  if (!ParseControlArgs("cancel", args, {"--reason"}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1) {
    err << "vocabpipe cancel: give exactly one job id\n" << usage;
    return kExitUsage;
  }
  v1::CancelJobRequest req;
  req.set_job_id(a.positional[0]);
  if (auto it = a.values.find("--reason"); it != a.values.end()) req.set_reason(it->second);
  Stubs s = Connect(a);
  v1::Job job;
  grpc::Status st = s.jobs->CancelJob(CallContext().get(), req, &job);
  if (!st.ok()) return ReportRpcError("cancel", st, a.coordinator, err);
  if (a.json) {
    out << JobJson(job).dump(2) << "\n";
  } else {
    out << job.id() << ": " << StateName(job.state()) << " — " << job.reason() << "\n";
  }
  return kExitOk;
}

}  // namespace vp::cli
