// Security of the control plane with real daemons over TLS (docs/operations.md, "Security"):
// the coordinator serves with the certificates of `vocabpipe certs init` and a tokens file of
// `vocabpipe certs token`, the worker daemons connect with the worker certificate (mTLS), and
// the test's stubs with the admin's token. Checked: confined storage (--storage-root on the
// coordinator and on the workers), errors that never echo file contents, memory admission at
// submit, a profiling crash that fails the job while the worker daemon lives on, and the
// limits. Every refusal leaves what is stored as it was.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/server/kv_store.h"
#include "proto/grpc/auth.h"
#include "tests/integration/control/control_harness.h"
#ifdef VP_HAVE_METRICS
#include "coordinator/server/prometheus_observer.h"
#endif

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;
using ::testing::Not;

// The profiling child's data limit (RLIMIT_DATA) in DaemonSurvivesAProfilingCrash: enough to
// profile a tiny model, not enough for a 60000 x 512 vocabulary with its
// gradients and Adam state.
// OPENBLAS_NUM_THREADS=1 keeps the child's data size independent of the machine's cores.
constexpr int64_t kProfileLimit = 768ll << 20;

class SecurityTest : public TlsClusterTest {
 protected:
  SecurityTest() : TlsClusterTest("vp_security_") {}

  void MakeData(const fs::path& out) {
    const CliResult r = SynthData(out);
    ASSERT_EQ(r.code, 0) << r.output;
  }

  // A tiny job whose relative paths resolve against `base`.
  v1::SubmitJobRequest TinyJob(
      const std::string& name, const fs::path& base, const std::string& data = "data.bin",
      const std::string& model = "{layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}",
      int pipeline = 1) {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: ", name, "\nmodel: ", model, "\n", "parallel: {pipeline: ", pipeline,
        ", microbatch_size: 2, microbatches: 2}\n", "train: {steps: 2, lr: 0.003, threads: 1}\n",
        "data: {path: ", data, "}\ncheckpoint: {dir: runs/", name, "}\n"));
    req.set_base_dir(base.string());
    return req;
  }

  v1::ListJobsResponse ListJobs(CoordinatorProcess& c) {
    v1::ListJobsResponse list;
    EXPECT_TRUE(c.jobs->ListJobs(Ctx().get(), v1::ListJobsRequest(), &list).ok());
    return list;
  }

  grpc::Status Submit(CoordinatorProcess& c, const v1::SubmitJobRequest& req, std::string* id) {
    v1::SubmitJobResponse resp;
    grpc::Status st = c.jobs->SubmitJob(Ctx().get(), req, &resp);
    *id = resp.job_id();
    return st;
  }
};

TEST_F(SecurityTest, CoordinatorStorageRootRefusesOutsidePathsAtSubmit) {
  const fs::path root = dir_ / "root";
  auto cp = StartCoordinator({"--storage-root", root.string()});
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  std::string id;
  ASSERT_TRUE(Submit(c, TinyJob("inside", root), &id).ok());
  ASSERT_EQ(id, "job-1");
  const v1::ListJobsResponse before = ListJobs(c);

  // data.path outside the root.
  grpc::Status st = Submit(c, TinyJob("passwd", root, "/etc/passwd"), &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(),
              HasSubstr("data.path: \"/etc/passwd\" is outside the storage root"));
  // checkpoint.dir escaping with "..".
  v1::SubmitJobRequest req = TinyJob("dotdot", root);
  req.set_base_dir((root / "a" / ".." / "..").string());
  st = Submit(c, req, &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("data.path"));
  // A symlink inside the root that points out of it.
  fs::create_directories(dir_ / "elsewhere");
  fs::create_directory_symlink(dir_ / "elsewhere", root / "escape");
  st = Submit(c, TinyJob("link", root / "escape"), &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("is outside the storage root"));

  // Nothing stored changed.
  const v1::ListJobsResponse after = ListJobs(c);
  ASSERT_EQ(after.jobs_size(), 1);
  EXPECT_EQ(after.jobs(0).SerializeAsString(), before.jobs(0).SerializeAsString());
}

TEST_F(SecurityTest, WorkerStorageRootRefusesTheTaskNamingTheField) {
  MakeData(dir_ / "data.bin");
  auto cp = StartCoordinator({"--no-profile"});
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  StartWorker(c, {"--storage-root", (dir_ / "root").string()});
  std::string id;
  ASSERT_TRUE(Submit(c, TinyJob("w", dir_), &id).ok());
  const v1::Job job = WaitTerminal(c, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker storage root: data.path: \""));
  EXPECT_THAT(job.reason(), HasSubstr("is outside the storage root"));
  EXPECT_FALSE(fs::exists(dir_ / "runs" / "w")) << "the worker touched checkpoint.dir";
}

TEST_F(SecurityTest, ErrorsNeverEchoFileContents) {
  // A text file handed in as data: the job fails without the file's bytes in the reason.
  std::ofstream(dir_ / "root" / "notes.txt") << "hunter2 is the password\n"
                                             << std::string(2000, '.') << "\nline two\n";
  // A coordinator without a root of its own, so the file reaches the worker (one with the root
  // refuses it at submit: limits_test's BadInputFilesFailOnceNotAtEveryRestart).
  auto cp = StartCoordinator({"--no-profile"});
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  StartWorker(c, {"--storage-root", (dir_ / "root").string()});
  std::string id;
  ASSERT_TRUE(Submit(c, TinyJob("txt", dir_ / "root", "notes.txt"), &id).ok());
  const v1::Job job = WaitTerminal(c, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("bad magic"));
  // "hunt" as a little-endian int32 is 1953396072.
  for (const char* piece : {"hunter2", "password", "1953396072"}) {
    EXPECT_THAT(job.reason(), Not(HasSubstr(piece))) << job.reason();
  }
  // A non-spec file submitted as the spec.
  v1::SubmitJobRequest req;
  req.set_spec_text("root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\n");
  req.set_base_dir((dir_ / "root").string());
  grpc::Status st = Submit(c, req, &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("not a job spec"));
  EXPECT_THAT(st.error_message(), Not(HasSubstr("alice")));
  EXPECT_THAT(st.error_message(), Not(HasSubstr("/bin/bash")));
}

// `vocabpipe submit` handed a file that is not a job spec: the CLI shows no line of it, and a
// large file is refused before it is read whole.
TEST_F(SecurityTest, CliSubmitOfANonSpecFileShowsNoneOfIt) {
  auto cp = StartCoordinator();
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  auto run = [&](const fs::path& file) {
    CliResult r = Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", admin_),
                            absl::StrCat("submit ", file.string(), " --coordinator ", c.address(),
                                         " --tls-ca ", pki_->Path("ca.pem")));
    EXPECT_NE(r.code, 0) << r.output;
    return r.output;
  };
  std::ofstream(dir_ / "passwd") << "root:x:0:0:root:/root:/bin/bash\n"
                                 << "carol:x:1001:1001:Carol:/home/carol:/bin/zsh\n";
  std::string out = run(dir_ / "passwd");
  EXPECT_THAT(out, HasSubstr("not a job spec"));
  for (const char* piece : {"carol", "/bin/zsh", "root:x"}) {
    EXPECT_THAT(out, Not(HasSubstr(piece))) << out;
  }
  std::ofstream(dir_ / "big.yaml") << "name: big\n# " << std::string(100000, 'z') << "\n";
  out = run(dir_ / "big.yaml");
  EXPECT_THAT(out, HasSubstr("larger than the job spec limit of 65536 bytes"));
  EXPECT_THAT(out, Not(HasSubstr("zzzz")));
  EXPECT_EQ(ListJobs(c).jobs_size(), 0);
}

// The model of the issue report: 48 layers of h = 8192 and a 256000-token vocabulary on one
// rank is about 700 GiB of weights, gradients and Adam state. Refused at submit by the
// planner's memory model, naming the rank and the largest worker; nothing is stored.
TEST_F(SecurityTest, OversizedModelRefusedAtSubmitWithTheMemoryNeeded) {
  auto cp = StartCoordinator();
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  StartWorker(c);
  const v1::ListWorkersResponse workers = ListWorkers(c);
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_GT(workers.workers(0).memory_bytes(), 0);
  // A job that fits is admitted (and runs); it must come through the refusals unchanged.
  MakeData(dir_ / "data.bin");
  std::string id;
  ASSERT_TRUE(Submit(c, TinyJob("small", dir_), &id).ok());
  ASSERT_TRUE(Succeeded(WaitTerminal(c, id)));
  const v1::ListJobsResponse before = ListJobs(c);
  grpc::Status st =
      Submit(c,
             TinyJob("huge", dir_, "data.bin",
                     "{layers: 48, hidden: 8192, heads: 64, vocab_size: 256000, seq_len: 1024}"),
             &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(),
              ::testing::MatchesRegex("memory: needs [0-9]+\\.[0-9] GiB on rank 0, the largest "
                                      "worker has [0-9]+\\.[0-9] GiB .*"));
  // Spread over more ranks, each still needs more than the worker has: the rank is named.
  st =
      Submit(c,
             TinyJob("huge4", dir_, "data.bin",
                     "{layers: 48, hidden: 8192, heads: 64, vocab_size: 256000, seq_len: 1024}", 4),
             &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr(" GiB on rank "));
  // Beyond the documented bounds: refused by validation, naming the field.
  st = Submit(c,
              TinyJob("wide", dir_, "data.bin",
                      "{layers: 2, hidden: 131072, heads: 64, vocab_size: 256000, seq_len: 16}"),
              &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("model.hidden: must be <= 65536"));
  // A request beyond the gRPC message limit is refused before it is parsed.
  v1::SubmitJobRequest big = TinyJob("big", dir_);
  big.set_base_dir(std::string(5 << 20, 'x'));
  st = Submit(c, big, &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  big.set_base_dir("/" + std::string(5000, 'x'));  // within the message limit, not the path's
  st = Submit(c, big, &id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("base_dir: must be at most 4096 bytes"));
  // Nothing stored changed: the one job as it was, the worker still there and free.
  const v1::ListJobsResponse after = ListJobs(c);
  ASSERT_EQ(after.jobs_size(), 1);
  EXPECT_EQ(after.jobs(0).SerializeAsString(), before.jobs(0).SerializeAsString());
  ASSERT_EQ(ListWorkers(c).workers_size(), 1);
  EXPECT_EQ(ListWorkers(c).workers(0).job_id(), "");
}

// Profiling runs in a child process with a data limit: a profile that needs more
// memory dies of std::bad_alloc there. The job fails with that reason, the daemon lives on and
// runs the next job.
TEST_F(SecurityTest, DaemonSurvivesAProfilingCrash) {
  MakeData(dir_ / "data.bin");
  auto cp = StartCoordinator();
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  setenv("OPENBLAS_NUM_THREADS", "1", 1);  // inherited by the daemon and its children
  StartWorker(c, {"--profile-memory-limit", std::to_string(kProfileLimit)});
  unsetenv("OPENBLAS_NUM_THREADS");
  const std::string worker_id = ListWorkers(c).workers(0).worker_id();
  std::string id;
  ASSERT_TRUE(Submit(c,
                     TinyJob("crash", dir_, "data.bin",
                             "{layers: 2, hidden: 512, heads: 8, vocab_size: 60000, seq_len: 64}"),
                     &id)
                  .ok());
  const v1::Job job = WaitTerminal(c, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("rank 0 (" + worker_id + "): profiling: "));
  EXPECT_THAT(job.reason(), HasSubstr("bad_alloc")) << job.reason();
  // The daemon is alive, still registered under the same id, and runs the next job.
  ASSERT_TRUE(
      WaitFor([&] { return kill(workers_[0]->pid(), 0) == 0; }, std::chrono::milliseconds(100)));
  const v1::ListWorkersResponse after = ListWorkers(c);
  ASSERT_EQ(after.workers_size(), 1);
  EXPECT_EQ(after.workers(0).worker_id(), worker_id);
  ASSERT_TRUE(Submit(c, TinyJob("next", dir_), &id).ok());
  const v1::Job next = WaitTerminal(c, id);
  EXPECT_TRUE(Succeeded(next));
}

// Store limits per run: a run's keys are "vocabpipe/ATTEMPT/..."; one run cannot fill the
// store, and another run's keys are unaffected.
TEST(StoreLimits, KeysAndBytesPerRun) {
  vp::server::KvStore kv;
  using vp::server::KvStore;
  EXPECT_EQ(KvStore::RunOf("vocabpipe/job-1.5/gloo/0"), "vocabpipe/job-1.5/");
  EXPECT_EQ(KvStore::RunOf("other/key"), "other/");
  EXPECT_EQ(KvStore::RunOf("plain"), "");
  for (size_t i = 0; i < KvStore::kMaxKeysPerRun; ++i) {
    ASSERT_TRUE(kv.Set(absl::StrCat("vocabpipe/a/", i), "v").ok()) << i;
  }
  absl::Status st = kv.Set("vocabpipe/a/one-more", "v");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("key: run \"vocabpipe/a/\" would hold 4097 keys"));
  EXPECT_TRUE(kv.Set("vocabpipe/a/0", "replaced").ok());  // replacing adds no key
  EXPECT_TRUE(kv.Set("vocabpipe/b/0", "v").ok());         // another run
  // Bytes: 16 values of 1 MiB do not fit one run.
  const std::string mib(KvStore::kMaxValueBytes, 'x');
  int stored = 0;
  for (int i = 0; i < 20 && kv.Set(absl::StrCat("vocabpipe/c/", i), mib).ok(); ++i) ++stored;
  EXPECT_EQ(stored, 15);
  EXPECT_EQ(kv.Get("vocabpipe/a/0", absl::Now()).value(), "replaced");
  // Dropping a run frees its share.
  kv.DropPrefix("vocabpipe/a/");
  EXPECT_TRUE(kv.Set("vocabpipe/a/again", "v").ok());
  EXPECT_EQ(kv.size(), 1u + 1u + 15u);
}

TEST_F(SecurityTest, WatchersAreCapped) {
  auto cp = StartCoordinator({"--max-watchers", "2", "--max-watchers-per-user", "2"});
  ASSERT_TRUE(cp->up());
  CoordinatorProcess& c = *cp;
  std::string id;
  ASSERT_TRUE(Submit(c, TinyJob("w", dir_), &id).ok());  // PENDING: no workers
  v1::WatchJobRequest req;
  req.set_job_id(id);
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> readers;
  v1::JobEvent e;
  for (int i = 0; i < 2; ++i) {
    ctx.push_back(Ctx(30));
    readers.push_back(c.jobs->WatchJob(ctx.back().get(), req));
    ASSERT_TRUE(readers.back()->Read(&e));  // the PENDING event: the stream is open
  }
  auto third_ctx = Ctx(10);
  auto third = c.jobs->WatchJob(third_ctx.get(), req);
  EXPECT_FALSE(third->Read(&e));
  grpc::Status st = third->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("watchers: 2 WatchJob streams are open"));
  // One leaves: a new watcher gets in.
  ctx[0]->TryCancel();
  readers[0]->Finish();
  EXPECT_TRUE(WaitFor(
      [&] {
        auto c4 = Ctx(10);
        auto r4 = c.jobs->WatchJob(c4.get(), req);
        const bool ok = r4->Read(&e);
        c4->TryCancel();
        r4->Finish();
        return ok;
      },
      std::chrono::seconds(5)));
  ctx[1]->TryCancel();
  readers[1]->Finish();
}

#ifdef VP_HAVE_METRICS
// Finished jobs' series are pruned: only the newest keep_finished finished jobs stay.
TEST(MetricsPruning, OldFinishedJobsLeaveTheExposition) {
  auto exporter = vp::metrics::MetricsExporter::Create("127.0.0.1:0");
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  vp::server::PrometheusObserver observer(std::move(*exporter), 2);
  for (int i = 1; i <= 4; ++i) {
    v1::Job job;
    job.set_id(absl::StrCat("job-", i));
    job.set_state(v1::JOB_STATE_RUNNING);
    observer.OnJobState(job);
    job.set_state(i % 2 ? v1::JOB_STATE_SUCCEEDED : v1::JOB_STATE_FAILED);
    observer.OnJobState(job);
  }
  v1::Job pending;
  pending.set_id("job-5");
  pending.set_state(v1::JOB_STATE_PENDING);
  observer.OnJobState(pending);
  const std::string text = observer.exporter().Scrape();
  EXPECT_THAT(text, Not(HasSubstr("training_job=\"job-1\"")));
  EXPECT_THAT(text, Not(HasSubstr("training_job=\"job-2\"")));
  EXPECT_THAT(text, HasSubstr("training_job=\"job-3\""));
  EXPECT_THAT(text, HasSubstr("training_job=\"job-4\""));
  EXPECT_THAT(text, HasSubstr("training_job=\"job-5\""));
}
#endif

}  // namespace

namespace {

// The rendezvous secret of a run (docs/operations.md, "Security"): keys of a run need its
// secret, keys of no active run are refused, other keys need none; dropping the run drops it.
TEST(RunSecrets, KeysOfARunNeedItsSecret) {
  vp::server::KvStore kv;
  kv.SetRunSecret("vocabpipe/job-1.5/", "s1");
  kv.SetRunSecret("vocabpipe/job-2.7/", "s2");
  EXPECT_TRUE(kv.CheckRunSecret("vocabpipe/job-1.5/gloo/0", "s1", "key").ok());
  absl::Status st = kv.CheckRunSecret("vocabpipe/job-1.5/gloo/0", "s2", "key");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(),
              HasSubstr("key: wrong rendezvous secret for run \"vocabpipe/job-1.5/\""));
  st = kv.CheckRunSecret("vocabpipe/job-1.5/gloo/0", "", "keys[1]");
  EXPECT_THAT(st.message(), HasSubstr("keys[1]: run \"vocabpipe/job-1.5/\" needs its rendezvous"));
  EXPECT_EQ(kv.CheckRunSecret("vocabpipe/job-9.1/x", "s1", "key").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(kv.CheckRunSecret("other/key", "", "key").ok());
  // A secure coordinator's store: keys outside the runs are refused, run keys as before.
  st = kv.CheckRunSecret("other/key", "s1", "keys[0]", /*runs_only=*/true);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("keys[0]: outside every run's namespace"));
  EXPECT_TRUE(kv.CheckRunSecret("vocabpipe/job-1.5/gloo/0", "s1", "key", true).ok());
  kv.DropPrefix("vocabpipe/job-1.5/");
  EXPECT_THAT(kv.CheckRunSecret("vocabpipe/job-1.5/gloo/0", "s1", "key").message(),
              HasSubstr("is not an active run"));
  EXPECT_TRUE(kv.CheckRunSecret("vocabpipe/job-2.7/gloo/0", "s2", "key").ok());
}

// The tokens file: hashes only, checked line by line with the line named.
TEST(Tokens, FileIsCheckedAndLookedUpByHash) {
  const fs::path file = fs::temp_directory_path() / absl::StrCat("vp_tokens_", getpid());
  fs::remove(file);
  auto token = vp::auth::AddToken(file.string(), "alice", "admin");
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(ReadWholeFile(file).find(*token), std::string::npos);
  EXPECT_EQ(fs::status(file).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  auto table = vp::auth::TokenTable::Load(file.string());
  ASSERT_TRUE(table.ok());
  auto user = table->Find(*token);
  ASSERT_TRUE(user.has_value());
  EXPECT_EQ(user->name, "alice");
  EXPECT_TRUE(user->admin);
  EXPECT_FALSE(table->Find(*token + "x").has_value());
  EXPECT_FALSE(table->Find("").has_value());
  EXPECT_EQ(vp::auth::AddToken(file.string(), "bad name", "user").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(vp::auth::AddToken(file.string(), "bob", "root").status().message(),
            "--role: user or admin");
  std::ofstream(file, std::ios::app) << "bob superuser " << std::string(64, 'a') << "\n";
  auto bad = vp::auth::TokenTable::Load(file.string());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("line 2: role: user or admin"));
  // An expiry: the fourth field, RFC 3339; the user carries it.
  fs::remove(file);
  const absl::Time when = absl::FromUnixSeconds(absl::ToUnixSeconds(absl::Now()) + 3600);
  auto expiring = vp::auth::AddToken(file.string(), "erin", "user", when);
  ASSERT_TRUE(expiring.ok()) << expiring.status();
  EXPECT_THAT(ReadWholeFile(file), HasSubstr(" " + vp::auth::FormatExpiry(when) + "\n"));
  table = vp::auth::TokenTable::Load(file.string());
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_TRUE(table->Find(*expiring).has_value());
  EXPECT_EQ(table->Find(*expiring)->expires, when);
  EXPECT_EQ(vp::auth::AddToken(file.string(), "erin", "user", absl::Now() - absl::Seconds(1))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::ofstream(file, std::ios::app) << "bob user " << std::string(64, 'a') << " tomorrow\n";
  bad = vp::auth::TokenTable::Load(file.string());
  EXPECT_THAT(bad.status().message(), HasSubstr("line 2: expires: an RFC 3339 time"));
  fs::remove(file);
}

// The revocation list: serials or fingerprints, any case, ':' separators, comments; a bad line
// is named and nothing of the file is echoed.
TEST(Revocation, ListMatchesSerialsAndFingerprints) {
  const fs::path file = fs::temp_directory_path() / absl::StrCat("vp_revoked_", getpid());
  const std::string fp(64, 'e');
  std::ofstream(file) << "# revoked\n"
                      << "  00:AB:CD:01  # node1, by serial (a DER leading zero is dropped)\n"
                      << "\n"
                      << fp << "\n";
  auto list = vp::auth::RevocationList::Load(file.string());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->size(), 2u);
  EXPECT_TRUE(list->Revoked({.name = "node1", .serial = "abcd01", .fingerprint = "f0"}));
  EXPECT_TRUE(list->Revoked({.name = "node2", .serial = "99", .fingerprint = fp}));
  EXPECT_FALSE(list->Revoked({.name = "node3", .serial = "abcd02", .fingerprint = "f1"}));
  std::ofstream(file, std::ios::app) << "secret-password\n";
  auto bad = vp::auth::RevocationList::Load(file.string());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("line 5: need a certificate serial number"));
  EXPECT_THAT(bad.status().message(), Not(HasSubstr("password")));
  fs::remove(file);
}

}  // namespace
