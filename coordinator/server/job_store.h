// Durable job records: one SQLite file holds every job (its spec, state, reason, plan, the
// planner's candidate table, the last step's metrics) and every job's event history (state
// changes and per-step metrics). A coordinator restarted on the same file sees all of it.
//
// Schema (docs/operations.md, "Control plane"):
//   jobs(id TEXT PRIMARY KEY, ordinal INTEGER, state INTEGER, record BLOB)   record = v1.Job
//   events(job_id TEXT, seq INTEGER, record BLOB, PRIMARY KEY(job_id, seq))  record = v1.JobEvent
//   steps(job_id TEXT, attempt INTEGER, step INTEGER, seq INTEGER, loss REAL, record BLOB,
//         PRIMARY KEY(job_id, attempt, step))   record = v1.JobEvent with its StepMetrics
//   quarantine(id TEXT, record BLOB, reason TEXT)   job rows that failed to parse at load
//   kv(key TEXT PRIMARY KEY, value BLOB)   the running launches' rendezvous store keys
//   counters(name TEXT PRIMARY KEY, value INTEGER)   e.g. the next worker number
//   rank_holders(job_id TEXT, attempt TEXT, rank INTEGER, identity TEXT, secret_sha256 TEXT,
//                PRIMARY KEY(job_id, attempt, rank))   who may take a running rank back after
//                a coordinator restart (RankHolder)
// A step's metrics are one row of `steps` (attempt = the job's restarts when it ran): recording
// a step does not rewrite the job row, and the same step reported again is recorded once. The
// job's step summary (step, loss, MFU, tokens/s, stages, last_event) is brought up to date
// from its newest step row when the job is loaded. Databases written before `steps` existed
// keep their step events in `events`; both are read as one sequence.
// Writes are transactions; a failed write leaves the previous rows untouched. Not thread-safe:
// the Coordinator serializes calls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "vocabpipe/v1/service.pb.h"

struct sqlite3;

namespace vp::server {

class JobStore {
 public:
  // Opens (creating if needed) the database file; ":memory:" for a throwaway store.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Inserts or replaces the job row and appends `events` (their seq must follow the stored
  // ones), in one transaction. When every event is a step, only the step rows are written
  // (INSERT OR IGNORE on job, attempt, step); the job row is rebuilt from them on load.
  absl::Status Save(const vocabpipe::v1::Job& job,
                    const std::vector<vocabpipe::v1::JobEvent>& events = {});
  absl::StatusOr<vocabpipe::v1::Job> Load(const std::string& id);  // NotFound
  // Every job, oldest first. A row whose record does not parse is moved to the quarantine
  // table (id, record, reason) and skipped; its id is listed in quarantined().
  absl::StatusOr<std::vector<vocabpipe::v1::Job>> LoadAll();
  const std::vector<std::string>& quarantined() const { return quarantined_; }
  // The job's events with seq > after_seq, in order.
  absl::StatusOr<std::vector<vocabpipe::v1::JobEvent>> Events(const std::string& id,
                                                              int64_t after_seq);
  // Removes jobs with their events and steps, in one transaction (retention of finished jobs).
  absl::Status DeleteJobs(const std::vector<std::string>& ids);
  // The largest job ordinal stored (job ids are "job-<ordinal>"), 0 when empty.
  int64_t MaxOrdinal() const { return max_ordinal_; }

  // The rendezvous store's keys of running launches (KvStore), so that a restarted coordinator
  // serves them again: set (insert or replace), every key, and a launch's keys dropped.
  absl::Status SaveKey(const std::string& key, const std::string& value);
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> LoadKeys();
  absl::Status DropKeys(const std::string& prefix);
  // A named counter that survives restarts (0 when never saved).
  absl::Status SaveCounter(const std::string& name, int64_t value);
  absl::StatusOr<int64_t> LoadCounter(const std::string& name);

  // Who holds each rank of a running attempt, for re-adoption after a restart: the name in the
  // certificate of the worker the rank was assigned to ("" on an insecure coordinator) and the
  // SHA-256 (hex) of the attempt's rendezvous secret (never the secret itself).
  struct RankHolder {
    int rank = 0;
    std::string identity;
    std::string secret_sha256;
  };
  // Replaces every row of the job (an earlier attempt's) with the attempt's, in one
  // transaction.
  absl::Status SaveRankHolders(const std::string& job_id, const std::string& attempt,
                               const std::vector<RankHolder>& holders);
  // The attempt's rows by rank (none: an empty vector).
  absl::StatusOr<std::vector<RankHolder>> LoadRankHolders(const std::string& job_id,
                                                          const std::string& attempt);
  absl::Status DropRankHolders(const std::string& job_id);

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql);
  // Applies the job's newest step row to its summary fields when that row is newer than the
  // job row (its seq > last_event).
  absl::Status WithLatestStep(vocabpipe::v1::Job& job);
  sqlite3* db_;
  int64_t max_ordinal_ = 0;
  std::vector<std::string> quarantined_;
};

}  // namespace vp::server
