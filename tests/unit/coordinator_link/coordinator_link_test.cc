// The worker daemon's link to the coordinator (worker/daemon/coordinator_link.h): the reasons
// it logs, when it logs and replaces its channel, and — against a real TLS server that goes
// away and comes back on the same port, with certificates from `vocabpipe certs init` — that a
// registration gets through again within its deadline (issue 29, probe 50: the daemons'
// fail-fast calls never drove a TLS reconnection).
#include "worker/daemon/coordinator_link.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"

namespace vp::daemon {
namespace {

namespace fs = std::filesystem;
namespace v1 = vocabpipe::v1;
using ::testing::HasSubstr;

// Messages as gRPC 1.51 words them (seen in the daemons' logs).
const grpc::Status kRefused(grpc::StatusCode::UNAVAILABLE,
                            "failed to connect to all addresses; last error: UNKNOWN: "
                            "ipv4:127.0.0.1:41293: Failed to connect to remote host: Connection "
                            "refused");
const grpc::Status kVerifyFailed(
    grpc::StatusCode::UNAVAILABLE,
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:43614: Ssl "
    "handshake failed: SSL_ERROR_SSL: error:0A000086:SSL routines::certificate verify failed");
const grpc::Status kClosed(grpc::StatusCode::UNAVAILABLE,
                           "failed to connect to all addresses; last error: UNAVAILABLE: "
                           "ipv4:127.0.0.1:43614: Socket closed");

TEST(DescribeUnreachable, NamesTheKindOfFailureAndWhatToCheck) {
  EXPECT_THAT(DescribeUnreachable(kRefused, "c:1"),
              HasSubstr("connection refused: nothing listens at c:1"));
  EXPECT_THAT(DescribeUnreachable(kVerifyFailed, "c:1"), HasSubstr("TLS handshake failed"));
  EXPECT_THAT(DescribeUnreachable(kVerifyFailed, "c:1"), HasSubstr("certificate verify failed"));
  EXPECT_THAT(DescribeUnreachable(kClosed, "c:1"),
              HasSubstr("refused this worker's TLS handshake: --tls-cert not signed by its "
                        "--tls-ca"));
  EXPECT_THAT(DescribeUnreachable(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                               "DNS resolution failed for nowhere.invalid:1"),
                                  "nowhere.invalid:1"),
              HasSubstr("cannot resolve the host name of nowhere.invalid:1"));
  EXPECT_THAT(DescribeUnreachable(
                  grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"), "c:1"),
              HasSubstr("no answer before the call's deadline"));
  // gRPC's own message is bounded and on one line.
  const std::string long_line = DescribeUnreachable(
      grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(5000, 'x') + "\nmore"), "c:1");
  EXPECT_LT(long_line.size(), 500u);
  EXPECT_EQ(long_line.find('\n'), std::string::npos);
}

TEST(ReachTracker, LogsTheFirstFailureAChangedReasonAndThenAtMostEveryPeriod) {
  ReachTracker t("c:1", absl::Seconds(30), 5);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto v = t.Note(kRefused, t0);
  EXPECT_THAT(v.log, HasSubstr("cannot reach the coordinator at c:1 for 0.0s (1 call)"));
  EXPECT_THAT(v.log, HasSubstr("connection refused"));
  EXPECT_FALSE(v.fresh_channel);
  // The same reason again within the period: silent.
  EXPECT_EQ(t.Note(kRefused, t0 + absl::Seconds(1)).log, "");
  EXPECT_EQ(t.Note(kRefused, t0 + absl::Seconds(2)).log, "");
  // Another reason: at once.
  v = t.Note(kVerifyFailed, t0 + absl::Seconds(3));
  EXPECT_THAT(v.log, HasSubstr("for 3.0s (4 calls): TLS handshake failed"));
  // The fifth failure in a row replaces the channel (and says so when it logs).
  v = t.Note(kVerifyFailed, t0 + absl::Seconds(4));
  EXPECT_TRUE(v.fresh_channel);
  EXPECT_EQ(v.log, "");
  EXPECT_FALSE(t.Note(kVerifyFailed, t0 + absl::Seconds(5)).fresh_channel);
  // The period is over: logged again, with the time since the first failure.
  v = t.Note(kVerifyFailed, t0 + absl::Seconds(33));
  EXPECT_THAT(v.log, HasSubstr("for 33.0s (7 calls)"));
  EXPECT_EQ(t.failures(), 7);
  // An answer (any, NOT_FOUND included) ends the outage with one line and resets.
  v = t.Note(grpc::Status(grpc::StatusCode::NOT_FOUND, "worker_id: unknown"),
             t0 + absl::Seconds(34));
  EXPECT_EQ(v.log, "reached the coordinator at c:1 again after 34.0s (7 calls failed)");
  EXPECT_EQ(t.failures(), 0);
  EXPECT_EQ(t.Note(grpc::Status::OK, t0 + absl::Seconds(35)).log, "");
  // A failed call that waited for the channel: the outage is timed from its start.
  EXPECT_THAT(t.Note(kRefused, t0 + absl::Seconds(41), t0 + absl::Seconds(36)).log,
              HasSubstr("for 5.0s (1 call)"));
}

TEST(ReachTracker, ARefusalOfThisWorkerIsLoggedRateLimitedButNeverReplacesTheChannel) {
  ReachTracker t("c:1", absl::Seconds(30), 2);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  const grpc::Status revoked(grpc::StatusCode::UNAUTHENTICATED,
                             "worker certificate revoked: \"node1\"");
  auto v = t.Note(revoked, t0);
  EXPECT_THAT(v.log, HasSubstr("refuses this worker (1 call): worker certificate revoked"));
  for (int i = 1; i < 10; ++i) {
    v = t.Note(revoked, t0 + absl::Seconds(i));
    EXPECT_EQ(v.log, "");
    EXPECT_FALSE(v.fresh_channel);
  }
  EXPECT_THAT(t.Note(revoked, t0 + absl::Seconds(31)).log, HasSubstr("(11 calls)"));
}

// A port with nothing listening (bound, read, closed).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t n = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

class Registrar final : public v1::WorkerService::Service {
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                              v1::RegisterWorkerResponse* resp) override {
    resp->set_worker_id("worker-1");
    return grpc::Status::OK;
  }
};

class CoordinatorLinkTls : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("vp_link_", getpid());
    fs::remove_all(dir_);
    vp::testing::CliResult r = vp::testing::Vocabpipe("certs init " + (dir_ / "certs").string());
    ASSERT_EQ(r.code, 0) << r.output;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Pem(const std::string& name) { return ReadFile(dir_ / "certs" / name); }

  // A TLS server like the coordinator's: its certificate, client certificates verified.
  std::unique_ptr<grpc::Server> Serve(int port) {
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = Pem("ca.pem");
    ssl.pem_key_cert_pairs.push_back({Pem("server-key.pem"), Pem("server.pem")});
    grpc::ServerBuilder b;
    b.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::SslServerCredentials(ssl));
    b.RegisterService(&registrar_);
    return b.BuildAndStart();
  }
  std::shared_ptr<grpc::ChannelCredentials> WorkerCredentials() {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Pem("ca.pem");
    ssl.pem_cert_chain = Pem("worker.pem");
    ssl.pem_private_key = Pem("worker-key.pem");
    return grpc::SslCredentials(ssl);
  }

  fs::path dir_;
  Registrar registrar_;
};

TEST_F(CoordinatorLinkTls, ARegistrationGetsThroughOverTlsOnceTheServerIsBack) {
  const int port = FreePort();
  const std::string target = absl::StrCat("127.0.0.1:", port);
  std::vector<std::string> logs;
  CoordinatorLink link(target, WorkerCredentials(), absl::Seconds(3),
                       [&logs](const std::string& line) { logs.push_back(line); });
  v1::RegisterWorkerRequest req;
  v1::RegisterWorkerResponse resp;
  auto server = Serve(port);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(link.Keepalive(&CoordinatorLink::Stub::RegisterWorker, req, &resp).ok());
  // The server dies (like a kill -9: no goodbye to the channel's next calls).
  server->Shutdown(std::chrono::system_clock::now());
  server.reset();
  // The first call may still fail on the old connection ("Broken pipe"); the next ones find
  // nothing listening. Each returns within its deadline.
  for (int i = 0; i < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    grpc::Status down = link.Keepalive(&CoordinatorLink::Stub::RegisterWorker, req, &resp);
    EXPECT_EQ(down.error_code(), grpc::StatusCode::UNAVAILABLE) << down.error_message();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  }
  ASSERT_FALSE(logs.empty());
  EXPECT_THAT(logs.back(), HasSubstr("cannot reach the coordinator at " + target));
  EXPECT_THAT(logs.back(), HasSubstr("connection refused"));
  // Back on the same port: the next registration waits for the channel, which reconnects and
  // completes its TLS handshake within the call's deadline. (Fail-fast calls alone, as the
  // daemon made them before, keep failing: nothing polls the reconnection's socket.)
  server = Serve(port);
  ASSERT_NE(server, nullptr);
  const auto t1 = std::chrono::steady_clock::now();
  grpc::Status up = link.Keepalive(&CoordinatorLink::Stub::RegisterWorker, req, &resp);
  ASSERT_TRUE(up.ok()) << up.error_message();
  EXPECT_EQ(resp.worker_id(), "worker-1");
  EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(3));
  EXPECT_THAT(logs.back(), HasSubstr("reached the coordinator at " + target + " again after"));
  server->Shutdown(std::chrono::system_clock::now());
}

TEST_F(CoordinatorLinkTls, AHandshakeTheWorkerCannotVerifyIsLoggedAsATlsFailure) {
  const int port = FreePort();
  auto server = Serve(port);
  ASSERT_NE(server, nullptr);
  // A CA that did not sign the server's certificate.
  vp::testing::CliResult r = vp::testing::Vocabpipe("certs init " + (dir_ / "other").string());
  ASSERT_EQ(r.code, 0) << r.output;
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(dir_ / "other" / "ca.pem");
  ssl.pem_cert_chain = Pem("worker.pem");
  ssl.pem_private_key = Pem("worker-key.pem");
  std::vector<std::string> logs;
  CoordinatorLink link(absl::StrCat("127.0.0.1:", port), grpc::SslCredentials(ssl),
                       absl::Seconds(1),
                       [&logs](const std::string& line) { logs.push_back(line); });
  v1::RegisterWorkerRequest req;
  v1::RegisterWorkerResponse resp;
  grpc::Status st = link.Keepalive(&CoordinatorLink::Stub::RegisterWorker, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  ASSERT_GE(logs.size(), 1u);
  EXPECT_THAT(logs[0], HasSubstr("TLS handshake failed"));
  EXPECT_THAT(logs[0], HasSubstr("--tls-ca"));
  server->Shutdown(std::chrono::system_clock::now());
}

}  // namespace
}  // namespace vp::daemon
