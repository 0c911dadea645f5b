// gRPC server reflection on the coordinator's server (CoordinatorServer::Start enables it so that
// grpcurl and grpc_cli work without the .proto). Neither the reflection .proto nor grpc_cli is
// installed here, so the client is a grpc::GenericStub on the bidi method
// ServerReflectionInfo that writes ServerReflectionRequest by hand (CodedOutputStream) and reads
// ServerReflectionResponse with UnknownFieldSet. The field numbers below follow the public
// grpc.reflection.v1alpha reflection.proto; FieldNumbersMatchTheServersOwnSchema checks them
// against the schema the server itself reflects.
#include <gmock/gmock.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"

namespace {

namespace pb = google::protobuf;
using ::testing::Contains;
using ::testing::IsSupersetOf;

constexpr char kV1Alpha[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
constexpr char kV1[] = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";

// ServerReflectionRequest.
constexpr int kRequestFileContainingSymbol = 4;  // string
constexpr int kRequestListServices = 7;          // string
// ServerReflectionResponse.
constexpr int kResponseOriginalRequest = 2;         // ServerReflectionRequest
constexpr int kResponseFileDescriptorResponse = 4;  // FileDescriptorResponse
constexpr int kResponseListServicesResponse = 6;    // ListServiceResponse
constexpr int kResponseErrorResponse = 7;           // ErrorResponse
// FileDescriptorResponse.file_descriptor_proto: repeated bytes.
constexpr int kFileDescriptorProto = 1;
// ListServiceResponse.service: repeated ServiceResponse; ServiceResponse.name: string.
constexpr int kListServiceResponseService = 1;
constexpr int kServiceResponseName = 1;
// ErrorResponse.error_code: int32; ErrorResponse.error_message: string.
constexpr int kErrorCode = 1;
constexpr int kErrorMessage = 2;

// A ServerReflectionRequest with one string field set (the oneof member `field`).
std::string EncodeRequest(int field, const std::string& value) {
  std::string out;
  {
    pb::io::StringOutputStream raw(&out);
    pb::io::CodedOutputStream coded(&raw);
    coded.WriteTag(pb::internal::WireFormatLite::MakeTag(
        field, pb::internal::WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    coded.WriteVarint32(static_cast<uint32_t>(value.size()));
    coded.WriteString(value);
  }  // the CodedOutputStream flushes into `out` when destroyed
  return out;
}

// The length-delimited payloads of every `number` field of `set`, in wire order.
std::vector<std::string> LengthDelimited(const pb::UnknownFieldSet& set, int number) {
  std::vector<std::string> out;
  for (int i = 0; i < set.field_count(); ++i) {
    const pb::UnknownField& f = set.field(i);
    if (f.number() == number && f.type() == pb::UnknownField::TYPE_LENGTH_DELIMITED) {
      out.push_back(f.length_delimited());
    }
  }
  return out;
}

// Null if `bytes` is not protobuf wire format.
std::unique_ptr<pb::UnknownFieldSet> Parse(const std::string& bytes) {
  auto set = std::make_unique<pb::UnknownFieldSet>();
  if (!set->ParseFromString(bytes)) return nullptr;
  return set;
}

// A decoded ServerReflectionResponse: the members this test reads.
struct Response {
  std::string original_request;               // raw ServerReflectionRequest echoed back
  std::vector<std::string> services;          // list_services_response
  std::vector<std::string> file_descriptors;  // file_descriptor_response (serialized protos)
  std::optional<int> error_code;              // error_response
  std::string error_message;
};

std::optional<Response> DecodeResponse(const std::string& bytes) {
  auto top = Parse(bytes);
  if (!top) return std::nullopt;
  Response r;
  for (const std::string& echoed : LengthDelimited(*top, kResponseOriginalRequest)) {
    r.original_request = echoed;
  }
  for (const std::string& list : LengthDelimited(*top, kResponseListServicesResponse)) {
    auto list_set = Parse(list);
    if (!list_set) return std::nullopt;
    for (const std::string& service : LengthDelimited(*list_set, kListServiceResponseService)) {
      auto service_set = Parse(service);
      if (!service_set) return std::nullopt;
      for (const std::string& name : LengthDelimited(*service_set, kServiceResponseName)) {
        r.services.push_back(name);
      }
    }
  }
  for (const std::string& files : LengthDelimited(*top, kResponseFileDescriptorResponse)) {
    auto files_set = Parse(files);
    if (!files_set) return std::nullopt;
    for (const std::string& file : LengthDelimited(*files_set, kFileDescriptorProto)) {
      r.file_descriptors.push_back(file);
    }
  }
  for (const std::string& error : LengthDelimited(*top, kResponseErrorResponse)) {
    auto error_set = Parse(error);
    if (!error_set) return std::nullopt;
    r.error_code = 0;  // proto3: a zero code is not on the wire
    for (int i = 0; i < error_set->field_count(); ++i) {
      const pb::UnknownField& f = error_set->field(i);
      if (f.number() == kErrorCode && f.type() == pb::UnknownField::TYPE_VARINT) {
        r.error_code = static_cast<int>(f.varint());
      }
      if (f.number() == kErrorMessage && f.type() == pb::UnknownField::TYPE_LENGTH_DELIMITED) {
        r.error_message = f.length_delimited();
      }
    }
  }
  return r;
}

// What one request on a fresh ServerReflectionInfo stream produced: the call's status and the
// first response message (when one came). A fresh stream per request, because the server may
// leave out file descriptors it already sent earlier on the same stream.
struct Reply {
  grpc::Status status;
  std::optional<std::string> response;
};

// One bidi call through GenericStub's async API: every operation is awaited before the next
// starts, so the completion queue never holds more than one tag.
Reply AskOnce(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
              const std::string& request) {
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(3);
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  int tags[5];  // StartCall, Write, Read, WritesDone, Finish
  auto await = [&](void* want) {
    void* got = nullptr;
    bool ok = false;
    // The call deadline ends every operation before this one.
    const auto st = cq.AsyncNext(&got, &ok, deadline + std::chrono::seconds(2));
    return st == grpc::CompletionQueue::GOT_EVENT && got == want && ok;
  };
  Reply reply;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(&ctx, method, &cq);
  call->StartCall(&tags[0]);
  if (await(&tags[0])) {
    grpc::Slice slice(request);
    call->Write(grpc::ByteBuffer(&slice, 1), &tags[1]);
    if (await(&tags[1])) {
      grpc::ByteBuffer in;
      call->Read(&in, &tags[2]);
      if (await(&tags[2])) {
        std::vector<grpc::Slice> slices;
        if (in.Dump(&slices).ok()) {
          std::string bytes;
          for (const grpc::Slice& s : slices) {
            bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
          }
          reply.response = std::move(bytes);
        }
        call->WritesDone(&tags[3]);
        await(&tags[3]);
      }
    }
  }
  // A server that does not know `method` ends the call before any response: Finish has why.
  call->Finish(&reply.status, &tags[4]);
  void* got = nullptr;
  bool ok = false;
  // Skips a tag left over from an operation that failed above.
  while (cq.AsyncNext(&got, &ok, deadline + std::chrono::seconds(2)) ==
             grpc::CompletionQueue::GOT_EVENT &&
         got != &tags[4]) {
  }
  cq.Shutdown();
  while (cq.Next(&got, &ok)) {
  }
  return reply;
}

class ReflectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    vp::server::CoordinatorOptions options;
    options.db_path = ":memory:";
    options.profile = false;
    auto coordinator = vp::server::Coordinator::Open(options);
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = std::move(*coordinator);
    auto server = vp::server::CoordinatorServer::Start(coordinator_.get(), "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    server_.reset();  // before the coordinator it serves
    coordinator_.reset();
  }

  // One request on `method`; fails the test unless the call produced a decodable response.
  Response Ask(const std::string& method, int field, const std::string& value) {
    const std::string request = EncodeRequest(field, value);
    Reply reply = AskOnce(channel_, method, request);
    EXPECT_TRUE(reply.response.has_value())
        << method << ": no response; status " << reply.status.error_code() << " "
        << reply.status.error_message();
    if (!reply.response) return {};
    std::optional<Response> r = DecodeResponse(*reply.response);
    EXPECT_TRUE(r.has_value()) << method << ": response is not valid protobuf wire format";
    if (!r) return {};
    // Every response echoes the request it answers (original_request).
    EXPECT_EQ(r->original_request, request) << method;
    return *r;
  }

  // file_containing_symbol `symbol`: the serialized FileDescriptorProtos, each parsed.
  std::vector<pb::FileDescriptorProto> FilesContaining(const std::string& method,
                                                       const std::string& symbol) {
    Response r = Ask(method, kRequestFileContainingSymbol, symbol);
    EXPECT_FALSE(r.error_code.has_value()) << symbol << ": " << r.error_message;
    std::vector<pb::FileDescriptorProto> files;
    for (const std::string& bytes : r.file_descriptors) {
      pb::FileDescriptorProto file;
      EXPECT_TRUE(file.ParseFromString(bytes)) << symbol << ": a file_descriptor_proto";
      files.push_back(std::move(file));
    }
    return files;
  }

  std::unique_ptr<vp::server::Coordinator> coordinator_;
  std::unique_ptr<vp::server::CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

// Builds every file of `files` into `pool`, dependencies first; false if one cannot be built
// (a dependency the response left out, or a malformed descriptor).
bool BuildAll(const std::vector<pb::FileDescriptorProto>& files, pb::DescriptorPool* pool) {
  std::set<std::string> built;
  bool progress = true;
  while (built.size() < files.size() && progress) {
    progress = false;
    for (const pb::FileDescriptorProto& f : files) {
      if (built.count(f.name())) continue;
      bool ready = true;
      for (const std::string& dep : f.dependency()) ready = ready && built.count(dep) > 0;
      if (!ready) continue;
      if (pool->BuildFile(f) == nullptr) return false;
      built.insert(f.name());
      progress = true;
    }
  }
  return built.size() == files.size();
}

TEST_F(ReflectionTest, ListServicesNamesEveryService) {
  Response r = Ask(kV1Alpha, kRequestListServices, "*");
  EXPECT_FALSE(r.error_code.has_value()) << r.error_message;
  EXPECT_THAT(r.services, IsSupersetOf({"vocabpipe.v1.JobService", "vocabpipe.v1.WorkerService",
                                        "vocabpipe.v1.StoreService", "grpc.health.v1.Health"}));
  // Names are unique.
  EXPECT_EQ(std::set<std::string>(r.services.begin(), r.services.end()).size(), r.services.size());
}

TEST_F(ReflectionTest, FileContainingJobServiceDeclaresSubmitJob) {
  std::vector<pb::FileDescriptorProto> files = FilesContaining(kV1Alpha, "vocabpipe.v1.JobService");
  ASSERT_FALSE(files.empty());
  // The file that declares the service, read straight from the FileDescriptorProto.
  const pb::ServiceDescriptorProto* job_service = nullptr;
  for (const pb::FileDescriptorProto& f : files) {
    for (const pb::ServiceDescriptorProto& s : f.service()) {
      if (f.package() == "vocabpipe.v1" && s.name() == "JobService") job_service = &s;
    }
  }
  ASSERT_NE(job_service, nullptr) << "no file declares service vocabpipe.v1.JobService";
  std::vector<std::string> methods;
  for (const pb::MethodDescriptorProto& m : job_service->method()) methods.push_back(m.name());
  EXPECT_THAT(methods, Contains("SubmitJob"));

  // The response carries the file's transitive imports too (service.proto imports job.proto):
  // a client can build a DescriptorPool from it alone and resolve the method's types.
  pb::DescriptorPool pool;
  ASSERT_TRUE(BuildAll(files, &pool)) << "the returned files do not form a closed set";
  const pb::ServiceDescriptor* service = pool.FindServiceByName("vocabpipe.v1.JobService");
  ASSERT_NE(service, nullptr);
  const pb::MethodDescriptor* submit = service->FindMethodByName("SubmitJob");
  ASSERT_NE(submit, nullptr);
  EXPECT_EQ(submit->input_type()->full_name(), "vocabpipe.v1.SubmitJobRequest");
  EXPECT_EQ(submit->output_type()->full_name(), "vocabpipe.v1.SubmitJobResponse");
  EXPECT_FALSE(submit->client_streaming());
  // SubmitJobRequest carries the spec, a message defined in the imported job.proto.
  EXPECT_NE(pool.FindMessageTypeByName("vocabpipe.v1.JobSpec"), nullptr);
}

TEST_F(ReflectionTest, UnknownSymbolIsANotFoundErrorResponse) {
  Response r = Ask(kV1Alpha, kRequestFileContainingSymbol, "vocabpipe.v1.NoSuchService");
  ASSERT_TRUE(r.error_code.has_value()) << "expected error_response";
  EXPECT_EQ(*r.error_code, static_cast<int>(grpc::StatusCode::NOT_FOUND)) << r.error_message;
  EXPECT_TRUE(r.file_descriptors.empty());
}

// The hand-written field numbers above, checked against the reflection schema the server
// itself serves (its own reflection.proto).
TEST_F(ReflectionTest, FieldNumbersMatchTheServersOwnSchema) {
  std::vector<pb::FileDescriptorProto> files =
      FilesContaining(kV1Alpha, "grpc.reflection.v1alpha.ServerReflection");
  pb::DescriptorPool pool;
  ASSERT_TRUE(BuildAll(files, &pool));
  auto number = [&](const std::string& message, const std::string& field) {
    const pb::Descriptor* d = pool.FindMessageTypeByName("grpc.reflection.v1alpha." + message);
    const pb::FieldDescriptor* f = d == nullptr ? nullptr : d->FindFieldByName(field);
    return f == nullptr ? -1 : f->number();
  };
  EXPECT_EQ(number("ServerReflectionRequest", "file_containing_symbol"),
            kRequestFileContainingSymbol);
  EXPECT_EQ(number("ServerReflectionRequest", "list_services"), kRequestListServices);
  EXPECT_EQ(number("ServerReflectionResponse", "original_request"), kResponseOriginalRequest);
  EXPECT_EQ(number("ServerReflectionResponse", "file_descriptor_response"),
            kResponseFileDescriptorResponse);
  EXPECT_EQ(number("ServerReflectionResponse", "list_services_response"),
            kResponseListServicesResponse);
  EXPECT_EQ(number("ServerReflectionResponse", "error_response"), kResponseErrorResponse);
  EXPECT_EQ(number("FileDescriptorResponse", "file_descriptor_proto"), kFileDescriptorProto);
  EXPECT_EQ(number("ListServiceResponse", "service"), kListServiceResponseService);
  EXPECT_EQ(number("ServiceResponse", "name"), kServiceResponseName);
  EXPECT_EQ(number("ErrorResponse", "error_code"), kErrorCode);
  EXPECT_EQ(number("ErrorResponse", "error_message"), kErrorMessage);
}

// grpc.reflection.v1 (same messages, new package) is served by newer gRPC releases only. The
// installed one must answer v1alpha; if it answers v1 as well, the two must agree.
TEST_F(ReflectionTest, V1AnswersLikeV1AlphaOrIsUnimplemented) {
  const std::string request = EncodeRequest(kRequestListServices, "*");
  Reply v1alpha = AskOnce(channel_, kV1Alpha, request);
  ASSERT_TRUE(v1alpha.response.has_value()) << v1alpha.status.error_message();
  Reply v1 = AskOnce(channel_, kV1, request);
  if (!v1.response.has_value()) {
    EXPECT_EQ(v1.status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << v1.status.error_message();
    return;
  }
  std::optional<Response> a = DecodeResponse(*v1alpha.response);
  std::optional<Response> b = DecodeResponse(*v1.response);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(std::set<std::string>(a->services.begin(), a->services.end()),
            std::set<std::string>(b->services.begin(), b->services.end()));
}

}  // namespace
