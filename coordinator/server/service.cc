#include "coordinator/server/service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <map>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/server/kv_store.h"
#include "proto/safefs/run_owner.h"
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

}  // namespace

// Who may call what (ServerOptions): a secure server knows JobService users by their bearer
// token and workers by their verified certificate; an insecure one (loopback only) trusts
// every caller as the admin "local". The tokens and the revocation list can be replaced while
// the server runs (CoordinatorServer::Reload).
class Guard {
 public:
  Guard(bool secure, std::shared_ptr<const auth::TokenTable> tokens,
        std::shared_ptr<const auth::RevocationList> revoked)
      : secure_(secure), tokens_(std::move(tokens)), revoked_(std::move(revoked)) {}

  bool secure() const { return secure_; }

  void SetTokens(std::shared_ptr<const auth::TokenTable> tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    tokens_ = std::move(tokens);
  }
  void SetRevoked(std::shared_ptr<const auth::RevocationList> revoked) {
    std::lock_guard<std::mutex> lock(mu_);
    revoked_ = std::move(revoked);
  }

  absl::StatusOr<auth::User> User(grpc::ServerContext* ctx) const {
    if (!secure_) return auth::User{"local", true};
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) {
      return absl::UnauthenticatedError(
          "authorization: this call needs a bearer token (set VOCABPIPE_TOKEN; an admin makes "
          "one with `vocabpipe certs token USER`)");
    }
    const std::string value(it->second.data(), it->second.size());
    constexpr std::string_view kBearer = "Bearer ";
    if (value.rfind(kBearer, 0) != 0) {
      return absl::UnauthenticatedError("authorization: not a bearer token (\"Bearer TOKEN\")");
    }
    std::shared_ptr<const auth::TokenTable> tokens;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tokens = tokens_;
    }
    std::optional<auth::User> user =
        tokens ? tokens->Find(std::string_view(value).substr(kBearer.size())) : std::nullopt;
    if (!user) {
      return absl::UnauthenticatedError("authorization: unknown bearer token");
    }
    if (absl::Now() >= user->expires) {
      return absl::UnauthenticatedError(
          absl::StrCat("authorization: the token of ", user->name, " expired at ",
                       auth::FormatExpiry(user->expires),
                       "; an admin makes a new one with `vocabpipe certs token`"));
    }
    return *user;
  }

  // A verified client certificate whose subject has OU=worker and that is not revoked: its
  // name (the subject's CN), "" on an insecure server.
  absl::StatusOr<std::string> Worker(grpc::ServerContext* ctx) const {
    if (!secure_) return std::string();
    std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
    if (auth != nullptr && auth->IsPeerAuthenticated()) {
      // The peer's certificate, verified against --tls-ca in the handshake.
      for (const grpc::string_ref& pem : auth->FindPropertyValues("x509_pem_cert")) {
        std::optional<auth::WorkerCertificate> cert =
            ParsedWorkerCertificate(std::string_view(pem.data(), pem.size()));
        if (!cert) continue;
        std::shared_ptr<const auth::RevocationList> revoked;
        {
          std::lock_guard<std::mutex> lock(mu_);
          revoked = revoked_;
        }
        if (revoked && revoked->Revoked(*cert)) {
          return absl::UnauthenticatedError(
              absl::StrCat("worker certificate revoked: \"", cert->name, "\" (serial ",
                           cert->serial, ") is on the coordinator's revocation list (--revoked)"));
        }
        return cert->name;
      }
    }
    return absl::UnauthenticatedError(
        "worker certificate required: WorkerService and StoreService accept only clients with "
        "a worker certificate (OU=worker) of the cluster CA (vocabpipe certs init)");
  }

  // The job's owner or an admin.
  static absl::Status MayUse(const auth::User& user, const v1::Job& job) {
    if (user.admin || user.name == job.owner()) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat("job ", job.id(), " belongs to ", job.owner(), "; user ", user.name,
                     " may not read, watch or cancel it (only its owner or an admin)"));
  }

 private:
  // auth::ParseWorkerCertificate, remembered by the PEM text: every call of a connection
  // presents the same verified certificate, and parsing it again (two X.509 decodes and a
  // digest, ~0.6 ms of OpenSSL's locked decoder lookups) was most of a heartbeat's
  // cost (docs/benchmarks.md §18). Bounded: cleared when it reaches kMaxParsed entries.
  std::optional<auth::WorkerCertificate> ParsedWorkerCertificate(std::string_view pem) const {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = parsed_.find(pem); it != parsed_.end()) return it->second;
    }
    std::optional<auth::WorkerCertificate> cert = auth::ParseWorkerCertificate(pem);
    std::lock_guard<std::mutex> lock(mu_);
    if (parsed_.size() >= kMaxParsed) parsed_.clear();
    parsed_.emplace(std::string(pem), cert);
    return cert;
  }

  static constexpr size_t kMaxParsed = 1 << 14;
  const bool secure_;
  mutable std::mutex mu_;
  std::shared_ptr<const auth::TokenTable> tokens_;
  std::shared_ptr<const auth::RevocationList> revoked_;
  mutable std::map<std::string, std::optional<auth::WorkerCertificate>, std::less<>> parsed_;
};

namespace {

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
  JobServiceImpl(Coordinator* c, int max_watchers, int max_watchers_per_user, const Guard* guard)
      : c_(c),
        max_watchers_(max_watchers),
        max_watchers_per_user_(max_watchers_per_user > 0 ? max_watchers_per_user
                                                         : std::max(1, max_watchers / 4)),
        guard_(guard) {}

  grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                         v1::SubmitJobResponse* resp) override {
    auto user = guard_->User(ctx);
    if (!user.ok()) return ToGrpc(user.status());
    auto spec = SpecFromRequest(*req);
    if (!spec.ok()) return ToGrpc(spec.status());
    // Run folders are claimed for the token's user; an insecure (local) coordinator's caller
    // is this account, so its folders carry the account's name, as a --direct run's do.
    const safefs::RunUser run_user{guard_->secure() ? user->name : safefs::LocalUserName(),
                                   user->admin};
    auto id = c_->Submit(*spec, req->resume(), user->name, run_user);
    if (!id.ok()) return ToGrpc(id.status());
    resp->set_job_id(*id);
    return grpc::Status::OK;
  }

  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                      v1::Job* resp) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    auto job = OwnedJob(ctx, req->job_id());
    if (!job.ok()) return ToGrpc(job.status());
    *resp = std::move(*job);
    return grpc::Status::OK;
  }

  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                        v1::ListJobsResponse* resp) override {
    auto user = guard_->User(ctx);
    if (!user.ok()) return ToGrpc(user.status());
    if (req->limit() < 0) return Invalid("limit: must be >= 0");
    if (req->page_size() < 0) return Invalid("page_size: must be >= 0");
    if (req->page_token().size() > 64) return Invalid("page_token: longer than 64 bytes");
    int page = req->page_size() == 0 ? kMaxJobsPage : std::min(req->page_size(), kMaxJobsPage);
    if (req->limit() > 0) page = std::min(page, req->limit());
    // A user sees their own jobs, an admin every job.
    std::string next;
    auto jobs = c_->ListJobs(user->admin ? std::string() : user->name, req->page_token(), page,
                             kMaxJobsPageBytes, &next);
    if (!jobs.ok()) return ToGrpc(jobs.status());
    for (auto& job : *jobs) *resp->add_jobs() = std::move(job);
    resp->set_next_page_token(next);
    return grpc::Status::OK;
  }

  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->after_event() < 0) return Invalid("after_event: must be >= 0");
    auto user = guard_->User(ctx);
    if (!user.ok()) return ToGrpc(user.status());
    if (auto job = OwnedJob(ctx, req->job_id()); !job.ok()) return ToGrpc(job.status());
    // On a secure server each user has a share of the streams, so one user holding many
    // cannot lock the others out; the global cap stays (an insecure server has one user).
    const std::string who = guard_->secure() ? user->name : std::string();
    {
      std::lock_guard<std::mutex> lock(watchers_mu_);
      int& mine = watchers_by_user_[who];
      if (watchers_ >= max_watchers_) {
        if (mine == 0) watchers_by_user_.erase(who);
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("watchers: ", max_watchers_,
                                         " WatchJob streams are open, the limit; try again later"));
      }
      if (!who.empty() && mine >= max_watchers_per_user_) {
        if (mine == 0) watchers_by_user_.erase(who);
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("watchers: user ", who, " has ", mine,
                         " WatchJob streams open, the limit per user (--max-watchers-per-user ",
                         max_watchers_per_user_, "); close one or try again later"));
      }
      ++mine;
      ++watchers_;
    }
    struct Release {
      JobServiceImpl* self;
      std::string who;
      ~Release() {
        std::lock_guard<std::mutex> lock(self->watchers_mu_);
        --self->watchers_;
        if (--self->watchers_by_user_[who] <= 0) self->watchers_by_user_.erase(who);
      }
    } release{this, who};
    int64_t after = req->after_event();
    while (!ctx->IsCancelled()) {
      // The token is checked again at every poll: a token removed from the file (or expired)
      // ends the stream within half a second.
      if (auto user = guard_->User(ctx); !user.ok()) return ToGrpc(user.status());
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

  grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                         v1::Job* resp) override {
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->reason().size() > 1024) return Invalid("reason: longer than 1024 bytes");
    // The owner never changes: checked here, the cancel below cannot meet another owner.
    if (auto owned = OwnedJob(ctx, req->job_id()); !owned.ok()) return ToGrpc(owned.status());
    auto job = c_->Cancel(req->job_id(), req->reason());
    if (!job.ok()) return ToGrpc(job.status());
    *resp = std::move(*job);
    return grpc::Status::OK;
  }

  grpc::Status PlanJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                       v1::PlanJobResponse* resp) override {
    auto user = guard_->User(ctx);
    if (!user.ok()) return ToGrpc(user.status());
    auto spec = SpecFromRequest(*req);
    if (!spec.ok()) return ToGrpc(spec.status());
    auto plan = c_->PlanDryRun(*spec, user->name);
    if (!plan.ok()) return ToGrpc(plan.status());
    *resp = std::move(*plan);
    return grpc::Status::OK;
  }

 private:
  // The job, when the caller is authenticated and owns it (or is an admin). An unknown job is
  // NOT_FOUND for everyone.
  absl::StatusOr<v1::Job> OwnedJob(grpc::ServerContext* ctx, const std::string& id) {
    auto user = guard_->User(ctx);
    if (!user.ok()) return user.status();
    auto job = c_->GetJob(id);
    if (!job.ok()) return job.status();
    if (auto st = Guard::MayUse(*user, *job); !st.ok()) return st;
    return job;
  }

  Coordinator* c_;
  const int max_watchers_, max_watchers_per_user_;
  const Guard* guard_;
  std::mutex watchers_mu_;
  int watchers_ = 0;                             // open streams
  std::map<std::string, int> watchers_by_user_;  // open streams per user (secure servers)
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  WorkerServiceImpl(Coordinator* c, const Guard* guard) : c_(c), guard_(guard) {}

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const v1::RegisterWorkerRequest* req,
                              v1::RegisterWorkerResponse* resp) override {
    auto name = guard_->Worker(ctx);
    if (!name.ok()) return ToGrpc(name.status());
    auto r = c_->RegisterWorker(*req, *name);
    if (!r.ok()) return ToGrpc(r.status());
    *resp = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    if (auto st = Named(ctx, req->worker_id()); !st.ok()) return ToGrpc(st);
    auto r = c_->Heartbeat(*req);
    if (!r.ok()) return ToGrpc(r.status());
    *resp = std::move(*r);
    return grpc::Status::OK;
  }
  grpc::Status ReportMetrics(grpc::ServerContext* ctx, const v1::ReportMetricsRequest* req,
                             v1::ReportMetricsResponse*) override {
    if (auto st = Named(ctx, req->worker_id()); !st.ok()) return ToGrpc(st);
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    return ToGrpc(c_->ReportMetrics(*req));
  }
  grpc::Status ReportTask(grpc::ServerContext* ctx, const v1::ReportTaskRequest* req,
                          v1::ReportTaskResponse*) override {
    if (auto st = Named(ctx, req->worker_id()); !st.ok()) return ToGrpc(st);
    if (req->job_id().empty()) return Invalid("job_id: must not be empty");
    if (req->rank() < -1) return Invalid("rank: must be >= 0 (or -1 for a profile)");
    return ToGrpc(c_->ReportTask(*req));
  }
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* resp) override {
    // Users (`vocabpipe workers`) and workers alike.
    if (!guard_->Worker(ctx).ok()) {
      if (auto user = guard_->User(ctx); !user.ok()) return ToGrpc(user.status());
    }
    for (auto& w : c_->ListWorkers()) *resp->add_workers() = std::move(w);
    return grpc::Status::OK;
  }

 private:
  // A worker certificate whose name is the one `worker_id` registered with.
  absl::Status Named(grpc::ServerContext* ctx, const std::string& worker_id) {
    auto name = guard_->Worker(ctx);
    if (!name.ok()) return name.status();
    if (worker_id.empty()) return absl::InvalidArgumentError("worker_id: must not be empty");
    return c_->CheckWorkerIdentity(worker_id, *name);
  }

  Coordinator* c_;
  const Guard* guard_;
};

// Every call needs a worker certificate (on a secure server); keys of a run
// ("vocabpipe/ATTEMPT/...") need that run's secret as well (KvStore::CheckRunSecret), and a
// secure server has no other keys.
class StoreServiceImpl final : public v1::StoreService::Service {
 public:
  StoreServiceImpl(Coordinator* c, const Guard* guard) : c_(c), guard_(guard) {}

  grpc::Status Set(grpc::ServerContext* ctx, const v1::StoreSetRequest* req,
                   v1::StoreSetResponse*) override {
    if (auto st = Allowed(ctx, req->key(), "key"); !st.ok()) return ToGrpc(st);
    return ToGrpc(c_->kv().Set(req->key(), req->value()));
  }
  grpc::Status Get(grpc::ServerContext* ctx, const v1::StoreGetRequest* req,
                   v1::StoreGetResponse* resp) override {
    if (auto st = Allowed(ctx, req->key(), "key"); !st.ok()) return ToGrpc(st);
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
    for (int i = 0; i < req->keys_size(); ++i) {
      if (auto st = Allowed(ctx, req->keys(i), absl::StrCat("keys[", i, "]")); !st.ok()) {
        return ToGrpc(st);
      }
    }
    return ToGrpc(c_->kv().Wait({req->keys().begin(), req->keys().end()}, *deadline));
  }

 private:
  absl::Status Allowed(grpc::ServerContext* ctx, const std::string& key,
                       const std::string& field) const {
    if (auto st = guard_->Worker(ctx); !st.ok()) return st.status();
    if (auto st = ValidateKey(key, field); !st.ok()) return st;
    const auto& md = ctx->client_metadata();
    auto it = md.find(auth::kRunSecretMetadata);
    const std::string secret =
        it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
    // A secure server's store holds the keys of running jobs' ranks only.
    return c_->kv().CheckRunSecret(key, secret, field, /*runs_only=*/guard_->secure());
  }

  Coordinator* c_;
  const Guard* guard_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    Coordinator* coordinator, const std::string& listen, const ServerOptions& options) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  const bool secure = options.tls.any();
  if (secure) {
    auto tls = auth::ServerCredentials(options.tls);
    if (!tls.ok()) return tls.status();
    credentials = *tls;
    if (options.tokens == nullptr) {
      return absl::InvalidArgumentError("--tokens: required with TLS (vocabpipe certs token)");
    }
  } else if (!auth::IsLoopbackAddress(listen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen ", listen, ": without TLS (--tls-cert/--tls-key/--tls-ca) only loopback"));
  }
  s->guard_ = std::make_unique<Guard>(secure, options.tokens, options.revoked);
  s->tokens_path_ = options.tokens_path;
  s->revoked_path_ = options.revoked_path;
  s->jobs_ = std::make_unique<JobServiceImpl>(coordinator, options.max_watchers,
                                              options.max_watchers_per_user, s->guard_.get());
  s->workers_ = std::make_unique<WorkerServiceImpl>(coordinator, s->guard_.get());
  s->store_ = std::make_unique<StoreServiceImpl>(coordinator, s->guard_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // Explicit message limits (docs/operations.md, "Security"): requests are small (a spec is
  // at most 64 KiB); answers carry job records with their plan text.
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(kMaxResponseBytes);
  builder.AddListeningPort(listen, credentials, &s->port_);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->workers_.get());
  builder.RegisterService(s->store_.get());
  s->server_ = builder.BuildAndStart();
  // A unix socket has no port (gRPC reports 1 for it); only a TCP listen must have bound one.
  const bool unix_socket = listen.rfind("unix:", 0) == 0;
  if (s->server_ == nullptr || (s->port_ == 0 && !unix_socket)) {
    return absl::UnavailableError(absl::StrCat("--listen ", listen, ": cannot listen there"));
  }
  if (auto* health = s->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    for (const char* name :
         {"vocabpipe.v1.JobService", "vocabpipe.v1.WorkerService", "vocabpipe.v1.StoreService"}) {
      health->SetServingStatus(name, true);
    }
  }
  if (options.reload_interval > absl::ZeroDuration() &&
      (!s->tokens_path_.empty() || !s->revoked_path_.empty())) {
    s->last_seen_ = {FileVersion(s->tokens_path_), FileVersion(s->revoked_path_)};
    s->watcher_ = std::thread([p = s.get(), every = options.reload_interval] { p->Watch(every); });
  }
  return s;
}

std::string CoordinatorServer::FileVersion(const std::string& path) {
  struct stat st {};
  if (path.empty() || stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

void CoordinatorServer::Watch(absl::Duration every) {
  std::unique_lock<std::mutex> lock(watch_mu_);
  std::pair<std::string, std::string> previous = last_seen_;
  while (!stop_watching_) {
    watch_cv_.wait_for(lock, absl::ToChronoMilliseconds(every));
    if (stop_watching_) break;
    const std::pair<std::string, std::string> now = {FileVersion(tokens_path_),
                                                     FileVersion(revoked_path_)};
    // A file is read once it has stopped changing (the same inode, size and mtime at two
    // checks in a row), never while an editor or a copy is still writing it.
    const bool settled = now == previous;
    previous = now;
    if (now == last_seen_ || !settled) continue;
    lock.unlock();
    Reload().IgnoreError();  // logged
    lock.lock();
  }
}

absl::Status CoordinatorServer::Reload() {
  std::lock_guard<std::mutex> lock(reload_mu_);
  {
    // What this reload reads: the watcher does not read the same versions again.
    std::lock_guard<std::mutex> watch(watch_mu_);
    last_seen_ = {FileVersion(tokens_path_), FileVersion(revoked_path_)};
  }
  absl::Status result;
  if (!tokens_path_.empty()) {
    auto tokens = auth::TokenTable::Load(tokens_path_);
    if (tokens.ok()) {
      std::cerr << "vocabpipe-coordinator: --tokens: loaded " << tokens->size() << " tokens"
                << std::endl;
      guard_->SetTokens(std::make_shared<const auth::TokenTable>(std::move(*tokens)));
    } else {
      std::cerr << "vocabpipe-coordinator: " << tokens.status().message()
                << " (keeping the tokens loaded before)" << std::endl;
      result = tokens.status();
    }
  }
  if (!revoked_path_.empty()) {
    auto revoked = auth::RevocationList::Load(revoked_path_);
    if (revoked.ok()) {
      std::cerr << "vocabpipe-coordinator: --revoked: " << revoked->size()
                << " revoked certificates" << std::endl;
      guard_->SetRevoked(std::make_shared<const auth::RevocationList>(std::move(*revoked)));
    } else {
      std::cerr << "vocabpipe-coordinator: " << revoked.status().message()
                << " (keeping the list loaded before)" << std::endl;
      if (result.ok()) result = revoked.status();
    }
  }
  return result;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    stop_watching_ = true;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable() && watcher_.get_id() != std::this_thread::get_id()) watcher_.join();
  if (server_ != nullptr) {
    // Open WatchJob streams notice within their 500 ms poll; give them a second.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
}

void CoordinatorServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace vp::server
