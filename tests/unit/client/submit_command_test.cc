// `vocabpipe submit` checks what it can see before it connects: a model vocabulary that does not
// match the tokenizer.model beside data.path, or beside data.val_path, is refused (exit 2) naming
// the field, and no coordinator is contacted (none listens at the address given).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "client/commands.h"
#include "client/control_client.h"

namespace vp::cli {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class SubmitCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("vp_submit_command_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_ / "train");
    fs::create_directories(dir_ / "val");
    std::string text;
    for (int i = 0; i < 100; ++i) {
      text += "Line " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog.\n";
    }
    std::ofstream(dir_ / "corpus.txt") << text;
    std::ostringstream out, err;
    ASSERT_EQ(RunDataCommand({"train-tokenizer", (dir_ / "corpus.txt").string(), "--vocab-size",
                              "320", "--out", (dir_ / "tok.model").string()},
                             out, err),
              0)
        << err.str();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A job file whose model has `vocab` tokens, training on train/ and validating on val/.
  std::string Spec(int vocab) const {
    const fs::path p = dir_ / "job.yaml";
    std::ofstream(p) << "model: {layers: 1, hidden: 32, heads: 2, vocab_size: " << vocab
                     << ", seq_len: 16}\n"
                        "parallel: {microbatch_size: 2, microbatches: 1}\n"
                        "train: {steps: 2, eval_every: 1}\n"
                        "data: {path: train/t.bin, val_path: val/v.bin}\n"
                        "checkpoint: {dir: run}\n";
    return p.string();
  }
  int Submit(const std::string& spec) {
    out_.str("");
    err_.str("");
    return RunSubmitCommand({spec, "--coordinator", "127.0.0.1:1", "--insecure"}, out_, err_);
  }

  fs::path dir_;
  std::ostringstream out_, err_;
};

TEST_F(SubmitCommandTest, RefusesAVocabularyThatDoesNotMatchTheValidationTokenizer) {
  // Only the validation folder has a tokenizer: the check must look there too.
  fs::copy_file(dir_ / "tok.model", dir_ / "val" / "tokenizer.model");
  EXPECT_EQ(Submit(Spec(400)), kExitUsage);
  EXPECT_THAT(err_.str(), HasSubstr("data.val_path: "));
  EXPECT_THAT(err_.str(), HasSubstr("model.vocab_size: 400 does not match the tokenizer"));
  EXPECT_THAT(err_.str(), HasSubstr("tokenizer.model has 320 tokens"));
  EXPECT_EQ(out_.str(), "");
}

TEST_F(SubmitCommandTest, RefusesAVocabularyThatDoesNotMatchTheTrainingTokenizer) {
  fs::copy_file(dir_ / "tok.model", dir_ / "train" / "tokenizer.model");
  EXPECT_EQ(Submit(Spec(400)), kExitUsage);
  EXPECT_THAT(err_.str(), HasSubstr("model.vocab_size: 400 does not match the tokenizer"));
  EXPECT_THAT(err_.str(), Not(HasSubstr("data.val_path")));
}

}  // namespace
}  // namespace vp::cli
