#include "client/control_client.h"

#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/grpc/auth.h"

namespace vp::cli {
namespace v1 = vocabpipe::v1;

bool ParseControlArgs(const std::string& cmd, const Args& args,
                      const std::vector<std::string>& known, const std::string& usage,
                      std::ostream& err, ControlArgs* out) {
  auto fail = [&](const std::string& why) {
    err << "vocabpipe " << cmd << ": " << why << "\n" << usage;
    return false;
  };
  std::string output = "text";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--insecure") {
      out->insecure = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      const bool is_known = a == "--coordinator" || a == "--output" || a == "--tls-ca" ||
                            std::find(known.begin(), known.end(), a) != known.end();
      if (!is_known) return fail("unknown flag " + a);
      if (i + 1 >= args.size()) return fail(a + " needs a value");
      const std::string& v = args[++i];
      if (a == "--coordinator") {
        out->coordinator = v;
      } else if (a == "--tls-ca") {
        out->tls_ca = v;
      } else if (a == "--output") {
        output = v;
      } else {
        out->values[a] = v;
      }
    } else {
      out->positional.push_back(a);
    }
  }
  if (output != "text" && output != "json") return fail("--output: text or json");
  out->json = output == "json";
  if (out->coordinator.empty()) {
    if (const char* env = std::getenv("VOCABPIPE_COORDINATOR")) out->coordinator = env;
  }
  if (out->coordinator.empty()) {
    return fail("no coordinator: pass --coordinator HOST:PORT or set VOCABPIPE_COORDINATOR");
  }
  std::string why;
  if (!ResolveSecurity(out, &why)) return fail(why);
  return true;
}

bool ResolveSecurity(ControlArgs* a, std::string* why) {
  if (a->tls_ca.empty() && !a->insecure) {
    if (const char* env = std::getenv("VOCABPIPE_TLS_CA")) a->tls_ca = env;
  }
  a->security_flags.clear();
  if (a->insecure) {
    if (auto st = auth::CheckInsecure(auth::TlsFiles{.cert = "", .key = "", .ca = a->tls_ca},
                                      a->coordinator, "--coordinator");
        !st.ok()) {
      *why = std::string(st.message());
      return false;
    }
    a->credentials = grpc::InsecureChannelCredentials();
    a->security_flags = {"--insecure"};
    return true;
  }
  if (a->tls_ca.empty()) {
    *why =
        "TLS required: --tls-ca FILE (or VOCABPIPE_TLS_CA) with VOCABPIPE_TOKEN set, or "
        "--insecure for a loopback coordinator";
    return false;
  }
  const char* token = std::getenv("VOCABPIPE_TOKEN");
  auto creds = auth::ClientCredentials(auth::TlsFiles{.cert = "", .key = "", .ca = a->tls_ca},
                                       token ? token : "");
  if (!creds.ok()) {
    *why = std::string(creds.status().message());
    return false;
  }
  a->credentials = *creds;
  a->security_flags = {"--tls-ca", a->tls_ca};
  return true;
}

Stubs Connect(const ControlArgs& args) { return Connect(args.coordinator, args.credentials); }

Stubs Connect(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  Stubs s;
  grpc::ChannelArguments args;
  // The coordinator's answers are at most 64 MiB (coordinator/server/service.h).
  args.SetMaxReceiveMessageSize(64 << 20);
  s.channel = grpc::CreateCustomChannel(address, credentials, args);
  s.jobs = v1::JobService::NewStub(s.channel);
  s.workers = v1::WorkerService::NewStub(s.channel);
  return s;
}

namespace {

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "other";
  }
}

}  // namespace

std::unique_ptr<grpc::ClientContext> CallContext(int seconds) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return ctx;
}

int ReportRpcError(const std::string& cmd, const grpc::Status& st, const std::string& address,
                   std::ostream& err) {
  if (st.error_message().empty()) {
    // gRPC's own failures (a message that could not be serialized or parsed) come without a
    // reason: say at least what kind of failure it was.
    err << "vocabpipe " << cmd << ": the call failed with status " << st.error_code() << " ("
        << StatusCodeName(st.error_code()) << ") and no message\n";
    return st.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? kExitUsage : kExitFailed;
  }
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      err << "vocabpipe " << cmd << ": invalid: " << st.error_message() << "\n";
      return kExitUsage;
    case grpc::StatusCode::UNAUTHENTICATED:
      err << "vocabpipe " << cmd << ": unauthenticated: " << st.error_message() << "\n";
      return kExitFailed;
    case grpc::StatusCode::PERMISSION_DENIED:
      err << "vocabpipe " << cmd << ": permission denied: " << st.error_message() << "\n";
      return kExitFailed;
    case grpc::StatusCode::NOT_FOUND:
      err << "vocabpipe " << cmd << ": " << st.error_message() << "\n";
      return kExitNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      err << "vocabpipe " << cmd << ": coordinator " << address
          << " unreachable: " << st.error_message() << "\n";
      return kExitUnavailable;
    default:
      err << "vocabpipe " << cmd << ": " << st.error_message() << "\n";
      return kExitFailed;
  }
}

std::string StateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

namespace {

nlohmann::json StagesJson(const google::protobuf::RepeatedPtrField<v1::StageStats>& stages) {
  nlohmann::json out = nlohmann::json::array();
  for (const v1::StageStats& s : stages) {
    out.push_back({{"rank", s.rank()},
                   {"stage", s.stage()},
                   {"replica", s.replica()},
                   {"tensor", s.tensor()},
                   {"worker_id", s.worker_id()},
                   {"peak_memory_bytes", s.peak_memory_bytes()},
                   {"busy_seconds", s.busy_seconds()},
                   {"comm_seconds", s.comm_seconds()}});
  }
  return out;
}

}  // namespace

nlohmann::json JobJson(const v1::Job& job) {
  nlohmann::json candidates = nlohmann::json::array();
  for (const v1::PlanCandidate& c : job.candidates()) {
    candidates.push_back({{"schedule", c.schedule()},
                          {"vocab", c.vocab()},
                          {"seq_chunks", c.seq_chunks()},
                          {"ok", c.ok()},
                          {"error", c.error()},
                          {"predicted_step_seconds", c.predicted_step_seconds()},
                          {"bubble_ratio", c.bubble_ratio()},
                          {"peak_memory_bytes", c.peak_memory_bytes()},
                          {"fits", c.fits()},
                          {"chosen", c.chosen()}});
  }
  const v1::PlanSummary& p = job.plan();
  nlohmann::json j = {
      {"id", job.id()},
      {"name", job.spec().name()},
      {"state", StateName(job.state())},
      {"reason", job.reason()},
      {"step", job.step()},
      {"total_steps", job.total_steps()},
      {"loss", job.has_loss() ? nlohmann::json(job.loss()) : nlohmann::json(nullptr)},
      {"mfu", job.mfu()},
      {"tokens_per_second", job.tokens_per_second()},
      {"plan",
       {{"schedule", p.schedule()},
        {"vocab", p.vocab()},
        {"seq_chunks", p.seq_chunks()},
        {"pipeline", p.pipeline()},
        {"microbatches", p.microbatches()},
        {"predicted_step_seconds", p.predicted_step_seconds()},
        {"costs_source", p.costs_source()}}},
      {"candidates", candidates},
      {"stages", StagesJson(job.stages())},
      {"created_unix_ms", job.created_unix_ms()},
      {"updated_unix_ms", job.updated_unix_ms()},
      {"last_event", job.last_event()},
  };
  if (job.requested_data() > 1) {  // train.elastic: now and as asked for
    j["elastic"] = {{"data", job.spec().parallel().data()},
                    {"microbatches", job.spec().parallel().microbatches()},
                    {"requested_data", job.requested_data()},
                    {"requested_microbatches", job.requested_microbatches()},
                    {"resizes", job.resizes()}};
  }
  if (!job.layout().empty()) {
    // parallel.world: the layout the planner chose at submit, and its table of candidates.
    const auto& par = job.spec().parallel();
    j["layout"] = {{"chosen", job.layout()},       {"data", par.data()},
                   {"tensor", par.tensor()},       {"pipeline", par.pipeline()},
                   {"recompute", par.recompute()}, {"table", job.layout_table()}};
  }
  if (job.has_profiled_costs()) {
    const v1::PassCosts& c = job.profiled_costs();
    j["profiled_costs"] = {
        {"F", c.f()},
        {"B", c.b()},
        {"W", c.w()},
        {"S", c.s()},
        {"T", c.t()},
        {"IF", c.input_f()},
        {"IB", c.input_b()},
        {"OPT", c.opt()},
        // The link model (latency s, bandwidth B/s per call kind).
        {"p2p", {{"latency", c.p2p_latency()}, {"bandwidth", c.p2p_bandwidth()}}},
        {"broadcast", {{"latency", c.broadcast_latency()}, {"bandwidth", c.broadcast_bandwidth()}}},
        {"allreduce",
         {{"latency", c.allreduce_latency()}, {"bandwidth", c.allreduce_bandwidth()}}}};
  }
  return j;
}

nlohmann::json EventJson(const v1::JobEvent& e) {
  nlohmann::json j = {{"job_id", e.job_id()}, {"seq", e.seq()}, {"unix_ms", e.unix_ms()}};
  if (e.has_step()) {
    const v1::StepMetrics& m = e.step();
    j["step"] = {{"step", m.step()},
                 {"loss", m.has_loss() ? nlohmann::json(m.loss()) : nlohmann::json(nullptr)},
                 {"seconds", m.seconds()},
                 {"tokens_per_second", m.tokens_per_second()},
                 {"mfu", m.mfu()},
                 {"grad_norm", m.grad_norm()},
                 {"lr", m.lr()},
                 {"stages", StagesJson(m.stages())}};
  } else {
    j["state"] = StateName(e.state());
    j["message"] = e.message();
  }
  return j;
}

nlohmann::json WorkerJson(const v1::WorkerInfo& w) {
  return {{"worker_id", w.worker_id()},
          {"device", w.device()},
          {"memory_bytes", w.memory_bytes()},
          {"address", w.address()},
          {"hostname", w.hostname()},
          {"pid", w.pid()},
          {"job_id", w.job_id()},
          {"rank", w.job_id().empty() ? nlohmann::json(nullptr) : nlohmann::json(w.rank())},
          {"stage", w.job_id().empty() ? nlohmann::json(nullptr) : nlohmann::json(w.stage())},
          {"replica", w.job_id().empty() ? nlohmann::json(nullptr) : nlohmann::json(w.replica())},
          {"peak_flops", w.peak_flops()},
          {"last_heartbeat_unix_ms", w.last_heartbeat_unix_ms()}};
}

FollowResult FollowJob(Stubs& stubs, const v1::Job& job, int64_t after,
                       const std::function<void(const v1::JobEvent&)>& on_event) {
  FollowResult result;
  result.last_state = job.state();
  result.last_reason = job.reason();
  absl::Time unreachable_since = absl::InfiniteFuture();
  for (;;) {
    v1::WatchJobRequest req;
    req.set_job_id(job.id());
    req.set_after_event(after);
    grpc::ClientContext ctx;  // a stream: no deadline, it ends with the job
    auto reader = stubs.jobs->WatchJob(&ctx, req);
    v1::JobEvent e;
    while (reader->Read(&e)) {
      unreachable_since = absl::InfiniteFuture();
      after = e.seq();
      if (!e.has_step()) {
        result.last_state = e.state();
        result.last_reason = e.message();
      }
      on_event(e);
    }
    result.status = reader->Finish();
    if (result.status.ok()) return result;
    if (result.status.error_code() != grpc::StatusCode::UNAVAILABLE) return result;
    if (unreachable_since == absl::InfiniteFuture()) unreachable_since = absl::Now();
    if (absl::Now() - unreachable_since > absl::Seconds(60)) return result;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

}  // namespace vp::cli
