// The coordinator: job lifecycle, worker registry and scheduling, independent of gRPC (the
// services in service.h translate RPCs into these calls; tests drive it directly too).
//
// Job states: PENDING -> (PROFILING) -> PLANNING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED.
// A PENDING job waits until `parallel.pipeline` free workers of its device kind are
// registered; it then takes them (rank r = r-th of them), optionally asks each to profile the
// passes at the job's shapes, builds the plan from the measured (else FLOP-proportional)
// costs, and sends every worker its RunTask. Ranks report per-step metrics; when every rank
// reported step N the merged StepMetrics becomes an event. A rank that fails, or a worker
// whose heartbeats stop for heartbeat_timeout, fails the job with a reason naming the rank;
// the other ranks are told to cancel and every worker of the job is free again.
//
// Every job record and event is written to the JobStore before it is visible: a coordinator
// restarted on the same database has the whole history. A job that was RUNNING when it stopped
// is re-adopted: its worker daemons keep running their ranks, register again naming the rank
// they hold (RegisterWorkerRequest.held) and resend the reports the old process did not
// acknowledge; when every rank is back within adopt_grace the job goes on untouched, else it
// restarts from its latest verified checkpoint. PROFILING and PLANNING jobs are scheduled
// again. No job fails because the coordinator restarted.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/server/job_plan.h"
#include "coordinator/server/job_store.h"
#include "coordinator/server/kv_store.h"
#include "proto/safefs/run_owner.h"
#include "vocabpipe/v1/service.pb.h"

namespace vp::server {

// Told about job state changes, merged steps and worker counts (the Prometheus exporter in
// coordinator_main.cc). Never call back into the Coordinator. OnJobState and OnWorkers are
// called with the coordinator's lock held (keep them quick); OnStep without it, one call at a
// time, in the order the steps were merged, with a Job that carries only its id and plan.
class CoordinatorObserver {
 public:
  virtual ~CoordinatorObserver() = default;
  virtual void OnJobState(const vocabpipe::v1::Job& job) = 0;
  virtual void OnStep(const vocabpipe::v1::Job& job, const vocabpipe::v1::StepMetrics& step) = 0;
  virtual void OnWorkers(int idle, int busy) = 0;
};

struct CoordinatorOptions {
  std::string db_path;  // SQLite file (":memory:" for tests that need no restart)
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A worker silent this long is dropped, and its job fails naming the rank.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Gloo timeout given to the ranks (a rank whose peer died fails within it).
  absl::Duration rank_timeout = absl::Seconds(60);
  // Wait before a restarted job's attempt n + 1: restart_backoff · 2^(n-1), at most 60 s.
  absl::Duration restart_backoff = absl::Seconds(1);
  // Ask the job's workers to time the passes before planning.
  bool profile = true;
  // FLOP-proportional cost scale when no profile is available (FLOP/s per rank).
  double flops_per_second = 1e11;
  std::shared_ptr<CoordinatorObserver> observer;  // optional
  // Planning (at submit for memory admission, before a run, for a dry run) runs on its own
  // thread outside the coordinator's lock; a plan that takes longer fails with
  // DeadlineExceeded. At most max_concurrent_plans run at once (beyond: ResourceExhausted).
  absl::Duration planning_deadline = absl::Seconds(30);
  int max_concurrent_plans = 4;
  // Canonical storage root (spec::ResolveStorageRoot); when set, Submit refuses a spec whose
  // data.path or checkpoint.dir resolves outside it. Empty: no confinement.
  std::string storage_root;
  // A user's PENDING jobs at most (ResourceExhausted "queue: ..." beyond); 0: no limit.
  int max_queued_per_user = 16;
  // The most memory a worker may report (RegisterWorkerRequest.memory_bytes is the worker's
  // own word): a larger report is counted as this many bytes, and logged. 0: no cap.
  int64_t max_worker_memory = 0;
  // After a restart, how long a RUNNING job waits for all its ranks to re-register before it
  // is restarted from its checkpoint instead. Also how long an elastic job (train.elastic)
  // that lost a worker waits for a replacement before it runs at fewer replicas.
  absl::Duration adopt_grace = absl::Seconds(30);
  // A job PROFILING longer than this fails (a worker that never answers its ProfileTask).
  absl::Duration profiling_deadline = absl::Minutes(10);
  // Progress watchdog: a RUNNING job whose step count does not advance for this long is
  // restarted (or fails, when no restarts are left); zero disables it.
  absl::Duration progress_timeout = absl::Minutes(30);
  // Retention of finished (SUCCEEDED, FAILED, CANCELLED) jobs: a job finished longer ago than
  // finished_ttl is deleted with its events and steps (zero: kept forever), and of each user's
  // finished jobs only the newest max_finished_per_user are kept (0: no cap), so no user can
  // grow the job table without bound.
  absl::Duration finished_ttl = absl::Hours(24 * 30);
  int max_finished_per_user = 1000;
};

bool IsTerminal(vocabpipe::v1::JobState state);
std::string JobStateName(vocabpipe::v1::JobState state);  // "RUNNING", ...

// Checks and completes a submitted spec: exactly one of spec / spec_text, parsed (text),
// defaults applied, validated, paths absolute. InvalidArgument naming the field path.
absl::StatusOr<vocabpipe::v1::JobSpec> SpecFromRequest(
    const vocabpipe::v1::SubmitJobRequest& request);

class Coordinator {
 public:
  static absl::StatusOr<std::unique_ptr<Coordinator>> Open(const CoordinatorOptions& options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Jobs.
  // A validated spec, admitted when its paths are inside the storage root and the planner's
  // memory model fits it on the largest registered worker of its device kind
  // (ResourceExhausted "memory: needs X GiB on rank r, the largest worker has Y GiB").
  // resume: the ranks continue from the latest step all of them saved in
  // checkpoint.dir (SubmitJobRequest.resume).
  // owner: the submitting user, recorded on the job (Job.owner).
  // run_user: who the job's run folders are claimed for and whether they are an admin
  // (Job.run_owner, Job.owner_admin; an empty name: owner). A checkpoint.dir or
  // model.init_from inside another user's run folder is PermissionDenied naming the field and
  // the owner (spec::CheckSpecOwners), unless run_user is an admin.
  absl::StatusOr<std::string> Submit(const vocabpipe::v1::JobSpec& spec, bool resume = false,
                                     const std::string& owner = "local",
                                     const safefs::RunUser& run_user = {});
  absl::StatusOr<vocabpipe::v1::Job> GetJob(const std::string& id);
  // Newest first: the jobs of `owner` (empty: every job) older than page_token's (empty: from
  // the newest), at most page_size of them and, beyond the first, at most max_bytes of records.
  // *next_page_token: where the next page starts (empty: no more). InvalidArgument for a token
  // that is not one of ours.
  absl::StatusOr<std::vector<vocabpipe::v1::Job>> ListJobs(const std::string& owner,
                                                           const std::string& page_token,
                                                           int page_size, size_t max_bytes,
                                                           std::string* next_page_token);
  absl::StatusOr<vocabpipe::v1::Job> Cancel(const std::string& id, const std::string& reason);
  // The job's events with seq > after_seq; waits up to max_wait for one when there is none
  // yet. *terminal: the job had reached a terminal state (its last event is included).
  absl::StatusOr<std::vector<vocabpipe::v1::JobEvent>> WaitEvents(const std::string& id,
                                                                  int64_t after_seq,
                                                                  absl::Duration max_wait,
                                                                  bool* terminal);
  // Dry run of the plan a job would get (profiled costs of the last profile of the same shape
  // when the coordinator has one).
  // user: the caller (at most one plan per user at a time, like Submit's).
  absl::StatusOr<vocabpipe::v1::PlanJobResponse> PlanDryRun(const vocabpipe::v1::JobSpec& spec,
                                                            const std::string& user = "local");

  // Workers.
  // identity: the name in the caller's worker certificate ("" without TLS); the worker's later
  // calls must come with the same one (CheckWorkerIdentity).
  absl::StatusOr<vocabpipe::v1::RegisterWorkerResponse> RegisterWorker(
      const vocabpipe::v1::RegisterWorkerRequest& request, const std::string& identity = "");
  // PermissionDenied when worker_id registered with another certificate name than `identity`;
  // NotFound for an unknown worker.
  absl::Status CheckWorkerIdentity(const std::string& worker_id, const std::string& identity);
  absl::StatusOr<vocabpipe::v1::HeartbeatResponse> Heartbeat(
      const vocabpipe::v1::HeartbeatRequest& request);
  absl::Status ReportMetrics(const vocabpipe::v1::ReportMetricsRequest& request);
  absl::Status ReportTask(const vocabpipe::v1::ReportTaskRequest& request);
  std::vector<vocabpipe::v1::WorkerInfo> ListWorkers();

  KvStore& kv() { return kv_; }
  const CoordinatorOptions& options() const { return options_; }

 private:
  struct Worker {
    vocabpipe::v1::WorkerInfo info;
    std::string identity;  // its certificate's name (RegisterWorker)
    absl::Time last_heartbeat;
    // Sent until acknowledged (Heartbeat); seq 0 until first sent.
    std::deque<vocabpipe::v1::WorkerCommand> commands;
    int64_t next_seq = 1;
    bool leaving = false;  // stopping (HeartbeatRequest.leaving): no new tasks
  };
  struct RankReport {
    int reported = 0;                   // ranks that reported this step
    std::vector<nlohmann::json> lines;  // per rank: its line (proto/runlog), null until reported
  };
  struct ActiveJob {                   // what a non-terminal job needs beyond its record
    std::vector<std::string> workers;  // per rank
    std::vector<bool> done;            // per rank: task finished ok
    std::vector<bool> failed;          // per rank: task reported a failure
    // The first rank failure, held back until every rank reported or the deadline passes: a
    // peer's transport error usually arrives before the heartbeat timeout reveals the worker
    // that really died, and the reason must name that one.
    // A rank killed by a signal is named first even when a peer's report came earlier.
    std::string failure;
    bool failure_signaled = false;
    bool failure_refused = false;  // a daemon refused its task: no restart
    absl::Time failure_deadline;
    std::map<int, vocabpipe::v1::PassCosts> profiles;  // per rank
    std::map<int64_t, RankReport> steps;
    std::string attempt;
    // Since when the job is in its state (the PROFILING deadline) or last made progress (RUNNING:
    // a merged step; the progress watchdog).
    absl::Time since = absl::Now();
    // A RUNNING job of the previous coordinator process whose ranks have not all registered
    // again (workers[r] empty for those); restarted from its checkpoint at adopt_deadline.
    bool adopting = false;
    absl::Time adopt_deadline;
    // The failure was reported during the re-adoption: it happened while the coordinator was
    // away, so the restart it causes is forced (not refused by train.max_restarts).
    bool failed_while_away = false;
    // Who may take each rank back after a restart (by rank, from the job store): the
    // certificate name its worker registered with and the SHA-256 of the attempt's secret.
    // A rank without an entry is not re-adopted.
    std::map<int, JobStore::RankHolder> holders;
    double peak_flops = 0;  // sum over the job's workers
    double model_flops_per_step = 0;
    std::vector<int64_t> predicted_memory;  // per rank: the planner's state + activations
    // train.elastic growing back: the coordinator asked the ranks to stop at a step with a
    // checkpoint (GrowElastic); `stopped`: a rank reported that stop (not a failure).
    bool growing = false;
    bool stopped = false;
  };
  // An elastic job (train.elastic) that lost a worker: until when it waits for a replacement
  // before it may shrink, and what a restart that changes its replicas refunds.
  struct ElasticState {
    absl::Time shrink_after = absl::InfinitePast();  // lost worker + adopt_grace
    std::string lost_worker;                         // named in the shrink event
    // The pending restart was counted against train.max_restarts; an attempt at another
    // number of replicas takes it back (a shrink or a grow is not the job's failure).
    bool refund = false;
    // The shrunk shape did not fit its workers' memory: wait for the full shape until the job
    // loses a worker again.
    bool hold_full = false;
  };

  Coordinator(const CoordinatorOptions& options, std::unique_ptr<JobStore> store);
  // All private methods expect mu_ held.
  vocabpipe::v1::Job* FindJob(const std::string& id);
  // A worker's report about a job: NotFound for an unknown worker or job; `active` is null
  // when the job is no longer active (a late report, ignored). Requires mu_.
  struct ReportTarget {
    vocabpipe::v1::Job* job = nullptr;
    ActiveJob* active = nullptr;
  };
  absl::StatusOr<ReportTarget> ReportTargetFor(const std::string& worker_id,
                                               const std::string& job_id,
                                               const std::string& attempt = "");
  absl::Status SaveWithEvent(vocabpipe::v1::Job& job, vocabpipe::v1::JobEvent event);
  absl::Status SetState(vocabpipe::v1::Job& job, vocabpipe::v1::JobState state,
                        const std::string& reason);
  // Terminal transition: state + reason, cancel every other rank, free the workers.
  void Finish(vocabpipe::v1::Job& job, vocabpipe::v1::JobState state, const std::string& reason,
              const std::string& except_worker = "");
  // Cancels the job's other ranks, frees its workers and drops its attempt (Finish's second
  // half).
  void Release(vocabpipe::v1::Job& job, const std::string& except_worker);
  // A rank failed: a RUNNING job with restarts left goes back to PENDING for its next attempt
  // (after a backoff, resuming from its latest verified checkpoint); otherwise it FAILS.
  // `reason` by value: callers pass the active job's failure text, which Release() frees.
  // forced: restart even when train.max_restarts is used up (the coordinator's own restart
  // lost the launch; not the job's failure).
  void FailOrRestart(vocabpipe::v1::Job& job, std::string reason,
                     const std::string& except_worker = "", bool forced = false);
  // A released job back to PENDING for its next attempt, resuming from its checkpoint, with
  // `reason` as its event (FailOrRestart, RestartToGrow).
  void Requeue(vocabpipe::v1::Job& job, const std::string& reason);
  // Free (no job, not leaving) and of `device`'s kind.
  static bool IsFreeFor(const Worker& worker, const std::string& device);
  // A re-registering worker holds `held`: take it as that rank of the job when the job is
  // RUNNING that attempt and the rank is not adopted yet; otherwise tell the worker to cancel.
  void Adopt(Worker& worker, const vocabpipe::v1::HeldTask& held);
  // PermissionDenied unless the rank `held` names goes back to a worker with this certificate
  // name and the attempt's secret (when the coordinator knows who holds it; else Adopt
  // cancels the rank). Requires mu_.
  absl::Status CheckHolder(const vocabpipe::v1::HeldTask& held, const std::string& identity);
  // Deadlines: PROFILING too long, a re-adoption whose grace ran out, a RUNNING job without
  // progress for progress_timeout.
  void CheckDeadlines();
  // ReportMetrics under mu_: checks the lines, merges every step all ranks have reported and
  // stores it; the merged steps the observer is to be told go to `observed`.
  absl::Status MergeReport(const vocabpipe::v1::ReportMetricsRequest& req,
                           std::vector<vocabpipe::v1::StepMetrics>* observed);
  void Schedule();
  // An elastic job about to be scheduled with `free` free workers of its kind: sets the
  // replicas it runs at (ChooseReplicas, within the spec's rules) and says whether to place it
  // now; false: it waits (its reason says why when that is news).
  bool ReshapeElastic(vocabpipe::v1::Job& job, int free, absl::Time now);
  // RUNNING elastic jobs below their requested replicas with enough free workers to grow: ask
  // their ranks to stop at the next step with a checkpoint (the rendezvous store's preemption
  // request); Schedule then runs them at the larger shape from it.
  void GrowElastic();
  // A growing job's ranks all stopped at their checkpoint: the next attempt (not counted
  // against train.max_restarts) resumes from it at more replicas.
  void RestartToGrow(vocabpipe::v1::Job& job);
  // Sets PLANNING and plans on a thread of its own (planners_), off the lock; the result is
  // applied by FinishPlanning under the lock when the job is still in that attempt.
  void StartPlanning(vocabpipe::v1::Job& job, ActiveJob& active);
  void FinishPlanning(const std::string& job_id, const std::string& attempt,
                      absl::StatusOr<JobPlan> plan);
  void JoinFinishedPlanners();
  // PlanForJob with the deadline and concurrency cap of the options; a plan past its deadline
  // is cancelled (the planner stops at its next check). `user` (empty for the scheduler's own
  // plans): at most one plan of theirs at a time, else ResourceExhausted. Call WITHOUT mu_.
  absl::StatusOr<JobPlan> PlanWithDeadline(const vocabpipe::v1::JobSpec& spec,
                                           std::optional<vocabpipe::v1::PassCosts> costs,
                                           const std::string& user);
  // ResourceExhausted "queue: ..." when `owner` has max_queued_per_user PENDING jobs.
  absl::Status CheckQueue(const std::string& owner);
  // The memory of the largest registered worker of `device`'s kind; 0 when none reports any.
  // Requires mu_.
  int64_t LargestWorkerMemory(const std::string& device) const;
  void ExpireWorkers();
  // Deletes finished jobs past finished_ttl or beyond a user's max_finished_per_user.
  void PurgeFinished();
  void SettleFailures();  // jobs whose held-back failure is due
  void NotifyWorkers();
  void MonitorLoop();

  const CoordinatorOptions options_;
  std::unique_ptr<JobStore> store_;
  KvStore kv_;

  std::mutex mu_;
  std::mutex observe_mu_;  // taken under mu_ (never the other way): observer steps in order
  std::condition_variable events_cv_;  // a job got a new event
  std::map<std::string, vocabpipe::v1::Job> jobs_;
  std::map<std::string, ActiveJob> active_;
  std::map<std::string, absl::Time> restart_after_;  // restarted PENDING jobs: not before
  std::map<std::string, ElasticState> elastic_;      // elastic jobs that lost a worker
  std::map<std::string, Worker> workers_;
  int64_t next_job_ = 1, next_worker_ = 1;
  absl::Time next_purge_ = absl::InfinitePast();
  bool stopping_ = false;
  // Planning threads by number; finished ones are joined by the monitor loop.
  std::map<int64_t, std::thread> planners_;
  std::vector<int64_t> finished_planners_;
  int64_t next_planner_ = 0;
  // Plans being computed now, and whose (shared with the planning threads, which may outlive a
  // timed-out wait until the planner notices its cancellation).
  struct PlanSlots {
    std::mutex mu;
    int running = 0;
    std::set<std::string> users;  // users with a plan being computed (Submit, PlanDryRun)
  };
  std::shared_ptr<PlanSlots> plan_slots_ = std::make_shared<PlanSlots>();
  std::condition_variable stop_cv_;
  std::thread monitor_;
};

}  // namespace vp::server
