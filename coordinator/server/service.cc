#include "coordinator/server/service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace vp::server {
namespace v1 = vocabpipe::v1;
namespace {

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

// Store waits are bounded by the request's timeout, by the call's deadline and by this cap (a
// Gloo rendezvous never waits longer).
constexpr int64_t kMaxStoreWaitMs = 10 * 60 * 1000;

absl::StatusOr<absl::Time> StoreDeadline(int64_t timeout_ms, grpc::ServerContext* ctx) {
  if (timeout_ms < 0 || timeout_ms > kMaxStoreWaitMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be in [0, ", kMaxStoreWaitMs, "]"));
  }
  absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  return std::min(deadline, absl::FromChrono(ctx->deadline()));
}

class JobServiceImpl final : public v1::JobService::Service {
 public:
  JobServiceImpl(Coordinator* c, int max_watchers) : c_(c), max_watchers_(max_watchers) {}

  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                         v1::SubmitJobResponse* resp) override {
    auto spec = SpecFromRequest(*req);
    if (!spec.ok()) return ToGrpc(spec.status());
    auto id = c_->Submit(*spec, req->resume());
    if (!id.ok()) return ToGrpc(id.status());
    resp->set_job_id(*id);
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* req, v1::Job* resp) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    auto job = c_->GetJob(req->job_id());
    if (!job.ok()) return ToGrpc(job.status());
    *resp = std::move(*job);
    return grpc::Status::OK;
  }

  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override {
    if (req->limit() < 0) return Invalid("limit: must be >= 0");
    for (auto& job : c_->ListJobs(req->limit())) *resp->add_jobs() = std::move(job);
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->after_event() < 0) return Invalid("after_event: must be >= 0");
    if (watchers_.fetch_add(1) >= max_watchers_) {
      watchers_.fetch_sub(1);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("watchers: ", max_watchers_,
                                       " WatchJob streams are open, the limit; try again later"));
    }
    struct Release {
      std::atomic<int>& n;
      ~Release() { n.fetch_sub(1); }
    } release{watchers_};
    int64_t after = req->after_event();
    while (!ctx->IsCancelled()) {
      bool terminal = false;
      auto events = c_->WaitEvents(req->job_id(), after, absl::Milliseconds(500), &terminal);
      if (!events.ok()) return ToGrpc(events.status());
      for (const v1::JobEvent& e : *events) {
        if (!writer->Write(e)) return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
        after = e.seq();
      }
      if (terminal) return grpc::Status::OK;
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
  }

  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* req,
                         v1::Job* resp) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->reason().size() > 1024) return Invalid("reason: longer than 1024 bytes");
    auto job = c_->Cancel(req->job_id(), req->reason());
    if (!job.ok()) return ToGrpc(job.status());
    *resp = std::move(*job);
    return grpc::Status::OK;
  }

  grpc::Status PlanJob(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                       v1::PlanJobResponse* resp) override {
    auto spec = SpecFromRequest(*req);
    if (!spec.ok()) return ToGrpc(spec.status());
    auto plan = c_->PlanDryRun(*spec);
    if (!plan.ok()) return ToGrpc(plan.status());
    *resp = std::move(*plan);
    return grpc::Status::OK;
  }

 private:
  Coordinator* c_;
  const int max_watchers_;
  std::atomic<int> watchers_{0};
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  explicit WorkerServiceImpl(Coordinator* c) : c_(c) {}

  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse* resp) override {
    auto r = c_->RegisterWorker(*req);
    if (!r.ok()) return ToGrpc(r.status());
    *resp = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    if (req->worker_id().empty()) return Invalid("worker_id: must not be empty");
    auto r = c_->Heartbeat(*req);
    if (!r.ok()) return ToGrpc(r.status());
    *resp = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status ReportMetrics(grpc::ServerContext*, const v1::ReportMetricsRequest* req,
                             v1::ReportMetricsResponse*) override {
    if (req->worker_id().empty()) return Invalid("worker_id: must not be empty");
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    return ToGrpc(c_->ReportMetrics(*req));
  }
  grpc::Status ReportTask(grpc::ServerContext*, const v1::ReportTaskRequest* req,
                          v1::ReportTaskResponse*) override {
    if (req->worker_id().empty()) return Invalid("worker_id: must not be empty");
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->rank() < -1) return Invalid("rank: must be >= 0 (or -1 for a profile)");
    return ToGrpc(c_->ReportTask(*req));
  }
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override {
    for (auto& w : c_->ListWorkers()) *resp->add_workers() = std::move(w);
    return grpc::Status::OK;
  }

 private:
  Coordinator* c_;
};

class StoreServiceImpl final : public v1::StoreService::Service {
 public:
  explicit StoreServiceImpl(Coordinator* c) : c_(c) {}

  grpc::Status Set(grpc::ServerContext*, const v1::StoreSetRequest* req,
                   v1::StoreSetResponse*) override {
    return ToGrpc(c_->kv().Set(req->key(), req->value()));
  }
  grpc::Status Get(grpc::ServerContext* ctx, const v1::StoreGetRequest* req,
                   v1::StoreGetResponse* resp) override {
    auto deadline = StoreDeadline(req->timeout_ms(), ctx);
    if (!deadline.ok()) return ToGrpc(deadline.status());
    auto v = c_->kv().Get(req->key(), *deadline);
    if (!v.ok()) return ToGrpc(v.status());
    resp->set_value(std::move(*v));
    return grpc::Status::OK;
  }
  grpc::Status Wait(grpc::ServerContext* ctx, const v1::StoreWaitRequest* req,
                    v1::StoreWaitResponse*) override {
    auto deadline = StoreDeadline(req->timeout_ms(), ctx);
    if (!deadline.ok()) return ToGrpc(deadline.status());
    if (req->keys_size() == 0) return Invalid("keys: must not be empty");
    return ToGrpc(c_->kv().Wait({req->keys().begin(), req->keys().end()}, *deadline));
  }

 private:
  Coordinator* c_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    Coordinator* coordinator, const std::string& listen, const ServerOptions& options) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->jobs_ = std::make_unique<JobServiceImpl>(coordinator, options.max_watchers);
  s->workers_ = std::make_unique<WorkerServiceImpl>(coordinator);
  s->store_ = std::make_unique<StoreServiceImpl>(coordinator);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Explicit message limits (docs/operations.md, "Security"): requests are small (a spec is
  // at most 64 KiB); answers carry job records with their plan text.
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(kMaxResponseBytes);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->workers_.get());
  builder.RegisterService(s->store_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("--listen ", listen, ": cannot listen there"));
  }
  if (auto* health = s->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    for (const char* name :
         {"vocabpipe.v1.JobService", "vocabpipe.v1.WorkerService", "vocabpipe.v1.StoreService"}) {
      health->SetServingStatus(name, true);
    }
  }
  return s;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Shutdown() {
  if (server_ != nullptr) {
    // Open WatchJob streams notice within their 500 ms poll; give them a second.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
}

void CoordinatorServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace vp::server
