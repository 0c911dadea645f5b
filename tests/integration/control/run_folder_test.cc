// Run folders over TLS with real daemons (docs/operations.md, "Security"): a coordinator with
// certificates from `vocabpipe certs init`, tokens for alice, bob and the admin root from
// `vocabpipe certs token`, and --storage-root on it and on the worker daemons. A run folder
// belongs to the user whose run first claimed it (OWNER), and no file of a run folder is
// opened through a link. Each refusal is checked for its status and message, and for leaving
// what is stored as it was: the job list, the owner's checkpoints (SHA-256 of every file) and
// the targets of planted links (content and modification time).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <map>
#include <memory>

#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "tests/integration/control/control_harness.h"

namespace {

using namespace vp::testing;  // NOLINT
using ::testing::HasSubstr;
using ::testing::Not;

std::string Sha256(const fs::path& path) {
  const std::string data = ReadWholeFile(path);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += absl::StrFormat("%02x", md[i]);
  return hex;
}

// Every entry below `dir`: relative path -> SHA-256 of a file, "dir" of a folder, or "link".
std::map<std::string, std::string> Snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    if (e.is_symlink()) {
      out[rel] = "link";
    } else if (e.is_directory()) {
      out[rel] = "dir";
    } else {
      out[rel] = Sha256(e.path());
    }
  }
  return out;
}

// What a planted link points at: its bytes and modification time, to show it was not touched.
struct Target {
  fs::path path;
  std::string content;
  fs::file_time_type mtime;
};

class RunFolderTest : public TlsClusterTest {
 protected:
  RunFolderTest() : TlsClusterTest("vp_runfolder_") {}

  void SetUp() override {
    TlsClusterTest::SetUp();
    if (HasFatalFailure()) return;
    fs::create_directories(root_ / "data");
    fs::create_directories(dir_ / "outside");
    alice_ = pki_->Token("alice");
    bob_ = pki_->Token("bob");
    ASSERT_EQ(bob_.size(), 64u);
    CliResult r = SynthData(root_ / "data" / "data.bin");
    ASSERT_EQ(r.code, 0) << r.output;
    coordinator_ = StartCoordinator({"--no-profile", "--storage-root", root_.string()});
    ASSERT_TRUE(coordinator_->up());
  }
  void TearDown() override {
    workers_.clear();
    coordinator_.reset();
    TlsClusterTest::TearDown();
  }

  void StartWorkers(int n) {
    for (int i = 0; i < n; ++i) {
      StartWorker(*coordinator_, {"--storage-root", root_.string()});
      if (HasFatalFailure()) return;
    }
  }

  // A tiny job of p ranks into root/<dir>; extra: more spec text (model.init_from, ...).
  v1::SubmitJobRequest Job(const std::string& dir, int pipeline = 2,
                           const std::string& init_from = "",
                           const std::string& checkpoint = "every: 2") {
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: j\nmodel: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16",
        init_from.empty() ? "" : absl::StrCat(", init_from: ", init_from), "}\n",
        "parallel: {pipeline: ", pipeline, ", microbatch_size: 2, microbatches: 2}\n",
        "train: {steps: 4, lr: 0.003, threads: 1, max_restarts: 0}\n",
        "data: {path: data/data.bin}\ncheckpoint: {dir: ", dir, ", ", checkpoint, "}\n"));
    req.set_base_dir(root_.string());
    return req;
  }

  grpc::Status Submit(const std::string& token, const v1::SubmitJobRequest& req,
                      std::string* id = nullptr) {
    v1::SubmitJobResponse resp;
    grpc::Status st = Jobs(*coordinator_, token)->SubmitJob(Ctx().get(), req, &resp);
    if (id != nullptr) *id = resp.job_id();
    return st;
  }

  // A file outside the root, and a link to it at `link`.
  Target Plant(const fs::path& link, const std::string& name) {
    const fs::path target = dir_ / "outside" / name;
    { std::ofstream(target) << "outside bytes of " << name << "\n"; }
    fs::create_directories(link.parent_path());
    fs::create_symlink(target, link);
    return {target, ReadWholeFile(target), fs::last_write_time(target)};
  }
  static void ExpectUntouched(const Target& t) {
    EXPECT_EQ(ReadWholeFile(t.path), t.content) << t.path;
    EXPECT_EQ(fs::last_write_time(t.path), t.mtime) << t.path;
  }

  std::string alice_, bob_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
};

// Probes 27 and 24: bob names alice's finished run as checkpoint.dir, resumes from it, starts
// from its weights; all refused before anything is stored, and her checkpoints stay byte for
// byte what they were. An admin may start from her weights; her folder stays hers.
TEST_F(RunFolderTest, AFinishedRunBelongsToItsUser) {
  StartWorkers(2);
  std::string id;
  ASSERT_TRUE(Submit(alice_, Job("runs/alice"), &id).ok());
  v1::Job job = WaitTerminal(*coordinator_, id);
  ASSERT_TRUE(Succeeded(job));
  EXPECT_EQ(ReadWholeFile(root_ / "runs/alice/OWNER"), "alice\n");
  ASSERT_TRUE(fs::exists(root_ / "runs/alice/step_4/model.safetensors"));
  ASSERT_TRUE(fs::exists(root_ / "runs/alice/step_2/rank_1/MANIFEST.json"));
  const auto before = Snapshot(root_ / "runs/alice");
  const int jobs = JobCount(*coordinator_);

  grpc::Status st = Submit(bob_, Job("runs/alice", 2, "", "every: 4, keep_last: 1"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(st.error_message(), HasSubstr("belongs to alice; user bob may not write into it"));

  v1::SubmitJobRequest resume = Job("runs/alice");
  resume.set_resume(true);
  st = Submit(bob_, resume);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("may not resume from or write into it"));

  st = Submit(bob_, Job("runs/bob", 2, "runs/alice/step_4"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("model.init_from: "));
  EXPECT_THAT(st.error_message(), HasSubstr("belongs to alice; user bob may not read"));
  // Through a link of his own to her step folder too.
  fs::create_directories(root_ / "runs/bob-links");
  fs::create_directory_symlink(root_ / "runs/alice/step_4", root_ / "runs/bob-links/hf");
  st = Submit(bob_, Job("runs/bob", 2, "runs/bob-links/hf"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("belongs to alice"));

  EXPECT_EQ(JobCount(*coordinator_), jobs) << "a refused submit stored a job";
  EXPECT_FALSE(fs::exists(root_ / "runs/bob"));
  EXPECT_EQ(Snapshot(root_ / "runs/alice"), before) << "alice's run folder changed";

  // An admin may; the new folder is the admin's, alice's stays hers and unchanged.
  ASSERT_TRUE(Submit(admin_, Job("runs/copy", 2, "runs/alice/step_4"), &id).ok());
  job = WaitTerminal(*coordinator_, id);
  EXPECT_TRUE(Succeeded(job));
  EXPECT_EQ(ReadWholeFile(root_ / "runs/copy/OWNER"), "root\n");
  EXPECT_EQ(Snapshot(root_ / "runs/alice"), before);
}

// The worker checks again when the run claims the folder: a folder that became alice's after
// bob's submit (his job waited for workers) is refused by the daemon, naming her; the job
// fails at once and nothing is written into her folder.
TEST_F(RunFolderTest, TheWorkerChecksTheOwnerWhenTheRunClaimsTheFolder) {
  std::string id;
  ASSERT_TRUE(Submit(bob_, Job("runs/late", 1), &id).ok());
  fs::create_directories(root_ / "runs/late");
  std::ofstream(root_ / "runs/late/OWNER") << "alice\n";
  const auto before = Snapshot(root_ / "runs/late");
  StartWorkers(1);
  const v1::Job job = WaitTerminal(*coordinator_, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(job.reason(), HasSubstr("belongs to alice; user bob may not"));
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(Snapshot(root_ / "runs/late"), before);
}

// Probe 24: init_from outside the root is refused at submit; a folder that was inside at submit
// and became a link out of the root before the run is refused by the worker's own check.
TEST_F(RunFolderTest, InitFromIsConfinedToTheStorageRoot) {
  fs::create_directories(dir_ / "outside" / "hf");
  std::ofstream(dir_ / "outside" / "hf" / "config.json") << "{}";
  const int jobs = JobCount(*coordinator_);
  grpc::Status st = Submit(bob_, Job("runs/bob", 1, (dir_ / "outside" / "hf").string()));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("model.init_from: "));
  EXPECT_THAT(st.error_message(), HasSubstr("is outside the storage root"));
  st = Submit(bob_, Job("runs/bob", 1, "../outside/hf"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(JobCount(*coordinator_), jobs);

  fs::create_directories(root_ / "models" / "hf");
  std::string id;
  ASSERT_TRUE(Submit(bob_, Job("runs/bob", 1, "models/hf"), &id).ok());
  fs::remove(root_ / "models" / "hf");
  fs::create_directory_symlink(dir_ / "outside" / "hf", root_ / "models" / "hf");
  StartWorkers(1);
  const v1::Job job = WaitTerminal(*coordinator_, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker storage root: model.init_from: "));
  EXPECT_FALSE(fs::exists(root_ / "runs" / "bob")) << "the worker touched checkpoint.dir";
}

// Probes 25 and 26: links planted where run files belong (LOCK, a rank's pid and log, a step
// folder) or beside the data (tokenizer.model) are refused at submit, naming the link; links
// planted after the submit are refused by the workers when the run claims the folder. No link
// target outside the root is written, truncated or even opened for writing.
TEST_F(RunFolderTest, PlantedLinksAreRefusedAndTheirTargetsUntouched) {
  std::vector<Target> targets;
  const std::vector<std::string> links = {"LOCK", "rank_0.pid", "rank_1.log", "step_2"};
  const int jobs = JobCount(*coordinator_);
  for (size_t i = 0; i < links.size(); ++i) {
    const fs::path run = root_ / absl::StrCat("runs/evil", i);
    if (links[i] == "step_2") {
      fs::create_directories(dir_ / "outside" / "stepdir");
      fs::create_directories(run);
      fs::create_directory_symlink(dir_ / "outside" / "stepdir", run / links[i]);
    } else {
      targets.push_back(Plant(run / links[i], absl::StrCat("victim", i)));
    }
    grpc::Status st = Submit(bob_, Job(absl::StrCat("runs/evil", i)));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << links[i];
    EXPECT_THAT(st.error_message(),
                HasSubstr(absl::StrCat("runs/evil", i, "/", links[i], " is a symbolic link")));
    EXPECT_THAT(st.error_message(), Not(HasSubstr("outside bytes")));
  }
  // The tokenizer beside the data: a link out of the root is refused by the root check.
  fs::create_directories(root_ / "data2");
  fs::copy_file(root_ / "data" / "data.bin", root_ / "data2" / "data.bin");
  targets.push_back(Plant(root_ / "data2" / "tokenizer.model", "secret.model"));
  v1::SubmitJobRequest tok = Job("runs/tok");
  tok.set_spec_text(absl::StrReplaceAll(tok.spec_text(), {{"data/data.bin", "data2/data.bin"}}));
  grpc::Status st = Submit(bob_, tok);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("data.path's tokenizer.model: "));
  EXPECT_EQ(JobCount(*coordinator_), jobs);

  // Planted after the submit, while the job waits for its workers.
  std::string id;
  ASSERT_TRUE(Submit(bob_, Job("runs/evil_late"), &id).ok());
  for (const std::string name : {"LOCK", "rank_0.pid", "rank_1.log"}) {
    targets.push_back(Plant(root_ / "runs/evil_late" / name, "late_" + name));
  }
  StartWorkers(2);
  const v1::Job job = WaitTerminal(*coordinator_, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("is a symbolic link where a run file belongs"));
  EXPECT_EQ(job.restarts(), 0);
  for (const Target& t : targets) ExpectUntouched(t);
  EXPECT_TRUE(fs::is_empty(dir_ / "outside" / "stepdir"));
  // Nothing of the run was written beside the links either.
  EXPECT_FALSE(fs::exists(root_ / "runs/evil_late/job.yaml"));
}

}  // namespace
