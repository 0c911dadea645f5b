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

}  // namespace
}  // namespace vp::spec
