// The coordinator's limits against a tenant of a shared cluster (docs/operations.md,
// "Security"), each as the probe that once got past it: real vocabpipe-coordinator processes
// over TLS with the certificates of `vocabpipe certs init`/`certs worker` and the tokens of
// `vocabpipe certs token`; where a worker is needed, the test speaks WorkerService itself with a
// worker certificate (it can then claim anything, as a dishonest worker would). Every refusal
// is checked for its status and message and for what it left stored: the job count, the
// store's rows in the SQLite file, the files.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include "proto/grpc/auth.h"
#include "proto/spec/job_spec.h"
#include "tests/integration/control/control_harness.h"

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;
using ::testing::Not;

// The run secret's metadata key (auth::kRunSecretMetadata).
constexpr char kSecretMetadata[] = "x-vocabpipe-run-secret";

// Rows and bytes (keys + values) of the coordinator's durable store table `kv`.
std::pair<int64_t, int64_t> KvRows(const fs::path& db) {
  sqlite3* h = nullptr;
  std::pair<int64_t, int64_t> out{-1, -1};
  if (sqlite3_open_v2(db.c_str(), &h, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(h,
                           "SELECT COUNT(*), COALESCE(SUM(LENGTH(key) + LENGTH(value)), 0) FROM kv",
                           -1, &st, nullptr) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW) {
      out = {sqlite3_column_int64(st, 0), sqlite3_column_int64(st, 1)};
    }
    sqlite3_finalize(st);
  }
  sqlite3_close(h);
  return out;
}

// The result of one integer query on the coordinator's SQLite file (-1 on error).
int64_t DbInt(const fs::path& db, const std::string& sql) {
  sqlite3* h = nullptr;
  int64_t out = -1;
  if (sqlite3_open_v2(db.c_str(), &h, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(h, sql.c_str(), -1, &st, nullptr) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW) {
      out = sqlite3_column_int64(st, 0);
    }
    sqlite3_finalize(st);
  }
  sqlite3_close(h);
  return out;
}

// A worker that is only the test speaking WorkerService with a worker certificate: it reports
// whatever it is told to and heartbeats on a thread of its own, collecting the commands.
class FakeWorker {
 public:
  FakeWorker(const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : stub_(v1::WorkerService::NewStub(grpc::CreateChannel(address, credentials))) {}
  ~FakeWorker() {
    stop_ = true;
    if (beat_.joinable()) beat_.join();
  }

  grpc::Status Register(int64_t memory_bytes, const std::string& hostname) {
    v1::RegisterWorkerRequest req;
    req.set_device("cpu");
    req.set_memory_bytes(memory_bytes);
    req.set_address("127.0.0.1");
    req.set_hostname(hostname);
    req.set_pid(getpid());
    req.set_threads(1);
    req.set_peak_flops(1e9);
    v1::RegisterWorkerResponse resp;
    grpc::Status st = stub_->RegisterWorker(Ctx().get(), req, &resp);
    if (!st.ok()) return st;
    id_ = resp.worker_id();
    beat_ = std::thread([this] {
      int64_t acked = 0;
      while (!stop_) {
        v1::HeartbeatRequest hb;
        hb.set_worker_id(id_);
        hb.set_acked_seq(acked);
        v1::HeartbeatResponse out;
        if (stub_->Heartbeat(Ctx(5).get(), hb, &out).ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          for (const v1::WorkerCommand& c : out.commands()) {
            if (c.seq() > acked) {
              acked = c.seq();
              commands_.push_back(c);
            }
          }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    return st;
  }
  const std::string& id() const { return id_; }
  std::vector<v1::WorkerCommand> Commands() {
    std::lock_guard<std::mutex> lock(mu_);
    return commands_;
  }

 private:
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::string id_;
  std::atomic<bool> stop_{false};
  std::thread beat_;
  std::mutex mu_;
  std::vector<v1::WorkerCommand> commands_;
};

class LimitsTest : public TlsClusterTest {
 protected:
  LimitsTest() : TlsClusterTest("vp_limits_") {}

  void SetUp() override {
    TlsClusterTest::SetUp();
    if (HasFatalFailure()) return;
    alice_ = pki_->Token("alice");
    bob_ = pki_->Token("bob");
    ASSERT_EQ(alice_.size(), 64u);
    ASSERT_EQ(bob_.size(), 64u);
  }

  // A process that must refuse to start: its exit code and output.
  std::pair<int, std::string> Refused(const std::vector<std::string>& args) {
    Process p(args, dir_ / "refused.log");
    int status = 0;
    waitpid(p.pid(), &status, 0);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, p.Log()};
  }

  v1::SubmitJobRequest Job(const std::string& name, const std::string& model, int pipeline = 1,
                           const std::string& parallel_extra = "") {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat("name: ", name, "\nmodel: ", model, "\n",
                                   "parallel: {pipeline: ", pipeline,
                                   ", microbatch_size: 1, microbatches: 2", parallel_extra, "}\n",
                                   "train: {steps: 2, lr: 0.003, threads: 1}\n",
                                   "data: {path: data.bin}\ncheckpoint: {dir: runs/", name, "}\n"));
    req.set_base_dir((dir_ / "root").string());
    return req;
  }
  v1::SubmitJobRequest TinyJob(const std::string& name, int pipeline = 1) {
    return Job(name, "{layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}", pipeline);
  }

  std::string alice_, bob_;
};

// Probe 19: a host name that merely starts with "127." resolves wherever its DNS says; only a
// numeric loopback address, localhost or a unix socket is loopback for --insecure.
TEST_F(LimitsTest, InsecureRefusesANameThatOnlyLooksLikeLoopback) {
  using vp::auth::IsLoopbackAddress;
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:1"));
  EXPECT_TRUE(IsLoopbackAddress("127.3.2.1:1"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:1"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:1"));
  EXPECT_TRUE(IsLoopbackAddress("unix:/run/x/coordinator.sock"));
  for (const char* a : {"127.evil.example:1", "127.0.0.1.nip.io:1", "localhost.evil:1", "0.0.0.0:1",
                        "[::]:1", "192.0.2.2:1", "unix:", "unix-abstract:x"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
  auto [code, log] =
      Refused({Bin("coordinator/server/vocabpipe-coordinator"), "--db",
               (dir_ / "bypass.db").string(), "--insecure", "--listen", "127.evil.example:0"});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log,
              HasSubstr("--insecure: only on loopback, but --listen is \"127.evil.example:0\""));
  EXPECT_FALSE(fs::exists(dir_ / "bypass.db"));
  std::tie(code, log) = Refused(
      {Bin("worker/main/vocabpipe-worker"), "--coordinator", "127.evil.example:1", "--insecure"});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("--insecure: only on loopback"));
  CliResult cli = Vocabpipe("", "workers --insecure --coordinator 127.evil.example:1");
  EXPECT_EQ(cli.code, 2);
  EXPECT_THAT(cli.output, HasSubstr("--insecure: only on loopback, but --coordinator is"));
}

// Probe 56: a TLS coordinator must name its storage root, or say explicitly that it has none.
TEST_F(LimitsTest, TlsCoordinatorNeedsItsStorageRootNamed) {
  std::vector<std::string> args = {Bin("coordinator/server/vocabpipe-coordinator"), "--db",
                                   db_.string(), "--listen", "127.0.0.1:0"};
  for (const std::string& f : pki_->ServerFlags()) args.push_back(f);
  auto [code, log] = Refused(args);
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("--storage-root DIR: required with TLS"));
  EXPECT_THAT(log, HasSubstr("--storage-root none"));
  EXPECT_FALSE(fs::exists(db_));
  // Named: /etc/shadow and /etc/cron.d are refused at submit, and nothing is stored.
  auto c = StartCoordinator({"--storage-root", (dir_ / "root").string()});
  ASSERT_TRUE(c->up());
  v1::SubmitJobRequest req = TinyJob("shadow");
  req.set_spec_text(
      "name: shadow\nmodel: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
      "data: {path: /etc/shadow}\ncheckpoint: {dir: /etc/cron.d/vp}\n");
  v1::SubmitJobResponse resp;
  grpc::Status st = Jobs(*c, alice_)->SubmitJob(Ctx().get(), req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("is outside the storage root"));
  EXPECT_EQ(JobCount(*c), 0);
}

// Probe 54: an empty tokens file (a careless `: > tokens`) is refused at start, and on reload
// (SIGHUP or the file watcher) the tokens loaded before stay in force.
TEST_F(LimitsTest, EmptyTokensFileIsRefusedAtStartAndOnReload) {
  const std::string kept = ReadWholeFile(pki_->tokens());
  std::ofstream(pki_->tokens(), std::ios::trunc).close();
  std::vector<std::string> args = {Bin("coordinator/server/vocabpipe-coordinator"),
                                   "--db",
                                   db_.string(),
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--storage-root",
                                   "none"};
  for (const std::string& f : pki_->ServerFlags()) args.push_back(f);
  auto [code, log] = Refused(args);
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("holds no token; an empty table would lock every user out"));
  std::ofstream(pki_->tokens(), std::ios::trunc) << kept;

  auto c = StartCoordinator();
  ASSERT_TRUE(c->up());
  auto list = [&](const std::string& token) {
    v1::ListJobsResponse resp;
    return Jobs(*c, token)->ListJobs(Ctx().get(), v1::ListJobsRequest(), &resp);
  };
  ASSERT_TRUE(list(alice_).ok());
  // Truncated while it runs: the watcher (no signal) and SIGHUP both keep the old tokens.
  std::ofstream(pki_->tokens(), std::ios::trunc).close();
  EXPECT_TRUE(
      WaitFor([&] { return c->process().Log().find("holds no token") != std::string::npos; },
              std::chrono::seconds(10)))
      << c->process().Log();
  EXPECT_THAT(c->process().Log(), HasSubstr("keeping the tokens loaded before"));
  EXPECT_TRUE(list(alice_).ok());
  EXPECT_TRUE(list(admin_).ok());
  kill(c->process().pid(), SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(list(alice_).ok());
  // A file still being written is not read until it stops changing: while a line is appended
  // every 300 ms, a token added meanwhile stays unknown; once the writes stop it is loaded.
  std::ofstream(pki_->tokens(), std::ios::trunc) << kept;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(3500);
  std::string carol;
  while (std::chrono::steady_clock::now() < until) {
    std::ofstream(pki_->tokens(), std::ios::app) << "# still writing\n";
    if (carol.empty()) carol = pki_->Token("carol");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(list(carol).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_TRUE(WaitFor([&] { return list(carol).ok(); }, std::chrono::seconds(5)))
      << c->process().Log();
  EXPECT_TRUE(list(alice_).ok());
}

// Probe 43: one user holding streams cannot lock another out; the global cap stays.
TEST_F(LimitsTest, EachUserHasAShareOfTheWatchers) {
  auto c = StartCoordinator({"--max-watchers", "4", "--max-watchers-per-user", "2"});
  ASSERT_TRUE(c->up());
  auto alice = Jobs(*c, alice_), bob = Jobs(*c, bob_);
  v1::SubmitJobResponse a, b;
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("a"), &a).ok());  // PENDING: no workers
  ASSERT_TRUE(bob->SubmitJob(Ctx().get(), TinyJob("b"), &b).ok());
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> open;
  auto watch = [&](v1::JobService::Stub& stub, const std::string& id) {
    v1::WatchJobRequest req;
    req.set_job_id(id);
    ctx.push_back(Ctx(30));
    open.push_back(stub.WatchJob(ctx.back().get(), req));
    v1::JobEvent e;
    return open.back()->Read(&e);  // the PENDING event: the stream is open
  };
  ASSERT_TRUE(watch(*alice, a.job_id()));
  ASSERT_TRUE(watch(*alice, a.job_id()));
  EXPECT_FALSE(watch(*alice, a.job_id()));
  grpc::Status st = open.back()->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("watchers: user alice has 2 WatchJob streams open, the limit per user"));
  // Bob is served while alice holds her share.
  EXPECT_TRUE(watch(*bob, b.job_id()));
  EXPECT_TRUE(watch(*bob, b.job_id()));
  // The global cap (4) still holds, for everyone.
  auto admin = Jobs(*c, admin_);
  EXPECT_FALSE(watch(*admin, a.job_id()));
  st = open.back()->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("watchers: 4 WatchJob streams are open"));
  for (size_t i = 0; i < ctx.size(); ++i) ctx[i]->TryCancel();
  EXPECT_EQ(JobCount(*c), 2);
}

// Probe 44: the queue limit is checked before planning; one plan per user at a time; a plan
// past its deadline stops (its slot comes back within seconds, not when the plan would end).
TEST_F(LimitsTest, PlanningChecksTheQueueFirstAndServesOnePlanPerUser) {
  auto c = StartCoordinator({"--max-queued-per-user", "1", "--planning-deadline", "2"});
  ASSERT_TRUE(c->up());
  auto alice = Jobs(*c, alice_), bob = Jobs(*c, bob_);
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("first"), &resp).ok());  // PENDING
  // A spec whose automatic choice takes many seconds of planning (p = 256, m = 512).
  v1::SubmitJobRequest huge = TinyJob("huge");
  huge.set_spec_text(absl::StrCat(
      "name: huge\nmodel: {layers: 256, hidden: 64, heads: 2, vocab_size: 1000, seq_len: 32}\n",
      "parallel: {pipeline: 256, microbatch_size: 1, microbatches: 512, schedule: auto, vocab: "
      "auto}\ntrain: {steps: 2}\ndata: {path: data.bin}\n"));
  // At her queue limit: refused at once, before any planning.
  auto t0 = std::chrono::steady_clock::now();
  grpc::Status st = alice->SubmitJob(Ctx().get(), huge, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("queue: user alice has 1 queued (PENDING) jobs"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // A dry run of the huge spec holds alice's one plan; a second plan of hers is refused while
  // bob's is served.
  grpc::Status dry;
  std::thread first([&] {
    v1::PlanJobResponse out;
    dry = alice->PlanJob(Ctx(60).get(), huge, &out);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  v1::PlanJobResponse out;
  st = alice->PlanJob(Ctx().get(), TinyJob("small"), &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("planner: user alice already has a plan being computed; one plan per "
                        "user at a time"));
  st = bob->PlanJob(Ctx().get(), TinyJob("small"), &out);
  EXPECT_TRUE(st.ok()) << st.error_message();
  first.join();
  EXPECT_EQ(dry.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(dry.error_message(), HasSubstr("deadline of 2s and was stopped"));
  // The stopped plan gives alice's slot back within a few seconds (the whole choice would run
  // for tens of seconds more).
  EXPECT_TRUE(WaitFor(
      [&] {
        v1::PlanJobResponse small;
        return alice->PlanJob(Ctx().get(), TinyJob("small"), &small).ok();
      },
      std::chrono::seconds(5)));
  EXPECT_EQ(JobCount(*c), 1);
}

// Probe 37: what a worker reports is capped by --max-worker-memory, and a job is checked
// against each worker it gets before it profiles there.
TEST_F(LimitsTest, WorkerMemoryIsCappedAndCheckedPerWorkerBeforeProfiling) {
  for (const char* name : {"node3", "node4"}) {
    CliResult r = Vocabpipe("", absl::StrCat("certs worker ", name, " ", pki_->certs().string()));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  constexpr int64_t kCap = int64_t{64} << 30;
  auto c = StartCoordinator({"--max-worker-memory", std::to_string(kCap)});
  ASSERT_TRUE(c->up());
  FakeWorker liar(c->address(), pki_->Credentials("node3"));
  ASSERT_TRUE(liar.Register(int64_t{1} << 50, "host1").ok());
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(c->workers->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &workers).ok());
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).memory_bytes(), kCap);
  EXPECT_TRUE(WaitFor(
      [&] { return c->process().Log().find("more than --max-worker-memory") != std::string::npos; },
      std::chrono::seconds(2)));
  auto alice = Jobs(*c, alice_);
  // 40 layers of h = 8192 on one rank is about 480 GiB of weights, gradients and Adam state.
  v1::SubmitJobResponse resp;
  grpc::Status st = alice->SubmitJob(
      Ctx().get(),
      Job("big", "{layers: 40, hidden: 8192, heads: 64, vocab_size: 1000, seq_len: 16}"), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("the largest worker has 64.0 GiB"));
  EXPECT_EQ(JobCount(*c), 0);
  // A second worker with 1 GiB on the same host; a two-rank job of several GiB per rank fits the
  // largest worker at submit, and fails as soon as it gets the small one, naming it, before any
  // profiling.
  FakeWorker small(c->address(), pki_->Credentials("node4"));
  ASSERT_TRUE(small.Register(int64_t{1} << 30, "host1").ok());
  ASSERT_TRUE(alice
                  ->SubmitJob(Ctx().get(),
                              Job("mid",
                                  "{layers: 8, hidden: 4096, heads: 32, vocab_size: 1000, "
                                  "seq_len: 16}",
                                  2),
                              &resp)
                  .ok());
  v1::Job job;
  ASSERT_TRUE(WaitFor(
      [&] {
        v1::GetJobRequest get;
        get.set_job_id(resp.job_id());
        return alice->GetJob(Ctx().get(), get, &job).ok() && job.state() == v1::JOB_STATE_FAILED;
      },
      std::chrono::seconds(10)))
      << job.DebugString();
  EXPECT_THAT(job.reason(),
              HasSubstr(absl::StrCat("its worker ", small.id(), " (host1) has 1.0 GiB")));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a heartbeat or two
  for (FakeWorker* w : {&liar, &small}) {
    for (const v1::WorkerCommand& cmd : w->Commands()) {
      EXPECT_FALSE(cmd.has_profile()) << w->id() << " was asked to profile";
      EXPECT_FALSE(cmd.has_run()) << w->id() << " was given a rank";
    }
  }
}

// Probe 47: a run's writes beyond its key and byte limits are refused before they reach the
// coordinator's SQLite file.
TEST_F(LimitsTest, StoreWritesBeyondARunsLimitsAreNeverPersisted) {
  CliResult made = Vocabpipe("", absl::StrCat("certs worker node1 ", pki_->certs().string()));
  ASSERT_EQ(made.code, 0) << made.output;
  auto c = StartCoordinator({"--no-profile"});
  ASSERT_TRUE(c->up());
  FakeWorker worker(c->address(), pki_->Credentials("node1"));
  ASSERT_TRUE(worker.Register(int64_t{8} << 30, "node1").ok());
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), TinyJob("kv"), &resp).ok());
  v1::RunTask run;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const v1::WorkerCommand& cmd : worker.Commands()) {
          if (cmd.has_run()) run = cmd.run();
        }
        return !run.store_secret().empty();
      },
      std::chrono::seconds(10)));
  auto store =
      v1::StoreService::NewStub(grpc::CreateChannel(c->address(), pki_->Credentials("node1")));
  const std::string value(64 << 10, 'v');
  int stored = 0, refused = 0;
  std::string message;
  for (int i = 0; i < 300; ++i) {
    auto ctx = Ctx();
    ctx->AddMetadata(kSecretMetadata, run.store_secret());
    v1::StoreSetRequest set;
    set.set_key(absl::StrCat("vocabpipe/", run.attempt(), "/k", i));
    set.set_value(value);
    v1::StoreSetResponse out;
    grpc::Status st = store->Set(ctx.get(), set, &out);
    if (st.ok()) {
      ++stored;
    } else {
      ++refused;
      EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      message = st.error_message();
    }
  }
  EXPECT_GT(stored, 200);
  EXPECT_GT(refused, 0);
  EXPECT_THAT(message, HasSubstr("the limit per run is 4096 keys and 16777216 bytes"));
  // Exactly the admitted writes are in the file, within the run's byte limit.
  const auto [rows, bytes] = KvRows(db_);
  EXPECT_EQ(rows, stored);
  EXPECT_LE(bytes, 16 << 20);
  EXPECT_EQ(JobCount(*c), 1);
}

// Probe 20: the coordinator `vocabpipe run` starts in-process (plaintext, every caller its
// admin) is on a unix socket in a 0700 folder, not on a loopback port another local user can
// reach; its daemons still connect, and the run succeeds untouched.
TEST_F(LimitsTest, LocalRunCoordinatorIsClosedToOtherLocalUsers) {
  CliResult synth = SynthData(dir_ / "data.bin");
  ASSERT_EQ(synth.code, 0) << synth.output;
  std::ofstream(dir_ / "local.yaml")
      << "name: local\nmodel: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
      << "parallel: {pipeline: 2, microbatch_size: 2, microbatches: 2}\n"
      << "train: {steps: 20, lr: 0.003, threads: 1}\ndata: {path: data.bin}\n";
  Process run({Bin("client/vocabpipe"), "run", (dir_ / "local.yaml").string()}, dir_ / "run.log");
  const fs::path daemon_log = dir_ / "runs" / "local" / "daemon_0.log";
  const std::string marker = " with unix:";
  ASSERT_TRUE(WaitFor([&] { return ReadWholeFile(daemon_log).find(marker) != std::string::npos; },
                      std::chrono::seconds(60)))
      << run.Log();
  std::string log = ReadWholeFile(daemon_log);
  std::string socket = log.substr(log.find(marker) + marker.size());
  socket = socket.substr(0, socket.find(','));
  const fs::path folder = fs::path(socket).parent_path();
  struct stat st {};
  ASSERT_EQ(stat(folder.c_str(), &st), 0) << folder;
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(st.st_uid, getuid());
  // The second daemon connects too (it may log a moment after the first).
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadWholeFile(dir_ / "runs" / "local" / "daemon_1.log").find(marker) !=
               std::string::npos;
      },
      std::chrono::seconds(60)));
  // Another local user cannot even connect (search permission on the folder); run as root,
  // the test checks it as uid 65534 in a child process.
  if (getuid() == 0) {
    sockaddr_un addr{};  // built before the fork: the child only makes system calls
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket.c_str());
    const pid_t child = fork();
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      _exit(rc == 0 ? 1 : errno == EACCES ? 0 : 2);
    }
    int status = 0;
    waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "1: connected; 2: another error; 3: setuid failed";
  }
  int status = 0;
  waitpid(run.pid(), &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << run.Log();
  EXPECT_THAT(run.Log(), HasSubstr("job-1: SUCCEEDED"));
  EXPECT_FALSE(fs::exists(folder)) << "the socket's folder outlived the run";
}

// Probe 32: a spec that is not UTF-8 (in a name, a comment or a path) is refused naming where,
// by the CLI before it sends anything (spec_text is a proto3 string, which gRPC cannot carry
// otherwise); a raw client that sends such bytes anyway is refused by gRPC's parser before the
// coordinator sees the request. Nothing is stored either way.
TEST_F(LimitsTest, NonUtf8SpecIsRefusedNamingWhere) {
  auto c = StartCoordinator({"--storage-root", (dir_ / "root").string()});
  ASSERT_TRUE(c->up());
  const fs::path file = dir_ / "root" / "nonutf.yaml";
  std::ofstream(file, std::ios::binary)
      << "# caf\xc3\xa9 is fine, the next line is not\nname: caf\xe9\n"
      << "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
      << "data: {path: data.bin}\n";
  CliResult r = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                          absl::StrCat("submit ", file.string(), " --coordinator ", c->address(),
                                       " --tls-ca ", pki_->Path("ca.pem")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("nonutf.yaml: name: expected a UTF-8 string, got other bytes"));
  EXPECT_THAT(r.output, Not(HasSubstr("libprotobuf")));
  CliResult plan = Vocabpipe("", absl::StrCat("plan ", file.string()));
  EXPECT_EQ(plan.code, 2) << plan.output;
  EXPECT_THAT(plan.output, HasSubstr("name: expected a UTF-8 string"));
  // Outside every field (a comment): named by its byte, line and column.
  std::ofstream(file, std::ios::binary)
      << "name: cafe\n# caf\xe9\n"
      << "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
      << "data: {path: data.bin}\n";
  r = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                absl::StrCat("submit ", file.string(), " --coordinator ", c->address(),
                             " --tls-ca ", pki_->Path("ca.pem")));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("(root): byte 16 (line 2, column 6) is not valid UTF-8"));
  EXPECT_THAT(r.output, Not(HasSubstr("libprotobuf")));
  plan = Vocabpipe("", absl::StrCat("plan ", file.string()));
  EXPECT_EQ(plan.code, 2) << plan.output;
  EXPECT_THAT(plan.output, HasSubstr("(root): byte 16 (line 2, column 6) is not valid UTF-8"));
  // Overlong forms and surrogates are not UTF-8 either.
  for (const char* bad : {"name: \xc0\xae\n", "name: \xed\xa0\x80\n", "name: \xf4\x90\x80\x80\n",
                          "name: x\xe2\x82\n"}) {
    EXPECT_EQ(vp::spec::CheckUtf8(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(vp::spec::CheckUtf8("name: \xe2\x82\xac\xf0\x9f\x98\x80\n").ok());
  // A raw client: SubmitJobRequest.spec_text (field 2) with the same bytes, sent as they are.
  const std::string text = ReadWholeFile(file);
  std::string wire = "\x12";
  for (size_t n = text.size();; n >>= 7) {  // varint length
    wire.push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
    if (n < 0x80) break;
  }
  wire += text;
  grpc::Slice slice(wire);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::GenericStub generic(grpc::CreateChannel(c->address(), pki_->Credentials("", alice_)));
  auto ctx = Ctx();
  std::promise<grpc::Status> done;
  generic.UnaryCall(ctx.get(), "/vocabpipe.v1.JobService/SubmitJob", grpc::StubOptions(), &request,
                    &response, [&](grpc::Status st) { done.set_value(st); });
  const grpc::Status st = done.get_future().get();
  // spec_text is a bytes field: gRPC hands the bytes over and the coordinator's parser names
  // where they stop being UTF-8 (an empty INTERNAL from gRPC's own parser before).
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(),
              HasSubstr("(root): byte 16 (line 2, column 6) is not valid UTF-8"));
  EXPECT_EQ(JobCount(*c), 0);
  EXPECT_EQ(kill(c->process().pid(), 0), 0);
}

// Probe 45: finished jobs have a per-user cap and a retention period (user churn cannot grow
// the job table without bound, and prunes nobody else's history), and ListJobs answers in pages.
TEST_F(LimitsTest, FinishedJobsAreCappedPerUserExpireAndListInPages) {
  std::vector<std::string> flags = {"--max-finished-per-user", "5", "--max-queued-per-user", "0"};
  auto c = StartCoordinator(flags);
  ASSERT_TRUE(c->up());
  auto alice = Jobs(*c, alice_), bob = Jobs(*c, bob_);
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(bob->SubmitJob(Ctx().get(), TinyJob("bob"), &resp).ok());
  v1::CancelJobRequest cancel;
  cancel.set_job_id(resp.job_id());
  v1::Job cancelled;
  ASSERT_TRUE(bob->CancelJob(Ctx().get(), cancel, &cancelled).ok());
  for (int i = 0; i < 20; ++i) {  // alice: submit and cancel, over and over
    ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob(absl::StrCat("a", i)), &resp).ok());
    cancel.set_job_id(resp.job_id());
    ASSERT_TRUE(alice->CancelJob(Ctx().get(), cancel, &cancelled).ok());
  }
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("pending"), &resp).ok());  // not finished
  EXPECT_TRUE(WaitFor([&] { return DbInt(db_, "SELECT COUNT(*) FROM jobs") == 7; },
                      std::chrono::seconds(5)))
      << DbInt(db_, "SELECT COUNT(*) FROM jobs");
  // Alice keeps her newest 5 finished jobs and the pending one; bob's job is untouched; the
  // deleted jobs' events went with them.
  v1::ListJobsResponse mine;
  ASSERT_TRUE(alice->ListJobs(Ctx().get(), v1::ListJobsRequest(), &mine).ok());
  ASSERT_EQ(mine.jobs_size(), 6);
  EXPECT_EQ(mine.jobs(0).id(), "job-22");
  EXPECT_EQ(mine.jobs(5).id(), "job-17");
  EXPECT_EQ(DbInt(db_, "SELECT COUNT(*) FROM jobs WHERE id = 'job-1'"), 1);
  EXPECT_EQ(DbInt(db_, "SELECT COUNT(DISTINCT job_id) FROM events"), 7);
  // Pages: the admin sees all 7, two at a time, newest first, in the same order as one page.
  v1::ListJobsResponse all;
  ASSERT_TRUE(c->jobs->ListJobs(Ctx().get(), v1::ListJobsRequest(), &all).ok());
  ASSERT_EQ(all.jobs_size(), 7);
  EXPECT_TRUE(all.next_page_token().empty());
  std::vector<std::string> paged;
  v1::ListJobsRequest page_req;
  page_req.set_page_size(2);
  int pages = 0;
  do {
    v1::ListJobsResponse page;
    ASSERT_TRUE(c->jobs->ListJobs(Ctx().get(), page_req, &page).ok());
    EXPECT_LE(page.jobs_size(), 2);
    for (const v1::Job& j : page.jobs()) paged.push_back(j.id());
    page_req.set_page_token(page.next_page_token());
    ++pages;
  } while (!page_req.page_token().empty() && pages < 10);
  EXPECT_EQ(pages, 4);
  ASSERT_EQ(paged.size(), 7u);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(paged[i], all.jobs(i).id());
  page_req.set_page_token("job-3; DROP TABLE jobs");
  v1::ListJobsResponse bad;
  grpc::Status st = c->jobs->ListJobs(Ctx().get(), page_req, &bad);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("page_token: not a token of ListJobs"));
  // The CLI follows the pages.
  CliResult cli = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", admin_),
                            absl::StrCat("status --output json --coordinator ", c->address(),
                                         " --tls-ca ", pki_->Path("ca.pem")));
  EXPECT_EQ(cli.code, 0) << cli.output;
  EXPECT_THAT(cli.output, HasSubstr("\"job-22\""));
  EXPECT_THAT(cli.output, HasSubstr("\"job-1\""));
  // Retention: restarted with a 1 s TTL, every finished job goes; the pending one stays, and
  // the next job does not reuse a deleted job's number.
  c.reset();
  flags.insert(flags.end(), {"--finished-ttl", "1"});
  c = StartCoordinator(flags);
  ASSERT_TRUE(c->up());
  EXPECT_TRUE(WaitFor([&] { return DbInt(db_, "SELECT COUNT(*) FROM jobs") == 1; },
                      std::chrono::seconds(10)));
  EXPECT_EQ(DbInt(db_, "SELECT COUNT(*) FROM jobs WHERE id = 'job-22'"), 1);
  EXPECT_EQ(DbInt(db_, "SELECT COUNT(*) FROM events WHERE job_id <> 'job-22'"), 0);
  alice = Jobs(*c, alice_);
  v1::CancelJobRequest last;
  last.set_job_id("job-22");
  ASSERT_TRUE(alice->CancelJob(Ctx().get(), last, &cancelled).ok());
  EXPECT_TRUE(WaitFor([&] { return DbInt(db_, "SELECT COUNT(*) FROM jobs") == 0; },
                      std::chrono::seconds(10)));
  c.reset();
  c = StartCoordinator(flags);
  ASSERT_TRUE(c->up());
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), TinyJob("after"), &resp).ok());
  EXPECT_EQ(resp.job_id(), "job-23");
}

// Defect 16 (probes 26 and 38): a token file that is truncated, empty or not one fails the
// submit when the coordinator can see it (inside its storage root), naming the field and never
// quoting the file; a tokenizer beside it that links out of the root is refused; a bad file the
// coordinator could not see is refused by the worker daemon before it forks the rank, and the
// job fails once, with no restart, although train.max_restarts allows three.
TEST_F(LimitsTest, BadInputFilesFailOnceNotAtEveryRestart) {
  const fs::path root = dir_ / "root";
  CliResult synth = SynthData(root / "data.bin");
  ASSERT_EQ(synth.code, 0) << synth.output;
  const std::string good = ReadWholeFile(root / "data.bin");
  std::ofstream(root / "trunc.bin", std::ios::binary) << good.substr(0, good.size() - 1001);
  std::ofstream(root / "magic.bin", std::ios::binary) << "secret words " << std::string(2000, 'x');
  std::ofstream(root / "empty.bin", std::ios::binary).close();
  fs::create_directories(root / "linked");
  fs::create_directories(dir_ / "outside");
  std::ofstream(dir_ / "outside" / "secret.txt") << "not for you\n";
  fs::copy_file(root / "data.bin", root / "linked" / "data.bin");
  fs::create_symlink(dir_ / "outside" / "secret.txt", root / "linked" / "tokenizer.model");
  auto c = StartCoordinator({"--no-profile", "--storage-root", root.string()});
  ASSERT_TRUE(c->up());
  auto alice = Jobs(*c, alice_);
  auto job = [&](const std::string& name, const std::string& data) {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: ", name, "\nmodel: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n",
        "train: {steps: 2, lr: 0.003, threads: 1, max_restarts: 3}\n", "data: {path: ", data,
        "}\ncheckpoint: {dir: runs/", name, "}\n"));
    req.set_base_dir(root.string());
    return req;
  };
  v1::SubmitJobResponse resp;
  for (const auto& [file, why] : std::vector<std::pair<std::string, std::string>>{
           {"trunc.bin", "bytes"}, {"magic.bin", "bad magic"}, {"empty.bin", ""}}) {
    grpc::Status st = alice->SubmitJob(Ctx().get(), job("bad", file), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << file;
    EXPECT_THAT(st.error_message(), HasSubstr("data.path: " + (root / file).string())) << file;
    EXPECT_THAT(st.error_message(), HasSubstr(why)) << file;
    EXPECT_THAT(st.error_message(), Not(HasSubstr("secret words")));
  }
  grpc::Status st = alice->SubmitJob(Ctx().get(), job("linked", "linked/data.bin"), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("data.path's tokenizer.model"));
  EXPECT_THAT(st.error_message(), HasSubstr("is outside the storage root"));
  EXPECT_THAT(st.error_message(), Not(HasSubstr("not for you")));
  EXPECT_EQ(JobCount(*c), 0);
  // Not there at submit (the coordinator cannot tell), truncated by the time a worker runs it.
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), job("later", "later.bin"), &resp).ok());
  std::ofstream(root / "later.bin", std::ios::binary) << good.substr(0, good.size() - 1001);
  std::vector<std::string> args = {Bin("worker/main/vocabpipe-worker"),
                                   "--coordinator",
                                   c->address(),
                                   "--exit-with-parent",
                                   "1",
                                   "--storage-root",
                                   root.string()};
  for (const std::string& f : pki_->WorkerFlags()) args.push_back(f);
  Process worker(args, dir_ / "worker.log");
  v1::Job failed;
  ASSERT_TRUE(WaitFor(
      [&] {
        v1::GetJobRequest get;
        get.set_job_id(resp.job_id());
        return alice->GetJob(Ctx().get(), get, &failed).ok() &&
               failed.state() == v1::JOB_STATE_FAILED;
      },
      std::chrono::seconds(30)))
      << failed.DebugString() << worker.Log();
  EXPECT_EQ(failed.restarts(), 0);
  EXPECT_THAT(failed.reason(), HasSubstr("data.path: " + (root / "later.bin").string()));
  EXPECT_FALSE(fs::exists(root / "runs" / "later")) << "the rank's folder was made";
  EXPECT_EQ(JobCount(*c), 1);
}

}  // namespace
