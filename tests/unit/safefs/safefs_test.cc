// proto/safefs: folder handles that never follow links, and the run folder's OWNER file.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "proto/safefs/dir.h"
#include "proto/safefs/run_owner.h"

namespace vp::safefs {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class SafefsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("vp_safefs_" + std::to_string(getpid()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "run");
    fs::create_directories(base_ / "outside");
    std::ofstream(victim()) << "victim's bytes\n";
  }
  void TearDown() override { fs::remove_all(base_); }

  fs::path victim() const { return base_ / "outside" / "victim.txt"; }
  Dir Run() {
    auto d = Dir::Open((base_ / "run").string());
    EXPECT_TRUE(d.ok()) << d.status();
    return std::move(*d);
  }

  fs::path base_;
};

TEST_F(SafefsTest, OpenRefusesAFolderThatIsALink) {
  fs::create_directory_symlink(base_ / "outside", base_ / "linked");
  auto d = Dir::Open((base_ / "linked").string());
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(d.status())) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr((base_ / "linked").string()));
  EXPECT_THAT(d.status().message(), HasSubstr("symbolic link"));
  // The trailing slash does not make it look through the link.
  EXPECT_FALSE(Dir::Open((base_ / "linked").string() + "/").ok());
  // OpenFollowing is for folders the storage-root check resolved (the data's folder).
  EXPECT_TRUE(Dir::OpenFollowing((base_ / "linked").string()).ok());
}

TEST_F(SafefsTest, AFileLinkIsRefusedAndItsTargetUntouched) {
  fs::create_symlink(victim(), base_ / "run" / "LOCK");
  const auto before = fs::last_write_time(victim());
  Dir run = Run();
  for (int flags :
       {O_RDWR | O_CREAT, O_WRONLY | O_CREAT | O_TRUNC, O_WRONLY | O_APPEND, O_RDONLY}) {
    auto fd = run.OpenFile("LOCK", flags);
    ASSERT_FALSE(fd.ok()) << flags;
    EXPECT_TRUE(absl::IsPermissionDenied(fd.status())) << fd.status();
    EXPECT_THAT(fd.status().message(), HasSubstr((base_ / "run" / "LOCK").string()));
    // The target is never named or quoted.
    EXPECT_THAT(fd.status().message(), Not(HasSubstr("victim")));
  }
  EXPECT_FALSE(run.ReadFile("LOCK").ok());
  EXPECT_EQ(Slurp(victim()), "victim's bytes\n");
  EXPECT_EQ(fs::last_write_time(victim()), before);
}

TEST_F(SafefsTest, AtomicWriteReplacesALinkNeverItsTarget) {
  fs::create_symlink(victim(), base_ / "run" / "rank_0.pid");
  ASSERT_TRUE(Run().WriteFileAtomically("rank_0.pid", "1234\n", /*sync=*/true).ok());
  EXPECT_FALSE(fs::is_symlink(base_ / "run" / "rank_0.pid"));
  EXPECT_EQ(Slurp(base_ / "run" / "rank_0.pid"), "1234\n");
  EXPECT_EQ(Slurp(victim()), "victim's bytes\n");
  // No temporary is left behind.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(base_ / "run")) entries += e.exists() ? 1 : 0;
  EXPECT_EQ(entries, 1);
}

TEST_F(SafefsTest, SubAndWalkRefuseALinkedFolderEvenWhenCreating) {
  fs::create_directory_symlink(base_ / "outside", base_ / "run" / "step_5");
  Dir run = Run();
  auto sub = run.Sub("step_5", /*create=*/true);
  ASSERT_FALSE(sub.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(sub.status()));
  EXPECT_THAT(sub.status().message(), HasSubstr("step_5"));
  auto walk = run.Walk("step_5/rank_0", /*create=*/true);
  ASSERT_FALSE(walk.ok());
  EXPECT_THAT(walk.status().message(), HasSubstr("step_5"));
  EXPECT_FALSE(fs::exists(base_ / "outside" / "rank_0"));  // nothing made through the link
  // A real path is made one folder at a time.
  auto made = run.Walk("step_6/rank_1", /*create=*/true);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->path(), (base_ / "run" / "step_6" / "rank_1").string());
  EXPECT_TRUE(fs::is_directory(base_ / "run" / "step_6" / "rank_1"));
}

TEST_F(SafefsTest, OnlySingleNamesAreTaken) {
  Dir run = Run();
  for (const char* bad : {"", ".", "..", "../outside", "a/b", "/etc/passwd"}) {
    auto fd = run.OpenFile(bad, O_RDONLY);
    ASSERT_FALSE(fd.ok()) << bad;
    EXPECT_TRUE(absl::IsInvalidArgument(fd.status())) << bad << ": " << fd.status();
    EXPECT_FALSE(run.Sub(bad).ok()) << bad;
  }
}

TEST_F(SafefsTest, HardLinksAreNotWrittenInPlace) {
  ASSERT_EQ(link(victim().c_str(), (base_ / "run" / "rank_1.log").c_str()), 0);
  auto fd = Run().OpenFile("rank_1.log", O_WRONLY | O_APPEND);
  ASSERT_FALSE(fd.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(fd.status())) << fd.status();
  EXPECT_THAT(fd.status().message(), HasSubstr("hard link"));
  EXPECT_EQ(Slurp(victim()), "victim's bytes\n");
  // Reading one is harmless.
  EXPECT_TRUE(Run().OpenFile("rank_1.log", O_RDONLY).ok());
}

TEST_F(SafefsTest, AFifoIsRefusedWithoutBlocking) {
  ASSERT_EQ(mkfifo((base_ / "run" / "rank_0.log").c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  auto w = Run().OpenFile("rank_0.log", O_WRONLY | O_CREAT | O_APPEND);
  auto r = Run().OpenFile("rank_0.log", O_RDONLY);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_FALSE(w.ok());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("not a regular file"));
}

TEST_F(SafefsTest, RemoveTreeRemovesLinksNotWhatTheyPointAt) {
  fs::create_directories(base_ / "run" / "step_1" / "rank_0");
  std::ofstream(base_ / "run" / "step_1" / "rank_0" / "DONE") << "1\n";
  fs::create_directory_symlink(base_ / "outside", base_ / "run" / "step_1" / "rank_1");
  fs::create_symlink(victim(), base_ / "run" / "step_1" / "model.safetensors");
  ASSERT_TRUE(Run().RemoveTree("step_1").ok());
  EXPECT_FALSE(fs::exists(base_ / "run" / "step_1"));
  EXPECT_EQ(Slurp(victim()), "victim's bytes\n");
  EXPECT_TRUE(fs::is_directory(base_ / "outside"));
  // A missing tree is fine.
  EXPECT_TRUE(Run().RemoveTree("step_1").ok());
}

TEST_F(SafefsTest, KindOfDoesNotFollow) {
  fs::create_symlink(victim(), base_ / "run" / "DONE");
  fs::create_directory(base_ / "run" / "step_0");
  std::ofstream(base_ / "run" / "plan.txt") << "x";
  Dir run = Run();
  EXPECT_EQ(run.KindOf("DONE"), Kind::kLink);
  EXPECT_EQ(run.KindOf("step_0"), Kind::kDirectory);
  EXPECT_EQ(run.KindOf("plan.txt"), Kind::kFile);
  EXPECT_EQ(run.KindOf("missing"), Kind::kMissing);
}

TEST_F(SafefsTest, TheFirstClaimRecordsTheOwnerAndOthersAreRefused) {
  Dir run = Run();
  ASSERT_TRUE(ClaimOwner(run, {"alice", false}).ok());
  EXPECT_EQ(Slurp(base_ / "run" / "OWNER"), "alice\n");
  struct stat first;
  ASSERT_EQ(stat((base_ / "run" / "OWNER").c_str(), &first), 0);
  // Her next claim reads it and writes nothing.
  ASSERT_TRUE(ClaimOwner(run, {"alice", false}).ok());
  struct stat again;
  ASSERT_EQ(stat((base_ / "run" / "OWNER").c_str(), &again), 0);
  EXPECT_EQ(first.st_ino, again.st_ino);
  EXPECT_EQ(first.st_mtim.tv_nsec, again.st_mtim.tv_nsec);

  const absl::Status bob = ClaimOwner(run, {"bob", false}, "checkpoint.dir", "write into");
  EXPECT_TRUE(absl::IsPermissionDenied(bob)) << bob;
  EXPECT_THAT(bob.message(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(bob.message(), HasSubstr("belongs to alice"));
  EXPECT_THAT(bob.message(), HasSubstr("user bob may not write into it"));
  // An admin may; the folder stays alice's.
  EXPECT_TRUE(ClaimOwner(run, {"root", true}).ok());
  EXPECT_EQ(Slurp(base_ / "run" / "OWNER"), "alice\n");
  auto owner = ReadOwner(run);
  ASSERT_TRUE(owner.ok());
  EXPECT_EQ(*owner, "alice");
}

TEST_F(SafefsTest, AnOwnerLinkIsRefusedAndNotWrittenThrough) {
  fs::create_symlink(base_ / "outside" / "missing_owner", base_ / "run" / "OWNER");
  const absl::Status st = ClaimOwner(Run(), {"bob", false});
  EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("OWNER"));
  EXPECT_FALSE(fs::exists(base_ / "outside" / "missing_owner"));  // O_EXCL: never created
}

TEST_F(SafefsTest, AClaimLeavesNoTemporaryAndNoEmptyOwner) {
  ASSERT_TRUE(ClaimOwner(Run(), {"carol", false}).ok());
  EXPECT_EQ(Slurp(base_ / "run" / "OWNER"), "carol\n");
  int entries = 0;
  for (const auto& e : fs::directory_iterator(base_ / "run")) entries += e.exists() ? 1 : 0;
  EXPECT_EQ(entries, 1);
  // An empty OWNER was not written by a claim: it is refused, not taken over.
  fs::remove(base_ / "run" / "OWNER");
  std::ofstream(base_ / "run" / "OWNER");
  EXPECT_TRUE(absl::IsDataLoss(ClaimOwner(Run(), {"carol", false})));
}

TEST_F(SafefsTest, AMalformedOwnerIsRefusedWithoutQuotingIt) {
  std::ofstream(base_ / "run" / "OWNER") << "root:x:0:0:secret\n";
  auto owner = ReadOwner(Run());
  ASSERT_FALSE(owner.ok());
  EXPECT_TRUE(absl::IsDataLoss(owner.status()));
  EXPECT_THAT(owner.status().message(), Not(HasSubstr("secret")));
  EXPECT_FALSE(ClaimOwner(Run(), {"root", false}).ok());
  EXPECT_FALSE(ClaimOwner(Run(), {"bad name", false}).ok());
}

TEST_F(SafefsTest, OnlyOneOfTwoRacingClaimsWins) {
  // Without the run lock, O_EXCL still lets exactly one user become the owner.
  for (int round = 0; round < 20; ++round) {
    fs::remove(base_ / "run" / "OWNER");
    absl::Status a, b;
    std::thread ta([&] { a = ClaimOwner(Run(), {"alice", false}); });
    std::thread tb([&] { b = ClaimOwner(Run(), {"bob", false}); });
    ta.join();
    tb.join();
    const std::string owner = Slurp(base_ / "run" / "OWNER");
    ASSERT_TRUE(owner == "alice\n" || owner == "bob\n") << owner;
    EXPECT_NE(a.ok(), b.ok()) << a << " / " << b;
    // The loser is told who won.
    const absl::Status& lost = a.ok() ? b : a;
    EXPECT_TRUE(absl::IsPermissionDenied(lost)) << lost;
    EXPECT_THAT(std::string(lost.message()), HasSubstr(owner.substr(0, owner.size() - 1)));
  }
}

TEST(LocalUserNameTest, IsAValidOwnerName) { EXPECT_TRUE(ValidOwnerName(LocalUserName())); }

}  // namespace
}  // namespace vp::safefs
