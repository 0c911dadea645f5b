// The worker daemon (`vocabpipe-worker --coordinator HOST:PORT`): registers with the
// coordinator (device kind, memory, the address its Gloo transport binds to, measured peak
// FLOP/s), heartbeats, and executes what the heartbeat answers carry:
//   ProfileTask: times the passes at the job's shapes (profile.h) in a child process, so a
//                crash there fails the job and not the daemon, and reports the costs;
//   RunTask:     writes the job's run files (job.yaml, plan.txt) into checkpoint.dir and starts
//                one rank process (`vocabpipe-worker --run-dir DIR --rank R --store HOST:PORT`)
//                whose Gloo rendezvous goes through the coordinator's StoreService; streams
//                its per-step lines (rank_<R>.jsonl) to the coordinator and reports its exit;
//   CancelTask:  stops the rank process (SIGKILL: SIGTERM means "preempted, save first").
// Stopped (SIGINT/SIGTERM) while a rank runs: a graceful preemption (DaemonOptions::
// preempt_grace) before the daemon exits.
// A rank process dies with its daemon (PR_SET_PDEATHSIG). One daemon runs one rank at a time;
// several daemons on one machine take one rank each.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/grpc/auth.h"

namespace vp::daemon {

struct DaemonOptions {
  std::string coordinator;            // HOST:PORT
  std::string device = "cpu";         // cpu | cuda:N
  std::string address = "127.0.0.1";  // IP the rank's Gloo transport binds to (address.h)
  int rank_hint = -1;                 // the rank this worker asks for (-1: none)
  // The executable started for a rank (vocabpipe-worker; the daemon passes /proc/self/exe).
  std::string worker_binary;
  absl::Duration rpc_deadline = absl::Seconds(5);  // every unary call
  bool measure_peak = true;  // time one SGEMM at start for MFU (tests may skip it)
  // Canonical storage root (spec::ResolveStorageRoot): a task whose data.path or
  // checkpoint.dir resolves outside it is refused before anything is touched. Empty: none.
  std::string storage_root;
  // Data limit (bytes, RLIMIT_DATA) of the profiling child process; 0: none (profile.h).
  int64_t profile_memory_limit = 0;
  // TLS to the coordinator: its CA, and this worker's certificate (OU=worker) and key; the
  // rank processes get the same files for the store. Or `insecure` (loopback only).
  auth::TlsFiles tls;
  bool insecure = false;
  // On stop (SIGTERM) while a rank runs: the daemon tells the coordinator it is leaving, passes
  // SIGTERM to the rank (which saves an emergency checkpoint and exits, preemption.h), and
  // waits this long for it, heartbeating and reporting as usual; then SIGKILL.
  absl::Duration preempt_grace = absl::Seconds(25);
};

// Runs until *stop becomes true (and a running rank has stopped, within preempt_grace). Errors: bad
// options only (InvalidArgument naming the flag: neither TLS nor --insecure, --insecure off
// loopback, unreadable certificate files) (a coordinator that is down is retried: the daemon
// registers once it is up, and again after a coordinator restart).
absl::Status RunDaemon(const DaemonOptions& options, const std::atomic<bool>* stop);

}  // namespace vp::daemon
