#include "worker/launch/grpc_store.h"

#include <grpcpp/grpcpp.h>

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

}  // namespace

GrpcStore::GrpcStore(const std::string& address, std::chrono::milliseconds timeout,
                     std::shared_ptr<grpc::ChannelCredentials> credentials, std::string run_secret)
    : channel_(grpc::CreateChannel(address, std::move(credentials))),
      run_secret_(std::move(run_secret)),
      timeout_(timeout) {}

void GrpcStore::Prepare(grpc::ClientContext& ctx) const {
  if (!run_secret_.empty()) ctx.AddMetadata(auth::kRunSecretMetadata, run_secret_);
}

GrpcStore::~GrpcStore() = default;

void GrpcStore::set(const std::string& key, const std::vector<char>& data) {
  auto stub = v1::StoreService::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ctx.set_wait_for_ready(true);
  Prepare(ctx);
  v1::StoreSetRequest req;
  req.set_key(key);
  req.set_value(std::string(data.begin(), data.end()));
  v1::StoreSetResponse resp;
  if (auto st = stub->Set(&ctx, req, &resp); !st.ok()) Throw("set " + key, st);
}

std::vector<char> GrpcStore::get(const std::string& key) {
  auto stub = v1::StoreService::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout_ + kSlack);
  ctx.set_wait_for_ready(true);
  Prepare(ctx);
  v1::StoreGetRequest req;
  req.set_key(key);
  req.set_timeout_ms(timeout_.count());
  v1::StoreGetResponse resp;
  if (auto st = stub->Get(&ctx, req, &resp); !st.ok()) Throw("get " + key, st);
  return std::vector<char>(resp.value().begin(), resp.value().end());
}

void GrpcStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GrpcStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  auto stub = v1::StoreService::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + kSlack);
  ctx.set_wait_for_ready(true);
  Prepare(ctx);
  v1::StoreWaitRequest req;
  for (const std::string& k : keys) req.add_keys(k);
  req.set_timeout_ms(timeout.count());
  v1::StoreWaitResponse resp;
  if (auto st = stub->Wait(&ctx, req, &resp); !st.ok()) {
    Throw(absl::StrCat("wait for ", keys.size(), " keys"), st);
  }
}

}  // namespace vp::launch
