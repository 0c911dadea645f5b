#include "coordinator/server/coordinator.h"

#include <algorithm>
#include <filesystem>
#include <future>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/layout.h"
#include "coordinator/server/elastic.h"
#include "coordinator/server/job_plan.h"
#include "coordinator/server/placement.h"
#include "proto/grpc/auth.h"
#include "proto/plan/plan.h"
#include "proto/plan/topology.h"
#include "proto/runlog/step_lines.h"
#include "proto/spec/job_spec.h"
#include "proto/spec/storage_root.h"
#include "worker/data/token_shards.h"
#include "worker/data/tokenizer.h"

namespace vp::server {
namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

std::string JobStateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// A merged step line (proto/runlog) as the StepMetrics of a job event; `workers` per rank.
v1::StepMetrics StepMetricsFromLine(const nlohmann::json& line,
                                    const std::vector<std::string>& workers) {
  v1::StepMetrics m;
  m.set_step(line.value("step", int64_t{0}) + 1);  // steps done
  if (line.contains("loss")) {
    m.set_has_loss(true);
    m.set_loss(line["loss"].get<double>());
  }
  if (auto it = line.find("val_loss"); it != line.end() && it->is_number()) {
    m.set_has_val_loss(true);
    m.set_val_loss(it->get<double>());
  }
  m.set_seconds(line.value("step_seconds", 0.0));
  m.set_tokens_per_second(line.value("tokens_per_s", 0.0));
  m.set_mfu(line.value("mfu", 0.0));
  m.set_grad_norm(line.value("grad_norm", 0.0));
  m.set_lr(line.value("lr", 0.0));
  for (const nlohmann::json& stage : line["stages"]) {
    v1::StageStats* s = m.add_stages();
    const int rank = stage.value("rank", 0);
    s->set_rank(rank);
    // Data parallelism names both coordinates; one replica: the rank is the stage.
    s->set_stage(static_cast<int>(stage.value("stage", int64_t{rank})));
    s->set_replica(static_cast<int>(stage.value("replica", int64_t{0})));
    s->set_tensor(static_cast<int>(stage.value("tensor", int64_t{0})));
    if (rank < static_cast<int>(workers.size())) s->set_worker_id(workers[rank]);
    // The rank's real peak when it measured one (memory.footprint), else the engine's total.
    s->set_peak_memory_bytes(
        stage["memory"].value("footprint", stage["memory"].value("total", int64_t{0})));
    s->set_busy_seconds(stage.value("busy_seconds", 0.0));
    s->set_comm_seconds(stage.value("comm_seconds", 0.0));
    s->set_predicted_memory_bytes(stage.value("predicted_memory_total", int64_t{0}));
  }
  m.set_line_json(line.dump());
  return m;
}

// Resolves a path of the spec against base_dir; it must end up absolute (the workers that read
// it run elsewhere).
absl::Status MakeAbsolute(std::string* path, const std::string& base_dir,
                          const std::string& field) {
  if (path->empty() || fs::path(*path).is_absolute()) return absl::OkStatus();
  if (base_dir.empty() || !fs::path(base_dir).is_absolute()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": relative path \"", *path, "\" needs an absolute base_dir to resolve against"));
  }
  *path = (fs::path(base_dir) / *path).lexically_normal().string();
  return absl::OkStatus();
}

bool DeviceMatches(const std::string& job_device, const std::string& worker_device) {
  if (job_device.empty() || job_device == "cpu") return worker_device == "cpu";
  return worker_device.rfind("cuda", 0) == 0;
}

// The job's token files as far as the coordinator can see them: with a storage root it sees
// the cluster's shared storage, so a file that is there is checked now (its header and the
// tokenizer beside it), and a bad one fails the submit instead of every attempt of the job. A
// file not there (yet) is left to the workers, which check it before they start a rank.
absl::Status CheckInputFiles(const v1::JobSpec& spec, const std::string& root) {
  if (root.empty()) return absl::OkStatus();
  const bool listed = !spec.data().paths().empty(), val_listed = !spec.data().val_paths().empty();
  for (const auto& [field, entries] :
       {std::pair<std::string, std::vector<std::string>>{listed ? "data.paths" : "data.path",
                                                         spec::DataPathEntries(spec.data())},
        {val_listed ? "data.val_paths" : "data.val_path", spec::ValPathEntries(spec.data())}}) {
    if (entries.empty() || entries.front().empty()) continue;
    // Not all visible here (yet): the workers check them before they start a rank. An entry is
    // visible when it exists (a file or a folder), or for a glob when its folder does.
    std::error_code ec;
    const bool visible = std::all_of(entries.begin(), entries.end(), [&](const std::string& e) {
      const bool glob = fs::path(e).filename().string().find_first_of("*?[") != std::string::npos;
      return fs::exists(glob ? fs::path(e).parent_path() : fs::path(e), ec);
    });
    if (!visible) continue;
    const fs::path folder = data::DataFolder(entries.front());
    // The tokenizer beside the data is read too: it must be inside the root like the data.
    const fs::path tokenizer = folder / "tokenizer.model";
    if (fs::exists(fs::symlink_status(tokenizer, ec))) {
      if (auto st = spec::CheckInsideRoot(tokenizer.string(), root, field + " (tokenizer.model)");
          !st.ok()) {
        return st;
      }
    }
    if (auto st = data::CheckDataFiles(entries, spec.model().vocab_size(), field); !st.ok()) {
      return st;
    }
  }
  return absl::OkStatus();
}

// The ordinal of a job id ("job-<ordinal>"), 0 for anything else.
int64_t JobOrdinal(const std::string& id) {
  int64_t n = 0;
  const size_t dash = id.find('-');
  if (dash == std::string::npos || !absl::SimpleAtoi(id.substr(dash + 1), &n)) return 0;
  return n;
}

std::string GiB(int64_t bytes) {
  return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
}

// Per rank: what the planner's memory model predicts it holds at its peak (weights, gradients,
// optimizer state, activations).
std::vector<int64_t> PredictedRankBytes(const JobPlan& plan) {
  std::vector<int64_t> out;
  for (const planner::RankStats& r : plan.sim.ranks) {
    out.push_back(r.state_bytes + r.peak_activation_bytes);
  }
  return out;
}

// The job's ranks: parallel.data replicas of its pipeline, parallel.tensor ranks a stage
// (proto/plan/topology.h). The spec was validated at submit (d·t·p within spec::kMaxRanks); a
// record that is not (a hand-edited store) falls back to one replica.
planner::Topology JobTopology(const v1::JobSpec& spec) {
  const int p = std::max(1, spec.parallel().pipeline());
  auto t = planner::Topology::Create(p, std::max(1, spec.parallel().data()),
                                     std::max(1, spec.parallel().tensor()), spec::kMaxRanks);
  if (t.ok()) return *t;
  return *planner::Topology::Create(p, 1);
}

// train.elastic with more than one replica asked for: requested_data is set at submit only then.
bool IsElastic(const v1::Job& job) { return job.requested_data() > 1; }

// The job's spec at `data` replicas, each with its share of the global batch. An `auto`
// schedule or vocabulary layout is pinned to the first plan's choice: the job's exported series
// are labelled by it, and the per-step losses stay those of one schedule. An unused
// eval_batches (eval_every 0) follows the microbatches, whose multiple it must be.
v1::JobSpec ElasticSpec(const v1::Job& job, int data) {
  v1::JobSpec s = job.spec();
  v1::ParallelSpec* par = s.mutable_parallel();
  par->set_data(data);
  par->set_microbatches(job.requested_data() * job.requested_microbatches() / data);
  if (par->schedule() == "auto" && !job.plan().schedule().empty()) {
    par->set_schedule(job.plan().schedule());
    if (job.plan().seq_chunks() > 0) par->set_seq_chunks(job.plan().seq_chunks());
  }
  if (par->vocab() == "auto" && !job.plan().vocab().empty()) par->set_vocab(job.plan().vocab());
  if (s.train().eval_every() == 0) s.mutable_train()->set_eval_batches(par->microbatches());
  return s;
}

// The ranks that time the passes: one per pipeline position (replica 0 of each stage); the
// other replicas run the same shapes.
bool ProfilesPasses(const planner::Topology& t, int rank) { return t.CoordOf(rank).replica == 0; }

// How many profiles planning waits for: one per rank of replica 0 (ProfilesPasses), i.e. one
// per pipeline position, each from every tensor rank of its group (they profile together).
int ProfilesNeeded(const v1::JobSpec& spec) {
  const planner::Topology t = JobTopology(spec);
  return t.pipeline() * t.tensor();
}

// The job rank r a worker runs, or a stage's record of it: the rank and its coordinates.
template <typename RankRecord>  // v1::WorkerInfo or v1::StageStats
void SetRank(RankRecord& record, const planner::Topology& t, int r) {
  const planner::RankCoord c = t.CoordOf(r);
  record.set_rank(r);
  record.set_stage(c.stage);
  record.set_replica(c.replica);
}

}  // namespace

absl::StatusOr<v1::JobSpec> SpecFromRequest(const v1::SubmitJobRequest& request) {
  const bool has_text = !request.spec_text().empty();
  if (request.has_spec() == has_text) {
    return absl::InvalidArgumentError("spec, spec_text: give exactly one of them");
  }
  if (request.base_dir().size() > spec::kMaxPathBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("base_dir: must be at most ", spec::kMaxPathBytes, " bytes"));
  }
  v1::JobSpec spec;
  if (has_text) {
    auto parsed = spec::ParseJobSpec(request.spec_text(), request.base_dir());
    if (!parsed.ok()) return parsed.status();
    spec = std::move(*parsed);
  } else {
    spec = request.spec();
    spec::ApplyDefaults(&spec);
    if (auto st = spec::ValidateJobSpec(spec); !st.ok()) return st;
  }
  if (auto st = MakeAbsolute(spec.mutable_data()->mutable_path(), request.base_dir(), "data.path");
      !st.ok()) {
    return st;
  }
  for (const char* many : {"data.paths", "data.val_paths"}) {
    auto* list = std::string_view(many) == "data.paths" ? spec.mutable_data()->mutable_paths()
                                                        : spec.mutable_data()->mutable_val_paths();
    for (int i = 0; i < list->size(); ++i) {
      if (auto st =
              MakeAbsolute(list->Mutable(i), request.base_dir(), absl::StrCat(many, "[", i, "]"));
          !st.ok()) {
        return st;
      }
      if (list->Get(i).size() > spec::kMaxPathBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            many, "[", i, "]: must be at most ", spec::kMaxPathBytes, " bytes once resolved"));
      }
    }
  }
  if (spec.data().has_val_path()) {
    if (auto st = MakeAbsolute(spec.mutable_data()->mutable_val_path(), request.base_dir(),
                               "data.val_path");
        !st.ok()) {
      return st;
    }
  }
  if (auto st = MakeAbsolute(spec.mutable_checkpoint()->mutable_dir(), request.base_dir(),
                             "checkpoint.dir");
      !st.ok()) {
    return st;
  }
  if (auto st = MakeAbsolute(spec.mutable_model()->mutable_init_from(), request.base_dir(),
                             "model.init_from");
      !st.ok()) {
    return st;
  }
  // The resolved paths obey the same bound as the written ones.
  for (const auto& [field, path] :
       {std::pair<const char*, const std::string*>{"data.path", &spec.data().path()},
        {"data.val_path", &spec.data().val_path()},
        {"checkpoint.dir", &spec.checkpoint().dir()},
        {"model.init_from", &spec.model().init_from()}}) {
    if (path->size() > spec::kMaxPathBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": must be at most ", spec::kMaxPathBytes, " bytes once resolved"));
    }
  }
  return spec;
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Open(const CoordinatorOptions& options) {
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(
        "heartbeat_timeout: must exceed heartbeat_interval, which must be > 0");
  }
  auto store = JobStore::Open(options.db_path);
  if (!store.ok()) return store.status();
  auto loaded = (*store)->LoadAll();
  if (!loaded.ok()) return loaded.status();
  for (const std::string& id : (*store)->quarantined()) {
    std::cerr << "vocabpipe-coordinator: warning: job " << id
              << ": stored record does not parse; moved to the quarantine table" << std::endl;
  }
  std::unique_ptr<Coordinator> c(new Coordinator(options, std::move(*store)));
  {
    std::lock_guard<std::mutex> lock(c->mu_);
    // Finished jobs may have been deleted (retention): their numbers are not given again.
    auto next_job = c->store_->LoadCounter("next_job");
    if (!next_job.ok()) return next_job.status();
    c->next_job_ = std::max(c->store_->MaxOrdinal() + 1, *next_job);
    // Worker ids go on from the previous process's: a daemon still holding an old id must get
    // NOT_FOUND (and register again), never another worker's identity.
    auto next_worker = c->store_->LoadCounter("next_worker");
    if (!next_worker.ok()) return next_worker.status();
    c->next_worker_ = std::max<int64_t>(1, *next_worker);
    for (v1::Job& job : *loaded) {
      const std::string id = job.id();
      v1::Job& j = c->jobs_[id] = std::move(job);
      for (v1::StageStats& s : *j.mutable_stages()) s.clear_worker_id();  // old process's ids
      if (IsElastic(j) && j.state() == v1::JOB_STATE_PENDING && j.restarts() > 0) {
        // Restarted after a loss (or growing): it may shrink once the grace has passed, as if
        // the loss had just happened (which worker it was is not stored).
        c->elastic_[id].shrink_after = absl::Now() + options.adopt_grace;
      }
      if (j.state() == v1::JOB_STATE_RUNNING && !j.attempt().empty()) {
        // Its ranks may still be running: wait for their daemons to register again with them
        // (Adopt); whatever is not back within adopt_grace restarts from the checkpoint.
        const int p = JobTopology(j.spec()).world();  // every rank of every replica
        ActiveJob& a = c->active_[id];
        a.attempt = j.attempt();
        a.workers.assign(p, "");
        a.done.assign(p, false);
        a.failed.assign(p, false);
        a.model_flops_per_step = j.plan().model_flops_per_step();
        for (const v1::StageStats& s : j.stages()) {
          if (s.rank() < 0 || s.rank() >= p) continue;
          a.predicted_memory.resize(p, 0);
          a.predicted_memory[s.rank()] = s.predicted_memory_bytes();
        }
        // Only the worker each rank was assigned to, with the attempt's secret, gets it back.
        auto holders = c->store_->LoadRankHolders(id, a.attempt);
        if (!holders.ok()) return holders.status();
        for (JobStore::RankHolder& h : *holders) {
          if (h.rank >= 0 && h.rank < p) a.holders[h.rank] = std::move(h);
        }
        if (a.holders.empty()) {
          std::cerr << "vocabpipe-coordinator: warning: job " << id
                    << ": no rank holders stored for attempt " << a.attempt
                    << " (a database from before they were); its ranks are not re-adopted"
                    << std::endl;
        }
        a.adopting = true;
        a.adopt_deadline = absl::Now() + options.adopt_grace;
        const std::string reason = absl::StrCat(
            "coordinator restarted: waiting up to ", absl::FormatDuration(options.adopt_grace),
            " for the ", p, " ranks of attempt ", a.attempt, " to register again");
        if (auto st = c->SetState(j, v1::JOB_STATE_RUNNING, reason); !st.ok()) return st;
      } else if (!IsTerminal(j.state()) && j.state() != v1::JOB_STATE_PENDING) {
        // Profiling or planning: nothing of the job runs yet; it is scheduled again.
        j.clear_attempt();
        const std::string reason = absl::StrCat("coordinator restarted while the job was ",
                                                JobStateName(j.state()), "; scheduled again");
        if (auto st = c->SetState(j, v1::JOB_STATE_PENDING, reason); !st.ok()) return st;
      } else if (options.observer) {
        options.observer->OnJobState(j);  // the exporter starts empty: publish stored states
      }
    }
  }
  {
    // The rendezvous keys of the launches being re-adopted come back; the rest are stale.
    std::lock_guard<std::mutex> lock(c->mu_);
    auto keys = c->store_->LoadKeys();
    if (!keys.ok()) return keys.status();
    std::set<std::string> dropped;
    for (auto& [key, value] : *keys) {
      const std::string run = KvStore::RunOf(key);
      const std::string attempt = run.substr(std::string("vocabpipe/").size(),
                                             run.size() - std::string("vocabpipe/").size() - 1);
      const size_t dot = attempt.rfind('.');
      auto a = c->active_.find(dot == std::string::npos ? "" : attempt.substr(0, dot));
      if (a != c->active_.end() && a->second.adopting && a->second.attempt == attempt) {
        c->kv_.Restore(key, std::move(value));
      } else if (dropped.insert(run).second) {
        if (auto st = c->store_->DropKeys(run); !st.ok()) return st;
      }
    }
    c->kv_.SetPersist([p = c.get()](const std::string& key, const std::string& value) {
      std::lock_guard<std::mutex> lock(p->mu_);
      return p->store_->SaveKey(key, value);
    });
  }
  c->monitor_ = std::thread([p = c.get()] { p->MonitorLoop(); });
  return c;
}

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<JobStore> store)
    : options_(options), store_(std::move(store)) {}

Coordinator::~Coordinator() {
  std::map<int64_t, std::thread> planners;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  events_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    planners.swap(planners_);
  }
  // Each waits at most the planning deadline, then sees stopping_ and leaves.
  for (auto& [n, t] : planners) t.join();
}

absl::StatusOr<JobPlan> Coordinator::PlanWithDeadline(const v1::JobSpec& spec,
                                                      std::optional<v1::PassCosts> costs,
                                                      const std::string& user) {
  std::shared_ptr<PlanSlots> slots = plan_slots_;
  {
    std::lock_guard<std::mutex> lock(slots->mu);
    if (!user.empty() && slots->users.count(user)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "planner: user ", user,
          " already has a plan being computed; one plan per user at a time (a submit or a "
          "dry run); try again once it is done"));
    }
    if (slots->running >= options_.max_concurrent_plans) {
      return absl::ResourceExhaustedError(
          absl::StrCat("planner busy: ", options_.max_concurrent_plans,
                       " plans are being computed; try again shortly"));
    }
    ++slots->running;
    if (!user.empty()) slots->users.insert(user);
  }
  auto promise = std::make_shared<std::promise<absl::StatusOr<JobPlan>>>();
  std::future<absl::StatusOr<JobPlan>> result = promise->get_future();
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  // The thread owns copies of everything it reads: after a timed-out wait it is cancelled and
  // finishes alone, at the planner's next check. The user's slot and the global one are held
  // until it has really stopped, so a user cannot pile up plans past their deadline.
  std::thread([promise, slots, cancel, user, spec, costs, flops = options_.flops_per_second] {
    absl::StatusOr<JobPlan> plan = PlanForJob(spec, costs ? &*costs : nullptr, flops, cancel.get());
    {
      std::lock_guard<std::mutex> lock(slots->mu);
      --slots->running;
      if (!user.empty()) slots->users.erase(user);
    }
    promise->set_value(std::move(plan));
  }).detach();
  if (result.wait_for(absl::ToChronoMilliseconds(options_.planning_deadline)) !=
      std::future_status::ready) {
    cancel->store(true);
    return absl::DeadlineExceededError(
        absl::StrCat("planning took longer than its deadline of ",
                     absl::FormatDuration(options_.planning_deadline), " and was stopped"));
  }
  return result.get();
}

void Coordinator::JoinFinishedPlanners() {
  for (int64_t n : finished_planners_) {
    auto it = planners_.find(n);
    if (it == planners_.end()) continue;
    // The thread has released mu_ for good when it lists itself here; the join is quick.
    it->second.join();
    planners_.erase(it);
  }
  finished_planners_.clear();
}

void Coordinator::MonitorLoop() {
  const absl::Duration tick = std::min(absl::Milliseconds(100), options_.heartbeat_interval / 2);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    stop_cv_.wait_for(lock, absl::ToChronoMilliseconds(tick));
    if (stopping_) break;
    JoinFinishedPlanners();
    ExpireWorkers();
    SettleFailures();
    CheckDeadlines();
    Schedule();
    GrowElastic();  // after Schedule: queued jobs get free workers first
    NotifyWorkers();
    if (absl::Now() >= next_purge_) {
      PurgeFinished();
      next_purge_ = absl::Now() + absl::Seconds(1);
    }
  }
}

void Coordinator::PurgeFinished() {
  if (options_.finished_ttl <= absl::ZeroDuration() && options_.max_finished_per_user <= 0) return;
  const int64_t oldest_kept_ms = options_.finished_ttl > absl::ZeroDuration()
                                     ? absl::ToUnixMillis(absl::Now() - options_.finished_ttl)
                                     : std::numeric_limits<int64_t>::min();
  // Each user's finished jobs, newest first.
  std::map<std::string, std::vector<std::pair<int64_t, std::string>>> finished;
  for (const auto& [id, job] : jobs_) {
    if (IsTerminal(job.state())) finished[job.owner()].push_back({JobOrdinal(id), id});
  }
  std::vector<std::string> doomed;
  for (auto& [owner, list] : finished) {
    std::sort(list.begin(), list.end(), std::greater<>());
    for (size_t i = 0; i < list.size(); ++i) {
      const v1::Job& job = jobs_[list[i].second];
      const bool over_cap = options_.max_finished_per_user > 0 &&
                            i >= static_cast<size_t>(options_.max_finished_per_user);
      if (over_cap || job.updated_unix_ms() < oldest_kept_ms) doomed.push_back(list[i].second);
    }
  }
  if (doomed.empty()) return;
  // Job ids are never given twice: the next number is kept even when the newest job goes.
  if (auto st = store_->SaveCounter("next_job", next_job_); !st.ok()) return;
  if (auto st = store_->DeleteJobs(doomed); !st.ok()) {
    std::cerr << "vocabpipe-coordinator: retention: " << st.message() << std::endl;
    return;
  }
  for (const std::string& id : doomed) {
    jobs_.erase(id);
    restart_after_.erase(id);
    elastic_.erase(id);
  }
}

v1::Job* Coordinator::FindJob(const std::string& id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

absl::Status Coordinator::SaveWithEvent(v1::Job& job, v1::JobEvent event) {
  event.set_job_id(job.id());
  event.set_seq(job.last_event() + 1);
  event.set_unix_ms(NowMs());
  v1::Job updated = job;
  updated.set_last_event(event.seq());
  updated.set_updated_unix_ms(event.unix_ms());
  if (auto st = store_->Save(updated, {event}); !st.ok()) {
    std::cerr << "vocabpipe-coordinator: job " << job.id() << ": " << st.message() << std::endl;
    return st;
  }
  job = std::move(updated);
  events_cv_.notify_all();
  return absl::OkStatus();
}

absl::Status Coordinator::SetState(v1::Job& job, v1::JobState state, const std::string& reason) {
  v1::Job before = job;
  job.set_state(state);
  job.set_reason(reason);
  v1::JobEvent e;
  e.set_state(state);
  e.set_message(reason);
  absl::Status st = SaveWithEvent(job, std::move(e));
  if (!st.ok()) {
    job = std::move(before);
  } else if (options_.observer) {
    // After any step still being told (ReportMetrics): a finished job's series, once removed,
    // are not created again by a late step.
    std::lock_guard<std::mutex> in_order(observe_mu_);
    options_.observer->OnJobState(job);
  }
  return st;
}

void Coordinator::Finish(v1::Job& job, v1::JobState state, const std::string& reason,
                         const std::string& except_worker) {
  SetState(job, state, reason).IgnoreError();  // logged; the in-memory state still moves on
  if (!IsTerminal(job.state())) {  // the store refused the write: still end the job here
    job.set_state(state);
    job.set_reason(reason);
  }
  Release(job, except_worker);
}

void Coordinator::Release(v1::Job& job, const std::string& except_worker) {
  auto it = active_.find(job.id());
  if (it == active_.end()) return;
  ActiveJob& a = it->second;
  for (size_t r = 0; r < a.workers.size(); ++r) {
    auto w = workers_.find(a.workers[r]);
    if (w == workers_.end() || w->second.info.job_id() != job.id()) continue;
    if (a.workers[r] != except_worker && !a.done[r] && !a.failed[r]) {
      v1::WorkerCommand cmd;
      cmd.mutable_cancel()->set_job_id(job.id());
      w->second.commands.push_back(std::move(cmd));
    }
    w->second.info.clear_job_id();
    w->second.info.set_rank(-1);
  }
  kv_.DropPrefix(absl::StrCat("vocabpipe/", a.attempt, "/"));
  store_->DropKeys(absl::StrCat("vocabpipe/", a.attempt, "/")).IgnoreError();  // stale at worst
  store_->DropRankHolders(job.id()).IgnoreError();  // a later attempt replaces them anyway
  active_.erase(it);
}

void Coordinator::FailOrRestart(v1::Job& job, std::string reason, const std::string& except_worker,
                                bool forced) {
  const int max = job.spec().train().max_restarts();
  // Restarts that changed the replicas are not the job's failures (Job.resizes).
  const int counted = job.restarts() - job.resizes();
  // An elastic job that lost a worker restarts even with no restarts left: it may go on at
  // fewer replicas (then the restart is refunded); at the same shape it is counted after all.
  const bool may_resize = IsElastic(job) && !except_worker.empty();
  if (job.state() != v1::JOB_STATE_RUNNING || (counted >= max && !forced && !may_resize)) {
    Finish(job, v1::JOB_STATE_FAILED,
           max > 0 && job.state() == v1::JOB_STATE_RUNNING
               ? absl::StrCat(reason, " (attempt ", counted + 1, ": no restarts left of ", max, ")")
               : reason,
           except_worker);
    return;
  }
  // Stop the other ranks and free every worker; the job waits in PENDING for p free workers
  // (the survivors and any new one) and the backoff, then runs again from the latest step
  // whose shards verify (RunTask.resume), as the next attempt of the same job.
  Release(job, except_worker);
  const int n = job.restarts() + 1;
  const absl::Duration backoff =
      std::min(options_.restart_backoff * (int64_t{1} << std::min(n - 1, 16)), absl::Seconds(60));
  restart_after_[job.id()] = absl::Now() + backoff;
  if (IsElastic(job)) {
    // It waits adopt_grace for a replacement, then may shrink (ReshapeElastic).
    ElasticState& e = elastic_[job.id()];
    e = ElasticState{.shrink_after = absl::Now() + std::max(backoff, options_.adopt_grace),
                     .lost_worker = except_worker,
                     .refund = true};
  }
  job.set_restarts(n);
  Requeue(job, absl::StrCat("restart ", counted + 1, forced ? "" : absl::StrCat(" of ", max),
                            ": attempt ", n + 1, " in ", absl::FormatDuration(backoff),
                            " from the latest verified checkpoint, after ", reason));
}

bool Coordinator::IsFreeFor(const Worker& worker, const std::string& device) {
  return worker.info.job_id().empty() && !worker.leaving &&
         DeviceMatches(device, worker.info.device());
}

void Coordinator::Requeue(v1::Job& job, const std::string& reason) {
  job.set_resume(true);
  job.clear_stages();
  job.clear_attempt();
  SetState(job, v1::JOB_STATE_PENDING, reason).IgnoreError();  // logged
  job.set_state(v1::JOB_STATE_PENDING);  // the in-memory state moves on whatever the store did
}

absl::Status Coordinator::CheckQueue(const std::string& owner) {
  if (options_.max_queued_per_user <= 0) return absl::OkStatus();
  int queued = 0;
  for (const auto& [id, j] : jobs_) {
    queued += j.owner() == owner && j.state() == v1::JOB_STATE_PENDING;
  }
  if (queued < options_.max_queued_per_user) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("queue: user ", owner, " has ", queued, " queued (PENDING) jobs, the limit of ",
                   options_.max_queued_per_user,
                   " per user (--max-queued-per-user); cancel one or wait until one starts"));
}

absl::StatusOr<std::string> Coordinator::Submit(const v1::JobSpec& spec, bool resume,
                                                const std::string& owner,
                                                const safefs::RunUser& run_user) {
  // Confined storage: checked before anything is stored (the workers check again).
  if (auto st = spec::CheckSpecPaths(spec, options_.storage_root); !st.ok()) return st;
  // Run folders belong to their user: another user's checkpoint.dir, resume or init_from is
  // refused here where the coordinator sees the folder (and again when the run claims it).
  const safefs::RunUser folder_user{run_user.name.empty() ? owner : run_user.name, run_user.admin};
  if (auto st = spec::CheckSpecOwners(spec, resume, folder_user, options_.storage_root); !st.ok()) {
    return st;
  }
  if (auto st = CheckInputFiles(spec, options_.storage_root); !st.ok()) return st;
  // The user's limits come before the planner: a user at their limit costs no planning.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto st = CheckQueue(owner); !st.ok()) return st;
  }
  // parallel.world without a budget: the layout must fit the largest worker of the kind.
  v1::JobSpec requested = spec;
  if (planner::NeedsLayoutChoice(requested) && requested.parallel().memory_budget_bytes() == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    requested.mutable_parallel()->set_memory_budget_bytes(LargestWorkerMemory(spec.device()));
  }
  // Memory admission: the planner's memory model, off the lock and under a deadline (and the
  // layout choice first, under parallel.world).
  absl::StatusOr<JobPlan> plan = PlanWithDeadline(requested, std::nullopt, owner);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(), absl::StrCat("planning: ", plan.status().message()));
  }
  // The layout chosen, with the user's budget (a worker-memory one was only for the choice).
  v1::JobSpec chosen = plan->spec;
  chosen.mutable_parallel()->set_memory_budget_bytes(spec.parallel().memory_budget_bytes());
  const std::vector<int64_t> need = PredictedRankBytes(*plan);
  std::lock_guard<std::mutex> lock(mu_);
  // Again: a job of the user may have been queued while this one was planned.
  if (auto st = CheckQueue(owner); !st.ok()) return st;
  const int64_t largest = LargestWorkerMemory(spec.device());
  // With no worker of the kind registered (or none that reports its memory) there is nothing
  // to compare with: the job waits, and is checked against its own workers before it runs.
  if (largest > 0 && !need.empty()) {
    const auto worst = std::max_element(need.begin(), need.end());
    if (*worst > largest) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "memory: needs ", GiB(*worst), " on rank ", worst - need.begin(),
          ", the largest worker has ", GiB(largest),
          " (the planner's prediction of weights, gradients, optimizer state and activations; "
          "a longer pipeline or a smaller model needs less per rank)"));
    }
  }
  v1::Job job;
  job.set_id(absl::StrCat("job-", next_job_));
  *job.mutable_spec() = chosen;
  job.set_layout(plan->layout);
  job.set_layout_table(plan->layout_table);
  if (chosen.train().elastic() && chosen.parallel().data() > 1) {
    job.set_requested_data(chosen.parallel().data());
    job.set_requested_microbatches(chosen.parallel().microbatches());
  }
  job.set_resume(resume);
  job.set_owner(owner);
  job.set_run_owner(folder_user.name);
  job.set_owner_admin(folder_user.admin);
  job.set_total_steps(spec.train().steps());
  job.set_created_unix_ms(NowMs());
  for (int64_t bytes : need) job.add_predicted_rank_bytes(bytes);
  if (auto st = SetState(job, v1::JOB_STATE_PENDING,
                         absl::StrCat(plan->layout.empty() ? "" : plan->layout + "; ",
                                      "waiting for ", JobTopology(chosen).world(), " free ",
                                      spec.device().empty() ? "cpu" : spec.device(), " workers"));
      !st.ok()) {
    return st;
  }
  ++next_job_;
  const std::string id = job.id();
  jobs_[id] = std::move(job);
  Schedule();
  return id;
}

int64_t Coordinator::LargestWorkerMemory(const std::string& device) const {
  int64_t largest = 0;
  for (const auto& [wid, w] : workers_) {
    if (DeviceMatches(device, w.info.device())) largest = std::max(largest, w.info.memory_bytes());
  }
  return largest;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  const v1::Job* job = FindJob(id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job \"", id, "\""));
  return *job;
}

absl::StatusOr<std::vector<v1::Job>> Coordinator::ListJobs(const std::string& owner,
                                                           const std::string& page_token,
                                                           int page_size, size_t max_bytes,
                                                           std::string* next_page_token) {
  int64_t before = std::numeric_limits<int64_t>::max();
  if (!page_token.empty() && (!absl::SimpleAtoi(page_token, &before) || before <= 0)) {
    return absl::InvalidArgumentError(
        "page_token: not a token of ListJobs (give an answer's next_page_token, or none)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Only the page is copied: the records (with their plan text) stay where they are.
  std::vector<std::pair<int64_t, const v1::Job*>> visible;
  for (const auto& [id, job] : jobs_) {
    if (!owner.empty() && job.owner() != owner) continue;
    const int64_t n = JobOrdinal(id);
    if (n < before) visible.push_back({n, &job});
  }
  std::sort(visible.begin(), visible.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<v1::Job> out;
  size_t bytes = 0;
  next_page_token->clear();
  for (const auto& [n, job] : visible) {
    if (static_cast<int>(out.size()) >= page_size ||
        (!out.empty() && bytes + job->ByteSizeLong() > max_bytes)) {
      *next_page_token = absl::StrCat(out.empty() ? n + 1 : JobOrdinal(out.back().id()));
      break;
    }
    bytes += job->ByteSizeLong();
    out.push_back(*job);
  }
  return out;
}

absl::StatusOr<v1::Job> Coordinator::Cancel(const std::string& id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::Job* job = FindJob(id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job \"", id, "\""));
  if (IsTerminal(job->state())) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is already ", JobStateName(job->state())));
  }
  Finish(*job, v1::JOB_STATE_CANCELLED,
         reason.empty() ? "cancelled by request" : absl::StrCat("cancelled: ", reason));
  Schedule();
  return *job;
}

absl::StatusOr<std::vector<v1::JobEvent>> Coordinator::WaitEvents(const std::string& id,
                                                                  int64_t after_seq,
                                                                  absl::Duration max_wait,
                                                                  bool* terminal) {
  if (after_seq < 0) return absl::InvalidArgumentError("after_event: must be >= 0");
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = absl::ToChronoTime(absl::Now() + max_wait);
  for (;;) {
    const v1::Job* job = FindJob(id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("job_id: no job \"", id, "\""));
    *terminal = IsTerminal(job->state());
    if (job->last_event() > after_seq || *terminal || stopping_) {
      return store_->Events(id, after_seq);
    }
    if (events_cv_.wait_until(lock, until) == std::cv_status::timeout) {
      return std::vector<v1::JobEvent>{};
    }
  }
}

absl::StatusOr<v1::PlanJobResponse> Coordinator::PlanDryRun(const v1::JobSpec& spec,
                                                            const std::string& user) {
  auto plan = PlanWithDeadline(spec, std::nullopt, user);
  if (!plan.ok()) return plan.status();
  v1::PlanJobResponse out;
  *out.mutable_plan() = plan->summary;
  for (auto& c : plan->candidates) *out.add_candidates() = c;
  out.set_plan_text(planner::PlanToText(plan->plan));
  out.set_table(plan->table);
  out.set_layout(plan->layout);
  out.set_layout_table(plan->layout_table);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Scheduling.

void Coordinator::Schedule() {
  // Pending jobs in submission order (ids are "job-<ordinal>"; the map orders them as text).
  std::vector<std::pair<int64_t, std::string>> pending;
  const absl::Time now = absl::Now();
  for (const auto& [id, job] : jobs_) {
    if (job.state() != v1::JOB_STATE_PENDING) continue;
    if (auto r = restart_after_.find(id); r != restart_after_.end()) {
      if (now < r->second) continue;  // a restarted job's backoff
      restart_after_.erase(r);
    }
    int64_t n = 0;
    (void)absl::SimpleAtoi(id.substr(id.find('-') + 1), &n);
    pending.push_back({n, id});
  }
  std::sort(pending.begin(), pending.end());
  for (const auto& [ordinal, id] : pending) {
    v1::Job& job = jobs_[id];
    std::vector<Worker*> free;
    std::vector<PlacementCandidate> candidates;
    for (auto& [wid, w] : workers_) {
      if (IsFreeFor(w, job.spec().device())) {
        int64_t n = 0;
        (void)absl::SimpleAtoi(wid.substr(wid.find('-') + 1), &n);
        free.push_back(&w);
        candidates.push_back({.hostname = w.info.hostname(),
                              .device = DeviceIndex(w.info.device()),
                              .rank_hint = w.info.rank_hint(),
                              .registered = n});
      }
    }
    if (IsElastic(job) && !ReshapeElastic(job, static_cast<int>(free.size()), now)) continue;
    const planner::Topology topology = JobTopology(job.spec());
    const int p = topology.world();  // ranks: d replicas of the pipeline
    if (static_cast<int>(free.size()) < p) continue;
    // Rank r runs on placed[r]: a pipeline on one host where it fits (placement.h). A job whose
    // tensor groups do not fit the hosts' free workers waits, and says why.
    std::string unmet;
    const std::vector<int> where = PlaceRanks(candidates, topology, &unmet);
    if (where.empty()) {
      if (job.reason() != unmet) (void)SetState(job, v1::JOB_STATE_PENDING, unmet);
      continue;
    }
    std::vector<Worker*> placed;
    for (int i : where) placed.push_back(free[i]);
    // Ranks on different hosts connect to each other's advertised address: loopback there
    // would reach the rank's own host, and the job would only time out.
    std::set<std::string> hosts;
    for (int r = 0; r < p; ++r) hosts.insert(placed[r]->info.hostname());
    if (hosts.size() > 1) {
      std::string loopback;
      for (int r = 0; r < p && loopback.empty(); ++r) {
        const v1::WorkerInfo& w = placed[r]->info;
        if (auth::IsLoopbackHost(w.address())) {
          loopback = absl::StrCat("rank ", r, " (", w.worker_id(), " on ", w.hostname(),
                                  ") advertises loopback address ", w.address());
        }
      }
      if (!loopback.empty()) {
        Finish(job, v1::JOB_STATE_FAILED,
               absl::StrCat("address: ", loopback, " but the job spans ", hosts.size(), " hosts (",
                            absl::StrJoin(hosts, ", "),
                            "); start its workers with --address auto or a routable IP"));
        continue;
      }
    }
    // Memory admission against the workers the job is about to get, before it profiles at
    // its full shape there (submit only compared with the largest worker registered then).
    std::string short_of;
    for (int r = 0; r < p && short_of.empty(); ++r) {
      const int stage = topology.CoordOf(r).stage;  // the prediction is per stage
      if (stage >= job.predicted_rank_bytes_size()) continue;
      const v1::WorkerInfo& w = placed[r]->info;
      if (w.memory_bytes() > 0 && job.predicted_rank_bytes(stage) > w.memory_bytes()) {
        short_of = absl::StrCat("memory: needs ", GiB(job.predicted_rank_bytes(stage)), " on rank ",
                                r, ", its worker ", w.worker_id(), " (", w.hostname(), ") has ",
                                GiB(w.memory_bytes()));
      }
    }
    if (!short_of.empty()) {
      Finish(job, v1::JOB_STATE_FAILED, short_of);
      continue;
    }
    ActiveJob& a = active_[id];
    a = ActiveJob{};
    if (auto e = elastic_.find(id); e != elastic_.end()) e->second.refund = false;
    a.attempt = absl::StrCat(id, ".", NowMs());
    a.done.assign(p, false);
    a.failed.assign(p, false);
    job.clear_stages();
    for (int r = 0; r < p; ++r) {
      Worker& w = *placed[r];
      w.info.set_job_id(id);
      SetRank(w.info, topology, r);
      a.workers.push_back(w.info.worker_id());
      a.peak_flops += w.info.peak_flops();
      v1::StageStats* s = job.add_stages();
      SetRank(*s, topology, r);
      s->set_worker_id(w.info.worker_id());
    }
    if (options_.profile) {
      if (!SetState(job, v1::JOB_STATE_PROFILING,
                    absl::StrCat("timing the passes on ", absl::StrJoin(a.workers, ", ")))
               .ok()) {
        Finish(job, v1::JOB_STATE_FAILED, "job store write failed");
        continue;
      }
      // A 1-rank plan of 2 microbatches: small and quick to build whatever the job's size.
      absl::StatusOr<v1::ProfileTask> task = MakeProfileTask(id, job.spec());
      if (!task.ok()) {
        Finish(job, v1::JOB_STATE_FAILED, std::string(task.status().message()));
        continue;
      }
      if (topology.tensor() > 1) {
        // Each stage's tensor group profiles together, meeting in the store under the attempt's
        // run: its secret is set now (the launch sets a fresh one; Release drops the keys).
        absl::StatusOr<std::string> secret = auth::RandomHex(32);
        if (!secret.ok()) {
          Finish(job, v1::JOB_STATE_FAILED,
                 absl::StrCat("rendezvous secret: ", secret.status().message()));
          continue;
        }
        kv_.SetRunSecret(absl::StrCat("vocabpipe/", a.attempt, "/"), *secret);
        task->set_tensor_size(topology.tensor());
        task->set_store_secret(*secret);
      }
      for (int r = 0; r < p; ++r) {
        if (!ProfilesPasses(topology, r)) continue;
        v1::WorkerCommand cmd;
        *cmd.mutable_profile() = *task;
        if (topology.tensor() > 1) {
          const planner::RankCoord c = topology.CoordOf(r);
          cmd.mutable_profile()->set_tensor_rank(c.tensor);
          cmd.mutable_profile()->set_store_prefix(
              absl::StrCat("vocabpipe/", a.attempt, "/profile/stage", c.stage));
        }
        workers_[a.workers[r]].commands.push_back(std::move(cmd));
      }
    } else {
      StartPlanning(job, a);
    }
  }
}

bool Coordinator::ReshapeElastic(v1::Job& job, int free, absl::Time now) {
  const int requested = job.requested_data();
  const int data = std::max(1, job.spec().parallel().data());
  const planner::Topology topology = JobTopology(job.spec());
  const int per = topology.pipeline() * topology.tensor();  // ranks a replica
  auto e = elastic_.find(job.id());
  const bool may_shrink =
      e != elastic_.end() && !e->second.hold_full && now >= e->second.shrink_after;
  const ReplicaChoice choice = ChooseReplicas(requested, job.requested_microbatches(), per, free,
                                              may_shrink, job.spec().device());
  std::string wait = choice.wait;
  if (choice.data == 0 && wait.empty() && e != elastic_.end() && !e->second.hold_full) {
    wait = absl::StrCat(
        "elastic: waiting up to ",
        absl::FormatDuration(absl::Ceil(e->second.shrink_after - now, absl::Milliseconds(100))),
        " for ", requested * per, " free ", job.spec().device(), " workers (", free,
        " free) before running at fewer replicas");
    // Only the first tick's text: a countdown would be an event a tick.
    if (absl::StartsWith(job.reason(), "elastic: waiting up to")) return false;
  }
  if (choice.data > 0 && choice.data != data) {
    const v1::JobSpec shaped = ElasticSpec(job, choice.data);
    if (absl::Status st = spec::ValidateJobSpec(shaped); !st.ok()) {
      wait = absl::StrCat("elastic: cannot run at ",
                          ReplicaShape(choice.data, shaped.parallel().microbatches()), ": ",
                          st.message(), "; waiting for ", requested * per, " free workers");
    } else {
      const bool shrink = choice.data < data;
      std::string what = absl::StrCat(
          shrink ? "shrunk to " : (choice.data == requested ? "grew back to " : "grew to "),
          ReplicaShape(choice.data, shaped.parallel().microbatches()));
      if (shrink && e != elastic_.end() && !e->second.lost_worker.empty()) {
        absl::StrAppend(&what, " after ", e->second.lost_worker, " lost");
      }
      absl::StrAppend(&what, "; global batch unchanged (", requested, " × ",
                      job.requested_microbatches(), " microbatches)");
      if (e != elastic_.end() && e->second.refund) {
        // The restart that brought it here is not counted against train.max_restarts.
        job.set_resizes(job.resizes() + 1);
        e->second.refund = false;
      }
      *job.mutable_spec() = shaped;
      (void)SetState(job, v1::JOB_STATE_PENDING, what);
      return true;
    }
  }
  if (choice.data > 0) return true;
  if (!wait.empty() && job.reason() != wait) (void)SetState(job, v1::JOB_STATE_PENDING, wait);
  return false;
}

void Coordinator::GrowElastic() {
  for (auto& [id, a] : active_) {
    v1::Job* job = FindJob(id);
    if (job == nullptr || !IsElastic(*job) || job->state() != v1::JOB_STATE_RUNNING || a.adopting ||
        a.growing || !a.failure.empty()) {
      continue;
    }
    const int data = std::max(1, job->spec().parallel().data());
    if (data >= job->requested_data()) continue;
    const planner::Topology topology = JobTopology(job->spec());
    const int per = topology.pipeline() * topology.tensor();  // ranks a replica
    int free = 0;
    for (const auto& [wid, w] : workers_) {
      free += IsFreeFor(w, job->spec().device());
    }
    // Its own workers come free when it stops: the shape it would restart at.
    const ReplicaChoice choice =
        ChooseReplicas(job->requested_data(), job->requested_microbatches(), per, free + data * per,
                       /*may_shrink=*/true, job->spec().device());
    if (choice.data <= data) continue;
    // The ranks' own stop protocol (worker/launch/preemption.h): every rank acknowledges, they
    // agree on the step after the next, save it and exit 75. Written to the store directly:
    // the key-value store's persist callback would take mu_, which is held here.
    const std::string key = absl::StrCat("vocabpipe/", a.attempt, "/preempt/request");
    if (!store_->SaveKey(key, "1").ok()) continue;  // logged by the store; tried next tick
    kv_.Restore(key, "1");
    a.growing = true;
    (void)SetState(
        *job, v1::JOB_STATE_RUNNING,
        absl::StrCat("growing to ",
                     ReplicaShape(choice.data, job->requested_data() *
                                                   job->requested_microbatches() / choice.data),
                     ": ", free, " free workers; stopping at the next step with a checkpoint"));
  }
}

void Coordinator::RestartToGrow(v1::Job& job) {
  Release(job, "");
  // Not the job's failure: counted as a restart and as a resize at once (never refunded again).
  job.set_restarts(job.restarts() + 1);
  job.set_resizes(job.resizes() + 1);
  elastic_[job.id()] = ElasticState{};  // may take whatever fits at once: its workers are free
  Requeue(job, absl::StrCat("stopped at step ", job.step(), " with a checkpoint to grow; attempt ",
                            job.restarts() + 1, " resumes from it"));
}

void Coordinator::StartPlanning(v1::Job& job, ActiveJob& a) {
  v1::PassCosts costs;
  // One profile per rank of replica 0 (ProfilesPasses).
  const bool profiled = static_cast<int>(a.profiles.size()) == ProfilesNeeded(job.spec());
  if (profiled) {
    // The group every profile was timed on: all the stage's tensor ranks together (t), unless
    // one worker timed its whole stage alone (1), which the planner must divide by t.
    int tensor_measured = std::numeric_limits<int>::max();
    // The slowest worker bounds every pass of a pipeline: plan with the per-pass maximum.
    for (const auto& [rank, c] : a.profiles) {
      tensor_measured = std::min(tensor_measured, std::max(1, c.tensor_measured()));
      costs.set_f(std::max(costs.f(), c.f()));
      costs.set_b(std::max(costs.b(), c.b()));
      costs.set_w(std::max(costs.w(), c.w()));
      costs.set_s(std::max(costs.s(), c.s()));
      costs.set_t(std::max(costs.t(), c.t()));
      costs.set_input_f(std::max(costs.input_f(), c.input_f()));
      costs.set_input_b(std::max(costs.input_b(), c.input_b()));
      costs.set_opt(std::max(costs.opt(), c.opt()));
      costs.set_comm(std::max(costs.comm(), c.comm()));
      costs.set_collective(std::max(costs.collective(), c.collective()));
      MergeSlowestLink(c, &costs);
      costs.set_layer_activation_kept_bytes(
          std::max(costs.layer_activation_kept_bytes(), c.layer_activation_kept_bytes()));
      costs.set_layer_activation_transient_bytes(
          std::max(costs.layer_activation_transient_bytes(), c.layer_activation_transient_bytes()));
      costs.set_layer_activation_held_for_w_bytes(std::max(
          costs.layer_activation_held_for_w_bytes(), c.layer_activation_held_for_w_bytes()));
      costs.set_recompute_selective(std::max(costs.recompute_selective(), c.recompute_selective()));
    }
    costs.set_tensor_measured(tensor_measured);
    *job.mutable_profiled_costs() = costs;
  }
  if (!SetState(job, v1::JOB_STATE_PLANNING,
                profiled ? "planning with profiled costs" : "planning with FLOP-proportional costs")
           .ok()) {
    Finish(job, v1::JOB_STATE_FAILED, "job store write failed");
    return;
  }
  const std::string id = job.id(), attempt = a.attempt;
  const int64_t n = next_planner_++;
  planners_.emplace(
      n, std::thread([this, n, id, attempt, spec = job.spec(),
                      costs = profiled ? std::optional<v1::PassCosts>(costs) : std::nullopt] {
        absl::StatusOr<JobPlan> plan = PlanWithDeadline(spec, costs, "");
        std::lock_guard<std::mutex> lock(mu_);
        finished_planners_.push_back(n);
        if (!stopping_) FinishPlanning(id, attempt, std::move(plan));
      }));
}

void Coordinator::FinishPlanning(const std::string& id, const std::string& attempt,
                                 absl::StatusOr<JobPlan> plan) {
  v1::Job* found = FindJob(id);
  auto it = active_.find(id);
  // Cancelled, failed or rescheduled while the plan was computed: nothing to do.
  if (found == nullptr || it == active_.end() || it->second.attempt != attempt ||
      found->state() != v1::JOB_STATE_PLANNING) {
    return;
  }
  v1::Job& job = *found;
  ActiveJob& a = it->second;
  const int p = static_cast<int>(a.workers.size());
  const planner::Topology topology = JobTopology(job.spec());
  if (!plan.ok()) {
    Finish(job, v1::JOB_STATE_FAILED, absl::StrCat("planning: ", plan.status().message()));
    Schedule();
    return;
  }
  // Memory admission against the workers the job got (submit compared with the largest).
  // The planner predicts per stage; every replica of a stage holds the same.
  const std::vector<int64_t> stage_need = PredictedRankBytes(*plan);
  std::vector<int64_t> need(p, 0);
  for (int r = 0; r < p; ++r) {
    const int stage = topology.CoordOf(r).stage;
    if (stage < static_cast<int>(stage_need.size())) need[r] = stage_need[stage];
  }
  for (int r = 0; r < p; ++r) {
    auto w = workers_.find(a.workers[r]);
    const int64_t has = w == workers_.end() ? 0 : w->second.info.memory_bytes();
    if (has > 0 && need[r] > has) {
      const std::string why = absl::StrCat("memory: needs ", GiB(need[r]), " on rank ", r,
                                           ", its worker ", a.workers[r], " has ", GiB(has));
      if (IsElastic(job) && topology.data() < job.requested_data()) {
        // A shrunk replica holds more (ZeRO-1's optimizer state is split over fewer ranks):
        // not the job's failure; it waits for its full shape instead.
        const std::string shrunk =
            ReplicaShape(topology.data(), job.spec().parallel().microbatches());
        Release(job, "");
        *job.mutable_spec() = ElasticSpec(job, job.requested_data());
        elastic_[job.id()].hold_full = true;
        job.clear_stages();
        (void)SetState(
            job, v1::JOB_STATE_PENDING,
            absl::StrCat("elastic: ", shrunk, " does not fit (", why,
                         "); waiting for the workers of ", job.requested_data(), " replicas"));
      } else {
        Finish(job, v1::JOB_STATE_FAILED, why);
      }
      Schedule();
      return;
    }
  }
  *job.mutable_plan() = plan->summary;
  job.clear_candidates();
  for (const auto& c : plan->candidates) *job.add_candidates() = c;
  job.set_plan_text(planner::PlanToText(plan->plan));
  // The summary counts one pipeline's m microbatches; a step is d·m.
  a.model_flops_per_step = plan->summary.model_flops_per_step() * topology.data();
  a.predicted_memory = need;
  a.since = absl::Now();
  // The attempt's rendezvous secret: only its ranks (given it with the task) use its keys.
  absl::StatusOr<std::string> secret = auth::RandomHex(32);
  if (!secret.ok()) {
    Finish(job, v1::JOB_STATE_FAILED,
           absl::StrCat("rendezvous secret: ", secret.status().message()));
    Schedule();
    return;
  }
  // Who holds each rank, stored before any rank starts: after a restart only that worker (its
  // certificate name) with this secret (its hash) is re-adopted (CheckHolder).
  std::vector<JobStore::RankHolder> holders;
  a.holders.clear();
  for (int r = 0; r < p; ++r) {
    auto w = workers_.find(a.workers[r]);
    JobStore::RankHolder h{.rank = r,
                           .identity = w == workers_.end() ? "" : w->second.identity,
                           .secret_sha256 = auth::Sha256Hex(*secret)};
    holders.push_back(h);
    a.holders[r] = std::move(h);
  }
  if (auto st = store_->SaveRankHolders(job.id(), a.attempt, holders); !st.ok()) {
    Finish(job, v1::JOB_STATE_FAILED, absl::StrCat("job store write failed: ", st.message()));
    Schedule();
    return;
  }
  job.set_attempt(a.attempt);  // stored with the state: a restarted coordinator re-adopts it
  if (!SetState(job, v1::JOB_STATE_RUNNING,
                absl::StrCat(plan->summary.schedule(), " + ", plan->summary.vocab(), " on ",
                             absl::StrJoin(a.workers, ", ")))
           .ok()) {
    Finish(job, v1::JOB_STATE_FAILED, "job store write failed");
    return;
  }
  kv_.SetRunSecret(absl::StrCat("vocabpipe/", a.attempt, "/"), *secret);
  for (int r = 0; r < p; ++r) {
    v1::WorkerCommand cmd;
    v1::RunTask* run = cmd.mutable_run();
    run->set_store_secret(*secret);
    run->set_job_id(job.id());
    // Job ids restart at job-1 with a new store: the creation time makes the run's identity
    // (checkpoint manifests, the run directory's lock) unique, and the same for every attempt.
    run->set_run_id(absl::StrCat(job.id(), "@", job.created_unix_ms()));
    run->set_rank(r);
    run->set_attempt(a.attempt);
    *run->mutable_spec() = job.spec();
    // Only this rank's slice: the layout and its stage's actions (docs/operations.md,
    // "Security"); with data parallelism every replica of a stage gets the same slice.
    run->set_plan_text(
        planner::PlanToText(planner::RankSlice(plan->plan, topology.CoordOf(r).stage)));
    run->set_timeout_ms(absl::ToInt64Milliseconds(options_.rank_timeout));
    run->set_resume(job.resume());
    run->set_run_owner(job.run_owner().empty() ? job.owner() : job.run_owner());
    run->set_run_owner_admin(job.owner_admin());
    if (job.restarts() > 0) {
      run->set_resume_limited(true);
      run->set_resume_max_step(job.step());
    }
    workers_[a.workers[r]].commands.push_back(std::move(cmd));
  }
}

void Coordinator::ExpireWorkers() {
  const absl::Time now = absl::Now();
  for (auto it = workers_.begin(); it != workers_.end();) {
    Worker& w = it->second;
    if (now - w.last_heartbeat <= options_.heartbeat_timeout) {
      ++it;
      continue;
    }
    const std::string wid = it->first;
    if (!w.info.job_id().empty()) {
      if (v1::Job* job = FindJob(w.info.job_id()); job != nullptr && !IsTerminal(job->state())) {
        std::string reason =
            absl::StrCat("rank ", w.info.rank(), ": worker ", wid, " (", w.info.hostname(), " pid ",
                         w.info.pid(), ") lost: no heartbeat for ",
                         absl::FormatDuration(now - w.last_heartbeat));
        if (auto a = active_.find(job->id()); a != active_.end() && !a->second.failure.empty()) {
          absl::StrAppend(&reason, "; then ", a->second.failure);
        }
        FailOrRestart(*job, reason, wid);
      }
    }
    it = workers_.erase(it);
  }
}

void Coordinator::NotifyWorkers() {
  if (!options_.observer) return;
  int idle = 0, busy = 0;
  for (const auto& [id, w] : workers_) (w.info.job_id().empty() ? idle : busy) += 1;
  options_.observer->OnWorkers(idle, busy);
}

void Coordinator::SettleFailures() {
  const absl::Time now = absl::Now();
  std::vector<std::string> due;
  for (const auto& [id, a] : active_) {
    if (!a.failure.empty() && now >= a.failure_deadline) due.push_back(id);
  }
  for (const std::string& id : due) {
    if (active_[id].failure_refused) {
      Finish(jobs_[id], v1::JOB_STATE_FAILED, active_[id].failure);
    } else {
      // A rank that failed while the coordinator was away (reported on re-adoption) restarts
      // the job whatever train.max_restarts says: the restart cannot tell a rank's own failure
      // from one its coordinator's absence caused.
      FailOrRestart(jobs_[id], active_[id].failure, "", /*forced=*/active_[id].failed_while_away);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Workers.

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(
    const v1::RegisterWorkerRequest& req, const std::string& identity) {
  const std::string& d = req.device();
  int n = 0;
  if (!(d == "cpu" || d == "cuda" ||
        (d.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(d.substr(5), &n) && n >= 0))) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: \"", d, "\" is not cpu, cuda or cuda:N"));
  }
  if (req.memory_bytes() < 0) return absl::InvalidArgumentError("memory_bytes: must be >= 0");
  if (req.threads() < 0) return absl::InvalidArgumentError("threads: must be >= 0");
  if (!(req.peak_flops() >= 0)) return absl::InvalidArgumentError("peak_flops: must be >= 0");
  if (req.address().empty() || req.address().size() > 255 ||
      req.address().find_first_of(" \t\n/") != std::string::npos) {
    return absl::InvalidArgumentError("address: must be a host name or IP address");
  }
  if (req.has_rank_hint() && req.rank_hint() < 0) {
    return absl::InvalidArgumentError("rank_hint: must be >= 0");
  }
  if (req.has_held()) {
    const v1::HeldTask& h = req.held();
    for (const auto& [field, value] :
         {std::pair<const char*, const std::string*>{"held.job_id", &h.job_id()},
          {"held.attempt", &h.attempt()},
          {"held.store_secret", &h.store_secret()}}) {
      if (value->size() > 256) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": at most 256 bytes"));
      }
    }
    if (h.job_id().empty() || h.rank() < 0) {
      return absl::InvalidArgumentError("held: needs a job_id and a rank >= 0");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (req.has_held()) {
    if (auto st = CheckHolder(req.held(), identity); !st.ok()) return st;  // nothing registered
  }
  Worker w;
  w.identity = identity;
  w.info.set_worker_id(absl::StrCat("worker-", next_worker_++));
  if (auto st = store_->SaveCounter("next_worker", next_worker_); !st.ok()) {
    return absl::UnavailableError(absl::StrCat("job store: ", st.message()));
  }
  w.info.set_device(d);
  // Memory is self-reported: the operator's cap bounds what a worker certificate can claim, so
  // a worker that overstates cannot get jobs admitted that no real worker can hold.
  int64_t memory = req.memory_bytes();
  if (options_.max_worker_memory > 0 && memory > options_.max_worker_memory) {
    std::cerr << "vocabpipe-coordinator: worker " << w.info.worker_id() << " (\"" << identity
              << "\" on " << req.hostname().substr(0, 255) << ") reports " << GiB(memory)
              << " of memory, more than --max-worker-memory; counted as "
              << GiB(options_.max_worker_memory) << std::endl;
    memory = options_.max_worker_memory;
  }
  w.info.set_memory_bytes(memory);
  w.info.set_address(req.address());
  w.info.set_hostname(req.hostname());
  w.info.set_pid(req.pid());
  w.info.set_rank(-1);
  w.info.set_rank_hint(req.has_rank_hint() ? req.rank_hint() : -1);
  w.info.set_peak_flops(req.peak_flops());
  w.last_heartbeat = absl::Now();
  w.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(w.last_heartbeat));
  v1::RegisterWorkerResponse out;
  out.set_worker_id(w.info.worker_id());
  out.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  out.set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(options_.heartbeat_timeout));
  Worker& added = workers_[w.info.worker_id()] = std::move(w);
  if (req.has_held()) Adopt(added, req.held());
  Schedule();
  return out;
}

void Coordinator::Adopt(Worker& w, const v1::HeldTask& held) {
  const std::string& wid = w.info.worker_id();
  v1::Job* job = FindJob(held.job_id());
  auto it = active_.find(held.job_id());
  if (job == nullptr || job->state() != v1::JOB_STATE_RUNNING || it == active_.end() ||
      it->second.attempt != held.attempt() ||
      held.rank() >= static_cast<int>(it->second.workers.size()) ||
      !it->second.holders.count(held.rank())) {
    // A launch that no longer runs here (ended, restarted, or nobody known to hold the rank):
    // stop it.
    v1::WorkerCommand cmd;
    cmd.mutable_cancel()->set_job_id(held.job_id());
    cmd.mutable_cancel()->set_attempt(held.attempt());
    w.commands.push_back(std::move(cmd));
    return;
  }
  ActiveJob& a = it->second;
  const int r = held.rank();
  // CheckHolder passed: this is the rank's worker. Holding the rank under an older id already,
  // it registered again (the answer to its first registration was lost): that id is dropped,
  // not expired (which would restart the job), and answers NOT_FOUND from now on.
  if (const std::string old = a.workers[r]; !old.empty() && old != wid) {
    if (auto o = workers_.find(old); o != workers_.end()) {
      a.peak_flops -= o->second.info.peak_flops();
      workers_.erase(o);
    }
  }
  a.workers[r] = wid;
  a.peak_flops += w.info.peak_flops();
  w.info.set_job_id(job->id());
  SetRank(w.info, JobTopology(job->spec()), r);
  // The store is rebuilt from the ranks' daemons: the attempt's keys are readable again with
  // its secret (a rank that is still in its rendezvous sets its keys again on retry). The
  // secret was checked against the stored hash, so this installs the attempt's own.
  kv_.SetRunSecret(absl::StrCat("vocabpipe/", a.attempt, "/"), held.store_secret());
  bool staged = false;
  for (v1::StageStats& s : *job->mutable_stages()) {
    if (s.rank() == r) {
      s.set_worker_id(wid);
      staged = true;
    }
  }
  if (!staged) {
    v1::StageStats* s = job->add_stages();
    s->set_rank(r);
    s->set_worker_id(wid);
  }
  // Once, when the last rank is back (a rank taken over by its worker's newer registration
  // afterwards is no news).
  if (!a.adopting || std::find(a.workers.begin(), a.workers.end(), "") != a.workers.end()) {
    return;
  }
  a.adopting = false;
  a.since = absl::Now();
  SetState(*job, v1::JOB_STATE_RUNNING,
           absl::StrCat("re-adopted after the coordinator restart: ranks on ",
                        absl::StrJoin(a.workers, ", ")))
      .IgnoreError();  // logged; the job goes on either way
}

absl::Status Coordinator::CheckHolder(const v1::HeldTask& held, const std::string& identity) {
  auto it = active_.find(held.job_id());
  if (it == active_.end() || it->second.attempt != held.attempt()) return absl::OkStatus();
  auto h = it->second.holders.find(held.rank());
  if (h == it->second.holders.end()) return absl::OkStatus();
  const bool same_worker = h->second.identity == identity;
  // Hashes of equal length, compared in constant time.
  const bool same_secret =
      auth::SecretEquals(auth::Sha256Hex(held.store_secret()), h->second.secret_sha256);
  if (same_worker && same_secret) return absl::OkStatus();
  // The operator's log says which part differed; the caller learns the rule only.
  std::cerr << "vocabpipe-coordinator: refused to re-adopt " << held.job_id() << " rank "
            << held.rank() << " (attempt " << held.attempt() << ") to the certificate \""
            << identity << "\": "
            << (same_worker ? ""
                            : absl::StrCat("the rank was assigned to \"", h->second.identity, "\"",
                                           same_secret ? "" : "; "))
            << (same_secret ? "" : "not the attempt's rendezvous secret") << std::endl;
  return absl::PermissionDeniedError(absl::StrCat(
      "held: rank ", held.rank(), " of ", held.job_id(), " (attempt ", held.attempt(),
      ") is re-adopted only by the worker certificate it was assigned to, presenting its "
      "attempt's rendezvous secret; ",
      identity.empty()
          ? "this secret does not match"
          : absl::StrCat("the certificate \"", identity, "\" or the secret does not match"),
      " (docs/operations.md, \"Security\")"));
}

void Coordinator::CheckDeadlines() {
  const absl::Time now = absl::Now();
  struct Due {
    std::string id, reason;
    bool restart = false, forced = false;
  };
  std::vector<Due> due;
  for (const auto& [id, a] : active_) {
    const v1::Job* job = FindJob(id);
    if (job == nullptr) continue;
    if (job->state() == v1::JOB_STATE_PROFILING && now - a.since > options_.profiling_deadline) {
      std::vector<std::string> missing;
      const planner::Topology topology = JobTopology(job->spec());
      for (int r = 0; r < static_cast<int>(a.workers.size()); ++r) {
        if (ProfilesPasses(topology, r) && !a.profiles.count(r))
          missing.push_back(absl::StrCat("rank ", r, " (", a.workers[r], ")"));
      }
      due.push_back({id, absl::StrCat("profiling: no result from ", absl::StrJoin(missing, ", "),
                                      " within ", absl::FormatDuration(options_.profiling_deadline),
                                      " (coordinator --profiling-deadline)")});
    } else if (job->state() != v1::JOB_STATE_RUNNING || !a.failure.empty()) {
      continue;
    } else if (a.adopting && now >= a.adopt_deadline) {
      std::vector<std::string> missing;
      for (int r = 0; r < static_cast<int>(a.workers.size()); ++r) {
        if (a.workers[r].empty()) missing.push_back(absl::StrCat(r));
      }
      due.push_back(
          {id,
           absl::StrCat("coordinator restarted and rank ", absl::StrJoin(missing, ", "),
                        " did not register again within ",
                        absl::FormatDuration(options_.adopt_grace), " (coordinator --adopt-grace)"),
           true, true});
    } else if (!a.adopting && options_.progress_timeout > absl::ZeroDuration() &&
               now - a.since > options_.progress_timeout) {
      due.push_back(
          {id,
           absl::StrCat("progress: no step completed for ", absl::FormatDuration(now - a.since),
                        " after step ", job->step(), " (coordinator --progress-timeout ",
                        absl::FormatDuration(options_.progress_timeout), ")"),
           true, false});
    }
  }
  for (const Due& d : due) {
    v1::Job& job = jobs_[d.id];
    if (d.restart) {
      FailOrRestart(job, d.reason, "", d.forced);
    } else {
      Finish(job, v1::JOB_STATE_FAILED, d.reason);
    }
  }
}

absl::Status Coordinator::CheckWorkerIdentity(const std::string& worker_id,
                                              const std::string& identity) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker_id: unknown worker \"", worker_id, "\" (register again)"));
  }
  if (it->second.identity != identity) {
    return absl::PermissionDeniedError(absl::StrCat(
        "worker_id: ", worker_id, " registered with the certificate of \"", it->second.identity,
        "\"; a certificate of \"", identity, "\" may not act for it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = workers_.find(req.worker_id());
  if (it == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker_id: unknown worker \"", req.worker_id(), "\" (register again)"));
  }
  Worker& w = it->second;
  w.last_heartbeat = absl::Now();
  w.info.set_last_heartbeat_unix_ms(absl::ToUnixMillis(w.last_heartbeat));
  if (!req.job_id().empty()) {
    // Reconcile: the worker runs a rank of req.job_id; is that what this coordinator gave it?
    bool ours = w.info.job_id() == req.job_id();
    if (ours && !req.attempt().empty()) {
      auto a = active_.find(req.job_id());
      ours = a != active_.end() && a->second.attempt == req.attempt();
    }
    if (!ours) {
      v1::WorkerCommand cmd;
      cmd.mutable_cancel()->set_job_id(req.job_id());
      cmd.mutable_cancel()->set_attempt(req.attempt());
      bool queued = false;
      for (const v1::WorkerCommand& c : w.commands) {
        queued = queued || (c.has_cancel() && c.cancel().job_id() == req.job_id() &&
                            c.cancel().attempt() == req.attempt());
      }
      if (!queued) w.commands.push_back(std::move(cmd));
    }
  }
  w.leaving = w.leaving || req.leaving();
  v1::HeartbeatResponse out;
  // Commands stay queued until a heartbeat acknowledges them: an answer lost on the way is
  // answered again, and the worker runs each seq once.
  while (!w.commands.empty() && w.commands.front().seq() > 0 &&
         w.commands.front().seq() <= req.acked_seq()) {
    w.commands.pop_front();
  }
  for (v1::WorkerCommand& cmd : w.commands) {
    if (cmd.seq() == 0) cmd.set_seq(w.next_seq++);
    *out.add_commands() = cmd;
  }
  return out;
}

absl::StatusOr<Coordinator::ReportTarget> Coordinator::ReportTargetFor(const std::string& worker_id,
                                                                       const std::string& job_id,
                                                                       const std::string& attempt) {
  if (!workers_.count(worker_id)) {
    return absl::NotFoundError(absl::StrCat("worker_id: unknown worker \"", worker_id, "\""));
  }
  ReportTarget target;
  target.job = FindJob(job_id);
  if (target.job == nullptr) {
    return absl::NotFoundError(absl::StrCat("job_id: no job \"", job_id, "\""));
  }
  auto it = active_.find(job_id);
  // A report of an earlier attempt of a restarted job counts as late (empty: an older worker).
  if (it != active_.end() && (attempt.empty() || attempt == it->second.attempt)) {
    target.active = &it->second;
  }
  return target;
}

absl::Status Coordinator::ReportMetrics(const v1::ReportMetricsRequest& req) {
  // The merged steps for the observer, told after mu_ is released: recording a step of 1,024
  // ranks in the exporter takes tens of milliseconds that every heartbeat would wait for
  // (docs/benchmarks.md §18). observe_mu_, taken before mu_ is released, keeps the steps of
  // concurrent reports in the order they were merged.
  std::vector<v1::StepMetrics> observed;
  v1::Job observed_job;  // what the observer reads of the job: its id and plan
  std::unique_lock<std::mutex> lock(mu_);
  absl::Status st = MergeReport(req, &observed);
  if (observed.empty()) return st;
  if (v1::Job* job = FindJob(req.job_id()); job != nullptr) {
    observed_job.set_id(job->id());
    *observed_job.mutable_plan() = job->plan();
  }
  std::lock_guard<std::mutex> in_order(observe_mu_);
  lock.unlock();
  for (const v1::StepMetrics& m : observed) options_.observer->OnStep(observed_job, m);
  return st;
}

absl::Status Coordinator::MergeReport(const v1::ReportMetricsRequest& req,
                                      std::vector<v1::StepMetrics>* observed) {
  auto target = ReportTargetFor(req.worker_id(), req.job_id(), req.attempt());
  if (!target.ok()) return target.status();
  if (target->active == nullptr) return absl::OkStatus();  // the job ended: a late report
  ActiveJob& a = *target->active;
  v1::Job* job = target->job;
  const int p = static_cast<int>(a.workers.size());
  if (req.rank() < 0 || req.rank() >= p || a.workers[req.rank()] != req.worker_id()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", req.rank(), " of job ", req.job_id(),
                                                   " is not run by ", req.worker_id()));
  }
  // Check everything first: a bad line changes nothing.
  std::vector<nlohmann::json> lines;
  for (int i = 0; i < req.step_json_size(); ++i) {
    const std::string where = absl::StrCat("step_json[", i, "]");
    nlohmann::json j = nlohmann::json::parse(req.step_json(i), nullptr, false);
    if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where, ": not JSON"));
    if (auto st = runlog::CheckRankLine(j, where); !st.ok()) return st;
    if (j["rank"].get<int64_t>() != req.rank()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".rank: ", j["rank"].dump(),
                                                     " but the report is from rank ", req.rank()));
    }
    lines.push_back(std::move(j));
  }
  for (const std::string& w : req.warnings()) {
    v1::JobEvent e;  // the current state again, with the warning as its message
    e.set_state(job->state());
    e.set_message(absl::StrCat("warning: ", w.substr(0, 1000)));
    if (auto st = SaveWithEvent(*job, std::move(e)); !st.ok()) return st;
  }
  const auto& par = job->spec().parallel();
  // A step is d·m microbatches (every replica's m).
  const runlog::StepContext context{
      .tokens_per_step = static_cast<double>(par.microbatches()) * std::max(1, par.data()) *
                         par.microbatch_size() * job->spec().model().seq_len(),
      .model_flops_per_step = a.model_flops_per_step,
      .peak_flops_per_rank = a.peak_flops / p,
      .predicted_memory = a.predicted_memory};
  for (const nlohmann::json& j : lines) {
    const int64_t step = j["step"].get<int64_t>();
    if (step < job->step()) continue;  // already merged (a resent report)
    RankReport& rr = a.steps[step];
    if (rr.lines.empty()) rr.lines.resize(p);
    if (!rr.lines[req.rank()].is_null()) continue;  // this rank already reported the step
    rr.lines[req.rank()] = j;
    if (++rr.reported < p) continue;
    // Every rank reported: the step is complete. Ranks step in lockstep, so steps complete
    // in order.
    auto merged = runlog::MergeRankLines(rr.lines, context);
    a.steps.erase(step);
    if (!merged.ok()) {
      Finish(*job, v1::JOB_STATE_FAILED,
             absl::StrCat("step ", step,
                          ": the ranks' reports disagree: ", merged.status().message()));
      return absl::OkStatus();
    }
    v1::StepMetrics m = StepMetricsFromLine(*merged, a.workers);
    m.set_unix_ms(NowMs());
    a.since = absl::Now();  // progress (the watchdog's clock)
    job->set_step(m.step());
    if (m.has_loss()) {
      job->set_has_loss(true);
      job->set_loss(m.loss());
    }
    job->set_mfu(m.mfu());
    job->set_tokens_per_second(m.tokens_per_second());
    *job->mutable_stages() = m.stages();
    v1::JobEvent e;
    *e.mutable_step() = std::move(m);
    if (SaveWithEvent(*job, e).ok() && options_.observer) {  // errors are logged
      observed->push_back(std::move(*e.mutable_step()));
    }
  }
  return absl::OkStatus();
}

absl::Status Coordinator::ReportTask(const v1::ReportTaskRequest& req) {
  std::lock_guard<std::mutex> lock(mu_);
  auto target = ReportTargetFor(req.worker_id(), req.job_id(), req.attempt());
  if (!target.ok()) return target.status();
  if (target->active == nullptr) return absl::OkStatus();  // the job ended: a late report
  ActiveJob& a = *target->active;
  v1::Job* job = target->job;
  const int p = static_cast<int>(a.workers.size());
  const auto pos = std::find(a.workers.begin(), a.workers.end(), req.worker_id());
  if (pos == a.workers.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id: ", req.worker_id(), " has no rank of job ", req.job_id()));
  }
  const int rank = static_cast<int>(pos - a.workers.begin());
  if (req.rank() == -1) {  // a profile result
    if (job->state() != v1::JOB_STATE_PROFILING) return absl::OkStatus();
    if (!req.ok()) {
      Finish(*job, v1::JOB_STATE_FAILED,
             absl::StrCat("rank ", rank, " (", req.worker_id(), "): profiling: ", req.message()));
      Schedule();
      return absl::OkStatus();
    }
    a.profiles[rank] = req.costs();
    if (static_cast<int>(a.profiles.size()) == ProfilesNeeded(job->spec())) {
      StartPlanning(*job, a);
    }
    Schedule();
    return absl::OkStatus();
  }
  if (req.rank() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", req.worker_id(), " runs rank ", rank, ", not ", req.rank()));
  }
  if (!req.ok() && req.stopped() && a.growing) {
    // Stopped with a checkpoint at the step the ranks agreed on, as GrowElastic asked.
    a.done[rank] = true;
    a.stopped = true;
  } else if (!req.ok()) {
    a.failed[rank] = true;
    a.failure_refused = a.failure_refused || req.refused();
    const std::string what =
        absl::StrCat("rank ", rank, " (", req.worker_id(), ") failed: ", req.message());
    const bool signaled = req.term_signal() != 0;
    if (a.failure.empty()) {
      a.failure = what;
      a.failure_signaled = signaled;
      a.failed_while_away = a.adopting;
      a.failure_deadline = absl::Now() + options_.heartbeat_timeout + options_.heartbeat_interval;
    } else if (signaled && !a.failure_signaled) {
      // The earlier report was a peer losing its connection to this rank.
      a.failure = absl::StrCat(what, "; then ", a.failure);
      a.failure_signaled = true;
    } else {
      absl::StrAppend(&a.failure, "; then ", what);
    }
  } else {
    a.done[rank] = true;
  }
  int reported = 0;
  for (int r = 0; r < p; ++r) reported += a.done[r] || a.failed[r];
  if (reported == p) {
    if (a.failure.empty() && a.stopped) {
      RestartToGrow(*job);
    } else if (a.failure.empty()) {
      Finish(*job, v1::JOB_STATE_SUCCEEDED,
             absl::StrCat(job->step(), " of ", job->total_steps(), " steps done"));
    } else if (a.failure_refused) {
      Finish(*job, v1::JOB_STATE_FAILED, a.failure);  // a restart would be refused again
    } else {
      FailOrRestart(*job, a.failure, "", /*forced=*/a.failed_while_away);
    }
  }
  Schedule();
  return absl::OkStatus();
}

std::vector<v1::WorkerInfo> Coordinator::ListWorkers() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::WorkerInfo> out;
  for (const auto& [id, w] : workers_) out.push_back(w.info);
  std::sort(out.begin(), out.end(), [](const v1::WorkerInfo& a, const v1::WorkerInfo& b) {
    return a.worker_id().size() != b.worker_id().size()
               ? a.worker_id().size() < b.worker_id().size()
               : a.worker_id() < b.worker_id();
  });
  return out;
}

}  // namespace vp::server
