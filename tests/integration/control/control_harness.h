// Helpers for the control plane tests: real vocabpipe-coordinator and vocabpipe-worker
// processes on loopback (build tree binaries), gRPC stubs to them, and a tiny job.
#pragma once

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
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
#include <utility>
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

// The running test's own folder, TMP/<prefix><test name>_<pid> ('/' in a parameterized test's
// name made '_'), emptied and created.
inline fs::path FreshTestDir(const std::string& prefix) {
  std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(name.begin(), name.end(), '/', '_');
  const fs::path dir = fs::temp_directory_path() / absl::StrCat(prefix, name, "_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The tests' token file (V = 64, 20000 tokens, seed 5) written to `out` by `vocabpipe data synth`.
inline CliResult SynthData(const fs::path& out) {
  return Vocabpipe(
      "", absl::StrCat("data synth --vocab 64 --tokens 20000 --seed 5 --out ", out.string()));
}

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

// The one "expect the job to have succeeded, else say why" check of the control tests: a
// failure names the job, the state it ended in and its reason. Use as
// ASSERT_TRUE(Succeeded(job)) or EXPECT_TRUE(Succeeded(job)) << more context.
inline ::testing::AssertionResult Succeeded(const v1::Job& job) {
  if (job.state() == v1::JOB_STATE_SUCCEEDED) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "job " << (job.id().empty() ? "(unknown)" : job.id()) << " ended "
         << v1::JobState_Name(job.state()) << ", not SUCCEEDED: " << job.reason();
}

// A fixture over TLS: a folder of the test's own (dir_, with an empty storage root dir_/root), the
// certificates and tokens of `vocabpipe certs` in it with an admin token (admin_), coordinators on
// dir_/coordinator.db and worker daemons with the worker certificate.
class TlsClusterTest : public ::testing::Test {
 protected:
  // prefix: the start of the folder's name (FreshTestDir).
  explicit TlsClusterTest(std::string prefix) : prefix_(std::move(prefix)) {}

  // A subclass's SetUp calls this first and returns if HasFatalFailure().
  void SetUp() override {
    dir_ = FreshTestDir(prefix_);
    root_ = dir_ / "root";
    fs::create_directories(root_);
    db_ = dir_ / "coordinator.db";
    pki_ = std::make_unique<TestPki>(dir_);
    ASSERT_TRUE(pki_->ok()) << pki_->init_output();
    admin_ = pki_->Token("root", "admin");
    ASSERT_EQ(admin_.size(), 64u);
  }
  // Stops the daemons; keeps the folder of a failed test.
  void TearDown() override {
    workers_.clear();
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // A TLS coordinator (client certificates verified, tokens) with the flags `extra`; its stubs
  // present the worker certificate and the admin's token.
  std::unique_ptr<CoordinatorProcess> StartCoordinator(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = pki_->ServerFlags();
    flags.insert(flags.end(), extra.begin(), extra.end());
    auto c =
        std::make_unique<CoordinatorProcess>(dir_, db_, flags, pki_->Credentials("worker", admin_));
    EXPECT_TRUE(c->up()) << c->process().Log();
    return c;
  }
  // A user's JobService over TLS with their token.
  std::unique_ptr<v1::JobService::Stub> Jobs(CoordinatorProcess& c, const std::string& token) {
    return v1::JobService::NewStub(grpc::CreateChannel(c.address(), pki_->Credentials("", token)));
  }

  // One more worker daemon with the worker certificate and the flags `extra`; returns once c
  // lists it (a fatal failure after 30 s).
  void StartWorker(CoordinatorProcess& c, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {Bin("worker/main/vocabpipe-worker"), "--coordinator",
                                     c.address(), "--exit-with-parent", "1"};
    for (const std::string& f : pki_->WorkerFlags()) args.push_back(f);
    args.insert(args.end(), extra.begin(), extra.end());
    const size_t n = workers_.size();
    workers_.push_back(std::make_unique<Process>(args, dir_ / absl::StrCat("worker_", n, ".log")));
    ASSERT_TRUE(WaitFor([&] { return ListWorkers(c).workers_size() >= static_cast<int>(n) + 1; },
                        std::chrono::seconds(30)))
        << workers_.back()->Log();
  }

  v1::ListWorkersResponse ListWorkers(CoordinatorProcess& c) {
    v1::ListWorkersResponse resp;
    c.workers->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &resp).ok();
    return resp;
  }
  // The number of jobs the admin sees (every job).
  int JobCount(CoordinatorProcess& c) {
    v1::ListJobsResponse list;
    EXPECT_TRUE(c.jobs->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
    return list.jobs_size();
  }
  // The job `id` as the admin sees it (empty if the call failed).
  v1::Job GetJob(CoordinatorProcess& c, const std::string& id) {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job job;
    c.jobs->GetJob(Ctx().get(), get, &job).ok();
    return job;
  }
  // Waits up to `seconds` for a terminal state; returns the job as last seen.
  v1::Job WaitTerminal(CoordinatorProcess& c, const std::string& id, int seconds = 120) {
    v1::Job job;
    WaitFor(
        [&] {
          job = GetJob(c, id);
          return job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED ||
                 job.state() == v1::JOB_STATE_CANCELLED;
        },
        std::chrono::seconds(seconds));
    return job;
  }

  fs::path dir_, root_, db_;
  std::unique_ptr<TestPki> pki_;
  std::string admin_;                              // the admin root's token
  std::vector<std::unique_ptr<Process>> workers_;  // StartWorker

 private:
  std::string prefix_;
};

}  // namespace vp::testing
