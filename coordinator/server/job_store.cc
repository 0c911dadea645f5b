#include "coordinator/server/job_store.h"

#include <sqlite3.h>

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
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() { return sqlite3_step(stmt_); }
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
  {
    Statement put(db_, "INSERT OR REPLACE INTO jobs (id, ordinal, state, record) VALUES (?,?,?,?)");
    if (!put.status().ok()) return fail(put.status());
    put.BindText(1, job.id());
    put.BindInt(2, OrdinalOf(job.id()));
    put.BindInt(3, job.state());
    put.BindBlob(4, job.SerializeAsString());
    if (put.Step() != SQLITE_DONE) return fail(SqlError(db_, "save job"));
  }
  for (const JobEvent& e : events) {
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
  Statement q(db_, "SELECT record FROM events WHERE job_id = ? AND seq > ? ORDER BY seq");
  if (!q.status().ok()) return q.status();
  q.BindText(1, id);
  q.BindInt(2, after_seq);
  std::vector<JobEvent> events;
  int rc;
  while ((rc = q.Step()) == SQLITE_ROW) {
    JobEvent e;
    if (!e.ParseFromString(q.ColumnBlob(0))) {
      return absl::DataLossError(absl::StrCat("job ", id, ": a stored event does not parse"));
    }
    events.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return SqlError(db_, "load events");
  return events;
}

}  // namespace vp::server
