// Runs the `vocabpipe data` subcommands in-process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/commands.h"
#include "worker/data/token_file.h"

namespace vp::cli {
namespace {

using ::testing::HasSubstr;

class DataCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("vp_data_command_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  int Run(const Args& args) {
    out_.str("");
    err_.str("");
    return RunDataCommand(args, out_, err_);
  }

  std::filesystem::path dir_;
  std::ostringstream out_, err_;
};

TEST_F(DataCommandTest, SynthWritesV1AndPrintsEntropy) {
  const std::string f = Path("d.bin");
  ASSERT_EQ(Run({"synth", "--vocab", "1000", "--tokens", "5000", "--out", f, "--seed=7"}), 0)
      << err_.str();
  EXPECT_THAT(out_.str(),
              HasSubstr("wrote 5000 tokens (uint16, version 1) to " + f + "; entropy rate "));
  EXPECT_THAT(out_.str(), HasSubstr(" nats/token"));
  absl::StatusOr<data::TokenFile> file = data::TokenFile::Load(f, 1000);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 5000);
  EXPECT_EQ(file->header().format, data::TokenFormat::kUint16V1);

  // Same seed, same file; the printed rate is the same too.
  const std::string first = out_.str();
  ASSERT_EQ(
      Run({"synth", "--vocab", "1000", "--tokens", "5000", "--out", Path("e.bin"), "--seed", "7"}),
      0);
  absl::StatusOr<data::TokenFile> again = data::TokenFile::Load(Path("e.bin"), 1000);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(std::equal(file->tokens().begin(), file->tokens().end(), again->tokens().begin()));
  EXPECT_EQ(first.substr(first.find("entropy")), out_.str().substr(out_.str().find("entropy")));
}

TEST_F(DataCommandTest, SynthLargeVocabularyWritesV7) {
  const std::string f = Path("big.bin");
  ASSERT_EQ(Run({"synth", "--vocab", "70000", "--tokens", "1000", "--out", f, "--branching", "8"}),
            0)
      << err_.str();
  EXPECT_THAT(out_.str(), HasSubstr("(uint32, version 7)"));
  absl::StatusOr<data::TokenFile> file = data::TokenFile::Load(f, 70000);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header().format, data::TokenFormat::kUint32V7);
}

TEST_F(DataCommandTest, SynthUsageErrorsNameTheFlag) {
  const std::string f = Path("x.bin");
  EXPECT_EQ(Run({"synth", "--tokens", "10", "--out", f}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--vocab: required"));
  EXPECT_EQ(Run({"synth", "--vocab", "abc", "--tokens", "10", "--out", f}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--vocab: expected an integer in [2, 2147483647], got "
                                    "\"abc\""));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "0", "--out", f}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--tokens: expected an integer in [1, "));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--out: required"));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10", "--out", f, "--branching", "1"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--branching: expected an integer in [2, 256]"));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10", "--out", f, "--seed", "-1"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--seed: expected a non-negative integer"));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10", "--out", f, "--colour", "red"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--colour: unknown flag"));
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10", "--out"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--out: missing value"));
  EXPECT_EQ(Run({"synth", "--vocab", "70000", "--tokens", "10", "--out", f, "--format", "v1"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--format: v1 stores uint16 ids"));
  EXPECT_FALSE(std::filesystem::exists(f));
  EXPECT_EQ(Run({}), 2);
  EXPECT_EQ(Run({"shred"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("unknown subcommand \"shred\""));
  EXPECT_EQ(Run({"help"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("vocabpipe data synth"));
}

TEST_F(DataCommandTest, SynthWriteFailureIsARuntimeFailure) {
  EXPECT_EQ(Run({"synth", "--vocab", "10", "--tokens", "10", "--out", Path("no/such/dir/x.bin")}),
            1);
  EXPECT_THAT(err_.str(), HasSubstr("cannot create"));
}

TEST_F(DataCommandTest, InspectPrintsHeaderAndValidatesIds) {
  const std::string f = Path("i.bin");
  ASSERT_EQ(data::WriteTokenFile(f, std::vector<uint32_t>{1, 2, 3, 999}).status().code(),
            absl::StatusCode::kOk);
  ASSERT_EQ(Run({"inspect", f, "--vocab", "1000"}), 0) << err_.str();
  EXPECT_THAT(out_.str(), HasSubstr("format:  uint16, version 1 (magic 20240520)"));
  EXPECT_THAT(out_.str(), HasSubstr("tokens:  4"));
  EXPECT_THAT(out_.str(), HasSubstr("bytes:   1032"));
  EXPECT_THAT(out_.str(), HasSubstr("max id:  999"));
  EXPECT_THAT(out_.str(), HasSubstr("all < 1000 (ok)"));

  EXPECT_EQ(Run({"inspect", f, "--vocab", "999"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("token 3 (byte offset 1030) has id 999, not < vocab size "
                                    "999"));
  EXPECT_EQ(Run({"inspect"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("missing the token file"));
  EXPECT_EQ(Run({"inspect", Path("none.bin")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("none.bin"));
}

// A small English text with blank-line-separated paragraphs and non-ASCII characters.
std::string SampleText() {
  std::string text;
  for (int i = 0; i < 40; ++i) {
    text += "Paragraph " + std::to_string(i) +
            ": the quick brown fox jumps over the lazy dog. Caf\xC3\xA9  and  tea.\n";
    if (i % 2 == 1) text += "\n";
  }
  return text;
}

void WriteText(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST_F(DataCommandTest, TrainTokenizerThenTokenizeWritesShardsAndSummary) {
  const std::string text = Path("corpus.txt");
  WriteText(text, SampleText());
  const std::string model = Path("tok.model");
  ASSERT_EQ(Run({"train-tokenizer", text, "--vocab-size", "320", "--out", model}), 0) << err_.str();
  EXPECT_THAT(out_.str(), HasSubstr("bpe tokenizer, 320 tokens (EOT <|endoftext|> = 1)"));
  EXPECT_THAT(out_.str(), HasSubstr("20 documents"));

  const std::string dir = Path("shards");
  ASSERT_EQ(Run({"tokenize", "--tokenizer", model, text, "--out", dir, "--val-fraction", "0.1",
                 "--threads", "2"}),
            0)
      << err_.str();
  EXPECT_THAT(out_.str(), HasSubstr("20 documents (18 train, 2 val)"));
  EXPECT_THAT(out_.str(), HasSubstr("bytes/token, uint16 tokens, vocabulary 320"));
  for (const std::string name : {"shards_train_000000.bin", "shards_val_000000.bin"}) {
    absl::StatusOr<data::TokenFile> f = data::TokenFile::Load(dir + "/" + name, 320);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->tokens()[0], 1u) << "every document starts with EOT";
  }
  EXPECT_TRUE(std::filesystem::exists(dir + "/tokenizer.model"));
}

TEST_F(DataCommandTest, TextCommandsNameBadInput) {
  const std::string empty = Path("empty.txt");
  WriteText(empty, "");
  EXPECT_EQ(Run({"train-tokenizer", empty, "--vocab-size", "320", "--out", Path("t.model")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("empty.txt: empty file"));
  const std::string latin1 = Path("latin1.txt");
  WriteText(latin1, "na\xEFve");
  EXPECT_EQ(Run({"train-tokenizer", latin1, "--vocab-size", "320", "--out", Path("t.model")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("latin1.txt: not UTF-8 text: invalid byte sequence at byte "
                                    "offset 2"));
  EXPECT_EQ(Run({"train-tokenizer", latin1, "--vocab-size", "10", "--out", Path("t.model")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--vocab-size: expected an integer in [300"));
  EXPECT_EQ(Run({"tokenize", "--tokenizer", latin1, latin1, "--out", Path("o")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("latin1.txt: not a SentencePiece model"));
  EXPECT_EQ(Run({"tokenize", latin1, "--out", Path("o")}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--tokenizer: required"));
}

}  // namespace
}  // namespace vp::cli
