// vocabpipe submit JOB.yaml [--resume] [--coordinator HOST:PORT] [--output text|json]: sends
// the job file to the coordinator, which parses and validates it (relative paths resolve
// against the file's folder), and prints the new job id. --resume: the ranks continue from the
// latest step all of them saved in checkpoint.dir.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/control_client.h"
#include "proto/spec/job_spec.h"
#include "worker/data/tokenizer.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

int RunSubmitCommand(const Args& args, std::ostream& out, std::ostream& err) {
  const std::string usage =
      "usage: vocabpipe submit JOB.yaml [--resume] [--coordinator HOST:PORT] "
      "[--output text|json]\n";
  if (WantsHelp(args)) {
    out << usage;
    return kExitOk;
  }
  Args rest;
  bool resume = false;
  for (const std::string& x : args) {
    if (x == "--resume") {
      resume = true;
    } else {
      rest.push_back(x);
    }
  }
  ControlArgs a;
  if (!ParseControlArgs("submit", rest, {}, usage, err, &a)) return kExitUsage;
  if (a.positional.size() != 1) {
    err << "vocabpipe submit: give exactly one job file\n" << usage;
    return kExitUsage;
  }
  const std::string& path = a.positional[0];
  std::ifstream f(path);
  if (!f) {
    err << "vocabpipe submit: " << path << ": cannot read\n";
    return kExitUsage;
  }
  // At most the spec limit (+1 to tell a longer file): never a whole large file in memory.
  std::string text(spec::kMaxJobSpecBytes + 1, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(f.gcount()));
  if (text.size() > spec::kMaxJobSpecBytes) {
    err << "vocabpipe submit: " << path << ": larger than the job spec limit of "
        << spec::kMaxJobSpecBytes << " bytes\n";
    return kExitUsage;
  }
  // spec_text and base_dir are proto3 strings: bytes that are not UTF-8 cannot even be sent
  // (the call would fail with an empty INTERNAL), so they are refused here, naming the field
  // (the parser's message) or, outside any field, the byte.
  if (absl::Status st = spec::CheckUtf8(text); !st.ok()) {
    absl::StatusOr<v1::JobSpec> parsed = spec::ParseJobSpec(text, "/");
    err << "vocabpipe submit: " << path << ": "
        << (parsed.ok() ? st.message() : parsed.status().message()) << "\n";
    return kExitUsage;
  }
  v1::SubmitJobRequest req;
  req.set_spec_text(std::move(text));
  req.set_resume(resume);
  std::error_code ec;
  req.set_base_dir(std::filesystem::absolute(path, ec).parent_path().string());
  if (absl::Status st = spec::CheckUtf8(req.base_dir(), "the job file's folder"); !st.ok()) {
    err << "vocabpipe submit: " << st.message() << "\n";
    return kExitUsage;
  }
  // The coordinator validates the spec; the data may live on the workers only. When the spec
  // parses here and its data folder (or the validation file's) is visible here with a
  // tokenizer.model in it, a model vocabulary that does not match the tokenizer is refused
  // before submitting (the worker checks again when it opens the data).
  if (auto spec = spec::ParseJobSpec(req.spec_text(), req.base_dir()); spec.ok()) {
    const int64_t vocab = spec->model().vocab_size();
    if (absl::Status st =
            data::CheckDataTokenizer(spec::DataPathEntries(spec->data()).front(), vocab);
        !st.ok()) {
      err << "vocabpipe submit: " << path << ": " << st.message() << "\n";
      return kExitUsage;
    }
    const std::vector<std::string> val = spec::ValPathEntries(spec->data());
    if (!val.empty() && !val.front().empty()) {
      if (absl::Status st = data::CheckDataTokenizer(val.front(), vocab); !st.ok()) {
        err << "vocabpipe submit: " << path << ": data.val_path: " << st.message() << "\n";
        return kExitUsage;
      }
    }
  }
  Stubs s = Connect(a);
  v1::SubmitJobResponse resp;
  grpc::Status st = s.jobs->SubmitJob(CallContext().get(), req, &resp);
  if (!st.ok()) return ReportRpcError("submit", st, a.coordinator, err);
  if (a.json) {
    out << nlohmann::json{{"id", resp.job_id()}}.dump() << "\n";
  } else {
    out << resp.job_id() << "\n";
  }
  return kExitOk;
}

}  // namespace vp::cli
