#include "worker/launch/grpc_store.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"
#include "proto/grpc/auth.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace vp::launch {
namespace v1 = vocabpipe::v1;
namespace {

// Server-side waits end at timeout_ms; the call's own deadline leaves room for the answer.
constexpr std::chrono::seconds kSlack{5};

[[noreturn]] void Throw(const std::string& what, const grpc::Status& st) {
  throw gloo::IoException(absl::StrCat("coordinator store: ", what, ": ", st.error_message()));
}

// A coordinator that restarts (and re-adopts this rank's launch) is away for a moment: the
// connection drops (UNAVAILABLE), and until the rank's daemon has registered again the new
// process does not know the launch yet ("not an active run"). Both are retried until `until`;
// the keys themselves survive in the coordinator's database.
bool Retryable(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE ||
         (st.error_code() == grpc::StatusCode::PERMISSION_DENIED &&
          st.error_message().find("is not an active run") != std::string::npos);
}

template <typename Call>
grpc::Status Retrying(std::chrono::system_clock::time_point until, Call call) {
  for (;;) {
    grpc::Status st = call(until);
    if (st.ok() || !Retryable(st) || std::chrono::system_clock::now() >= until) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// Reconnects within a second after the coordinator is back (gRPC's default backoff grows to
// minutes). The minimum backoff is also gRPC's deadline for one connection attempt: 5 s, so a
// TLS handshake on a loaded host is not cut short (the calls wait for the channel, so they
// drive the attempt: docs/operations.md, "Fault tolerance", tells why that matters).
std::shared_ptr<grpc::Channel> StoreChannel(const std::string& address,
                                            std::shared_ptr<grpc::ChannelCredentials> creds) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(address, std::move(creds), args);
}

}  // namespace

GrpcStore::GrpcStore(const std::string& address, std::chrono::milliseconds timeout,
                     std::shared_ptr<grpc::ChannelCredentials> credentials, std::string run_secret)
    : channel_(StoreChannel(address, std::move(credentials))),
      run_secret_(std::move(run_secret)),
      timeout_(timeout) {}

void GrpcStore::Prepare(grpc::ClientContext& ctx) const {
  if (!run_secret_.empty()) ctx.AddMetadata(auth::kRunSecretMetadata, run_secret_);
}

GrpcStore::~GrpcStore() = default;

void GrpcStore::set(const std::string& key, const std::vector<char>& data) {
  auto stub = v1::StoreService::NewStub(channel_);
  v1::StoreSetRequest req;
  req.set_key(key);
  req.set_value(std::string(data.begin(), data.end()));
  const auto until = std::chrono::system_clock::now() +
                     std::max<std::chrono::milliseconds>(timeout_, std::chrono::seconds(10));
  grpc::Status st = Retrying(until, [&](auto deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    ctx.set_wait_for_ready(true);
    Prepare(ctx);
    v1::StoreSetResponse resp;
    return stub->Set(&ctx, req, &resp);
  });
  if (!st.ok()) Throw("set " + key, st);
}

std::vector<char> GrpcStore::get(const std::string& key) {
  auto stub = v1::StoreService::NewStub(channel_);
  const auto start = std::chrono::system_clock::now();
  v1::StoreGetResponse resp;
  grpc::Status st = Retrying(start + timeout_, [&](auto until) {
    grpc::ClientContext ctx;
    ctx.set_deadline(until + kSlack);
    ctx.set_wait_for_ready(true);
    Prepare(ctx);
    v1::StoreGetRequest req;  // the server waits what is left of the timeout
    req.set_key(key);
    req.set_timeout_ms(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                until - std::chrono::system_clock::now())
                                                .count()));
    return stub->Get(&ctx, req, &resp);
  });
  if (!st.ok()) Throw("get " + key, st);
  return std::vector<char>(resp.value().begin(), resp.value().end());
}

void GrpcStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GrpcStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  auto stub = v1::StoreService::NewStub(channel_);
  grpc::Status st = Retrying(std::chrono::system_clock::now() + timeout, [&](auto until) {
    grpc::ClientContext ctx;
    ctx.set_deadline(until + kSlack);
    ctx.set_wait_for_ready(true);
    Prepare(ctx);
    v1::StoreWaitRequest req;
    for (const std::string& k : keys) req.add_keys(k);
    req.set_timeout_ms(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                until - std::chrono::system_clock::now())
                                                .count()));
    v1::StoreWaitResponse resp;
    return stub->Wait(&ctx, req, &resp);
  });
  if (!st.ok()) Throw(absl::StrCat("wait for ", keys.size(), " keys"), st);
}

std::vector<std::string> StoreFlags(const std::string& address, const std::string& hostname,
                                    const auth::TlsFiles& tls, bool insecure) {
  std::vector<std::string> flags = {"--store", address, "--hostname", hostname};
  if (insecure) {
    flags.push_back("--insecure");
  } else {
    const std::vector<std::string> files = auth::TlsFlags(tls);
    flags.insert(flags.end(), files.begin(), files.end());
  }
  return flags;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> StoreCredentials(
    const std::string& address, const auth::TlsFiles& tls, bool insecure) {
  if (insecure) {
    if (auto st = auth::CheckInsecure(tls, address, "--store"); !st.ok()) return st;
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert.empty() || tls.key.empty()) {
    return absl::InvalidArgumentError(
        "--store: needs --tls-ca, --tls-cert and --tls-key (or --insecure on loopback)");
  }
  auto credentials = auth::ClientCredentials(tls);
  if (!credentials.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--store: ", credentials.status().message()));
  }
  return *credentials;
}

}  // namespace vp::launch
