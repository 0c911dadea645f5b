// A gloo::rendezvous::Store backed by the coordinator's StoreService: the ranks of a job run
// by worker daemons on any hosts meet through it (no shared file system needed). Also usable
// for any small key exchange (the NCCL unique id).
//
// Gloo's Store API reports errors by exception: a failed or timed-out call throws
// gloo::IoException naming the key, which ConnectGloo turns into a Status.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gloo/rendezvous/store.h"
#include "proto/grpc/auth.h"

namespace grpc {
class Channel;
class ChannelCredentials;
class ClientContext;
}  // namespace grpc

namespace vp::launch {

class GrpcStore final : public gloo::rendezvous::Store {
 public:
  // `address`: the coordinator's HOST:PORT, reached with `credentials` (TLS with the worker's
  // certificate, auth/auth.h; insecure only on loopback). `timeout` bounds get() and wait()
  // (Gloo's rendezvous timeout); set() has a fixed 10 s deadline. `run_secret` (the RunTask's
  // store_secret) goes with every call: the store refuses the run's keys without it.
  GrpcStore(const std::string& address, std::chrono::milliseconds timeout,
            std::shared_ptr<grpc::ChannelCredentials> credentials, std::string run_secret);
  ~GrpcStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  void Prepare(grpc::ClientContext& ctx) const;  // the run secret

  std::shared_ptr<grpc::Channel> channel_;
  std::string run_secret_;
  std::chrono::milliseconds timeout_;
};

// The credentials a process started by a worker daemon (a rank, a profiling child) reaches the
// store at `address` with: TLS with `tls` (the daemon's certificate and CA), or plaintext when
// `insecure` (loopback only). InvalidArgument naming --store otherwise.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> StoreCredentials(
    const std::string& address, const auth::TlsFiles& tls, bool insecure);
// The flags that hand a child process (a rank, a profiling child) the store: --store ADDRESS
// --hostname HOSTNAME, then --insecure or the daemon's TLS files (what StoreCredentials reads).
std::vector<std::string> StoreFlags(const std::string& address, const std::string& hostname,
                                    const auth::TlsFiles& tls, bool insecure);

}  // namespace vp::launch
