#include "coordinator/server/job_store.h"

#include <sqlite3.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace vp::server {
namespace {

using vocabpipe::v1::Job;
using vocabpipe::v1::JobEvent;

// RAII prepared statement.
class Statement {
 public:
  Statement(sqlite3* db, const char* sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr);
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  absl::Status status() const {
    if (rc_ == SQLITE_OK) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("sqlite prepare: ", sqlite3_errmsg(db_)));
  }
  void BindText(int i, const std::string& s) {
    sqlite3_bind_text(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void BindBlob(int i, const std::string& s) {
    sqlite3_bind_blob(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void BindInt(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  void BindDouble(int i, double v) { sqlite3_bind_double(stmt_, i, v); }
  void BindNull(int i) { sqlite3_bind_null(stmt_, i); }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() { return sqlite3_step(stmt_); }
  void Reset() {  // to run again with new bindings
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  std::string ColumnBlob(int i) const {
    const void* p = sqlite3_column_blob(stmt_, i);
    return std::string(static_cast<const char*>(p), sqlite3_column_bytes(stmt_, i));
  }
  int64_t ColumnInt(int i) const { return sqlite3_column_int64(stmt_, i); }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int rc_ = SQLITE_OK;
};

absl::Status SqlError(sqlite3* db, const std::string& what) {
  return absl::InternalError(absl::StrCat("sqlite ", what, ": ", sqlite3_errmsg(db)));
}

int64_t OrdinalOf(const std::string& id) {
  int64_t n = 0;
  if (id.rfind("job-", 0) == 0 && absl::SimpleAtoi(id.substr(4), &n)) return n;
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr) !=
      SQLITE_OK) {
    std::string why = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("--db ", path, ": cannot open: ", why));
  }
  std::unique_ptr<JobStore> store(new JobStore(db));
  sqlite3_busy_timeout(db, 5000);
  // WAL: readers never block the writer. FULL sync: every commit is fsynced before it
  // returns, so a committed state change survives a power loss as well as a crash (NORMAL
  // may lose the last commits on power loss).
  for (const char* sql : {
           "PRAGMA journal_mode=WAL",
           "PRAGMA synchronous=FULL",
           "CREATE TABLE IF NOT EXISTS quarantine (id TEXT NOT NULL, record BLOB, "
           "reason TEXT NOT NULL)",
           "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, ordinal INTEGER NOT NULL, "
           "state INTEGER NOT NULL, record BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, "
           "record BLOB NOT NULL, PRIMARY KEY (job_id, seq))",
           // Added for issue 16: a database from before it gets the table on open; its step
           // events stay in `events` and are still read from there.
           "CREATE TABLE IF NOT EXISTS steps (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, "
           "step INTEGER NOT NULL, seq INTEGER NOT NULL, loss REAL, record BLOB NOT NULL, "
           "PRIMARY KEY (job_id, attempt, step))",
           "CREATE INDEX IF NOT EXISTS steps_by_seq ON steps (job_id, seq)",
           "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
           // Added for issue 29 (re-adoption checks the worker and the secret): a running job
           // of an older database has no rows, so its ranks are not re-adopted (it restarts
           // from its checkpoint after --adopt-grace).
           "CREATE TABLE IF NOT EXISTS rank_holders (job_id TEXT NOT NULL, attempt TEXT NOT NULL, "
           "rank INTEGER NOT NULL, identity TEXT NOT NULL, secret_sha256 TEXT NOT NULL, "
           "PRIMARY KEY (job_id, attempt, rank))",
       }) {
    if (auto st = store->Exec(sql); !st.ok()) {
      return absl::UnavailableError(absl::StrCat("--db ", path, ": ", st.message()));
    }
  }
  Statement q(db, "SELECT COALESCE(MAX(ordinal), 0) FROM jobs");
  if (!q.status().ok()) return q.status();
  if (q.Step() == SQLITE_ROW) store->max_ordinal_ = q.ColumnInt(0);
  return store;
}

JobStore::~JobStore() { sqlite3_close(db_); }

absl::Status JobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string why = err ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("sqlite: ", why, " (", sql, ")"));
  }
  return absl::OkStatus();
}

absl::Status JobStore::Save(const Job& job, const std::vector<JobEvent>& events) {
  if (auto st = Exec("BEGIN IMMEDIATE"); !st.ok()) return st;
  auto fail = [&](absl::Status st) {
    Exec("ROLLBACK").IgnoreError();
    return st;
  };
  // A save of step events only leaves the job row alone: its summary is rebuilt from the
  // newest step row when the job is loaded (WithLatestStep).
  const bool steps_only =
      !events.empty() &&
      std::all_of(events.begin(), events.end(), [](const JobEvent& e) { return e.has_step(); });
  if (!steps_only) {
    Statement put(db_, "INSERT OR REPLACE INTO jobs (id, ordinal, state, record) VALUES (?,?,?,?)");
    if (!put.status().ok()) return fail(put.status());
    put.BindText(1, job.id());
    put.BindInt(2, OrdinalOf(job.id()));
    put.BindInt(3, job.state());
    put.BindBlob(4, job.SerializeAsString());
    if (put.Step() != SQLITE_DONE) return fail(SqlError(db_, "save job"));
  }
  for (const JobEvent& e : events) {
    if (e.has_step()) {
      // Keyed by (job, attempt, step): a step reported twice is recorded once.
      Statement put(db_,
                    "INSERT OR IGNORE INTO steps (job_id, attempt, step, seq, loss, record) "
                    "VALUES (?,?,?,?,?,?)");
      if (!put.status().ok()) return fail(put.status());
      put.BindText(1, job.id());
      put.BindInt(2, job.restarts());
      put.BindInt(3, e.step().step());
      put.BindInt(4, e.seq());
      if (e.step().has_loss()) {
        put.BindDouble(5, e.step().loss());
      } else {
        put.BindNull(5);
      }
      put.BindBlob(6, e.SerializeAsString());
      if (put.Step() != SQLITE_DONE) return fail(SqlError(db_, "save step"));
      continue;
    }
    Statement put(db_, "INSERT INTO events (job_id, seq, record) VALUES (?,?,?)");
    if (!put.status().ok()) return fail(put.status());
    put.BindText(1, job.id());
    put.BindInt(2, e.seq());
    put.BindBlob(3, e.SerializeAsString());
    if (put.Step() != SQLITE_DONE) return fail(SqlError(db_, "save event"));
  }
  if (auto st = Exec("COMMIT"); !st.ok()) return fail(st);
  max_ordinal_ = std::max(max_ordinal_, OrdinalOf(job.id()));
  return absl::OkStatus();
}

absl::Status JobStore::WithLatestStep(Job& job) {
  Statement q(db_, "SELECT seq, record FROM steps WHERE job_id = ? ORDER BY seq DESC LIMIT 1");
  if (!q.status().ok()) return q.status();
  q.BindText(1, job.id());
  const int rc = q.Step();
  if (rc == SQLITE_DONE) return absl::OkStatus();
  if (rc != SQLITE_ROW) return SqlError(db_, "load steps");
  if (q.ColumnInt(0) <= job.last_event()) return absl::OkStatus();  // the row is newer
  JobEvent e;
  if (!e.ParseFromString(q.ColumnBlob(1)) || !e.has_step()) {
    return absl::DataLossError(absl::StrCat("job ", job.id(), ": a stored step does not parse"));
  }
  // What the coordinator sets on the job when a step completes (Coordinator::ReportMetrics).
  const vocabpipe::v1::StepMetrics& m = e.step();
  job.set_step(m.step());
  if (m.has_loss()) {
    job.set_has_loss(true);
    job.set_loss(m.loss());
  }
  job.set_mfu(m.mfu());
  job.set_tokens_per_second(m.tokens_per_second());
  *job.mutable_stages() = m.stages();
  job.set_last_event(e.seq());
  job.set_updated_unix_ms(e.unix_ms());
  return absl::OkStatus();
}

absl::StatusOr<Job> JobStore::Load(const std::string& id) {
  Statement q(db_, "SELECT record FROM jobs WHERE id = ?");
  if (!q.status().ok()) return q.status();
  q.BindText(1, id);
  const int rc = q.Step();
  if (rc == SQLITE_DONE) return absl::NotFoundError(absl::StrCat("job_id: no job ", id));
  if (rc != SQLITE_ROW) return SqlError(db_, "load job");
  Job job;
  if (!job.ParseFromString(q.ColumnBlob(0))) {
    return absl::DataLossError(absl::StrCat("job ", id, ": stored record does not parse"));
  }
  if (auto st = WithLatestStep(job); !st.ok()) return st;
  return job;
}

absl::StatusOr<std::vector<Job>> JobStore::LoadAll() {
  Statement q(db_, "SELECT record, id FROM jobs ORDER BY ordinal, id");
  if (!q.status().ok()) return q.status();
  std::vector<Job> jobs;
  std::vector<std::string> bad;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    Job job;
    if (!job.ParseFromString(q.ColumnBlob(0))) {
      bad.push_back(q.ColumnBlob(1));  // quarantined below: one bad row must not stop the rest
      continue;
    }
    jobs.push_back(std::move(job));
  }
  if (rc != SQLITE_DONE) return SqlError(db_, "load jobs");
  for (Job& job : jobs) {
    // A step row that does not parse costs the job its newest metrics, not its record.
    if (auto st = WithLatestStep(job); !st.ok() && !absl::IsDataLoss(st)) return st;
  }
  for (const std::string& id : bad) {
    if (auto st = Exec("BEGIN IMMEDIATE"); !st.ok()) return st;
    Statement move(db_,
                   "INSERT INTO quarantine (id, record, reason) SELECT id, record, "
                   "'job record does not parse' FROM jobs WHERE id = ?");
    Statement drop(db_, "DELETE FROM jobs WHERE id = ?");
    if (!move.status().ok() || !drop.status().ok()) {
      Exec("ROLLBACK").IgnoreError();
      return move.status().ok() ? drop.status() : move.status();
    }
    move.BindText(1, id);
    drop.BindText(1, id);
    if (move.Step() != SQLITE_DONE || drop.Step() != SQLITE_DONE) {
      Exec("ROLLBACK").IgnoreError();
      return SqlError(db_, "quarantine");
    }
    if (auto st = Exec("COMMIT"); !st.ok()) return st;
    quarantined_.push_back(id);
  }
  return jobs;
}

absl::StatusOr<std::vector<JobEvent>> JobStore::Events(const std::string& id, int64_t after_seq) {
  // State changes and warnings live in `events`, step metrics in `steps` (and, in a database
  // written before the steps table, in `events` too): one sequence across both.
  Statement q(db_,
              "SELECT seq, record FROM events WHERE job_id = ?1 AND seq > ?2 UNION ALL "
              "SELECT seq, record FROM steps WHERE job_id = ?1 AND seq > ?2 ORDER BY 1");
  if (!q.status().ok()) return q.status();
  q.BindText(1, id);
  q.BindInt(2, after_seq);
  std::vector<JobEvent> events;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    JobEvent e;
    if (!e.ParseFromString(q.ColumnBlob(1))) {
      return absl::DataLossError(absl::StrCat("job ", id, ": a stored event does not parse"));
    }
    events.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return SqlError(db_, "load events");
  return events;
}

absl::Status JobStore::SaveKey(const std::string& key, const std::string& value) {
  Statement put(db_, "INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)");
  if (!put.status().ok()) return put.status();
  put.BindText(1, key);
  put.BindBlob(2, value);
  if (put.Step() != SQLITE_DONE) {
    return absl::UnavailableError(absl::StrCat("store key: ", sqlite3_errmsg(db_)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> JobStore::LoadKeys() {
  Statement q(db_, "SELECT key, value FROM kv ORDER BY key");
  if (!q.status().ok()) return q.status();
  std::vector<std::pair<std::string, std::string>> out;
  while (q.Step() == SQLITE_ROW) out.emplace_back(q.ColumnBlob(0), q.ColumnBlob(1));
  return out;
}

absl::Status JobStore::DropKeys(const std::string& prefix) {
  // Keys are compared as text: every key from prefix up to prefix with its last byte + 1.
  Statement del(db_, "DELETE FROM kv WHERE substr(key, 1, ?) = ?");
  if (!del.status().ok()) return del.status();
  del.BindInt(1, static_cast<int64_t>(prefix.size()));
  del.BindText(2, prefix);
  if (del.Step() != SQLITE_DONE) {
    return absl::UnavailableError(absl::StrCat("store keys: ", sqlite3_errmsg(db_)));
  }
  return absl::OkStatus();
}

absl::Status JobStore::DeleteJobs(const std::vector<std::string>& ids) {
  if (ids.empty()) return absl::OkStatus();
  if (auto st = Exec("BEGIN IMMEDIATE"); !st.ok()) return st;
  for (const char* sql : {"DELETE FROM jobs WHERE id = ?", "DELETE FROM events WHERE job_id = ?",
                          "DELETE FROM steps WHERE job_id = ?"}) {
    Statement del(db_, sql);
    if (!del.status().ok()) {
      Exec("ROLLBACK").IgnoreError();
      return del.status();
    }
    for (const std::string& id : ids) {
      del.Reset();
      del.BindText(1, id);
      if (del.Step() != SQLITE_DONE) {
        const std::string why = sqlite3_errmsg(db_);
        Exec("ROLLBACK").IgnoreError();
        return absl::UnavailableError(absl::StrCat("delete job ", id, ": ", why));
      }
    }
  }
  return Exec("COMMIT");
}

absl::Status JobStore::SaveCounter(const std::string& name, int64_t value) {
  Statement put(db_, "INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)");
  if (!put.status().ok()) return put.status();
  put.BindText(1, name);
  put.BindInt(2, value);
  if (put.Step() != SQLITE_DONE) {
    return absl::UnavailableError(absl::StrCat("counter ", name, ": ", sqlite3_errmsg(db_)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobStore::LoadCounter(const std::string& name) {
  Statement q(db_, "SELECT value FROM counters WHERE name = ?");
  if (!q.status().ok()) return q.status();
  q.BindText(1, name);
  return q.Step() == SQLITE_ROW ? q.ColumnInt(0) : 0;
}

absl::Status JobStore::SaveRankHolders(const std::string& job_id, const std::string& attempt,
                                       const std::vector<RankHolder>& holders) {
  if (auto st = Exec("BEGIN IMMEDIATE"); !st.ok()) return st;
  auto fail = [&](const char* what) {
    absl::Status st = absl::UnavailableError(absl::StrCat(what, ": ", sqlite3_errmsg(db_)));
    Exec("ROLLBACK").IgnoreError();
    return st;
  };
  {
    Statement del(db_, "DELETE FROM rank_holders WHERE job_id = ?");
    if (!del.status().ok()) return fail("rank holders");
    del.BindText(1, job_id);
    if (del.Step() != SQLITE_DONE) return fail("rank holders");
  }
  for (const RankHolder& h : holders) {
    Statement put(db_,
                  "INSERT INTO rank_holders (job_id, attempt, rank, identity, secret_sha256) "
                  "VALUES (?, ?, ?, ?, ?)");
    if (!put.status().ok()) return fail("rank holders");
    put.BindText(1, job_id);
    put.BindText(2, attempt);
    put.BindInt(3, h.rank);
    put.BindText(4, h.identity);
    put.BindText(5, h.secret_sha256);
    if (put.Step() != SQLITE_DONE) return fail("rank holders");
  }
  return Exec("COMMIT");
}

absl::StatusOr<std::vector<JobStore::RankHolder>> JobStore::LoadRankHolders(
    const std::string& job_id, const std::string& attempt) {
  Statement q(db_,
              "SELECT rank, identity, secret_sha256 FROM rank_holders WHERE job_id = ? AND "
              "attempt = ? ORDER BY rank");
  if (!q.status().ok()) return q.status();
  q.BindText(1, job_id);
  q.BindText(2, attempt);
  std::vector<RankHolder> out;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    out.push_back({.rank = static_cast<int>(q.ColumnInt(0)),
                   .identity = q.ColumnBlob(1),
                   .secret_sha256 = q.ColumnBlob(2)});
  }
  if (rc != SQLITE_DONE) return SqlError(db_, "load rank holders");
  return out;
}

absl::Status JobStore::DropRankHolders(const std::string& job_id) {
  Statement del(db_, "DELETE FROM rank_holders WHERE job_id = ?");
  if (!del.status().ok()) return del.status();
  del.BindText(1, job_id);
  if (del.Step() != SQLITE_DONE) {
    return absl::UnavailableError(absl::StrCat("rank holders: ", sqlite3_errmsg(db_)));
  }
  return absl::OkStatus();
}

}  // namespace vp::server
