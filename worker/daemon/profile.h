// Pass profiling for the coordinator's planner: times F, B, W, S, T, IF, IB (and the optimizer
// step) at a job's real shapes on this worker, in the planner's units (planner::Costs):
// F, B, W = one pipeline stage's layers (L/p) over one whole microbatch; S, T = one rank's
// vocabulary shard (V/p rows) for one microbatch; IF, IB = the input layer on that shard.
//
// How: the coordinator's one-rank plan (planner::BuildProfilingPlan, sent in the ProfileTask)
// of a model cut to one stage's layers and one shard's vocabulary (ceil(L/p) layers, ceil(V/p)
// tokens, same h, heads, s, b), scheduled with split backward (zbh1: B and W are separate
// passes) and a vocabulary-parallel output layer (vocab1: S and T passes), runs a warm-up step
// and three timed steps on synthetic tokens through the real runtime (runtime::PipelineRank on
// the 1-rank communicator); each pass kind's fastest busy seconds, divided by the number of
// such passes and scaled from ceil(L/p) to L/p layers, are the costs. For p > 1,
// p Gloo ranks of this process on loopback time an all-reduce, a broadcast and a send/recv at
// b·s and b·s·h floats (ProfileCommunication), and the planner gets each kind's latency and
// bandwidth (its communication model: docs/planner.md, "Simulator").
//
// The daemon never profiles in its own process: ProfileInChild runs ProfilePasses in a child
// (`vocabpipe-worker --profile-task FILE --profile-out FILE`), so a crash there (a failed
// allocation, a kernel fault) fails the job with the reason while the daemon lives on.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/grpc/auth.h"
#include "vocabpipe/v1/job.pb.h"
#include "vocabpipe/v1/service.pb.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace vp::daemon {

// cuda_device: a GPU daemon's device (cuda jobs are timed on it); -1 otherwise.
// The link model of one communication call: latency + bytes / bandwidth seconds (the
// planner's LinkCost; bandwidth 0: the size costs nothing).
struct LinkFit {
  double latency = 0, bandwidth = 0;
};
// The line through (bytes_small, seconds_small) and (bytes_large, seconds_large), clamped to a
// non-negative latency and slope; when the large call was the faster, a flat line at its time.
LinkFit FitLink(double bytes_small, double seconds_small, double bytes_large, double seconds_large);

// What ProfileCommunication measured: the fastest of seven calls (after a warm-up) at each of
// two sizes, the sizes alternating, the slowest rank's time for a collective and the receiver's for
// a send/recv, and the fits through them.
struct CommProfile {
  std::array<double, 2> bytes{}, allreduce_seconds{}, broadcast_seconds{}, p2p_seconds{},
      allgather_seconds{};
  LinkFit allreduce, broadcast, p2p, allgather;
};
// Times an all-reduce, a broadcast from rank 0 and a send/recv from rank 0 to 1 of
// floats_small and of floats_large floats between `ranks` Gloo ranks of this process on
// loopback (one thread each; a barrier before every call), and fits each kind's link model.
absl::StatusOr<CommProfile> ProfileCommunication(int ranks, size_t floats_small,
                                                 size_t floats_large);

// Where a tensor group's profile meets (ProfileTask.tensor_size > 1): the coordinator's store
// (or any store in tests), the address this rank's Gloo transport binds to, and the bound on
// waiting for the group's other ranks.
struct ProfileGroup {
  std::shared_ptr<gloo::rendezvous::Store> store = nullptr;
  std::string hostname = "";
  absl::Duration timeout = absl::Minutes(2);
};

// task: the job and the coordinator's one-stage spec and 1-rank plan
// (planner::BuildProfilingPlan); a task whose plan is not a 1-rank plan of a cut of the job is
// InvalidArgument naming the field. Under tensor parallelism (task.tensor_size = t > 1) this is
// tensor rank task.tensor_rank of the stage's group: the t ranks connect through group.store
// under task.store_prefix and run the stage together, so every pass is one tensor rank's with
// its collectives inside (PassCosts.tensor_measured = t). CPU only (cuda jobs have no tensor
// split yet).
absl::StatusOr<vocabpipe::v1::PassCosts> ProfilePasses(const vocabpipe::v1::ProfileTask& task,
                                                       int cuda_device = -1,
                                                       const ProfileGroup& group = {});

struct ProfileChildOptions {
  std::string worker_binary;  // the vocabpipe-worker executable
  int cuda_device = -1;
  // Data limit of the child (RLIMIT_DATA: its heap and private writable mappings) in bytes;
  // 0: none. A profile that needs more fails with std::bad_alloc in the child, not in the
  // daemon. Not RLIMIT_AS: a CUDA build maps hundreds of MiB of shared libraries (NCCL,
  // cuBLASLt) and the CUDA runtime reserves virtual address space it never touches.
  int64_t memory_limit_bytes = 0;
  // A child still running after this is killed (DeadlineExceeded).
  absl::Duration timeout = absl::Minutes(10);
  // A tensor group's profile: the coordinator's store the child reaches (HOST:PORT), with the
  // daemon's TLS files or `insecure` (loopback), and the address its Gloo transport binds to.
  // The task's store_secret goes to the child in its environment, never in a file or argv.
  std::string store_address = "";
  auth::TlsFiles tls = {};
  bool insecure = false;
  std::string hostname = "";
};

// ProfilePasses(task) in a child process. A child that fails reports its error message; one
// killed by a signal gives "profiling process killed by signal N (NAME)" and its last stderr
// line (e.g. "terminate called after throwing an instance of 'std::bad_alloc'").
// on_start (optional) gets the child's pid once it runs, and -1 when it has been reaped.
absl::StatusOr<vocabpipe::v1::PassCosts> ProfileInChild(
    const vocabpipe::v1::ProfileTask& task, const ProfileChildOptions& options,
    const std::function<void(int)>& on_pid = nullptr);

// `vocabpipe-worker --profile-comm RANKS --floats SMALL,LARGE`: ProfileCommunication, printed as
// one JSON line {"ranks", "bytes": [2], "p2p"|"broadcast"|"allreduce": {"latency" s,
// "bandwidth" B/s, "seconds": [2]}} (bench/paper uses it for the planner's link costs). Exit 0
// ok, 1 on an error, 2 bad usage.
int ProfileCommMain(int argc, char** argv);

// The child's main: `--profile-task FILE --profile-out FILE [--cuda-device N] [--store HOST:PORT
// (--tls-ca F --tls-cert F --tls-key F | --insecure) --hostname IP]`; reads a serialized
// ProfileTask (a tensor group's needs --store, and the run secret in the environment), writes
// the serialized PassCosts. Exit code 0 ok, 1 on an error (the
// message is the last line on stderr), 2 bad usage.
int ProfileChildMain(int argc, char** argv);

}  // namespace vp::daemon
