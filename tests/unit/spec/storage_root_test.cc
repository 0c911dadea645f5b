#include "proto/spec/storage_root.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace vp::spec {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class StorageRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("vp_root_" + std::to_string(getpid()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "root" / "data");
    fs::create_directories(base_ / "outside");
    std::ofstream(base_ / "outside" / "secret.bin") << "secret";
    std::ofstream(base_ / "root" / "data" / "tokens.bin") << "tokens";
    auto root = ResolveStorageRoot((base_ / "root").string());
    ASSERT_TRUE(root.ok()) << root.status();
    root_ = *root;
  }
  void TearDown() override { fs::remove_all(base_); }

  vocabpipe::v1::JobSpec Spec(const fs::path& data, const fs::path& ckpt) {
    vocabpipe::v1::JobSpec s;
    s.mutable_data()->set_path(data.string());
    s.mutable_checkpoint()->set_dir(ckpt.string());
    return s;
  }

  fs::path base_;
  std::string root_;
};

TEST_F(StorageRootTest, RootMustBeAnExistingDirectory) {
  EXPECT_THAT(ResolveStorageRoot((base_ / "nope").string()).status().message(),
              HasSubstr("--storage-root: "));
  EXPECT_THAT(ResolveStorageRoot((base_ / "outside" / "secret.bin").string()).status().message(),
              HasSubstr("is not a directory"));
  EXPECT_FALSE(ResolveStorageRoot("").ok());
}

TEST_F(StorageRootTest, InsidePathsPass) {
  EXPECT_TRUE(
      CheckSpecPaths(Spec(base_ / "root/data/tokens.bin", base_ / "root/runs/new/dir"), root_)
          .ok());
  // Not existing yet is fine (the run directory is created later).
  EXPECT_TRUE(
      CheckInsideRoot((base_ / "root/x/../data/missing.bin").string(), root_, "data.path").ok());
}

TEST_F(StorageRootTest, OutsidePathsNameTheField) {
  absl::Status st = CheckSpecPaths(Spec("/etc/passwd", base_ / "root/runs/a"), root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(),
              HasSubstr("data.path: \"/etc/passwd\" is outside the storage root " + root_));
  st = CheckSpecPaths(Spec(base_ / "root/data/tokens.bin", base_ / "root/../outside/run"), root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("checkpoint.dir: "));
  // A prefix that is only a string prefix is outside ("/x/root2" is not in "/x/root").
  fs::create_directories(base_ / "root2");
  EXPECT_FALSE(CheckInsideRoot((base_ / "root2/f").string(), root_, "data.path").ok());
  // Relative paths cannot be checked.
  EXPECT_THAT(CheckInsideRoot("data/tokens.bin", root_, "data.path").message(),
              HasSubstr("must be absolute"));
}

TEST_F(StorageRootTest, SymlinksAreFollowed) {
  fs::create_symlink(base_ / "outside", base_ / "root" / "escape");
  fs::create_symlink(base_ / "outside" / "secret.bin", base_ / "root" / "data" / "link.bin");
  absl::Status st =
      CheckInsideRoot((base_ / "root/escape/secret.bin").string(), root_, "data.path");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), Not(HasSubstr("outside/secret.bin\" is")));
  EXPECT_FALSE(CheckInsideRoot((base_ / "root/data/link.bin").string(), root_, "data.path").ok());
  EXPECT_FALSE(
      CheckInsideRoot((base_ / "root/escape/newrun").string(), root_, "checkpoint.dir").ok());
  // A link that stays inside is fine.
  fs::create_symlink(base_ / "root" / "data", base_ / "root" / "alias");
  EXPECT_TRUE(CheckInsideRoot((base_ / "root/alias/tokens.bin").string(), root_, "data.path").ok());
  // No root configured: everything passes.
  EXPECT_TRUE(CheckSpecPaths(Spec("/etc/passwd", "/tmp/x"), "").ok());
}

TEST_F(StorageRootTest, InitFromIsConfinedLikeTheOtherPaths) {
  fs::create_directories(base_ / "outside" / "hf");
  fs::create_directories(base_ / "root" / "models" / "hf");
  auto spec = Spec(base_ / "root/data/tokens.bin", base_ / "root/runs/bob");
  spec.mutable_model()->set_init_from((base_ / "outside" / "hf").string());
  absl::Status st = CheckSpecPaths(spec, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("model.init_from: "));
  EXPECT_THAT(st.message(), HasSubstr("outside the storage root"));
  // Through a link inside the root too.
  fs::create_directory_symlink(base_ / "outside" / "hf", base_ / "root" / "models" / "linked");
  spec.mutable_model()->set_init_from((base_ / "root" / "models" / "linked").string());
  EXPECT_EQ(CheckSpecPaths(spec, root_).code(), absl::StatusCode::kPermissionDenied);
  spec.mutable_model()->set_init_from((base_ / "root" / "models" / "hf").string());
  EXPECT_TRUE(CheckSpecPaths(spec, root_).ok());
}

TEST_F(StorageRootTest, TheTokenizerBesideTheDataIsConfinedToo) {
  const auto spec = Spec(base_ / "root/data/tokens.bin", base_ / "root/runs/new");
  EXPECT_TRUE(CheckSpecPaths(spec, root_).ok());
  std::ofstream(base_ / "outside" / "secret.model") << "not yours";
  fs::create_symlink(base_ / "outside" / "secret.model", base_ / "root/data/tokenizer.model");
  const absl::Status st = CheckSpecPaths(spec, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("data.path's tokenizer.model: "));
  EXPECT_THAT(st.message(), Not(HasSubstr("not yours")));
}

// Run folders and their owners (proto/safefs/run_owner.h) at submit.
class RunOwnerTest : public StorageRootTest {
 protected:
  void SetUp() override {
    StorageRootTest::SetUp();
    // alice's finished run: OWNER, a step folder with its weights.
    fs::create_directories(base_ / "root/runs/alice/step_10/rank_0");
    std::ofstream(base_ / "root/runs/alice/OWNER") << "alice\n";
    std::ofstream(base_ / "root/runs/alice/step_10/model.safetensors") << "weights";
  }
  vocabpipe::v1::JobSpec Into(const std::string& dir, const std::string& init = "") {
    auto s = Spec(base_ / "root/data/tokens.bin", base_ / "root" / dir);
    if (!init.empty()) s.mutable_model()->set_init_from((base_ / "root" / init).string());
    return s;
  }
  const safefs::RunUser alice_{"alice", false}, bob_{"bob", false}, root_user_{"root", true};
};

TEST_F(RunOwnerTest, AnotherUsersRunFolderIsRefusedNamingFieldAndOwner) {
  absl::Status st = CheckSpecOwners(Into("runs/alice"), false, bob_, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(st.message(), HasSubstr("belongs to alice"));
  EXPECT_THAT(st.message(), HasSubstr("user bob may not write into it"));
  st = CheckSpecOwners(Into("runs/alice"), /*resume=*/true, bob_, root_);
  EXPECT_THAT(st.message(), HasSubstr("may not resume from or write into it"));
  // Its owner and an admin may; a fresh folder is anyone's; so is one without an owner.
  EXPECT_TRUE(CheckSpecOwners(Into("runs/alice"), true, alice_, root_).ok());
  EXPECT_TRUE(CheckSpecOwners(Into("runs/alice"), true, root_user_, root_).ok());
  EXPECT_TRUE(CheckSpecOwners(Into("runs/bob-new"), false, bob_, root_).ok());
  fs::create_directories(base_ / "root/runs/old");
  EXPECT_TRUE(CheckSpecOwners(Into("runs/old"), false, bob_, root_).ok());
}

TEST_F(RunOwnerTest, InitFromAnotherUsersRunIsRefused) {
  absl::Status st = CheckSpecOwners(Into("runs/bob", "runs/alice/step_10"), false, bob_, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("model.init_from: "));
  EXPECT_THAT(st.message(), HasSubstr("belongs to alice"));
  EXPECT_THAT(st.message(), HasSubstr("user bob may not read the weights of it"));
  // A link in bob's own folder to alice's step is judged by its target.
  fs::create_directories(base_ / "root/runs/bob");
  std::ofstream(base_ / "root/runs/bob/OWNER") << "bob\n";
  fs::create_directory_symlink(base_ / "root/runs/alice/step_10", base_ / "root/runs/bob/hf");
  st = CheckSpecOwners(Into("runs/bob2", "runs/bob/hf"), false, bob_, root_);
  EXPECT_THAT(st.message(), HasSubstr("belongs to alice"));
  // Her own run, an admin, and a model folder outside every run folder are fine.
  EXPECT_TRUE(CheckSpecOwners(Into("runs/a2", "runs/alice/step_10"), false, alice_, root_).ok());
  EXPECT_TRUE(CheckSpecOwners(Into("runs/r", "runs/alice/step_10"), false, root_user_, root_).ok());
  fs::create_directories(base_ / "root/models/hf");
  EXPECT_TRUE(CheckSpecOwners(Into("runs/bob3", "models/hf"), false, bob_, root_).ok());
}

TEST_F(RunOwnerTest, ALinkWhereARunFileBelongsIsRefusedAtSubmit) {
  fs::create_directories(base_ / "root/runs/evil");
  fs::create_symlink(base_ / "outside" / "secret.bin", base_ / "root/runs/evil/rank_1.log");
  absl::Status st = CheckSpecOwners(Into("runs/evil"), false, bob_, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(st.message(), HasSubstr("runs/evil/rank_1.log is a symbolic link"));
  // Below a step folder any link counts; elsewhere a user's own link is left alone.
  fs::remove(base_ / "root/runs/evil/rank_1.log");
  fs::create_symlink(base_ / "outside", base_ / "root/runs/evil/notes");
  EXPECT_TRUE(CheckSpecOwners(Into("runs/evil"), false, bob_, root_).ok());
  fs::create_directories(base_ / "root/runs/evil/step_2/rank_0");
  fs::create_symlink(base_ / "outside" / "secret.bin",
                     base_ / "root/runs/evil/step_2/rank_0/model.safetensors");
  st = CheckSpecOwners(Into("runs/evil"), false, bob_, root_);
  EXPECT_THAT(st.message(), HasSubstr("step_2/rank_0/model.safetensors is a symbolic link"));
}

TEST_F(RunOwnerTest, ALinkInPlaceOfTheRunFolderIsRefused) {
  fs::create_directory_symlink(base_ / "root/runs/alice", base_ / "root/runs/alias");
  absl::Status st = CheckSpecOwners(Into("runs/alias"), false, alice_, root_);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(st.message(), HasSubstr("checkpoint.dir: "));
  EXPECT_THAT(st.message(), HasSubstr("symbolic link"));
}

}  // namespace
}  // namespace vp::spec
