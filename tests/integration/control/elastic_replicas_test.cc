// Elastic replicas (train.elastic, issue 36) with a real coordinator and real worker daemons:
// a job of d = 2 replicas that loses a worker goes on at one replica with twice the
// microbatches (the same global batch, so the same losses), grows back when a worker returns,
// and succeeds; a job whose batch does not split waits and says why; a job that is not
// elastic waits for its full shape as before.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <iostream>
#include <map>
#include <thread>

#include "absl/strings/str_join.h"
#include "tests/integration/control/control_fixture.h"
#include "tests/integration/control/control_harness.h"
#include "tests/integration/metrics/http.h"
#include "tests/support/weights.h"

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;
namespace mt = vp::metrics::testing;

class ElasticTest : public ControlTest {
 protected:
  // vocabpipe_job_data_replicas{training_job=id} on the coordinator's metrics port (-1: none).
  static double Replicas(int port, const std::string& id) {
    auto got = mt::HttpGet(port, "/metrics");
    if (!got.ok()) return -1;
    return mt::Find(mt::ParseExposition(got->body), "vocabpipe_job_data_replicas",
                    {{"training_job", id}})
        .value_or(-1);
  }

  // The job's per-step losses (step → loss) and its state events' messages, from its events.
  static void Read(const std::vector<v1::JobEvent>& events, std::map<int64_t, double>* losses,
                   std::vector<std::string>* messages, std::vector<int64_t>* steps) {
    for (const v1::JobEvent& e : events) {
      if (e.has_step()) {
        steps->push_back(e.step().step());
        (*losses)[e.step().step()] = e.step().loss();
      } else {
        messages->push_back(e.message());
      }
    }
  }

  static int Count(const std::vector<std::string>& messages, const std::string& part) {
    int n = 0;
    for (const std::string& m : messages) n += m.find(part) != std::string::npos;
    return n;
  }
};

TEST_F(ElasticTest, AJobThatLosesAWorkerShrinksKeepsItsLossesGrowsBackAndSucceeds) {
  // Over TLS: the coordinator's stop request and the ranks' acknowledgements go through the
  // attempt's secret-guarded rendezvous keys.
  MakeData();
  UseTls();
  const int port = mt::FreePort();
  auto c = StartCoordinator(
      {"--no-profile", "--adopt-grace", "2", "--metrics-listen", absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(c->up()) << c->process().Log();
  StartWorkers(*c, 4);  // exactly d·p
  // d = 2 replicas of a 2-stage pipeline, m = 4 each: a global batch of 8 microbatches.
  // eps 1e-5: Adam's update of a near-zero gradient stays small, so the summation order of
  // one replica against two (the only difference) stays at rounding level (data_parallel_test).
  const std::string extra_train = ", elastic: true, eps: 1.0e-5";
  const std::string id = Submit(*c, TinyJob("el", 2, 60, ", data: 2", extra_train, ", every: 5"));
  ASSERT_TRUE(WaitFor([&] { return GetJob(*c, id).step() >= 20; }, std::chrono::seconds(60)))
      << GetJob(*c, id).reason() << "\n"
      << c->process().Log();
  EXPECT_EQ(Replicas(port, id), 2);
  std::string lost;
  Process* victim = DaemonOfRank(*c, id, 3, &lost);
  ASSERT_NE(victim, nullptr);
  const int64_t killed_at = GetJob(*c, id).step();
  ASSERT_LT(killed_at, 50) << "the job is nearly done before the kill; make it longer";
  victim->Kill(SIGKILL);  // the daemon; its rank process dies with it

  // No free worker replaces it within --adopt-grace: one replica of m = 8 goes on.
  ASSERT_TRUE(WaitFor(
      [&] {
        const v1::Job j = GetJob(*c, id);
        return j.state() == v1::JOB_STATE_RUNNING && j.spec().parallel().data() == 1 &&
               j.step() > killed_at;
      },
      std::chrono::seconds(60)))
      << GetJob(*c, id).reason() << "\n"
      << c->process().Log();
  v1::Job shrunk = GetJob(*c, id);
  EXPECT_EQ(shrunk.spec().parallel().microbatches(), 8);
  EXPECT_EQ(shrunk.requested_data(), 2);
  EXPECT_EQ(shrunk.requested_microbatches(), 4);
  EXPECT_EQ(shrunk.restarts(), 1);
  EXPECT_EQ(shrunk.restarts() - shrunk.resizes(), 0) << "the shrink counted as a restart";
  EXPECT_EQ(Replicas(port, id), 1);
  // vocabpipe status shows the shape now and the one asked for.
  const CliResult status =
      Vocabpipe(absl::StrCat("VOCABPIPE_TOKEN=", admin_),
                absl::StrCat("status ", id, " --coordinator ", c->address(), " --tls-ca ",
                             (pki_->certs() / "ca.pem").string()));
  EXPECT_THAT(status.output,
              HasSubstr("data parallel (elastic): 1 of 2 replicas, m=8 each (global batch 2 × 4)"));

  // A fifth worker: the job stops at the next step with a checkpoint and resumes at d = 2.
  const size_t before = workers_.size();
  StartWorkers(*c, 1);
  ASSERT_EQ(workers_.size(), before + 1);
  v1::Job job;
  ASSERT_TRUE(Succeeds(*c, id, 120, &job));
  EXPECT_EQ(job.step(), 60);
  EXPECT_EQ(job.spec().parallel().data(), 2);
  EXPECT_EQ(job.spec().parallel().microbatches(), 4);
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_EQ(job.restarts() - job.resizes(), 0);
  EXPECT_EQ(Replicas(port, id), 2);

  std::map<int64_t, double> losses;
  std::vector<std::string> messages;
  std::vector<int64_t> steps;
  Read(Watch(*c, id), &losses, &messages, &steps);
  const std::string story = absl::StrJoin(messages, "\n");
  // The shrink names the lost worker when the heartbeat timeout revealed it (the usual order:
  // a held-back failure waits a heartbeat interval longer than the timeout).
  ASSERT_EQ(Count(messages, "shrunk to 1 replica (m 8)"), 1) << story;
  for (const std::string& m : messages) {
    if (m.rfind("shrunk to", 0) != 0) continue;
    EXPECT_THAT(m, HasSubstr("global batch unchanged (2 × 4 microbatches)"));
    if (m.find(" after ") != std::string::npos) {
      EXPECT_THAT(m, HasSubstr(lost + " lost"));
    }
  }
  EXPECT_EQ(Count(messages, "grew back to 2 replicas (m 4); global batch unchanged"), 1) << story;
  EXPECT_EQ(Count(messages, "growing to 2 replicas (m 4)"), 1) << story;
  ASSERT_EQ(steps.size(), 60u) << absl::StrJoin(steps, " ");  // every step once
  for (int i = 0; i < 60; ++i) EXPECT_EQ(steps[i], i + 1);

  // The same job uninterrupted at d = 2 on the same workers: the same losses at every step
  // (before, during and after the shrink) and the same final weights.
  const std::string ref = Submit(*c, TinyJob("ref", 2, 60, ", data: 2", extra_train));
  ASSERT_TRUE(Succeeds(*c, ref, 120, &job));
  std::map<int64_t, double> ref_losses;
  std::vector<std::string> ref_messages;
  std::vector<int64_t> ref_steps;
  Read(Watch(*c, ref), &ref_losses, &ref_messages, &ref_steps);
  ASSERT_EQ(ref_losses.size(), 60u);
  double worst = 0;
  for (const auto& [step, loss] : ref_losses) {
    ASSERT_TRUE(losses.count(step)) << step;
    worst = std::max(worst, std::abs(losses[step] - loss) / std::abs(loss));
  }
  EXPECT_LE(worst, 1e-4) << "the largest relative loss difference of a step";
  std::cout << "steps 1-60, shrunk after step " << killed_at << ": largest relative loss "
            << "difference from the uninterrupted run " << worst << "\n"
            << story << std::endl;
  ExpectSameWeights(dir_ / "el" / "step_60" / "model.safetensors",
                    dir_ / "ref" / "step_60" / "model.safetensors", 1e-4);
}

TEST_F(ElasticTest, AGlobalBatchThatDoesNotSplitOverTheSurvivorsWaitsAndSaysWhy) {
  // d = 3 replicas of m = 1: after a loss 2 replicas' workers are free, and 3 microbatches do
  // not split over 2. The job waits (not at 1 replica: it was promised 3 workers) until a
  // third worker comes, then runs at 3 again.
  MakeData();
  CoordinatorProcess c(dir_, db_, {"--no-profile", "--adopt-grace", "1"});
  ASSERT_TRUE(c.up()) << c.process().Log();
  StartWorkers(c, 3);
  v1::SubmitJobRequest req =
      TinyJob("odd", 1, 100000, ", data: 3", ", elastic: true", ", every: 2");
  // TinyJob's m = 4 → m = 1.
  std::string text = req.spec_text();
  text.replace(text.find("microbatches: 4"), 15, "microbatches: 1");
  req.set_spec_text(text);
  const std::string id = Submit(c, req);
  ASSERT_TRUE(WaitFor([&] { return GetJob(c, id).step() >= 3; }, std::chrono::seconds(60)))
      << GetJob(c, id).reason();
  Process* victim = DaemonOfRank(c, id, 2);
  ASSERT_NE(victim, nullptr);
  victim->Kill(SIGKILL);
  ASSERT_TRUE(WaitFor(
      [&] {
        return GetJob(c, id).reason().find(
                   "elastic: cannot keep the global batch at 2 replicas "
                   "(3 × 1 = 3 microbatches do not split over 2)") != std::string::npos;
      },
      std::chrono::seconds(30)))
      << GetJob(c, id).reason() << "\n"
      << c.process().Log();
  const v1::Job waiting = GetJob(c, id);
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(waiting.spec().parallel().data(), 3);
  EXPECT_THAT(waiting.reason(), HasSubstr("waiting for 3 free cpu workers (2 free)"));
  const int64_t stopped_at = waiting.step();

  StartWorkers(c, 3);  // the survivors and a newcomer: 3 listed
  ASSERT_TRUE(WaitFor(
      [&] {
        const v1::Job j = GetJob(c, id);
        return j.state() == v1::JOB_STATE_RUNNING && j.step() > stopped_at;
      },
      std::chrono::seconds(60)))
      << GetJob(c, id).reason();
  EXPECT_EQ(GetJob(c, id).spec().parallel().data(), 3);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(id);
  v1::Job job;
  ASSERT_TRUE(c.jobs->CancelJob(Ctx().get(), cancel, &job).ok());
}

TEST_F(ElasticTest, WithoutElasticALostReplicaWaitsForTheFullShape) {
  MakeData();
  CoordinatorProcess c(dir_, db_, {"--no-profile", "--adopt-grace", "1"});
  ASSERT_TRUE(c.up()) << c.process().Log();
  StartWorkers(c, 2);
  const std::string id = Submit(c, TinyJob("rigid", 1, 100000, ", data: 2", "", ", every: 2"));
  ASSERT_TRUE(WaitFor([&] { return GetJob(c, id).step() >= 3; }, std::chrono::seconds(60)))
      << GetJob(c, id).reason();
  Process* victim = DaemonOfRank(c, id, 1);
  ASSERT_NE(victim, nullptr);
  victim->Kill(SIGKILL);
  ASSERT_TRUE(WaitFor([&] { return GetJob(c, id).state() == v1::JOB_STATE_PENDING; },
                      std::chrono::seconds(10)));
  std::this_thread::sleep_for(std::chrono::seconds(3));  // past the grace and the backoff
  const v1::Job job = GetJob(c, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING) << job.reason();
  EXPECT_EQ(job.spec().parallel().data(), 2);
  EXPECT_EQ(job.requested_data(), 0);
  EXPECT_THAT(job.reason(), HasSubstr("restart 1 of 3"));
}

}  // namespace
