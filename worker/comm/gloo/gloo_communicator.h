// A Communicator over Gloo's TCP transport (CPU ranks, loopback or a cluster network).
//
// One GlooCommunicator = one Gloo context (full mesh of TCP pairs) with its own TCP device and
// event-loop thread. Gloo contexts are not safe for concurrent use, so a runtime that runs the
// vocabulary barriers on a communication thread while the compute thread does point-to-point
// transfers opens two communicators with different key prefixes on the same store.
//
// Errors: every Gloo exception (IoException, EnforceNotMet, timeouts) is caught and returned
// as an absl::Status naming the operation, the peer/root and this rank. A Gloo context is not
// usable after an error (Gloo tears its pairs down), so the first error poisons the
// communicator: every later call returns FailedPrecondition carrying the original error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace vp::comm {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous store shared by all ranks: a FileStore in a shared directory for processes,
  // a HashStore for threads of one process (see MakeFileStore / MakeHashStore), or a store
  // backed by the coordinator. Required.
  std::shared_ptr<gloo::rendezvous::Store> store;
  // Namespaces this communicator's keys in the store. Must be unique per communicator
  // incarnation (e.g. "job7/attempt0/vocab"): a second connect under the same prefix would read
  // the first one's stale addresses.
  std::string prefix;
  // Address the TCP device binds to and publishes. An IP, never gethostname(): Debian maps the
  // hostname to 127.0.1.1, which peers on other hosts cannot reach.
  std::string hostname = "127.0.0.1";
  // Bound on every operation: rendezvous, connect, each collective and each transfer.
  absl::Duration timeout = absl::Seconds(30);
};

// A directory-backed store for ranks that are separate processes on one host (or a shared
// file system). The directory must exist.
absl::StatusOr<std::shared_ptr<gloo::rendezvous::Store>> MakeFileStore(const std::string& dir);
// An in-process store for ranks that are threads of one process (tests, benchmarks).
std::shared_ptr<gloo::rendezvous::Store> MakeHashStore();

class GlooCommunicator final : public Communicator {
 private:
  // Only ConnectGloo can make a key, so only it constructs communicators (via make_unique).
  struct ConnectKey {
    explicit ConnectKey() = default;
  };

 public:
  GlooCommunicator(ConnectKey, int rank, int size, std::string prefix, absl::Duration timeout,
                   std::shared_ptr<gloo::transport::Device> device,
                   std::shared_ptr<gloo::Context> context);
  ~GlooCommunicator() override;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override;
  absl::Status Broadcast(float* data, size_t count, int root) override;
  // Rings over the point-to-point slots with the tags 2^56 − 1 and 2^56 − 2, which Send and
  // Recv callers must leave alone.
  absl::Status ReduceScatterSum(float* data, size_t count) override;
  absl::Status AllGather(float* data, size_t count) override;
  // Tags must be < 2^56: a tag maps to Gloo slot (0x80 << 56) | tag, a range no Gloo
  // collective uses, so point-to-point traffic never matches a collective's messages.
  absl::Status Send(const float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Recv(float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Barrier() override;

  // Posts the receive first, then the send, then waits for both. Gloo's TCP send does not
  // complete before the peer has posted the matching receive, so two ranks that exchange with
  // blocking Send-then-Recv deadlock; this is the safe form for rings and pairwise exchanges.
  // send_count or recv_count may be 0 (that half is skipped).
  absl::Status SendRecv(const float* send_data, size_t send_count, int send_peer, uint64_t send_tag,
                        float* recv_data, size_t recv_count, int recv_peer, uint64_t recv_tag);

  absl::Duration timeout() const { return timeout_; }

 private:
  friend absl::StatusOr<std::unique_ptr<GlooCommunicator>> ConnectGloo(const GlooOptions&);

  // Returns the poisoning error if an earlier operation failed.
  absl::Status CheckUsable() const;
  // Converts the exception being handled into a Status and poisons the communicator.
  absl::Status Fail(const std::string& what_op, const std::exception& e);
  absl::Status CheckPeer(const char* op, const char* arg, int peer, bool allow_self) const;

  int rank_;
  int size_;
  std::string prefix_;
  absl::Duration timeout_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  absl::Status error_;  // first error; OK while usable
  // ReduceScatterSum's incoming piece (at most kReduceChunkFloats), kept between calls.
  static constexpr size_t kReduceChunkFloats = size_t{1} << 20;
  std::vector<float> scratch_;
};

// Creates the TCP device, publishes this rank's addresses under `prefix` and connects the full
// mesh. Blocks until all `size` ranks have connected (or the timeout). Validates every option.
absl::StatusOr<std::unique_ptr<GlooCommunicator>> ConnectGloo(const GlooOptions& options);

}  // namespace vp::comm
