// The fixture of the control-plane tests with real daemons (control_test, elastic_replicas_test): a
// vocabpipe-coordinator on a fresh folder's SQLite file, worker daemons it starts, TLS on
// request, and the RPCs the tests drive.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/control/control_harness.h"

namespace vp::testing {

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("vp_control_");
    db_ = dir_ / "coordinator.db";
  }
  void TearDown() override {
    workers_.clear();
    if (!HasFailure()) fs::remove_all(dir_);
  }

  void MakeData() {
    const CliResult r = SynthData(dir_ / "data.bin");
    ASSERT_EQ(r.code, 0) << r.output;
  }

  // A tiny p-rank job: V = 64, h = 32, s = 16, m = 4 microbatches of b = 2.
  v1::SubmitJobRequest TinyJob(const std::string& name, int pipeline, int steps,
                               const std::string& extra_parallel = "",
                               const std::string& extra_train = "",
                               const std::string& extra_checkpoint = "") {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: ", name, "\n",
        "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n",
        "parallel: {pipeline: ", pipeline, ", microbatch_size: 2, microbatches: 4", extra_parallel,
        "}\n", "train: {steps: ", steps, ", lr: 0.003, threads: 1", extra_train, "}\n",
        "data: {path: data.bin}\ncheckpoint: {dir: ", name, extra_checkpoint, "}\n"));
    req.set_base_dir(dir_.string());
    return req;
  }

  // From here on the coordinators and daemons this test starts use TLS: certificates made by
  // `vocabpipe certs init` / `certs worker` (one per daemon) and an admin token for the stubs.
  void UseTls() {
    pki_ = std::make_unique<TestPki>(dir_);
    ASSERT_TRUE(pki_->ok()) << pki_->init_output();
    admin_ = pki_->Token("root", "admin");
    ASSERT_FALSE(admin_.empty());
  }

  // A coordinator on db_, over TLS after UseTls() (else plaintext), with the flags `extra`.
  std::unique_ptr<CoordinatorProcess> StartCoordinator(const std::vector<std::string>& extra) {
    if (!pki_) return std::make_unique<CoordinatorProcess>(dir_, db_, extra);
    std::vector<std::string> flags = pki_->ServerFlags();
    flags.insert(flags.end(), extra.begin(), extra.end());
    return std::make_unique<CoordinatorProcess>(dir_, db_, flags, pki_->Credentials("", admin_));
  }

  // The daemon flags of the next worker: a certificate of its own (CN=node<N>) over TLS.
  std::vector<std::string> NextWorkerFlags() {
    if (!pki_) return {"--insecure"};
    const std::string name = absl::StrCat("node", workers_.size());
    CliResult r = Vocabpipe("", absl::StrCat("certs worker ", name, " ", pki_->certs().string()));
    EXPECT_EQ(r.code, 0) << r.output;
    return pki_->WorkerFlags(name);
  }

  void StartWorkers(CoordinatorProcess& c, int n) {
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> args = {Bin("worker/main/vocabpipe-worker"), "--coordinator",
                                       c.address(), "--exit-with-parent", "1"};
      const std::vector<std::string> flags = NextWorkerFlags();
      args.insert(args.end(), flags.begin(), flags.end());
      workers_.push_back(
          std::make_unique<Process>(args, dir_ / absl::StrCat("worker_", workers_.size(), ".log")));
    }
    ASSERT_TRUE(
        WaitFor([&] { return ListWorkers(c).workers_size() >= n; }, std::chrono::seconds(20)));
  }

  v1::ListWorkersResponse ListWorkers(CoordinatorProcess& c) {
    v1::ListWorkersResponse resp;
    c.workers->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &resp).ok();
    return resp;
  }

  // Waits up to `seconds` for job `id` on `c` to succeed; a failure names the job's reason and
  // carries the coordinator's log. *job: the job as it ended.
  ::testing::AssertionResult Succeeds(CoordinatorProcess& c, const std::string& id, int seconds,
                                      v1::Job* job) {
    WaitFor([&] { return GetJob(c, id).state() == v1::JOB_STATE_SUCCEEDED; },
            std::chrono::seconds(seconds));
    *job = GetJob(c, id);
    ::testing::AssertionResult succeeded = Succeeded(*job);
    if (!succeeded) succeeded << " (waited " << seconds << " s)\n" << c.process().Log();
    return succeeded;
  }

  // The worker daemon this test started that runs `rank` of job `id` (null if none), and its
  // worker id. The coordinator names workers in registration order, which need not be start
  // order, so the daemon is found by the pid its worker reports.
  Process* DaemonOfRank(CoordinatorProcess& c, const std::string& id, int rank,
                        std::string* worker_id = nullptr) {
    const v1::ListWorkersResponse list = ListWorkers(c);
    for (const auto& w : list.workers()) {
      if (w.job_id() != id || w.rank() != rank) continue;
      for (const auto& p : workers_) {
        if (p->pid() != w.pid()) continue;
        if (worker_id != nullptr) *worker_id = w.worker_id();
        return p.get();
      }
    }
    return nullptr;
  }

  // Runs `ref` (the interrupted job's spec under another checkpoint.dir) to the end on c, then
  // expects the interrupted run's final weights in <run>/step_<steps> to equal its bytes.
  void ExpectTheWeightsOfAnUninterruptedRun(CoordinatorProcess& c, const std::string& run,
                                            const v1::SubmitJobRequest& ref,
                                            const std::string& ref_run, int steps) {
    v1::Job job;
    ASSERT_TRUE(Succeeds(c, Submit(c, ref), 60, &job));
    const std::string step = absl::StrCat("step_", steps);
    const std::string a = ReadWholeFile(dir_ / run / step / "model.safetensors");
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(a == ReadWholeFile(dir_ / ref_run / step / "model.safetensors"))
        << run << "'s final weights differ from the uninterrupted run's";
  }

  // Every one of the n registered workers is free: the RPC succeeds and lists them all, so an
  // empty or failed answer cannot pass for "free".
  void ExpectWorkersFree(CoordinatorProcess& c, int n) {
    v1::ListWorkersResponse resp;
    const grpc::Status st = c.workers->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.workers_size(), n);
    for (const auto& w : resp.workers()) {
      EXPECT_TRUE(w.job_id().empty()) << w.worker_id() << " still holds " << w.job_id();
    }
  }

  v1::Job GetJob(CoordinatorProcess& c, const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::Status st = c.jobs->GetJob(Ctx().get(), req, &job);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return job;
  }

  std::string Submit(CoordinatorProcess& c, const v1::SubmitJobRequest& req) {
    v1::SubmitJobResponse resp;
    grpc::Status st = c.jobs->SubmitJob(Ctx().get(), req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.job_id();
  }

  // Every event of the job from after_event on, until the stream ends (terminal) or timeout.
  std::vector<v1::JobEvent> Watch(CoordinatorProcess& c, const std::string& id,
                                  int64_t after_event = 0, int seconds = 60) {
    v1::WatchJobRequest req;
    req.set_job_id(id);
    req.set_after_event(after_event);
    auto ctx = Ctx(seconds);
    auto reader = c.jobs->WatchJob(ctx.get(), req);
    std::vector<v1::JobEvent> events;
    v1::JobEvent e;
    while (reader->Read(&e)) events.push_back(e);
    grpc::Status st = reader->Finish();
    EXPECT_TRUE(st.ok()) << st.error_message();
    return events;
  }

  fs::path dir_, db_;
  std::vector<std::unique_ptr<Process>> workers_;
  std::unique_ptr<TestPki> pki_;  // UseTls()
  std::string admin_;             // an admin's token (UseTls)
};

}  // namespace vp::testing
