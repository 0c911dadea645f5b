// Run-folder files of the runtime never go through a link (proto/safefs): the tokenizer copy
// into a checkpoint, safetensors files in a run folder, and the search for the newest step.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "worker/runtime/checkpoint.h"
#include "worker/runtime/run_job.h"
#include "worker/runtime/safetensors.h"

namespace vp::runtime {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string Slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class RunFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("vp_run_files_" + std::to_string(getpid()));
    fs::remove_all(base_);
    fs::create_directories(base_ / "data");
    fs::create_directories(base_ / "run" / "step_1");
    fs::create_directories(base_ / "outside");
    std::ofstream(base_ / "outside" / "secret.model") << "someone else's model";
    std::ofstream(base_ / "data" / "data.bin") << "tokens";
    spec_.mutable_data()->set_path((base_ / "data" / "data.bin").string());
  }
  void TearDown() override { fs::remove_all(base_); }

  fs::path base_;
  vocabpipe::v1::JobSpec spec_;
};

TEST_F(RunFilesTest, TheTokenizerIsCopiedButNeverThroughALink) {
  const std::string step = (base_ / "run" / "step_1").string();
  // No tokenizer: nothing to copy.
  ASSERT_TRUE(CopyDataTokenizer(spec_, step).ok());
  EXPECT_FALSE(fs::exists(base_ / "run" / "step_1" / "tokenizer.model"));
  // A link beside the data (probe 26): refused, naming it; nothing lands in the checkpoint.
  fs::create_symlink(base_ / "outside" / "secret.model", base_ / "data" / "tokenizer.model");
  const absl::Status st = CopyDataTokenizer(spec_, step);
  EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("data/tokenizer.model is a symbolic link"));
  EXPECT_THAT(st.message(), ::testing::Not(HasSubstr("someone else")));
  EXPECT_FALSE(fs::exists(base_ / "run" / "step_1" / "tokenizer.model"));
  // A real one is copied; a link in the step folder under its name is replaced, not followed.
  fs::remove(base_ / "data" / "tokenizer.model");
  std::ofstream(base_ / "data" / "tokenizer.model") << "our model";
  fs::create_symlink(base_ / "outside" / "secret.model",
                     base_ / "run" / "step_1" / "tokenizer.model");
  ASSERT_TRUE(CopyDataTokenizer(spec_, step).ok());
  EXPECT_FALSE(fs::is_symlink(base_ / "run" / "step_1" / "tokenizer.model"));
  EXPECT_EQ(Slurp(base_ / "run" / "step_1" / "tokenizer.model"), "our model");
  EXPECT_EQ(Slurp(base_ / "outside" / "secret.model"), "someone else's model");
}

TEST_F(RunFilesTest, SafetensorsInARunFolderRefuseLinks) {
  auto dir = safefs::Dir::Open((base_ / "run" / "step_1").string());
  ASSERT_TRUE(dir.ok()) << dir.status();
  const std::vector<float> data = {1, 2, 3, 4};
  const std::vector<TensorView> tensors = {{"w", {2, 2}, data.data()}};
  fs::create_symlink(base_ / "outside" / "secret.model",
                     base_ / "run" / "step_1" / "model.safetensors");
  auto read = ReadSafetensorsAt(*dir, "model.safetensors");
  ASSERT_FALSE(read.ok());
  EXPECT_TRUE(absl::IsPermissionDenied(read.status())) << read.status();
  // Writing replaces the link with the new file; the target keeps its bytes.
  ASSERT_TRUE(WriteSafetensorsAt(*dir, "model.safetensors", tensors).ok());
  EXPECT_FALSE(fs::is_symlink(base_ / "run" / "step_1" / "model.safetensors"));
  EXPECT_EQ(Slurp(base_ / "outside" / "secret.model"), "someone else's model");
  read = ReadSafetensorsAt(*dir, "model.safetensors");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tensors.at("w").data, data);
}

TEST_F(RunFilesTest, TheNewestStepIsFoundWithoutFollowingLinks) {
  std::ofstream(base_ / "run" / "step_1" / "DONE") << "1\n";
  fs::create_directories(base_ / "outside" / "step_9");
  std::ofstream(base_ / "outside" / "step_9" / "DONE") << "9\n";
  fs::create_directory_symlink(base_ / "outside" / "step_9", base_ / "run" / "step_9");
  fs::create_directories(base_ / "run" / "step_5");
  fs::create_symlink(base_ / "outside" / "step_9" / "DONE", base_ / "run" / "step_5" / "DONE");
  auto latest = LatestCheckpointStep((base_ / "run").string());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 1);
}

}  // namespace
}  // namespace vp::runtime
