// The SentencePiece tokenizer and text → shards: exact round trips, shards read back by the
// token-file reader in both versions, and clear errors for bad input.
#include "worker/data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/data/text_corpus.h"
#include "worker/data/token_file.h"

namespace vp::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// A small English corpus with whitespace runs, tabs, digits and non-ASCII text.
std::string Corpus() {
  std::string text;
  const std::vector<std::string> lines = {
      "The quick brown fox jumps over the lazy dog.\n",
      "In the beginning was the word, and the word was with the text.\n",
      "  Indented line with  two  spaces\tand a tab.\n",
      "Numbers 12345 and 2024-11-23 appear here.\n",
      "Caf\xC3\xA9, na\xC3\xAFve, \xC3\xBC"
      "ber, \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E.\n",
  };
  for (int i = 0; i < 60; ++i) {
    text += lines[static_cast<size_t>(i) % lines.size()];
    if (i % 3 == 2) text += "\n";  // a blank line: a new document
  }
  return text;
}

fs::path TempDir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() /
      (name + "_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

class TokenizerTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerTest, RoundTripsTextExactly) {
  const std::string corpus = Corpus();
  TokenizerTrainOptions opt;
  opt.model_type = GetParam();
  // Unigram learns fewer pieces from this small corpus.
  opt.vocab_size = GetParam() == "bpe" ? 400 : 310;
  absl::StatusOr<std::string> model = Tokenizer::Train(SplitDocuments(corpus), opt);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromModel(*model, "tok.model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(tok->vocab_size(), opt.vocab_size);
  EXPECT_EQ(tok->eot_id(), 1u);
  const std::vector<std::string> texts = {
      corpus,
      "   leading spaces, trailing spaces   ",
      "runs\n\n\n\nof\t\t\tnewlines and tabs\r\n",
      "unseen characters: \xCE\xA9\xCE\xBB \xF0\x9F\x8E\x89 \xE2\x96\x81 U+2581 itself",
      "\xE2\x96\x81\xE2\x96\x81 a\xE2\x96\x81"
      "b ",
      " ",
  };
  for (const std::string& text : texts) {
    absl::StatusOr<std::vector<uint32_t>> ids = tok->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status();
    for (uint32_t id : *ids) EXPECT_NE(id, tok->eot_id());
    absl::StatusOr<std::string> back = tok->Decode(*ids);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, text);
  }
  // The tokenizer learned pieces: the corpus takes fewer tokens than bytes.
  absl::StatusOr<std::vector<uint32_t>> ids = tok->Encode(corpus);
  ASSERT_TRUE(ids.ok());
  EXPECT_LT(ids->size(), corpus.size());
}

INSTANTIATE_TEST_SUITE_P(ModelTypes, TokenizerTest, ::testing::Values("bpe", "unigram"));

TEST(TokenizerTrain, RejectsBadOptions) {
  const std::string corpus = Corpus();
  TokenizerTrainOptions opt;
  opt.vocab_size = 100;
  absl::StatusOr<std::string> model = Tokenizer::Train(SplitDocuments(corpus), opt);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(model.status().message(), HasSubstr("--vocab-size"));
  opt.vocab_size = 400;
  opt.model_type = "word";
  model = Tokenizer::Train(SplitDocuments(corpus), opt);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(model.status().message(), HasSubstr("--model-type"));
}

TEST(TokenizerLoad, RefusesAFileThatIsNotAModel) {
  const fs::path dir = TempDir("vp_tok");
  WriteFile(dir / "bad.model", "this is not a protobuf at all");
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load((dir / "bad.model").string());
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(tok.status().message(), HasSubstr("bad.model"));
  EXPECT_THAT(tok.status().message(), Not(HasSubstr("protobuf at all")));
}

TEST(SplitDocuments, ConcatenatesBackToTheText) {
  const std::string text = "\n\nfirst\nstill first\n\n\nsecond\n\nthird";
  const std::vector<std::string_view> docs = SplitDocuments(text);
  ASSERT_EQ(docs.size(), 4u);
  EXPECT_EQ(docs[0], "\n\n");
  EXPECT_EQ(docs[1], "first\nstill first\n\n\n");
  EXPECT_EQ(docs[2], "second\n\n");
  EXPECT_EQ(docs[3], "third");
}

TEST(ValidationSplit, TakesExactlyTheFraction) {
  int val = 0;
  for (int i = 0; i < 1000; ++i) val += IsValidationDocument(i, 0.1) ? 1 : 0;
  EXPECT_EQ(val, 100);
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(IsValidationDocument(i, 0.0));
}

TEST(ReadTextFile, RefusesEmptyAndNonUtf8FilesNamingThem) {
  const fs::path dir = TempDir("vp_text");
  WriteFile(dir / "empty.txt", "");
  absl::StatusOr<std::string> r = ReadTextFile((dir / "empty.txt").string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("empty.txt: empty file"));

  WriteFile(dir / "latin1.txt", "caf\xE9 secret-contents");
  r = ReadTextFile((dir / "latin1.txt").string());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("latin1.txt: not UTF-8 text"));
  EXPECT_THAT(r.status().message(), HasSubstr("byte offset 3"));
  EXPECT_THAT(r.status().message(), Not(HasSubstr("secret")));

  for (const std::string bad : {"\xC0\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "ab\xE2\x96"}) {
    EXPECT_GE(FirstInvalidUtf8(bad), 0) << "accepted an invalid sequence";
  }
  EXPECT_EQ(FirstInvalidUtf8("plain \xC3\xA9 \xF0\x9F\x8E\x89"), -1);
}

// Text → shards → the token-file reader → decode: the documents come back exactly, in both
// file versions (a vocabulary over 65536 would need a large corpus, so version 7 is checked
// by re-writing the shard's tokens as version 7 and reading them with the same reader).
TEST(TokenizeFiles, ShardsReadBackAndDecodeToTheText) {
  const fs::path dir = TempDir("vp_shards");
  const std::string a = Corpus();
  const std::string b = "Second file.\n\nWith \xC3\xA9 and   spaces.\n\n\nEnd";
  WriteFile(dir / "a.txt", a);
  WriteFile(dir / "b.txt", b);
  TokenizerTrainOptions topt;
  topt.vocab_size = 400;
  absl::StatusOr<std::string> model = Tokenizer::Train(SplitDocuments(a), topt);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromModel(*model, "tok.model");
  ASSERT_TRUE(tok.ok()) << tok.status();

  TokenizeOptions opt;
  opt.out_dir = (dir / "out").string();
  opt.name = "demo";
  opt.val_fraction = 0.25;
  opt.threads = 3;
  opt.shard_tokens = 150;  // several train shards
  absl::StatusOr<TokenizeSummary> s =
      TokenizeFiles({(dir / "a.txt").string(), (dir / "b.txt").string()}, *tok, *model, opt);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<std::string_view> da = SplitDocuments(a), db = SplitDocuments(b);
  EXPECT_EQ(s->documents, static_cast<int64_t>(da.size() + db.size()));
  EXPECT_EQ(s->val_documents, s->documents / 4);
  EXPECT_EQ(s->bytes_per_token_on_disk, 2);
  EXPECT_TRUE(fs::exists(dir / "out" / "demo_val_000000.bin"));
  EXPECT_TRUE(fs::exists(dir / "out" / "demo_train_000001.bin"));
  EXPECT_TRUE(fs::exists(dir / "out" / "tokenizer.model"));

  // Read every shard with the existing reader, split at EOT, decode, and compare with the
  // documents of each split in order.
  std::vector<std::string> want_train, want_val;
  int64_t i = 0;
  for (const auto* docs : {&da, &db}) {
    for (std::string_view d : *docs) {
      (IsValidationDocument(i++, 0.25) ? want_val : want_train).emplace_back(d);
    }
  }
  auto read_split = [&](const std::string& split) {
    std::vector<uint32_t> all;
    for (int k = 0;; ++k) {
      char name[64];
      std::snprintf(name, sizeof(name), "demo_%s_%06d.bin", split.c_str(), k);
      if (!fs::exists(dir / "out" / name)) break;
      absl::StatusOr<TokenFile> f = TokenFile::Load((dir / "out" / name).string(), 400);
      EXPECT_TRUE(f.ok()) << f.status();
      if (!f.ok()) break;
      EXPECT_EQ(f->header().format, TokenFormat::kUint16V1);
      all.insert(all.end(), f->tokens().begin(), f->tokens().end());
    }
    return all;
  };
  for (const std::string split : {"train", "val"}) {
    const std::vector<uint32_t> all = read_split(split);
    const std::vector<std::string>& want = split == "train" ? want_train : want_val;
    EXPECT_EQ(static_cast<int64_t>(all.size()), split == "train" ? s->train_tokens : s->val_tokens);
    ASSERT_FALSE(all.empty());
    ASSERT_EQ(all[0], tok->eot_id());
    std::vector<std::string> got;
    size_t start = 1;
    for (size_t k = 1; k <= all.size(); ++k) {
      if (k == all.size() || all[k] == tok->eot_id()) {
        absl::StatusOr<std::string> text =
            tok->Decode(std::span<const uint32_t>(all).subspan(start, k - start));
        ASSERT_TRUE(text.ok()) << text.status();
        got.push_back(*text);
        start = k + 1;
      }
    }
    EXPECT_EQ(got, want) << split;

    // Version 7 (uint32): the same tokens written as v7 read back identically.
    const std::string v7 = (dir / ("v7_" + split + ".bin")).string();
    ASSERT_TRUE(WriteTokenFile(v7, all, TokenFormat::kUint32V7).ok());
    absl::StatusOr<TokenFile> f7 = TokenFile::Load(v7, 400);
    ASSERT_TRUE(f7.ok()) << f7.status();
    EXPECT_EQ(f7->header().format, TokenFormat::kUint32V7);
    EXPECT_EQ(std::vector<uint32_t>(f7->tokens().begin(), f7->tokens().end()), all);
  }
  // The tokenizer copied beside the shards is the same model.
  absl::StatusOr<Tokenizer> copy = Tokenizer::Load((dir / "out" / "tokenizer.model").string());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->vocab_size(), 400);
}

TEST(TokenizeFiles, BadInputNamesTheFile) {
  const fs::path dir = TempDir("vp_bad");
  const std::string corpus = Corpus();
  TokenizerTrainOptions topt;
  topt.vocab_size = 400;
  absl::StatusOr<std::string> model = Tokenizer::Train(SplitDocuments(corpus), topt);
  ASSERT_TRUE(model.ok());
  absl::StatusOr<Tokenizer> tok = Tokenizer::FromModel(*model, "tok.model");
  ASSERT_TRUE(tok.ok());
  WriteFile(dir / "good.txt", corpus);
  WriteFile(dir / "empty.txt", "");
  WriteFile(dir / "binary.txt", std::string("ok text\xFF\xFE", 9));
  TokenizeOptions opt;
  opt.out_dir = (dir / "out").string();
  opt.name = "x";
  absl::StatusOr<TokenizeSummary> s =
      TokenizeFiles({(dir / "good.txt").string(), (dir / "empty.txt").string()}, *tok, *model, opt);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("empty.txt: empty file"));
  s = TokenizeFiles({(dir / "good.txt").string(), (dir / "binary.txt").string()}, *tok, *model,
                    opt);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("binary.txt: not UTF-8 text"));
  // Nothing was written for the good file that came first, even with tiny shards.
  opt.shard_tokens = 10;
  s = TokenizeFiles({(dir / "good.txt").string(), (dir / "binary.txt").string()}, *tok, *model,
                    opt);
  ASSERT_FALSE(s.ok());
  EXPECT_FALSE(fs::exists(dir / "out")) << "bad input must not leave shards behind";
  opt.shard_tokens = 100000000;
  // One document cannot be split: a validation fraction with no validation document.
  WriteFile(dir / "one.txt", "a single paragraph");
  s = TokenizeFiles({(dir / "one.txt").string()}, *tok, *model, opt);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("--val-fraction"));
  EXPECT_FALSE(fs::exists(dir / "out")) << "refused before writing anything";
}

TEST(CheckDataTokenizer, NamesTheFieldAndBothSizes) {
  const fs::path dir = TempDir("vp_check");
  WriteFile(dir / "data.bin", "");
  const std::string data = (dir / "data.bin").string();
  EXPECT_TRUE(CheckDataTokenizer(data, 123).ok()) << "no tokenizer.model: nothing to check";
  TokenizerTrainOptions topt;
  topt.vocab_size = 400;
  const std::string corpus = Corpus();
  absl::StatusOr<std::string> model = Tokenizer::Train(SplitDocuments(corpus), topt);
  ASSERT_TRUE(model.ok());
  WriteFile(dir / "tokenizer.model", *model);
  EXPECT_TRUE(CheckDataTokenizer(data, 400).ok());
  for (int64_t v : {399, 401, 50304}) {
    const absl::Status st = CheckDataTokenizer(data, v);
    ASSERT_FALSE(st.ok()) << v;
    EXPECT_THAT(st.message(), HasSubstr("model.vocab_size: " + std::to_string(v)));
    EXPECT_THAT(st.message(), HasSubstr("tokenizer.model has 400 tokens"));
  }
  WriteFile(dir / "tokenizer.model", "garbage");
  const absl::Status st = CheckDataTokenizer(data, 400);
  ASSERT_FALSE(st.ok());
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.model: not a SentencePiece model"));
}

}  // namespace
}  // namespace vp::data
