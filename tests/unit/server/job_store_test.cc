// The job store (coordinator/server/job_store.h) on a real SQLite file: per-step metrics are
// rows of their own, recorded once per (job, attempt, step), and a database written before the
// steps table existed still reads.
#include "coordinator/server/job_store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"

namespace {

namespace fs = std::filesystem;
namespace v1 = vocabpipe::v1;
using vp::server::JobStore;

class JobStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::temp_directory_path() /
        absl::StrCat("vp_job_store_", testing::UnitTest::GetInstance()->current_test_info()->name(),
                     "_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    db_ = (dir_ / "jobs.db").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // One number from a SQL query on the file (a second connection, as an operator would).
  int64_t Count(const std::string& sql) {
    sqlite3* db = nullptr;
    EXPECT_EQ(sqlite3_open(db_.c_str(), &db), SQLITE_OK);
    sqlite3_stmt* q = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &q, nullptr), SQLITE_OK) << sql;
    int64_t n = -1;
    if (sqlite3_step(q) == SQLITE_ROW) n = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return n;
  }
  void Sql(const std::string& sql) {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(db_.c_str(), &db), SQLITE_OK);
    char* err = nullptr;
    const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
    EXPECT_EQ(rc, SQLITE_OK) << (err ? err : "") << " in " << sql;
    sqlite3_free(err);
    sqlite3_close(db);
  }

  static v1::JobEvent StateEvent(int64_t seq, v1::JobState state) {
    v1::JobEvent e;
    e.set_job_id("job-1");
    e.set_seq(seq);
    e.set_state(state);
    return e;
  }
  static v1::JobEvent StepEvent(int64_t seq, int64_t step, double loss) {
    v1::JobEvent e;
    e.set_job_id("job-1");
    e.set_seq(seq);
    e.set_unix_ms(1000 + seq);
    v1::StepMetrics* m = e.mutable_step();
    m->set_step(step);
    m->set_has_loss(true);
    m->set_loss(loss);
    m->set_mfu(0.25);
    m->set_tokens_per_second(100.0 * step);
    return e;
  }

  fs::path dir_;
  std::string db_;
};

TEST_F(JobStoreTest, StepsAreRowsOfTheirOwnRecordedOncePerAttempt) {
  v1::Job job;
  job.set_id("job-1");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_last_event(1);
  {
    auto store = JobStore::Open(db_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Save(job, {StateEvent(1, v1::JOB_STATE_RUNNING)}).ok());
    const std::string row_before =
        absl::StrCat(Count("SELECT length(record) FROM jobs WHERE id = 'job-1'"));
    // Steps 1 and 2, then step 2 again (a resent report): the job row is not rewritten (its
    // last_event stays 1 in the stored record, so a rewrite would show), step 2 is kept once.
    job.set_step(1);
    job.set_last_event(2);
    ASSERT_TRUE((*store)->Save(job, {StepEvent(2, 1, 4.0)}).ok());
    job.set_step(2);
    job.set_last_event(3);
    ASSERT_TRUE((*store)->Save(job, {StepEvent(3, 2, 3.5)}).ok());
    job.set_last_event(4);
    ASSERT_TRUE((*store)->Save(job, {StepEvent(4, 2, 9.9)}).ok());
    EXPECT_EQ(Count("SELECT COUNT(*) FROM steps WHERE job_id = 'job-1'"), 2);
    EXPECT_EQ(Count("SELECT COUNT(*) FROM events WHERE job_id = 'job-1'"), 1);
    EXPECT_EQ(absl::StrCat(Count("SELECT length(record) FROM jobs WHERE id = 'job-1'")),
              row_before);
    // The next attempt re-runs step 2 (a lost step): a row of its own.
    job.set_restarts(1);
    job.set_last_event(5);
    ASSERT_TRUE((*store)->Save(job, {StateEvent(5, v1::JOB_STATE_PENDING)}).ok());
    job.set_last_event(6);
    ASSERT_TRUE((*store)->Save(job, {StepEvent(6, 2, 3.25)}).ok());
    EXPECT_EQ(Count("SELECT COUNT(*) FROM steps WHERE job_id = 'job-1' AND step = 2"), 2);
    EXPECT_EQ(Count("SELECT COUNT(*) FROM steps WHERE attempt = 1"), 1);
  }
  // A new process on the same file: the job's summary comes from its newest step row.
  auto store = JobStore::Open(db_);
  ASSERT_TRUE(store.ok()) << store.status();
  auto all = (*store)->LoadAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 1u);
  const v1::Job& loaded = all->front();
  EXPECT_EQ(loaded.step(), 2);
  EXPECT_TRUE(loaded.has_loss());
  EXPECT_DOUBLE_EQ(loaded.loss(), 3.25);
  EXPECT_DOUBLE_EQ(loaded.tokens_per_second(), 200.0);
  EXPECT_EQ(loaded.last_event(), 6);
  EXPECT_EQ(loaded.updated_unix_ms(), 1006);
  EXPECT_EQ(loaded.restarts(), 1);
  auto one = (*store)->Load("job-1");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->last_event(), 6);
  // The event history is one sequence across both tables; the resent step is not in it.
  auto events = (*store)->Events("job-1", 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 5u);
  const int64_t seqs[] = {1, 2, 3, 5, 6};
  for (size_t i = 0; i < events->size(); ++i) EXPECT_EQ((*events)[i].seq(), seqs[i]) << i;
  EXPECT_DOUBLE_EQ((*events)[2].step().loss(), 3.5);
  EXPECT_TRUE((*events)[3].has_state());
  auto later = (*store)->Events("job-1", 3);
  ASSERT_TRUE(later.ok());
  EXPECT_EQ(later->size(), 2u);
}

TEST_F(JobStoreTest, ADatabaseFromBeforeTheStepsTableStillReads) {
  // The schema of earlier releases: step events in `events`, the job row rewritten each step.
  Sql("CREATE TABLE jobs (id TEXT PRIMARY KEY, ordinal INTEGER NOT NULL, "
      "state INTEGER NOT NULL, record BLOB NOT NULL)");
  Sql("CREATE TABLE events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, "
      "record BLOB NOT NULL, PRIMARY KEY (job_id, seq))");
  v1::Job job;
  job.set_id("job-1");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_step(1);
  job.set_has_loss(true);
  job.set_loss(4.0);
  job.set_last_event(2);
  auto hex = [](const std::string& bytes) {
    std::string out;
    for (unsigned char c : bytes) absl::StrAppend(&out, absl::Hex(c, absl::kZeroPad2));
    return out;
  };
  Sql(absl::StrCat("INSERT INTO jobs VALUES ('job-1', 1, ", int(job.state()), ", X'",
                   hex(job.SerializeAsString()), "')"));
  Sql(absl::StrCat("INSERT INTO events VALUES ('job-1', 1, X'",
                   hex(StateEvent(1, v1::JOB_STATE_RUNNING).SerializeAsString()), "')"));
  Sql(absl::StrCat("INSERT INTO events VALUES ('job-1', 2, X'",
                   hex(StepEvent(2, 1, 4.0).SerializeAsString()), "')"));

  auto store = JobStore::Open(db_);  // migrates: the steps table appears
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(Count("SELECT COUNT(*) FROM steps"), 0);
  auto all = (*store)->LoadAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ(all->front().step(), 1);
  EXPECT_DOUBLE_EQ(all->front().loss(), 4.0);
  // A new step goes to the new table; the history reads the old and the new rows in order.
  job.set_step(2);
  job.set_last_event(3);
  ASSERT_TRUE((*store)->Save(job, {StepEvent(3, 2, 3.0)}).ok());
  auto events = (*store)->Events("job-1", 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[1].step().step(), 1);
  EXPECT_EQ((*events)[2].step().step(), 2);
  auto loaded = (*store)->Load("job-1");
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->step(), 2);
  EXPECT_DOUBLE_EQ(loaded->loss(), 3.0);
}

}  // namespace

// Issue 29: who holds each rank of a running attempt (certificate name, SHA-256 of the
// attempt's secret) survives a reopen; a new attempt replaces the job's rows; a drop removes
// them; another job's rows are untouched.
TEST_F(JobStoreTest, RankHoldersAreStoredPerAttemptAndReplacedByTheNext) {
  const std::string hash(64, 'a'), other(64, 'b');
  {
    auto store = JobStore::Open(db_);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)
                    ->SaveRankHolders("job-1", "job-1.1",
                                      {{.rank = 0, .identity = "node0", .secret_sha256 = hash},
                                       {.rank = 1, .identity = "node1", .secret_sha256 = hash}})
                    .ok());
    ASSERT_TRUE((*store)->SaveRankHolders("job-2", "job-2.1", {{0, "node2", other}}).ok());
  }
  auto store = JobStore::Open(db_);
  ASSERT_TRUE(store.ok()) << store.status();
  auto held = (*store)->LoadRankHolders("job-1", "job-1.1");
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->size(), 2u);
  EXPECT_EQ((*held)[1].rank, 1);
  EXPECT_EQ((*held)[1].identity, "node1");
  EXPECT_EQ((*held)[1].secret_sha256, hash);
  // Another attempt of the job: nothing (the rows name the attempt they belong to).
  EXPECT_TRUE((*store)->LoadRankHolders("job-1", "job-1.2")->empty());
  // The next attempt replaces the job's rows.
  ASSERT_TRUE((*store)->SaveRankHolders("job-1", "job-1.2", {{0, "node3", other}}).ok());
  EXPECT_TRUE((*store)->LoadRankHolders("job-1", "job-1.1")->empty());
  EXPECT_EQ((*store)->LoadRankHolders("job-1", "job-1.2")->size(), 1u);
  EXPECT_EQ(Count("SELECT COUNT(*) FROM rank_holders WHERE job_id = 'job-1'"), 1);
  ASSERT_TRUE((*store)->DropRankHolders("job-1").ok());
  EXPECT_EQ(Count("SELECT COUNT(*) FROM rank_holders WHERE job_id = 'job-1'"), 0);
  EXPECT_EQ((*store)->LoadRankHolders("job-2", "job-2.1")->size(), 1u);
}
