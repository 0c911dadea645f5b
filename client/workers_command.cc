// vocabpipe workers [--coordinator HOST:PORT] [--output text|json]: the registered worker
// daemons, their device, memory, address and the job rank they run.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/control_client.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

int RunWorkersCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe workers [--coordinator HOST:PORT] [--output text|json]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  ControlArgs a;
  if (!ParseControlArgs("workers", args, {}, usage, err, &a)) return kExitUsage;
  if (!a.positional.empty()) {
    err << "vocabpipe workers: takes no arguments\n" << usage;
    return kExitUsage;
  }
  Stubs s = Connect(a);
  v1::ListWorkersResponse resp;
  grpc::Status st = s.workers->ListWorkers(CallContext().get(), v1::ListWorkersRequest(), &resp);
  if (!st.ok()) return ReportRpcError("workers", st, a.coordinator, err);
  if (a.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const v1::WorkerInfo& w : resp.workers()) list.push_back(WorkerJson(w));
    out << list.dump(2) << "\n";
    return kExitOk;
  }
  out << absl::StrFormat("%-10s %-8s %-10s %-16s %-8s %-10s %s\n", "ID", "DEVICE", "MEMORY",
                         "ADDRESS", "PID", "GFLOP/S", "JOB");
  for (const v1::WorkerInfo& w : resp.workers()) {
    out << absl::StrFormat("%-10s %-8s %-10s %-16s %-8d %-10.1f %s\n", w.worker_id(), w.device(),
                           absl::StrFormat("%.1fG", w.memory_bytes() / 1073741824.0), w.address(),
                           w.pid(), w.peak_flops() / 1e9,
                           w.job_id().empty()
                               ? "-"
                               : absl::StrCat(w.job_id(), " rank ", w.rank(), " (replica ",
                                              w.replica(), " stage ", w.stage(), ")"));
  }
  return kExitOk;
}

}  // namespace vp::cli
