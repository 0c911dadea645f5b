// Helpers for the control plane tests: real vocabpipe-coordinator and vocabpipe-worker
// processes on loopback (build tree binaries), gRPC stubs to them, and a tiny job.
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"
#include "vocabpipe/v1/service.grpc.pb.h"

extern char** environ;

namespace vp::testing {

namespace fs = std::filesystem;
namespace v1 = vocabpipe::v1;

inline std::string ReadWholeFile(const fs::path& path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// A child process whose stdout and stderr go to a file. Killed (SIGKILL) when destroyed.
class Process {
 public:
  Process(const std::vector<std::string>& args, const fs::path& log) : log_(log) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Process() { Kill(SIGKILL); }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  std::string Log() const { return ReadWholeFile(log_); }
  // Sends sig and reaps; returns the wait status (-1 if not running).
  int Kill(int sig) {
    if (pid_ <= 0) return -1;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  fs::path log_;
};

inline std::string Bin(const std::string& rel) { return absl::StrCat(VP_BINARY_DIR, "/", rel); }

// Polls `pred` every 20 ms until it holds or `timeout` passes.
template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// A coordinator process on 127.0.0.1 (a free port) with fast heartbeats. Plaintext
// (--insecure) unless `extra` has --tls-cert; the stubs use `credentials` (default: plaintext).
class CoordinatorProcess {
 public:
  CoordinatorProcess(const fs::path& dir, const fs::path& db, std::vector<std::string> extra = {},
                     std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr) {
    std::vector<std::string> args = {Bin("coordinator/server/vocabpipe-coordinator"),
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--db",
                                     db.string(),
                                     "--heartbeat-interval",
                                     "0.1",
                                     "--heartbeat-timeout",
                                     "1.5",
                                     "--rank-timeout",
                                     "10",
                                     "--exit-with-parent",
                                     "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    if (std::find(extra.begin(), extra.end(), "--tls-cert") == extra.end()) {
      args.push_back("--insecure");
    } else if (std::find(extra.begin(), extra.end(), "--storage-root") == extra.end()) {
      // TLS needs the storage root named; tests that do not confine paths say so.
      args.insert(args.end(), {"--storage-root", "none"});
    }
    const fs::path log = dir / absl::StrCat("coordinator_", ++count_, ".log");
    process_ = std::make_unique<Process>(args, log);
    const std::string marker = "listening on 127.0.0.1:";
    WaitFor([&] { return process_->Log().find(marker) != std::string::npos; },
            std::chrono::seconds(10));
    const std::string out = process_->Log();
    const size_t at = out.find(marker);
    if (at != std::string::npos) {
      port_ = std::stoi(out.substr(at + marker.size()));
      address_ = absl::StrCat("127.0.0.1:", port_);
    }
    channel_ = grpc::CreateChannel(address_,
                                   credentials ? credentials : grpc::InsecureChannelCredentials());
    jobs = v1::JobService::NewStub(channel_);
    workers = v1::WorkerService::NewStub(channel_);
    store = v1::StoreService::NewStub(channel_);
  }
  const std::string& address() const { return address_; }
  bool up() const { return port_ > 0; }
  Process& process() { return *process_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

  std::unique_ptr<v1::JobService::Stub> jobs;
  std::unique_ptr<v1::WorkerService::Stub> workers;
  std::unique_ptr<v1::StoreService::Stub> store;

 private:
  static inline int count_ = 0;
  std::unique_ptr<Process> process_;
  int port_ = 0;
  std::string address_ = "127.0.0.1:1";
  std::shared_ptr<grpc::Channel> channel_;
};

// The certificates and tokens of a test cluster, made the way an operator makes them:
// `vocabpipe certs init DIR/certs` and `vocabpipe certs token USER` into DIR/tokens.
class TestPki {
 public:
  explicit TestPki(const fs::path& dir) : certs_(dir / "certs"), tokens_(dir / "tokens") {
    init_ = Vocabpipe("", "certs init " + certs_.string());
  }
  bool ok() const { return init_.code == 0; }
  const std::string& init_output() const { return init_.output; }
  const fs::path& certs() const { return certs_; }
  const fs::path& tokens() const { return tokens_; }
  std::string Path(const std::string& name) const { return (certs_ / name).string(); }
  std::string Pem(const std::string& name) const { return ReadWholeFile(certs_ / name); }

  // A new token for `user` (printed once by the CLI); empty when the CLI failed. `extra`: more
  // flags of `certs token` (--expires ...).
  std::string Token(const std::string& user, const std::string& role = "user",
                    const std::string& extra = "") const {
    CliResult r = Vocabpipe("", absl::StrCat("certs token ", user, " --role ", role, " --tokens ",
                                             tokens_.string(), " ", extra));
    if (r.code != 0) return "";
    std::string token = r.output;
    while (!token.empty() && token.back() == '\n') token.pop_back();
    return token;
  }

  std::vector<std::string> ServerFlags() const {
    return {"--tls-cert", Path("server.pem"), "--tls-key", Path("server-key.pem"),
            "--tls-ca",   Path("ca.pem"),     "--tokens",  tokens_.string()};
  }
  // The daemon flags of the worker certificate `name` (`name`.pem, `name`-key.pem).
  std::vector<std::string> WorkerFlags(const std::string& name = "worker") const {
    return {"--tls-ca",          Path("ca.pem"), "--tls-cert",
            Path(name + ".pem"), "--tls-key",    Path(name + "-key.pem")};
  }
  // TLS verifying the server; with the worker certificate `cert` (empty: none) and a bearer
  // token when given.
  std::shared_ptr<grpc::ChannelCredentials> Credentials(const std::string& cert,
                                                        const std::string& token = "") const {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = Pem("ca.pem");
    if (!cert.empty()) {
      ssl.pem_cert_chain = Pem(cert + ".pem");
      ssl.pem_private_key = Pem(cert + "-key.pem");
    }
    auto creds = grpc::SslCredentials(ssl);
    if (!token.empty()) {
      creds = grpc::CompositeChannelCredentials(creds, grpc::AccessTokenCredentials(token));
    }
    return creds;
  }

 private:
  fs::path certs_, tokens_;
  CliResult init_;
};

// A context with a 10 s deadline (every unary call in the tests).
inline std::unique_ptr<grpc::ClientContext> Ctx(int seconds = 10) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  return ctx;
}

}  // namespace vp::testing
