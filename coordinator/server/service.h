// The coordinator's gRPC server: JobService, WorkerService and StoreService over one
// Coordinator, plus the standard gRPC health service (grpc.health.v1.Health; "" and every
// vocabpipe service report SERVING) and server reflection (grpcurl works without the .proto).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/server/coordinator.h"

namespace grpc {
class Server;
class Service;
}  // namespace grpc

namespace vp::server {

class CoordinatorServer {
 public:
  // Listens on `listen` (HOST:PORT; port 0 picks a free one, see port()).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(Coordinator* coordinator,
                                                                  const std::string& listen);
  ~CoordinatorServer();  // Shutdown()
  int port() const { return port_; }
  // Stops accepting calls, ends open WatchJob streams and waits for running calls.
  void Shutdown();
  // Blocks until Shutdown (from another thread or a signal handler thread).
  void Wait();

 private:
  CoordinatorServer() = default;
  std::unique_ptr<grpc::Service> jobs_, workers_, store_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace vp::server
