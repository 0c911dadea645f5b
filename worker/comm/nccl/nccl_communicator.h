// A Communicator over NCCL (GPU ranks): device pointers in, collectives and point-to-point on a
// CUDA stream owned by the communicator.
//
// Setup: rank 0 creates an ncclUniqueId and publishes it in a gloo::rendezvous::Store (the
// coordinator-backed store in cluster runs, a FileStore in the run directory for local runs,
// a HashStore for threads) under "<prefix>/nccl_unique_id"; the others wait for it with the
// timeout. The prefix must be unique per communicator incarnation (job/attempt/role), so a
// restart never reads a stale id. Typical use: one communicator "…/pp" for stage-to-stage
// Send/Recv on a normal-priority stream and one "…/vocab" for the vocabulary barriers
// (C0/C1/C2, input-layer reduce/broadcast) on a high-priority side stream.
//
// Semantics match the Gloo backend: every call enqueues on stream() and then waits for it, so
// when a call returns the data is in place (the caller's compute stream must have finished
// producing `data` first — synchronise or record an event before calling). NCCL has no tags:
// Send/Recv between a pair match in issue order, the tag is only checked for range. Waiting
// polls the stream and ncclCommGetAsyncError; past the timeout the communicator is aborted and
// the call returns DeadlineExceeded. The first error poisons the communicator (later calls
// return FailedPrecondition carrying it), as in GlooCommunicator.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

struct ncclComm;

namespace vp::comm {

struct Nccl;  // nccl_library.h: the NCCL functions, opened on the first connect

inline constexpr size_t kNcclIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using NcclIdBytes = std::array<char, kNcclIdBytes>;

// The id exchange on its own (device-free, so it is unit-tested without a GPU): rank 0 calls
// `make_id` and sets `key`; the others wait up to `timeout` for the key and read it.
// DeadlineExceeded when the key does not appear in time; InvalidArgument for a malformed value.
absl::StatusOr<NcclIdBytes> ExchangeNcclId(
    gloo::rendezvous::Store& store, const std::string& key, int rank, absl::Duration timeout,
    const std::function<absl::StatusOr<NcclIdBytes>()>& make_id);

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA device this rank uses (cudaSetDevice is called on it)
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::string prefix;                 // unique per communicator incarnation
  bool high_priority_stream = false;  // the vocabulary collectives' side stream
  absl::Duration timeout = absl::Seconds(60);
};

class NcclCommunicator final : public Communicator {
 private:
  struct ConnectKey {
    explicit ConnectKey() = default;
  };

 public:
  NcclCommunicator(ConnectKey, const NcclOptions& options, const Nccl* nccl, ncclComm* comm,
                   cudaStream_t stream, float* scratch);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override;
  absl::Status Broadcast(float* data, size_t count, int root) override;
  absl::Status ReduceScatterSum(float* data, size_t count) override;
  absl::Status AllGather(float* data, size_t count) override;
  absl::Status Send(const float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Recv(float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Barrier() override;
  // Both halves in one NCCL group (no deadlock for pairwise exchanges); a count may be 0.
  absl::Status SendRecv(const float* send_data, size_t send_count, int send_peer, float* recv_data,
                        size_t recv_count, int recv_peer);

  cudaStream_t stream() const { return stream_; }

  // Runs one of each operation the job will issue on this communicator, so NCCL sets up its
  // connections now, on the calling thread, instead of lazily in the first step — where
  // communicators of one device are driven from different threads while another's kernel may
  // be waiting on the device. An all-reduce, a reduce-scatter and an all-gather of one float a
  // member, and with `neighbours` one exchange with each pipeline neighbour (rank ± 1, each
  // direction one grouped send/recv). Collective: every member calls it, in the same order
  // relative to the other communicators' warm-ups.
  absl::Status WarmUp(bool neighbours);

  // A communicator of the members of this one that pass the same `color` (>= 0), ranked by
  // `key` (ncclCommSplit; the job's groups use planner::Topology's group ids and group ranks).
  // Collective over this communicator: every member calls it, the splits in the same order.
  // The new communicator has its own stream; `name` is its prefix in messages. InvalidArgument
  // when the group NCCL formed is not the `expect_size` members with this member at
  // `expect_rank` (the caller's arithmetic and NCCL's must agree). This communicator stays
  // usable.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color, int key, int expect_rank,
                                                          int expect_size,
                                                          bool high_priority_stream,
                                                          const std::string& name);

 private:
  friend absl::StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNccl(const NcclOptions&);
  absl::Status CheckUsable() const;
  absl::Status CheckPeer(const char* op, const char* arg, int peer, bool allow_self) const;
  // Waits for stream_ (polling the communicator's async error) up to the timeout.
  absl::Status Wait(const std::string& what);
  absl::Status Fail(absl::Status status);
  // ReduceScatterSum (reduce) or AllGather: one rooted call per RangeOf range, grouped.
  absl::Status RangedCollective(float* data, size_t count, bool reduce);

  const Nccl* nccl_;  // the process's NCCL (never unloaded)
  int rank_;
  int size_;
  int device_;
  std::string prefix_;
  absl::Duration timeout_;
  ncclComm* comm_;
  cudaStream_t stream_;
  float* scratch_;  // one float on the device, for Barrier
  absl::Status error_;
};

// Exchanges the id, creates the stream and the NCCL communicator (non-blocking init, bounded
// by the timeout). Blocks until all ranks have joined.
absl::StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNccl(const NcclOptions& options);

}  // namespace vp::comm
