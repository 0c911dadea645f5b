// Shared by the control-plane subcommands (submit, status, watch, cancel, workers): flag
// parsing, the coordinator address (--coordinator, else $VOCABPIPE_COORDINATOR), gRPC stubs
// with deadlines, exit codes and the JSON views of jobs, events and workers.
//
// Exit codes (docs/operations.md, "Control plane"): 0 ok (watch: the job SUCCEEDED), 1 the
// command or the watched job failed, 2 bad usage or invalid input (INVALID_ARGUMENT), 3 no such
// job (NOT_FOUND), 4 the coordinator is unreachable, 5 the watched job was CANCELLED.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "client/commands.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace vp::cli {

inline constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2, kExitNotFound = 3,
                     kExitUnavailable = 4, kExitCancelled = 5;

// Flags common to the control commands plus each command's own. Positional arguments go to
// `positional`; `--flag value` pairs to `values` (only flags named in `known`).
struct ControlArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;
  std::string coordinator;  // resolved address
  bool json = false;        // --output json
  // Channel security (docs/operations.md, "Security"): --tls-ca FILE (else
  // $VOCABPIPE_TLS_CA) with the bearer token of $VOCABPIPE_TOKEN, or --insecure (loopback
  // coordinators only). `security_flags` repeats the flags for a command run from this one.
  std::string tls_ca;
  bool insecure = false;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::vector<std::string> security_flags;
};
// Parses args; on error writes "vocabpipe <cmd>: why" + usage to err and returns false.
// Every command knows --coordinator, --output (text|json), --tls-ca FILE and --insecure.
bool ParseControlArgs(const std::string& cmd, const Args& args,
                      const std::vector<std::string>& known, const std::string& usage,
                      std::ostream& err, ControlArgs* out);

struct Stubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<vocabpipe::v1::JobService::Stub> jobs;
  std::unique_ptr<vocabpipe::v1::WorkerService::Stub> workers;
};
Stubs Connect(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials);
Stubs Connect(const ControlArgs& args);
// Fills args->credentials from args->tls_ca / insecure / $VOCABPIPE_TLS_CA / $VOCABPIPE_TOKEN
// (TLS unless --insecure, which needs a loopback coordinator). False with why on error.
bool ResolveSecurity(ControlArgs* args, std::string* why);

// A context whose deadline is `seconds` from now (every unary call has one).
std::unique_ptr<grpc::ClientContext> CallContext(int seconds = 15);

// Writes "vocabpipe <cmd>: <message>" and returns the exit code of a failed call.
int ReportRpcError(const std::string& cmd, const grpc::Status& st, const std::string& address,
                   std::ostream& err);

// Streams the job's events with seq > after to on_event until the job has ended. A dropped
// stream (coordinator restart) is resumed after the last event seen, for up to 60 s of
// unreachability. Returns the job's last state, or the call's error.
struct FollowResult {
  grpc::Status status;
  vocabpipe::v1::JobState last_state = vocabpipe::v1::JOB_STATE_UNSPECIFIED;
  std::string last_reason;  // the message of the last state event
};
FollowResult FollowJob(Stubs& stubs, const vocabpipe::v1::Job& job, int64_t after,
                       const std::function<void(const vocabpipe::v1::JobEvent&)>& on_event);

nlohmann::json JobJson(const vocabpipe::v1::Job& job);
nlohmann::json EventJson(const vocabpipe::v1::JobEvent& event);
nlohmann::json WorkerJson(const vocabpipe::v1::WorkerInfo& worker);
std::string StateName(vocabpipe::v1::JobState state);  // RUNNING, ...

}  // namespace vp::cli
