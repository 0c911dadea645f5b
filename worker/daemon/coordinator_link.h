// The worker daemon's channel to the coordinator, and how it comes back after the coordinator
// restarts (docs/operations.md, "Fault tolerance"; issue 29).
//
// Why the calls that keep the daemon registered wait for the channel: the daemon's synchronous
// calls are the only thing that polls its channel's sockets (gRPC's client-channel backup
// poller runs every 5 s). A fail-fast call on a channel in TRANSIENT_FAILURE fails at once,
// without polling, so the reconnection attempts gRPC starts in the background were never
// driven: the TCP connect was not seen to complete, the TLS client hello was never written, and
// the attempt was dropped at its connect deadline (which is GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
// 200 ms here before). A plaintext attempt needs one poll and got through at a backup-poller
// tick within about 5 s; a TLS handshake needs several round trips and never did. So:
//   - RegisterWorker and Heartbeat wait for the channel to be ready (bounded by the call's
//     deadline) once a fail-fast try found it down: the waiting call polls, and the handshake
//     completes;
//   - a connect deadline of kConnectTimeout (a TLS handshake on a loaded host gets its time),
//     and a short reconnect backoff (a restarted coordinator is found within about 2 s);
//   - after kFreshChannelAfter consecutive failures to reach it, a new channel with its own
//     subchannel (a fresh name resolution and connection, in case the old one is stuck);
//   - a log line saying why the coordinator cannot be reached (refused, TLS handshake, name
//     resolution, no answer), at the first failure, when the reason changes, and then at most
//     every log_every, and one when it is reached again.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace vp::daemon {

// How long one connection attempt (TCP connect and TLS handshake) may take.
inline constexpr absl::Duration kConnectTimeout = absl::Seconds(5);
// Reconnect backoff: the first retry after this, growing to kMaxReconnectBackoff.
inline constexpr absl::Duration kInitialReconnectBackoff = absl::Milliseconds(250);
inline constexpr absl::Duration kMaxReconnectBackoff = absl::Seconds(2);
// Consecutive calls that could not reach the coordinator before the channel is replaced.
inline constexpr int kFreshChannelAfter = 5;

// A channel to `target` with the connect deadline and backoff above, answers of up to 64 MiB
// (a heartbeat answer carries whole RunTasks), and a subchannel of its own (not shared through
// gRPC's global pool, so that a fresh channel really connects anew).
std::shared_ptr<grpc::Channel> NewCoordinatorChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& credentials);

// Whether a call's status means the coordinator was not reached (as opposed to an answer).
bool Unreached(const grpc::Status& status);

// Why the coordinator at `target` cannot be reached, for the operator: the kind of failure
// (connection refused, TLS handshake, name resolution, no answer) with what to check, and
// gRPC's message (at most 300 bytes of it).
std::string DescribeUnreachable(const grpc::Status& status, const std::string& target);

// Counts the outcomes of the calls that need the coordinator and decides when to log and when
// to replace the channel. Not thread-safe (CoordinatorLink serializes it).
class ReachTracker {
 public:
  ReachTracker(std::string target, absl::Duration log_every, int fresh_after)
      : target_(std::move(target)), log_every_(log_every), fresh_after_(fresh_after) {}

  struct Verdict {
    std::string log;             // a line to log now ("" for none)
    bool fresh_channel = false;  // replace the channel before the next call
  };
  // The outcome at `now` of one call started at `started` (an outage is timed from the start
  // of its first failed call, which may have waited for the channel).
  Verdict Note(const grpc::Status& status, absl::Time now, absl::Time started);
  Verdict Note(const grpc::Status& status, absl::Time now) { return Note(status, now, now); }
  int failures() const { return failures_; }

 private:
  const std::string target_;
  const absl::Duration log_every_;
  const int fresh_after_;
  int failures_ = 0;     // consecutive calls that did not reach the coordinator
  int since_fresh_ = 0;  // of them, since the channel was last replaced
  absl::Time first_failure_ = absl::InfinitePast();
  absl::Time last_log_ = absl::InfinitePast();
  std::string last_reason_;
  int refusals_ = 0;  // consecutive answers that refused this worker (certificate, revoked)
  absl::Time last_refusal_log_ = absl::InfinitePast();
};

// The channel and stub, replaced when ReachTracker says so. Calls may come from several threads
// (the daemon's loop, its profiling thread).
class CoordinatorLink {
 public:
  using Stub = vocabpipe::v1::WorkerService::Stub;
  CoordinatorLink(std::string target, std::shared_ptr<grpc::ChannelCredentials> credentials,
                  absl::Duration rpc_deadline, std::function<void(const std::string&)> log,
                  absl::Duration log_every = absl::Seconds(30));

  // One call with the rpc deadline. Fail-fast: for reports, which are resent later anyway.
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (Stub::*call)(grpc::ClientContext*, const Request&, Response*),
                    const Request& req, Response* resp) {
    return Invoke(call, req, resp, /*wait=*/false);
  }

  // A call that keeps the daemon registered (RegisterWorker, Heartbeat): tried fail-fast first
  // (whose UNAVAILABLE carries why the channel is down), then, while the channel is not ready,
  // again waiting for it within the same deadline, which drives the reconnection. Its outcome
  // feeds the log and the fresh-channel rule.
  template <typename Request, typename Response>
  grpc::Status Keepalive(grpc::Status (Stub::*call)(grpc::ClientContext*, const Request&,
                                                    Response*),
                         const Request& req, Response* resp) {
    const absl::Time deadline = absl::Now() + rpc_deadline_;
    grpc::Status st = Invoke(call, req, resp, /*wait=*/false, deadline);
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE && !Ready()) {
      const grpc::Status why = st;
      st = Invoke(call, req, resp, /*wait=*/true, deadline);
      // Still down at the deadline: the reason is the channel's, not "deadline exceeded".
      if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) st = why;
    }
    Note(st, deadline - rpc_deadline_);
    return st;
  }

  // The current channel's state (without starting a connection).
  bool Ready();

 private:
  template <typename Request, typename Response>
  grpc::Status Invoke(grpc::Status (Stub::*call)(grpc::ClientContext*, const Request&, Response*),
                      const Request& req, Response* resp, bool wait,
                      absl::Time deadline = absl::InfinitePast()) {
    if (deadline == absl::InfinitePast()) deadline = absl::Now() + rpc_deadline_;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(wait);
    std::shared_ptr<Stub> stub = CurrentStub();
    return ((*stub).*call)(&ctx, req, resp);
  }
  std::shared_ptr<Stub> CurrentStub();
  void Note(const grpc::Status& status, absl::Time started);

  const std::string target_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  const absl::Duration rpc_deadline_;
  const std::function<void(const std::string&)> log_;
  std::mutex mu_;
  std::shared_ptr<grpc::Channel> channel_;  // guarded by mu_
  std::shared_ptr<Stub> stub_;              // guarded by mu_
  ReachTracker tracker_;                    // guarded by mu_
};

}  // namespace vp::daemon
