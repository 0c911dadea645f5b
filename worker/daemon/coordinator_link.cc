#include "worker/daemon/coordinator_link.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace vp::daemon {
namespace {

std::string Seconds(absl::Duration d) { return absl::StrFormat("%.1fs", absl::ToDoubleSeconds(d)); }
std::string Calls(int n) { return absl::StrCat(n, n == 1 ? " call" : " calls"); }

}  // namespace

std::shared_ptr<grpc::Channel> NewCoordinatorChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  grpc::ChannelArguments args;
  // gRPC uses the minimum reconnect backoff as the deadline of each connection attempt (a
  // 200 ms one cut TLS handshakes short on a loaded host); the initial and maximum backoff
  // bound how soon a coordinator that is back is tried again (gRPC's default grows to 2 min).
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kConnectTimeout)));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kInitialReconnectBackoff)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(kMaxReconnectBackoff)));
  // Channels with equal arguments share subchannels through a global pool: a fresh channel
  // must not get the old connection (and its backoff) back.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A heartbeat answer carries whole RunTasks (spec and plan text): the coordinator's answers
  // are at most 64 MiB (coordinator/server/service.h).
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(target, credentials, args);
}

bool Unreached(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

std::string DescribeUnreachable(const grpc::Status& status, const std::string& target) {
  const std::string m = absl::AsciiStrToLower(status.error_message());
  auto has = [&m](std::initializer_list<absl::string_view> words) {
    return std::any_of(words.begin(), words.end(),
                       [&m](absl::string_view w) { return absl::StrContains(m, w); });
  };
  std::string kind;
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    kind =
        "no answer before the call's deadline (packets dropped on the way, or the "
        "coordinator is stopped or overloaded)";
  } else if (has({"ssl", "tls", "handshake", "certificate"})) {
    kind = absl::StrCat(
        "TLS handshake failed (check that --tls-ca is the CA that signed the coordinator's "
        "certificate, and that the certificate names the host of ",
        target, ")");
  } else if (has({"connection refused"})) {
    kind = absl::StrCat("connection refused: nothing listens at ", target,
                        " (the coordinator is down or restarting, or the address is wrong)");
  } else if (has({"socket closed", "connection reset", "end of tcp stream", "broken pipe"})) {
    kind =
        "the connection closed before an answer (the coordinator stopped, or it refused this "
        "worker's TLS handshake: --tls-cert not signed by its --tls-ca, not a worker "
        "certificate with OU=worker and clientAuth, or expired; or it does not serve TLS)";
  } else if (has({"dns", "resolution", "resolve", "name or service not known",
                  "domain name not found"})) {
    kind = absl::StrCat("cannot resolve the host name of ", target);
  } else if (has({"no route to host", "network is unreachable", "timed out"})) {
    kind = absl::StrCat("unreachable: no route to ", target);
  } else {
    kind = "unavailable";
  }
  // gRPC's own words for the details (addresses, OpenSSL's reason); one line, bounded.
  std::string detail = absl::StrReplaceAll(status.error_message(), {{"\n", " "}, {"\r", " "}});
  if (detail.size() > 300) detail = absl::StrCat(detail.substr(0, 300), "...");
  return detail.empty() ? kind : absl::StrCat(kind, ": ", detail);
}

ReachTracker::Verdict ReachTracker::Note(const grpc::Status& status, absl::Time now,
                                         absl::Time started) {
  Verdict v;
  if (!Unreached(status)) {
    if (failures_ > 0) {
      v.log = absl::StrCat("reached the coordinator at ", target_, " again after ",
                           Seconds(now - first_failure_), " (", Calls(failures_), " failed)");
    }
    failures_ = since_fresh_ = 0;
    last_reason_.clear();
    last_log_ = absl::InfinitePast();
    // An answer that refuses this worker (its certificate, a revocation) is no reachability
    // problem, but the operator must learn of it: the daemon can do nothing until it changes.
    if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
        status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      if (refusals_++ == 0 || now - last_refusal_log_ >= log_every_) {
        last_refusal_log_ = now;
        v.log = absl::StrCat("the coordinator at ", target_, " refuses this worker (",
                             Calls(refusals_), "): ", status.error_message());
      }
    } else {
      refusals_ = 0;
    }
    return v;
  }
  if (failures_++ == 0) first_failure_ = std::min(started, now);
  ++since_fresh_;
  const std::string reason = DescribeUnreachable(status, target_);
  if (since_fresh_ >= fresh_after_) {
    v.fresh_channel = true;
    since_fresh_ = 0;
  }
  if (failures_ == 1 || reason != last_reason_ || now - last_log_ >= log_every_) {
    v.log = absl::StrCat("cannot reach the coordinator at ", target_, " for ",
                         Seconds(now - first_failure_), " (", Calls(failures_), "): ", reason,
                         v.fresh_channel ? "; opening a new channel" : "", "; retrying");
    last_log_ = now;
    last_reason_ = reason;
  }
  return v;
}

CoordinatorLink::CoordinatorLink(std::string target,
                                 std::shared_ptr<grpc::ChannelCredentials> credentials,
                                 absl::Duration rpc_deadline,
                                 std::function<void(const std::string&)> log,
                                 absl::Duration log_every)
    : target_(std::move(target)),
      credentials_(std::move(credentials)),
      rpc_deadline_(rpc_deadline),
      log_(std::move(log)),
      channel_(NewCoordinatorChannel(target_, credentials_)),
      stub_(vocabpipe::v1::WorkerService::NewStub(channel_)),
      tracker_(target_, log_every, kFreshChannelAfter) {}

bool CoordinatorLink::Ready() {
  std::shared_ptr<grpc::Channel> channel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    channel = channel_;
  }
  return channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
}

std::shared_ptr<CoordinatorLink::Stub> CoordinatorLink::CurrentStub() {
  std::lock_guard<std::mutex> lock(mu_);
  return stub_;
}

void CoordinatorLink::Note(const grpc::Status& status, absl::Time started) {
  ReachTracker::Verdict v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v = tracker_.Note(status, absl::Now(), started);
    if (v.fresh_channel) {
      // Calls in flight keep the old channel (their stub holds it) until they return.
      channel_ = NewCoordinatorChannel(target_, credentials_);
      stub_ = vocabpipe::v1::WorkerService::NewStub(channel_);
    }
  }
  if (!v.log.empty() && log_) log_(v.log);
}

}  // namespace vp::daemon
