// TLS, users and rendezvous secrets with real daemons (docs/operations.md, "Security"): the
// certificates come from `vocabpipe certs init`, the tokens from `vocabpipe certs token`; a
// vocabpipe-coordinator serves over TLS with client certificates requested and verified, and
// vocabpipe-worker daemons connect with the worker certificate. Every refusal is checked for
// its status and message, and for leaving what is stored as it was.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/integration/control/control_harness.h"

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("vp_tls_");
    pki_ = std::make_unique<TestPki>(dir_);
    ASSERT_TRUE(pki_->ok()) << pki_->init_output();  // `vocabpipe certs init` exited 0
    certs_ = pki_->certs();
    tokens_ = pki_->tokens();
    alice_ = Token("alice", "user");
    bob_ = Token("bob", "user");
    admin_ = Token("root", "admin");
  }
  void TearDown() override {
    workers_.clear();
    if (!HasFailure()) fs::remove_all(dir_);
  }

  std::string Token(const std::string& user, const std::string& role) {
    CliResult r = Vocabpipe(
        "", absl::StrCat("certs token ", user, " --role ", role, " --tokens ", tokens_.string()));
    EXPECT_EQ(r.code, 0) << r.output;
    std::string token = r.output;
    while (!token.empty() && token.back() == '\n') token.pop_back();
    EXPECT_EQ(token.size(), 64u) << token;
    return token;
  }

  std::string Pem(const std::string& name) { return pki_->Pem(name); }
  std::string Path(const std::string& name) { return pki_->Path(name); }
  std::vector<std::string> ServerFlags() { return pki_->ServerFlags(); }
  std::vector<std::string> WorkerFlags() { return pki_->WorkerFlags(); }

  // TLS verifying the server; with the worker certificate or a bearer token when asked.
  std::shared_ptr<grpc::ChannelCredentials> Credentials(bool worker_cert,
                                                        const std::string& token = "") {
    return pki_->Credentials(worker_cert ? "worker" : "", token);
  }
  // TLS with the client certificate `cert` (none when empty).
  std::shared_ptr<grpc::ChannelCredentials> CertCredentials(const std::string& cert,
                                                            const std::string& token = "") {
    return pki_->Credentials(cert, token);
  }

  std::unique_ptr<CoordinatorProcess> StartCoordinator(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = ServerFlags();
    flags.insert(flags.end(), extra.begin(), extra.end());
    auto c = std::make_unique<CoordinatorProcess>(dir_, dir_ / "coordinator.db", flags,
                                                  Credentials(true, admin_));
    EXPECT_TRUE(c->up()) << c->process().Log();
    return c;
  }

  std::unique_ptr<v1::JobService::Stub> Jobs(CoordinatorProcess& c, const std::string& token) {
    return v1::JobService::NewStub(grpc::CreateChannel(c.address(), Credentials(false, token)));
  }

  // A worker daemon with the certificate `cert` (`cert`.pem, `cert`-key.pem in the certs DIR).
  void StartWorker(CoordinatorProcess& c, int expect, const std::string& cert = "worker") {
    std::vector<std::string> args = {Bin("worker/main/vocabpipe-worker"), "--coordinator",
                                     c.address(), "--exit-with-parent", "1"};
    const std::vector<std::string> tls = pki_->WorkerFlags(cert);
    args.insert(args.end(), tls.begin(), tls.end());
    workers_.push_back(
        std::make_unique<Process>(args, dir_ / absl::StrCat("worker_", workers_.size(), ".log")));
    ASSERT_TRUE(
        WaitFor([&] { return ListWorkers(c).workers_size() >= expect; }, std::chrono::seconds(30)))
        << workers_.back()->Log();
  }

  v1::ListWorkersResponse ListWorkers(CoordinatorProcess& c) {
    v1::ListWorkersResponse resp;
    c.workers->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &resp).ok();
    return resp;
  }

  void MakeData() {
    CliResult r = SynthData(dir_ / "data.bin");
    ASSERT_EQ(r.code, 0) << r.output;
  }

  // `parallel`: the parallel block's fields instead of a p-stage pipeline of m = 2 of b = 2.
  v1::SubmitJobRequest TinyJob(const std::string& name, int pipeline = 1, int steps = 3,
                               const std::string& parallel = "") {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: ", name, "\nmodel: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n",
        "parallel: {",
        parallel.empty()
            ? absl::StrCat("pipeline: ", pipeline, ", microbatch_size: 2, microbatches: 2")
            : parallel,
        "}\n", "train: {steps: ", steps, ", lr: 0.003, threads: 1}\n",
        "data: {path: data.bin}\ncheckpoint: {dir: runs/", name, "}\n"));
    req.set_base_dir(dir_.string());
    return req;
  }

  // Waits (up to 120 s) for job `id` to end and returns its record as the admin reads it.
  v1::Job WaitForEnd(CoordinatorProcess& c, const std::string& id) {
    EXPECT_TRUE(WaitFor(
        [&] {
          const v1::JobState s = GetJob(*Jobs(c, admin_), id).state();
          return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED;
        },
        std::chrono::seconds(120)))
        << workers_[0]->Log();
    return GetJob(*Jobs(c, admin_), id);
  }

  v1::Job GetJob(v1::JobService::Stub& jobs, const std::string& id, grpc::Status* st = nullptr) {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job job;
    grpc::Status s = jobs.GetJob(Ctx().get(), get, &job);
    if (st != nullptr) *st = s;
    return job;
  }

  std::unique_ptr<TestPki> pki_;
  fs::path dir_, certs_, tokens_;  // pki_'s folders
  std::string alice_, bob_, admin_;
  std::vector<std::unique_ptr<Process>> workers_;
};

TEST_F(TlsTest, CertsInitWritesPrivateKeysAndNeverOverwrites) {
  for (const char* key : {"ca-key.pem", "server-key.pem", "worker-key.pem"}) {
    struct stat st {};
    ASSERT_EQ(stat((certs_ / key).c_str(), &st), 0) << key;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << key;
  }
  const std::string ca = Pem("ca.pem");
  CliResult again = Vocabpipe("", "certs init " + certs_.string());
  EXPECT_EQ(again.code, 2);
  EXPECT_THAT(again.output, HasSubstr("ca.pem: exists; certs init never overwrites"));
  EXPECT_EQ(Pem("ca.pem"), ca);
  CliResult bad = Vocabpipe("", "certs init " + (dir_ / "c2").string() + " --hosts 'a b'");
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--hosts: \"a b\" is neither an IP address nor a DNS name"));
  EXPECT_FALSE(fs::exists(dir_ / "c2" / "ca.pem"));
  // The tokens file holds hashes only.
  const std::string tokens = ReadWholeFile(tokens_);
  EXPECT_THAT(tokens, HasSubstr("alice user "));
  EXPECT_THAT(tokens, HasSubstr("root admin "));
  EXPECT_EQ(tokens.find(alice_), std::string::npos);
}

TEST_F(TlsTest, InsecureOnlyByFlagAndOnlyOnLoopback) {
  auto run = [&](const std::vector<std::string>& flags) {
    std::vector<std::string> args = {Bin("coordinator/server/vocabpipe-coordinator"), "--db",
                                     (dir_ / "x.db").string()};
    args.insert(args.end(), flags.begin(), flags.end());
    Process p(args, dir_ / "refused.log");
    int status = 0;
    waitpid(p.pid(), &status, 0);
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, p.Log());
  };
  auto [code, log] = run({});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("TLS required: --tls-cert, --tls-key and --tls-ca"));
  std::tie(code, log) = run({"--insecure", "--listen", "0.0.0.0:0"});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("--insecure: only on loopback, but --listen is \"0.0.0.0:0\""));
  std::tie(code, log) = run({"--tls-cert", Path("server.pem"), "--tls-key", Path("server-key.pem"),
                             "--tls-ca", Path("ca.pem")});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(log, HasSubstr("--tokens FILE: required with TLS"));
  // The CLI and the workers: no plaintext without the flag, none off loopback.
  CliResult cli = Vocabpipe("VOCABPIPE_TLS_CA=", "status --coordinator 127.0.0.1:1");
  EXPECT_EQ(cli.code, 2);
  EXPECT_THAT(cli.output, HasSubstr("TLS required: --tls-ca FILE"));
  cli = Vocabpipe("", "status --coordinator 10.1.2.3:50051 --insecure");
  EXPECT_EQ(cli.code, 2);
  EXPECT_THAT(cli.output, HasSubstr("--insecure: only on loopback, but --coordinator is"));
  Process worker(
      {Bin("worker/main/vocabpipe-worker"), "--coordinator", "10.1.2.3:50051", "--insecure"},
      dir_ / "worker_refused.log");
  int status = 0;
  waitpid(worker.pid(), &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_THAT(worker.Log(), HasSubstr("--insecure: only on loopback"));
}

TEST_F(TlsTest, UnauthenticatedCallsAreRefusedAndChangeNothing) {
  auto c = StartCoordinator();
  std::string id;
  {
    v1::SubmitJobResponse resp;
    ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), TinyJob("a"), &resp).ok());
    id = resp.job_id();
  }
  const v1::Job before = GetJob(*Jobs(*c, admin_), id);
  ASSERT_EQ(before.owner(), "alice");

  for (const std::string& token : {std::string(), std::string(64, 'f')}) {
    auto jobs = Jobs(*c, token);
    v1::SubmitJobResponse submitted;
    grpc::Status st = jobs->SubmitJob(Ctx().get(), TinyJob("b"), &submitted);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(st.error_message(),
                HasSubstr(token.empty() ? "needs a bearer token" : "unknown bearer token"));
    GetJob(*jobs, id, &st);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    v1::Job ignored;
    EXPECT_EQ(jobs->CancelJob(Ctx().get(), cancel, &ignored).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::ListJobsResponse list;
    EXPECT_EQ(jobs->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // A plaintext client does not even get a handshake.
  auto plain = v1::JobService::NewStub(
      grpc::CreateChannel(c->address(), grpc::InsecureChannelCredentials()));
  grpc::Status st;
  v1::ListJobsResponse list;
  EXPECT_EQ(plain->ListJobs(Ctx(3).get(), v1::ListJobsRequest(), &list).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // The CLI says so too.
  const std::string flags =
      absl::StrCat(" --coordinator ", c->address(), " --tls-ca ", Path("ca.pem"));
  CliResult cli = Vocabpipe("VOCABPIPE_TOKEN=", "status" + flags);
  EXPECT_EQ(cli.code, 1);
  EXPECT_THAT(cli.output, HasSubstr("vocabpipe status: unauthenticated: authorization: "));

  // Nothing stored changed: one job, as it was.
  ASSERT_TRUE(Jobs(*c, admin_)->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).SerializeAsString(), before.SerializeAsString());
}

TEST_F(TlsTest, OnlyTheOwnerOrAnAdminReadsWatchesOrCancelsAJob) {
  auto c = StartCoordinator();
  auto alice = Jobs(*c, alice_), bob = Jobs(*c, bob_), admin = Jobs(*c, admin_);
  v1::SubmitJobResponse a, b;
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("a"), &a).ok());
  ASSERT_TRUE(bob->SubmitJob(Ctx().get(), TinyJob("b"), &b).ok());
  const v1::Job before = GetJob(*admin, a.job_id());

  v1::CancelJobRequest cancel;
  cancel.set_job_id(a.job_id());
  v1::Job out;
  grpc::Status st = bob->CancelJob(Ctx().get(), cancel, &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("job " + a.job_id() + " belongs to alice"));
  GetJob(*bob, a.job_id(), &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  {
    v1::WatchJobRequest watch;
    watch.set_job_id(a.job_id());
    grpc::ClientContext ctx;
    auto reader = bob->WatchJob(&ctx, watch);
    v1::JobEvent e;
    EXPECT_FALSE(reader->Read(&e));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // Bob lists his own job only; the admin sees both.
  v1::ListJobsResponse list;
  ASSERT_TRUE(bob->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).id(), b.job_id());
  list.Clear();
  ASSERT_TRUE(admin->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
  EXPECT_EQ(list.jobs_size(), 2);
  // The CLI: exit 1 with the reason.
  CliResult cli = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", bob_),
                            absl::StrCat("cancel ", a.job_id(), " --coordinator ", c->address(),
                                         " --tls-ca ", Path("ca.pem")));
  EXPECT_EQ(cli.code, 1);
  EXPECT_THAT(cli.output, HasSubstr("permission denied: job " + a.job_id() + " belongs to alice"));

  // Nothing changed; then the owner and an admin may.
  EXPECT_EQ(GetJob(*admin, a.job_id()).SerializeAsString(), before.SerializeAsString());
  EXPECT_EQ(GetJob(*alice, a.job_id()).state(), v1::JOB_STATE_PENDING);
  ASSERT_TRUE(admin->CancelJob(Ctx().get(), cancel, &out).ok());
  EXPECT_EQ(out.state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(TlsTest, OnlyWorkerCertificatesRegisterHeartbeatOrUseTheStore) {
  auto c = StartCoordinator();
  auto admin = Jobs(*c, admin_);
  v1::SubmitJobResponse submitted;  // stored before: it must come through unchanged
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), TinyJob("a"), &submitted).ok());
  const v1::Job before = GetJob(*admin, submitted.job_id());
  // TLS without a client certificate, with and without a user's token.
  for (const std::string& token : {std::string(), alice_}) {
    auto channel = grpc::CreateChannel(c->address(), Credentials(false, token));
    auto workers = v1::WorkerService::NewStub(channel);
    auto store = v1::StoreService::NewStub(channel);
    v1::RegisterWorkerRequest reg;
    reg.set_device("cpu");
    reg.set_address("127.0.0.1");
    v1::RegisterWorkerResponse regr;
    grpc::Status st = workers->RegisterWorker(Ctx().get(), reg, &regr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(st.error_message(), HasSubstr("worker certificate required"));
    v1::HeartbeatRequest hb;
    hb.set_worker_id("worker-1");
    v1::HeartbeatResponse hbr;
    EXPECT_EQ(workers->Heartbeat(Ctx().get(), hb, &hbr).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::StoreSetRequest set;
    set.set_key("other/key");
    set.set_value("x");
    v1::StoreSetResponse setr;
    st = store->Set(Ctx().get(), set, &setr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(st.error_message(), HasSubstr("worker certificate required"));
  }
  // A worker daemon without its certificate does not start.
  Process nocert({Bin("worker/main/vocabpipe-worker"), "--coordinator", c->address(), "--tls-ca",
                  Path("ca.pem")},
                 dir_ / "nocert.log");
  int status = 0;
  waitpid(nocert.pid(), &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_THAT(nocert.Log(), HasSubstr("--tls-cert, --tls-key: a worker needs its certificate"));
  // The server's certificate is not a client certificate: the handshake fails.
  Process server_cert({Bin("worker/main/vocabpipe-worker"), "--coordinator", c->address(),
                       "--tls-ca", Path("ca.pem"), "--tls-cert", Path("server.pem"), "--tls-key",
                       Path("server-key.pem"), "--exit-with-parent", "1"},
                      dir_ / "server_cert.log");
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_EQ(ListWorkers(*c).workers_size(), 0);  // nothing registered
  server_cert.Kill(SIGTERM);
  // Nothing stored changed: the job as it was; the store holds no keys outside runs at all.
  v1::ListJobsResponse list;
  ASSERT_TRUE(admin->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).SerializeAsString(), before.SerializeAsString());
  {
    v1::StoreGetRequest get;
    get.set_key("other/key");
    v1::StoreGetResponse got;
    grpc::Status st = c->store->Get(Ctx().get(), get, &got);  // the worker certificate
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(got.value().empty());
  }
  // The worker certificate registers.
  StartWorker(*c, 1);
  EXPECT_EQ(ListWorkers(*c).workers_size(), 1);
}

// Two long jobs run at once; each rank process got its run's secret (its environment, from the
// daemon). A worker-certificate holder with run B's secret cannot read or write run A's keys.
TEST_F(TlsTest, StoreKeysOfARunNeedThatRunsSecret) {
  MakeData();
  auto c = StartCoordinator();
  StartWorker(*c, 1);
  StartWorker(*c, 2);
  auto alice = Jobs(*c, alice_);
  v1::SubmitJobResponse a, b;
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("a", 1, 100000), &a).ok());
  ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("b", 1, 100000), &b).ok());
  // Each daemon logs "running job-N rank 0 (pid P, ...)"; the rank's attempt is on its command
  // line, its secret in its environment.
  struct Run {
    std::string attempt, secret;
  };
  std::map<std::string, Run> runs;
  const std::regex running(R"(running (job-\d+) rank \d+ \(pid (\d+))");
  ASSERT_TRUE(WaitFor(
      [&] {
        for (auto& w : workers_) {
          std::smatch m;
          const std::string log = w->Log();
          if (!std::regex_search(log, m, running) || runs.count(m[1])) continue;
          const std::string proc = absl::StrCat("/proc/", m[2].str());
          std::string cmdline = ReadWholeFile(proc + "/cmdline"),
                      environ = ReadWholeFile(proc + "/environ");
          Run r;
          std::vector<std::string> args;
          for (size_t at = 0; at < cmdline.size();) {
            const size_t end = cmdline.find('\0', at);
            args.push_back(cmdline.substr(at, end - at));
            at = end == std::string::npos ? cmdline.size() : end + 1;
          }
          for (size_t i = 0; i + 1 < args.size(); ++i) {
            if (args[i] == "--attempt") r.attempt = args[i + 1];
          }
          const std::string var = "VOCABPIPE_STORE_SECRET=";
          if (const size_t at = environ.find(var); at != std::string::npos) {
            r.secret = environ.substr(at + var.size(), 64);
          }
          if (!r.attempt.empty() && r.secret.size() == 64) runs[m[1]] = r;
        }
        return runs.size() == 2;
      },
      std::chrono::seconds(60)))
      << workers_[0]->Log() << workers_[1]->Log();
  const Run& ra = runs[a.job_id()];
  const Run& rb = runs[b.job_id()];
  ASSERT_NE(ra.secret, rb.secret);
  // The rank processes' command lines never carry the secret.
  for (auto& w : workers_) EXPECT_EQ(w->Log().find(ra.secret), std::string::npos);

  auto store = v1::StoreService::NewStub(grpc::CreateChannel(c->address(), Credentials(true)));
  auto set = [&](const std::string& key, const std::string& value, const std::string& secret) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!secret.empty()) ctx.AddMetadata("x-vocabpipe-run-secret", secret);
    v1::StoreSetRequest req;
    req.set_key(key);
    req.set_value(value);
    v1::StoreSetResponse resp;
    return store->Set(&ctx, req, &resp);
  };
  auto get = [&](const std::string& key, const std::string& secret, std::string* value) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!secret.empty()) ctx.AddMetadata("x-vocabpipe-run-secret", secret);
    v1::StoreGetRequest req;
    req.set_key(key);
    v1::StoreGetResponse resp;
    grpc::Status st = store->Get(&ctx, req, &resp);
    *value = resp.value();
    return st;
  };
  const std::string key = absl::StrCat("vocabpipe/", ra.attempt, "/probe");
  // Run A's own secret writes and reads its keys.
  ASSERT_TRUE(set(key, "mine", ra.secret).ok());
  std::string value;
  ASSERT_TRUE(get(key, ra.secret, &value).ok());
  EXPECT_EQ(value, "mine");
  // Run B's secret, no secret, and an unknown run are refused.
  grpc::Status st = set(key, "theirs", rb.secret);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("key: wrong rendezvous secret for run \"vocabpipe/" + ra.attempt + "/\""));
  st = get(key, rb.secret, &value);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  st = set(key, "theirs", "");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("needs its rendezvous secret"));
  st = set("vocabpipe/job-99.1/x", "v", rb.secret);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("is not an active run"));
  // Keys outside every run: refused with or without a secret (nothing to fill the store with).
  for (const std::string& secret : {std::string(), ra.secret}) {
    st = set("other/key", "v", secret);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), HasSubstr("key: outside every run's namespace"));
  }
  // Nothing stored changed.
  ASSERT_TRUE(get(key, ra.secret, &value).ok());
  EXPECT_EQ(value, "mine");
  // Both jobs still run.
  auto admin = Jobs(*c, admin_);
  EXPECT_EQ(GetJob(*admin, a.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(GetJob(*admin, b.job_id()).state(), v1::JOB_STATE_RUNNING);
  for (const std::string& id : {a.job_id(), b.job_id()}) {
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    v1::Job out;
    EXPECT_TRUE(alice->CancelJob(Ctx().get(), cancel, &out).ok());
  }
  // A finished run's secret is gone with its keys.
  EXPECT_TRUE(WaitFor(
      [&] {
        return get(key, ra.secret, &value).error_code() == grpc::StatusCode::PERMISSION_DENIED;
      },
      std::chrono::seconds(5)));
}

// A two-rank job end to end over TLS: daemons and ranks (their Gloo rendezvous through the
// StoreService with the worker certificate and the run's secret), and the CLI with a token.
TEST_F(TlsTest, TwoRankJobRunsOverTls) {
  MakeData();
  auto c = StartCoordinator();
  StartWorker(*c, 1);
  StartWorker(*c, 2);
  std::ofstream(dir_ / "job.yaml") << TinyJob("two", 2, 3).spec_text();
  const std::string flags =
      absl::StrCat(" --coordinator ", c->address(), " --tls-ca ", Path("ca.pem"));
  CliResult run = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                            absl::StrCat("run ", (dir_ / "job.yaml").string(), flags));
  EXPECT_EQ(run.code, 0) << run.output << workers_[0]->Log() << workers_[1]->Log();
  EXPECT_THAT(run.output, HasSubstr("SUCCEEDED"));
  const v1::Job job = GetJob(*Jobs(*c, admin_), "job-1");
  EXPECT_TRUE(Succeeded(job));
  EXPECT_EQ(job.owner(), "alice");
  EXPECT_EQ(job.step(), 3);
  // Each daemon got only its rank's slice of the plan (written to plan_rank_R.txt in the run
  // folder, which the ranks share): every chunk line of the job's plan, its own rank's actions
  // and none of the other rank's.
  auto lines = [](const std::string& text, const std::string& prefix) {
    std::vector<std::string> out;
    for (const std::string& l : std::vector<std::string>(absl::StrSplit(text, '\n'))) {
      if (l.rfind(prefix, 0) == 0) out.push_back(l);
    }
    return out;
  };
  const std::vector<std::string> full_ranks = lines(job.plan_text(), "rank ");
  ASSERT_EQ(full_ranks.size(), 2u) << job.plan_text();
  for (int r = 0; r < 2; ++r) {
    const fs::path slice_path = dir_ / "runs" / "two" / absl::StrCat("plan_rank_", r, ".txt");
    const std::string slice = ReadWholeFile(slice_path);
    ASSERT_FALSE(slice.empty()) << slice_path;
    EXPECT_EQ(lines(slice, "chunk "), lines(job.plan_text(), "chunk "));
    const std::vector<std::string> ranks = lines(slice, "rank ");
    ASSERT_EQ(ranks.size(), 2u) << slice;
    EXPECT_EQ(ranks[r], full_ranks[r]);
    EXPECT_GT(ranks[r].size(), absl::StrCat("rank ", r, ":").size());
    EXPECT_EQ(ranks[1 - r], absl::StrCat("rank ", 1 - r, ":")) << "rank " << r << " was sent "
                                                               << "rank " << 1 - r << "'s actions";
  }
  EXPECT_FALSE(fs::exists(dir_ / "runs" / "two" / "plan.txt"));
  // Bob does not see it.
  CliResult status = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", bob_), "status job-1" + flags);
  EXPECT_EQ(status.code, 1);
  EXPECT_THAT(status.output, HasSubstr("belongs to alice"));
}

// Data parallelism through the control plane: two replicas of a two-stage pipeline on four
// worker daemons over TLS. Every rank's record names its replica and stage (rank = replica +
// 2 · stage), the daemons of one stage were sent the same plan slice, the step metrics cover
// all four ranks, and only one copy of each stage's shard is written.
TEST_F(TlsTest, TwoReplicasOfATwoStagePipelineRunOnFourDaemons) {
  MakeData();
  auto c = StartCoordinator();
  for (int n = 1; n <= 3; ++n) StartWorker(*c, n);
  const v1::SubmitJobRequest req =
      TinyJob("dp", 2, 3, "pipeline: 2, microbatch_size: 2, microbatches: 2, data: 2, zero: 1");
  v1::SubmitJobResponse submitted;
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), req, &submitted).ok());
  // Three free workers for four ranks: the job waits, naming what it needs.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  v1::Job waiting = GetJob(*Jobs(*c, admin_), submitted.job_id());
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(waiting.reason(), HasSubstr("waiting for 4 free cpu workers"));
  StartWorker(*c, 4);
  const v1::Job job = WaitForEnd(*c, submitted.job_id());
  const std::string flags =
      absl::StrCat(" --coordinator ", c->address(), " --tls-ca ", Path("ca.pem"));
  EXPECT_TRUE(Succeeded(job)) << job.reason();
  EXPECT_EQ(job.step(), 3);
  ASSERT_EQ(job.stages_size(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(job.stages(r).rank(), r);
    EXPECT_EQ(job.stages(r).stage(), r / 2) << "rank " << r;
    EXPECT_EQ(job.stages(r).replica(), r % 2) << "rank " << r;
    EXPECT_GT(job.stages(r).peak_memory_bytes(), 0) << "rank " << r;
  }
  const fs::path run_dir = dir_ / "runs" / "dp";
  for (int stage = 0; stage < 2; ++stage) {
    EXPECT_EQ(ReadWholeFile(run_dir / absl::StrCat("plan_rank_", 2 * stage, ".txt")),
              ReadWholeFile(run_dir / absl::StrCat("plan_rank_", 2 * stage + 1, ".txt")));
    EXPECT_TRUE(fs::exists(run_dir / "step_3" / absl::StrCat("rank_", stage) / "MANIFEST.json"));
  }
  EXPECT_FALSE(fs::exists(run_dir / "step_3" / "rank_2"));
  EXPECT_TRUE(fs::exists(run_dir / "step_3" / "DONE"));
  // status --output json lists the four ranks with both coordinates.
  CliResult status =
      Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_), "status job-1 --output json" + flags);
  ASSERT_EQ(status.code, 0) << status.output;
  const auto stages = nlohmann::json::parse(status.output)["stages"];
  ASSERT_EQ(stages.size(), 4u) << status.output;
  EXPECT_EQ(stages[3].value("replica", -1), 1) << status.output;
  EXPECT_EQ(stages[3].value("stage", -1), 1) << status.output;
  CliResult text = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_), "status job-1" + flags);
  EXPECT_THAT(text.output, HasSubstr("rank 3 (replica 1 stage 1)"));
  EXPECT_THAT(text.output, HasSubstr("data parallel: 2 replicas of the pipeline, ZeRO-1"));
}

// Tensor parallelism through the control plane: a t = 2, p = 2 job on four worker daemons over
// TLS succeeds; every rank's record names its stage and tensor rank (rank = tensor + 2 · stage),
// each tensor rank writes its own shard (rank_<stage·2 + tensor>) and the shards merge into the
// Hugging Face checkpoint. The passes were profiled by each stage's tensor group together
// (meeting in the coordinator's store over TLS with the attempt's secret): tensor_measured 2.
TEST_F(TlsTest, ATensorParallelPipelineRunsOnFourDaemons) {
  MakeData();
  auto c = StartCoordinator();
  for (int n = 1; n <= 4; ++n) StartWorker(*c, n);
  const v1::SubmitJobRequest req =
      TinyJob("tp", 2, 3, "pipeline: 2, microbatch_size: 2, microbatches: 2, tensor: 2");
  v1::SubmitJobResponse submitted;
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), req, &submitted).ok());
  const v1::Job job = WaitForEnd(*c, submitted.job_id());
  EXPECT_TRUE(Succeeded(job)) << job.reason();
  EXPECT_EQ(job.step(), 3);
  EXPECT_EQ(job.profiled_costs().tensor_measured(), 2);
  EXPECT_GT(job.profiled_costs().f(), 0);
  ASSERT_EQ(job.stages_size(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(job.stages(r).rank(), r);
    EXPECT_EQ(job.stages(r).stage(), r / 2) << "rank " << r;
    EXPECT_EQ(job.stages(r).tensor(), r % 2) << "rank " << r;
    EXPECT_EQ(job.stages(r).replica(), 0) << "rank " << r;
    EXPECT_GT(job.stages(r).peak_memory_bytes(), 0) << "rank " << r;
  }
  const fs::path run_dir = dir_ / "runs" / "tp";
  for (int shard = 0; shard < 4; ++shard) {
    EXPECT_TRUE(fs::exists(run_dir / "step_3" / absl::StrCat("rank_", shard) / "MANIFEST.json"))
        << shard;
  }
  EXPECT_TRUE(fs::exists(run_dir / "step_3" / "DONE"));
  const std::string flags =
      absl::StrCat(" --coordinator ", c->address(), " --tls-ca ", Path("ca.pem"));
  CliResult status = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                               "status " + job.id() + " --output json" + flags);
  ASSERT_EQ(status.code, 0) << status.output;
  const auto stages = nlohmann::json::parse(status.output)["stages"];
  ASSERT_EQ(stages.size(), 4u) << status.output;
  EXPECT_EQ(stages[3].value("tensor", -1), 1) << status.output;
  EXPECT_EQ(stages[3].value("stage", -1), 1) << status.output;
}

// parallel.world through the control plane: a job of 4 ranks with every axis and the
// recomputation left to the planner runs on four daemons over TLS and succeeds; the layout the
// planner chose is the job's spec, its line and candidate table are in the record, `status`
// prints them and the job's first event names the choice.
TEST_F(TlsTest, AWorldOfFourRanksRunsTheLayoutThePlannerChose) {
  MakeData();
  auto c = StartCoordinator();
  for (int n = 1; n <= 4; ++n) StartWorker(*c, n);
  const v1::SubmitJobRequest req =
      TinyJob("world", 1, 3,
              "world: 4, pipeline: auto, data: auto, tensor: auto, recompute: auto, "
              "microbatch_size: 2, microbatches: 4");
  v1::SubmitJobResponse submitted;
  ASSERT_TRUE(Jobs(*c, alice_)->SubmitJob(Ctx().get(), req, &submitted).ok());
  const v1::Job job = WaitForEnd(*c, submitted.job_id());
  EXPECT_TRUE(Succeeded(job)) << job.reason();
  EXPECT_EQ(job.step(), 3);
  const auto& par = job.spec().parallel();
  EXPECT_EQ(par.world(), 0);
  EXPECT_EQ(par.data() * par.tensor() * par.pipeline(), 4);
  EXPECT_EQ(par.microbatches() * par.data(), 4);  // the step's 4 microbatches kept
  EXPECT_NE(par.recompute(), "auto");
  EXPECT_EQ(job.stages_size(), 4);
  EXPECT_THAT(job.layout(), HasSubstr(absl::StrCat("layout d ", par.data(), " x t ", par.tensor(),
                                                   " x p ", par.pipeline())));
  EXPECT_THAT(job.layout(), HasSubstr("candidates for 4 ranks"));
  EXPECT_THAT(job.layout_table(), HasSubstr("<- chosen"));
  // Two layers cannot make four stages: that candidate is in the table with its reason.
  EXPECT_THAT(job.layout_table(), HasSubstr("no: "));
  // The first event names the choice.
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::WatchJobRequest watch;
  watch.set_job_id(job.id());
  auto reader = Jobs(*c, alice_)->WatchJob(&watch_ctx, watch);
  v1::JobEvent first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_THAT(first.message(), HasSubstr("layout d "));
  watch_ctx.TryCancel();
  const std::string flags =
      absl::StrCat(" --coordinator ", c->address(), " --tls-ca ", Path("ca.pem"));
  CliResult status =
      Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_), "status " + job.id() + flags);
  ASSERT_EQ(status.code, 0) << status.output;
  EXPECT_THAT(status.output, HasSubstr("candidates for 4 ranks"));
  EXPECT_THAT(status.output, HasSubstr("tokens/s"));
  CliResult json = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                             "status " + job.id() + " --output json" + flags);
  ASSERT_EQ(json.code, 0) << json.output;
  const auto layout = nlohmann::json::parse(json.output)["layout"];
  EXPECT_EQ(layout.value("data", 0) * layout.value("tensor", 0) * layout.value("pipeline", 0), 4)
      << json.output;
  EXPECT_EQ(layout.value("recompute", ""), par.recompute());
}

// A user's queued (PENDING) jobs are capped; other users and stored jobs are unaffected.
TEST_F(TlsTest, QueuedJobsPerUserAreCapped) {
  auto c = StartCoordinator({"--max-queued-per-user", "2"});
  auto alice = Jobs(*c, alice_), bob = Jobs(*c, bob_), admin = Jobs(*c, admin_);
  std::vector<std::string> ids;
  for (const char* name : {"a1", "a2"}) {  // no workers: they stay PENDING
    v1::SubmitJobResponse r;
    ASSERT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob(name), &r).ok());
    ids.push_back(r.job_id());
  }
  v1::ListJobsResponse before;
  ASSERT_TRUE(admin->ListJobs(Ctx().get(), v1::ListJobsRequest(), &before).ok());
  v1::SubmitJobResponse r;
  grpc::Status st = alice->SubmitJob(Ctx().get(), TinyJob("a3"), &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("queue: user alice has 2 queued (PENDING) jobs, the limit of 2 per user "
                        "(--max-queued-per-user)"));
  // The CLI says so.
  std::ofstream(dir_ / "a4.yaml") << TinyJob("a4").spec_text();
  CliResult cli = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", alice_),
                            absl::StrCat("submit ", (dir_ / "a4.yaml").string(), " --coordinator ",
                                         c->address(), " --tls-ca ", Path("ca.pem")));
  EXPECT_EQ(cli.code, 1);
  EXPECT_THAT(cli.output, HasSubstr("queue: user alice has 2 queued"));
  // Nothing stored changed.
  v1::ListJobsResponse after;
  ASSERT_TRUE(admin->ListJobs(Ctx().get(), v1::ListJobsRequest(), &after).ok());
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
  // Another user has a queue of their own; one of alice's leaving the queue frees a place.
  EXPECT_TRUE(bob->SubmitJob(Ctx().get(), TinyJob("b1"), &r).ok());
  v1::CancelJobRequest cancel;
  cancel.set_job_id(ids[0]);
  v1::Job out;
  ASSERT_TRUE(alice->CancelJob(Ctx().get(), cancel, &out).ok());
  EXPECT_TRUE(alice->SubmitJob(Ctx().get(), TinyJob("a5"), &r).ok());
}

// `vocabpipe certs worker NAME` gives a worker a certificate of its own (CN=NAME): the
// coordinator binds the worker id it registers to that name, refuses calls for it under any
// other certificate, and refuses revoked certificates (--revoked, reloaded on change and on
// SIGHUP).
TEST_F(TlsTest, WorkersActOnlyUnderTheirOwnCertificateAndRevokedOnesAreRefused) {
  std::map<std::string, std::string> serial, fingerprint;
  for (const char* name : {"w-a", "w-b"}) {
    CliResult r = Vocabpipe("", absl::StrCat("certs worker ", name, " ", certs_.string()));
    ASSERT_EQ(r.code, 0) << r.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("serial ([0-9a-f]+)"))) << r.output;
    serial[name] = m[1];
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex("sha256 ([0-9a-f]{64})"))) << r.output;
    fingerprint[name] = m[1];
    struct stat st {};
    ASSERT_EQ(stat(Path(absl::StrCat(name, "-key.pem")).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  CliResult again = Vocabpipe("", "certs worker w-a " + certs_.string());
  EXPECT_EQ(again.code, 2);
  EXPECT_THAT(again.output, HasSubstr("w-a.pem: exists"));
  CliResult bad = Vocabpipe("", "certs worker 'a/b' " + certs_.string());
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("NAME: 1..64 letters, digits"));

  const fs::path revoked = dir_ / "revoked";
  std::ofstream(revoked) << "# revoked worker certificates\n";
  auto c = StartCoordinator({"--revoked", revoked.string()});
  StartWorker(*c, 1, "w-a");
  const v1::WorkerInfo a = ListWorkers(*c).workers(0);

  // Another worker's certificate (its own, or the shared one) cannot act for worker a.
  for (const char* other : {"w-b", "worker"}) {
    auto workers =
        v1::WorkerService::NewStub(grpc::CreateChannel(c->address(), CertCredentials(other)));
    v1::HeartbeatRequest hb;
    hb.set_worker_id(a.worker_id());
    v1::HeartbeatResponse hbr;
    grpc::Status st = workers->Heartbeat(Ctx().get(), hb, &hbr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << other;
    EXPECT_THAT(st.error_message(),
                HasSubstr(absl::StrCat("worker_id: ", a.worker_id(),
                                       " registered with the certificate of \"w-a\"")));
    v1::ReportTaskRequest report;
    report.set_worker_id(a.worker_id());
    report.set_job_id("job-1");
    report.set_ok(false);
    v1::ReportTaskResponse rr;
    EXPECT_EQ(workers->ReportTask(Ctx().get(), report, &rr).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    v1::ReportMetricsRequest metrics;
    metrics.set_worker_id(a.worker_id());
    metrics.set_job_id("job-1");
    v1::ReportMetricsResponse mr;
    EXPECT_EQ(workers->ReportMetrics(Ctx().get(), metrics, &mr).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // Worker a is still registered under its id and heartbeats on.
  std::this_thread::sleep_for(std::chrono::seconds(2));  // past the heartbeat timeout
  ASSERT_EQ(ListWorkers(*c).workers_size(), 1);
  EXPECT_EQ(ListWorkers(*c).workers(0).worker_id(), a.worker_id());

  // Revoke w-a by its serial number: picked up when the file changes; the daemon's heartbeats
  // are refused and the coordinator drops it; it cannot register again.
  std::ofstream(revoked, std::ios::app) << serial["w-a"] << "\n";
  EXPECT_TRUE(
      WaitFor([&] { return ListWorkers(*c).workers_size() == 0; }, std::chrono::seconds(10)))
      << c->process().Log();
  auto wa = v1::WorkerService::NewStub(grpc::CreateChannel(c->address(), CertCredentials("w-a")));
  v1::RegisterWorkerRequest reg;
  reg.set_device("cpu");
  reg.set_address("127.0.0.1");
  v1::RegisterWorkerResponse regr;
  grpc::Status st = wa->RegisterWorker(Ctx().get(), reg, &regr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("worker certificate revoked: \"w-a\" (serial " + serial["w-a"] + ")"));
  // w-b registers; revoking it by its SHA-256 fingerprint (and SIGHUP, which reloads at once)
  // refuses it too.
  auto wb = v1::WorkerService::NewStub(grpc::CreateChannel(c->address(), CertCredentials("w-b")));
  ASSERT_TRUE(wb->RegisterWorker(Ctx().get(), reg, &regr).ok());
  std::ofstream(revoked, std::ios::app) << fingerprint["w-b"] << "\n";
  kill(c->process().pid(), SIGHUP);
  // 10 s as for w-a above: once in a loaded `make test` (the suite's heaviest tests beside it)
  // 5 s were not enough; the last refusal and the coordinator's log say why if it recurs.
  grpc::Status last;
  EXPECT_TRUE(WaitFor(
      [&] {
        v1::RegisterWorkerResponse again;
        last = wb->RegisterWorker(Ctx().get(), reg, &again);
        return last.error_code() == grpc::StatusCode::UNAUTHENTICATED;
      },
      std::chrono::seconds(10)))
      << "last answer: " << last.error_code() << " " << last.error_message() << "\n"
      << c->process().Log();
  // A broken list leaves the previous one in force.
  std::ofstream(revoked, std::ios::app) << "not hex at all\n";
  kill(c->process().pid(), SIGHUP);
  EXPECT_TRUE(WaitFor(
      [&] {
        return c->process().Log().find("line 4: need a certificate serial") != std::string::npos;
      },
      std::chrono::seconds(5)))
      << c->process().Log();
  EXPECT_EQ(wa->RegisterWorker(Ctx().get(), reg, &regr).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// The tokens file is read again when it changes and on SIGHUP; a token may carry an expiry.
TEST_F(TlsTest, TokensReloadWithoutRestartAndExpire) {
  auto c = StartCoordinator();
  auto list = [&](const std::string& token) {
    v1::ListJobsResponse resp;
    return Jobs(*c, token)->ListJobs(Ctx().get(), v1::ListJobsRequest(), &resp);
  };
  // A user added after the start: accepted once the coordinator sees the file change.
  const std::string dave = Token("dave", "user");
  EXPECT_TRUE(WaitFor([&] { return list(dave).ok(); }, std::chrono::seconds(5)))
      << c->process().Log();
  // A token with an expiry seconds ahead: accepted, then refused once it passed.
  const absl::Time expires = absl::Now() + absl::Seconds(5);
  const std::string expiry = absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", expires, absl::UTCTimeZone());
  CliResult made = Vocabpipe(
      "", absl::StrCat("certs token erin --tokens ", tokens_.string(), " --expires ", expiry));
  ASSERT_EQ(made.code, 0) << made.output;
  std::string erin = made.output;
  while (!erin.empty() && erin.back() == '\n') erin.pop_back();
  EXPECT_THAT(ReadWholeFile(tokens_), HasSubstr("erin user "));
  EXPECT_THAT(ReadWholeFile(tokens_), HasSubstr(" " + expiry + "\n"));
  EXPECT_TRUE(WaitFor([&] { return list(erin).ok(); }, std::chrono::seconds(5)));
  EXPECT_TRUE(WaitFor([&] { return list(erin).error_code() == grpc::StatusCode::UNAUTHENTICATED; },
                      std::chrono::seconds(10)));
  grpc::Status st = list(erin);
  EXPECT_THAT(st.error_message(),
              HasSubstr("authorization: the token of erin expired at " + expiry));
  CliResult cli =
      Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", erin),
                absl::StrCat("status --coordinator ", c->address(), " --tls-ca ", Path("ca.pem")));
  EXPECT_EQ(cli.code, 1);
  EXPECT_THAT(cli.output, HasSubstr("unauthenticated: authorization: the token of erin expired"));
  // Past expiries are refused by the CLI.
  CliResult past = Vocabpipe("", absl::StrCat("certs token frank --tokens ", tokens_.string(),
                                              " --expires 2020-01-01T00:00:00Z"));
  EXPECT_EQ(past.code, 2);
  EXPECT_THAT(past.output, HasSubstr("--expires: 2020-01-01T00:00:00Z is not in the future"));
  // Dave watches a job of his; removing dave (rewriting the file) and SIGHUP: refused, and
  // the open stream ends.
  v1::SubmitJobResponse daves;
  ASSERT_TRUE(Jobs(*c, dave)->SubmitJob(Ctx().get(), TinyJob("d"), &daves).ok());
  auto dave_jobs = Jobs(*c, dave);
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::WatchJobRequest watch;
  watch.set_job_id(daves.job_id());
  auto reader = dave_jobs->WatchJob(&watch_ctx, watch);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));  // PENDING: the stream is open
  std::string kept;
  for (const std::string& line :
       std::vector<std::string>(absl::StrSplit(ReadWholeFile(tokens_), '\n'))) {
    if (!line.empty() && line.rfind("dave ", 0) != 0) kept += line + "\n";
  }
  std::ofstream(tokens_, std::ios::trunc) << kept;
  kill(c->process().pid(), SIGHUP);
  EXPECT_TRUE(WaitFor([&] { return list(dave).error_code() == grpc::StatusCode::UNAUTHENTICATED; },
                      std::chrono::seconds(5)));
  EXPECT_THAT(list(dave).error_message(), HasSubstr("unknown bearer token"));
  while (reader->Read(&event)) {
  }
  const grpc::Status ended = reader->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(ended.error_message(), HasSubstr("unknown bearer token"));
  // A broken file leaves the tokens loaded before in force.
  std::ofstream(tokens_, std::ios::app) << "mallory superuser xyz\n";
  kill(c->process().pid(), SIGHUP);
  EXPECT_TRUE(WaitFor(
      [&] {
        return c->process().Log().find("keeping the tokens loaded before") != std::string::npos;
      },
      std::chrono::seconds(5)))
      << c->process().Log();
  EXPECT_TRUE(list(alice_).ok());
  // The coordinator still serves.
  EXPECT_EQ(kill(c->process().pid(), 0), 0);
}

}  // namespace
