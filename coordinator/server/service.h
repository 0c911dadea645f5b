// The coordinator's gRPC server: JobService, WorkerService and StoreService over one
// Coordinator, plus the standard gRPC health service (grpc.health.v1.Health; "" and every
// vocabpipe service report SERVING) and server reflection (grpcurl works without the .proto).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/server/coordinator.h"
#include "proto/grpc/auth.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace vp::server {

// gRPC message size limits of the coordinator (docs/operations.md, "Security"): a request of
// more than kMaxRequestBytes is refused with RESOURCE_EXHAUSTED before it is parsed; answers
// (job records with their plan text) are at most kMaxResponseBytes. Clients set their receive
// limit to kMaxResponseBytes.
inline constexpr int kMaxRequestBytes = 4 << 20;
inline constexpr int kMaxResponseBytes = 64 << 20;
// ListJobs answers in pages: at most this many jobs, and beyond the first job at most this many
// bytes of records (half the answer limit: a page never runs into it however many jobs exist).
inline constexpr int kMaxJobsPage = 500;
inline constexpr size_t kMaxJobsPageBytes = 32 << 20;

struct ServerOptions {
  // Open WatchJob streams at most (each holds a server thread); more get RESOURCE_EXHAUSTED.
  int max_watchers = 64;
  // Open WatchJob streams of one user at most, on a secure server (0: a quarter of
  // max_watchers, at least 1): one user cannot take every stream.
  int max_watchers_per_user = 0;
  // TLS (docs/operations.md, "Security"): cert + key + ca. With them, WorkerService's worker
  // calls and StoreService need a client certificate of the CA with OU=worker
  // (UNAUTHENTICATED "worker certificate required") and JobService a bearer token of `tokens`
  // (UNAUTHENTICATED); a job is readable, watchable and cancellable by its owner and admins
  // only (PERMISSION_DENIED). Without them the server is plaintext, allowed only on a loopback
  // address, and every caller is the admin "local".
  auth::TlsFiles tls;
  std::shared_ptr<const auth::TokenTable> tokens;
  // Revoked worker certificates (--revoked): their calls get UNAUTHENTICATED "worker
  // certificate revoked". Optional.
  std::shared_ptr<const auth::RevocationList> revoked;
  // The files `tokens` and `revoked` came from: reloaded by Reload() (SIGHUP) and, when
  // reload_interval > 0, whenever they change (checked that often; read once two checks in a
  // row see the same version, so a file being written is not read half done). A file that no
  // longer loads (an empty tokens file included) leaves the previous table in force.
  std::string tokens_path, revoked_path;
  absl::Duration reload_interval = absl::Seconds(1);
};

class Guard;

class CoordinatorServer {
 public:
  // Listens on `listen` (HOST:PORT; port 0 picks a free one, see port()).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      Coordinator* coordinator, const std::string& listen,
      const ServerOptions& options = ServerOptions());
  ~CoordinatorServer();  // Shutdown()
  int port() const { return port_; }
  // Stops accepting calls, ends open WatchJob streams and waits for running calls.
  void Shutdown();
  // Blocks until Shutdown (from another thread or a signal handler thread).
  void Wait();
  // Reads the tokens file and the revocation list again (SIGHUP); on an error the previous one
  // stays in force and the error is returned (and logged).
  absl::Status Reload();

 private:
  CoordinatorServer() = default;
  static std::string FileVersion(const std::string& path);  // inode, size, mtime; "" if absent
  void Watch(absl::Duration every);
  std::unique_ptr<Guard> guard_;
  std::string tokens_path_, revoked_path_;
  std::mutex reload_mu_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool stop_watching_ = false;
  std::pair<std::string, std::string> last_seen_;
  std::thread watcher_;
  std::unique_ptr<grpc::Service> jobs_, workers_, store_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace vp::server
