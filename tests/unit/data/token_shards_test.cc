// Token shards: a data path's shards (file, folder, glob, list) in name order, their headers
// checked without reading tokens, the corpus read in place exactly as the same tokens in one
// file, ids checked lazily where no vocabulary bound is recorded, and resident memory flat however
// much is read.
#include "worker/data/token_shards.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "worker/data/sample_reader.h"

namespace vp::data {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

int64_t VmRss() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

class TokenShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("vp_token_shards_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::vector<uint32_t> Tokens(size_t n, uint32_t vocab, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint32_t> t(n);
    for (uint32_t& x : t) x = rng() % vocab;
    return t;
  }
  std::string Write(const std::string& name, const std::vector<uint32_t>& tokens,
                    TokenFormat format = TokenFormat::kAuto) {
    fs::create_directories(fs::path(Path(name)).parent_path());
    auto f = WriteTokenFile(Path(name), tokens, format);
    EXPECT_TRUE(f.ok()) << f.status();
    return Path(name);
  }
  // Sets header[3] (the vocabulary bound) of an existing file.
  void SetBound(const std::string& path, int32_t bound) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.write(reinterpret_cast<const char*>(&bound), 4);
  }

  fs::path dir_;
};

TEST_F(TokenShardsTest, AFolderOrAGlobNamesItsShardsInNameOrder) {
  Write("c/x_train_000002.bin", {5});
  Write("c/x_train_000000.bin", {1});
  Write("c/x_train_000001.bin", {3});
  Write("c/x_val_000000.bin", {9});
  std::ofstream(Path("c/notes.txt")) << "not a shard";
  std::ofstream(Path("c/.hidden.bin")) << "a temporary";
  fs::create_directories(Path("c/sub.bin"));  // a folder is never a shard
  auto folder = ResolveTokenShards("data.path", Path("c"));
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_THAT(*folder, ElementsAre(Path("c/x_train_000000.bin"), Path("c/x_train_000001.bin"),
                                   Path("c/x_train_000002.bin"), Path("c/x_val_000000.bin")));
  auto glob = ResolveTokenShards("data.path", Path("c/x_train_*.bin"));
  ASSERT_TRUE(glob.ok()) << glob.status();
  EXPECT_THAT(*glob, ElementsAre(Path("c/x_train_000000.bin"), Path("c/x_train_000001.bin"),
                                 Path("c/x_train_000002.bin")));
  auto file = ResolveTokenShards("data.path", Path("c/x_val_000000.bin"));
  ASSERT_TRUE(file.ok());
  EXPECT_THAT(*file, ElementsAre(Path("c/x_val_000000.bin")));
  auto list =
      ResolveTokenShardList("data.paths", {Path("c/x_val_*.bin"), Path("c/x_train_*1.bin")});
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, ElementsAre(Path("c/x_val_000000.bin"), Path("c/x_train_000001.bin")));
  EXPECT_EQ(DataFolder(Path("c")), Path("c"));
  EXPECT_EQ(DataFolder(Path("c/x_train_*.bin")), Path("c"));
  EXPECT_EQ(DataFolder(Path("c/x_val_000000.bin")), Path("c"));
}

TEST_F(TokenShardsTest, AnEmptyGlobOrFolderIsRefusedNamingIt) {
  fs::create_directories(Path("empty"));
  auto glob = ResolveTokenShards("data.path", Path("empty/kjv_*.bin"));
  ASSERT_FALSE(glob.ok());
  EXPECT_TRUE(absl::IsNotFound(glob.status()));
  EXPECT_THAT(glob.status().message(), HasSubstr("data.path: " + Path("empty/kjv_*.bin")));
  EXPECT_THAT(glob.status().message(), HasSubstr("no file matches the glob"));
  auto folder = ResolveTokenShards("data.val_path", Path("empty"));
  ASSERT_FALSE(folder.ok());
  EXPECT_THAT(folder.status().message(), HasSubstr("data.val_path: " + Path("empty")));
  auto nested = ResolveTokenShards("data.path", Path("*/x_*.bin"));
  ASSERT_FALSE(nested.ok());
  EXPECT_THAT(std::string(nested.status().message()),
              HasSubstr("a glob may only be in the last component"));
}

TEST_F(TokenShardsTest, BadShardsAreRefusedNamingTheFile) {
  const std::string a = Write("a.bin", {1, 2, 3});
  // Missing.
  auto missing = CheckTokenShards("data.paths", {a, Path("gone.bin")}, 1000);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_THAT(missing.status().message(), HasSubstr(Path("gone.bin")));
  // Truncated: the header promises more tokens than the file holds.
  const std::string cut = Write("cut.bin", Tokens(100, 1000, 1));
  fs::resize_file(cut, 1024 + 150);
  auto truncated = CheckTokenShards("data.path", {a, cut}, 1000);
  ASSERT_FALSE(truncated.ok());
  EXPECT_TRUE(absl::IsDataLoss(truncated.status()));
  EXPECT_THAT(truncated.status().message(), HasSubstr(cut + ": truncated"));
  // Another token width than the first shard's.
  const std::string wide = Write("wide.bin", {1, 2}, TokenFormat::kUint32V7);
  auto width = CheckTokenShards("data.path", {a, wide}, 1000);
  ASSERT_FALSE(width.ok());
  EXPECT_THAT(width.status().message(), HasSubstr(wide + ": uint32, version 7 tokens, but " + a));
  // Written for a larger vocabulary (its recorded bound).
  const std::string big = Write("big.bin", {1, 4999});
  auto vocab = CheckTokenShards("data.path", {a, big}, 1000);
  ASSERT_FALSE(vocab.ok());
  EXPECT_THAT(vocab.status().message(),
              HasSubstr(big + ": written for a vocabulary of 5000 tokens"));
  // A link where a shard belongs.
  fs::create_symlink(a, Path("link.bin"));
  auto link = CheckTokenShards("data.path", {Path("link.bin")}, 1000);
  ASSERT_FALSE(link.ok());
  EXPECT_THAT(link.status().message(), HasSubstr(Path("link.bin") + ": is a symbolic link"));
  // Not an llm.c file at all: its bytes are never quoted.
  std::ofstream(Path("text.bin")) << std::string(2000, 'z');
  auto text = CheckTokenShards("data.path", {Path("text.bin")}, 1000);
  ASSERT_FALSE(text.ok());
  EXPECT_THAT(text.status().message(), HasSubstr("bad magic"));
  EXPECT_THAT(text.status().message(), ::testing::Not(HasSubstr("zzz")));
  // Good shards: offsets in the corpus.
  const std::string b = Write("b.bin", {4, 5});
  auto good = CheckTokenShards("data.path", {a, b}, 1000);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ((*good)[1].first_token, 3);
  EXPECT_EQ((*good)[1].header.vocab_bound, 6);
}

TEST_F(TokenShardsTest, ThreeShardsReadExactlyAsTheirConcatenation) {
  for (TokenFormat format : {TokenFormat::kUint16V1, TokenFormat::kUint32V7}) {
    const auto t0 = Tokens(1000, 500, 1), t1 = Tokens(7, 500, 2), t2 = Tokens(2500, 500, 3);
    std::vector<uint32_t> all = t0;
    all.insert(all.end(), t1.begin(), t1.end());
    all.insert(all.end(), t2.begin(), t2.end());
    const std::string tag = format == TokenFormat::kUint16V1 ? "v1" : "v7";
    Write(tag + "/s_000.bin", t0, format);
    Write(tag + "/s_001.bin", t1, format);
    Write(tag + "/s_002.bin", t2, format);
    auto shards = OpenTokenShards("data.path", {Path(tag)}, 500, TokenAccess::kRandom);
    ASSERT_TRUE(shards.ok()) << shards.status();
    ASSERT_EQ((*shards)->size(), static_cast<int64_t>(all.size()));
    // Every window, including those crossing a boundary (the middle shard is shorter than one).
    for (int64_t start : {0, 990, 1000, 1003, 1006, 1007, 3000, 3490}) {
      std::vector<uint32_t> got(17);
      ASSERT_TRUE((*shards)->Read(start, 17, got.data()).ok());
      EXPECT_EQ(got, std::vector<uint32_t>(all.begin() + start, all.begin() + start + 17)) << start;
    }
    // The sample reader sees the same samples as over one in-memory file, shuffled or not.
    auto one = std::make_shared<TokenFile>(TokenFile::FromTokens(all));
    for (bool shuffle : {false, true}) {
      const SampleOrder order{
          .seq_len = 64, .microbatch_size = 3, .microbatches = 2, .shuffle = shuffle, .seed = 7};
      auto a = SampleReader::Create(*shards, order), b = SampleReader::Create(one, order);
      ASSERT_TRUE(a.ok() && b.ok());
      for (int64_t step = 0; step < 40; ++step) {
        for (int j = 0; j < 2; ++j) {
          std::vector<int32_t> ia(3 * 64), ta(3 * 64), ib(3 * 64), tb(3 * 64);
          ASSERT_TRUE(a->Fill(step, j, ia.data(), ta.data()).ok());
          ASSERT_TRUE(b->Fill(step, j, ib.data(), tb.data()).ok());
          ASSERT_EQ(ia, ib) << "step " << step << " shuffle " << shuffle;
          ASSERT_EQ(ta, tb);
        }
      }
    }
  }
}

TEST_F(TokenShardsTest, IdsWithoutARecordedBoundAreCheckedAsTheyAreRead) {
  const std::string a = Write("a.bin", {1, 2, 3, 4});
  const std::string b = Write("b.bin", {5, 6, 900, 7});
  SetBound(b, 0);  // as llm.c writes it: no bound, so Open cannot vouch for the ids
  auto shards = TokenShards::Open("data.path", {a, b}, 100, TokenAccess::kSequential);
  ASSERT_TRUE(shards.ok()) << shards.status();
  std::vector<uint32_t> out(8);
  ASSERT_TRUE((*shards)->Read(0, 6, out.data()).ok());
  absl::Status bad = (*shards)->Read(4, 4, out.data());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.message(), HasSubstr(b + ": token 2 (byte offset 1028) has id 900"));
  // A recorded bound that the ids break is corrupt data, refused by the whole-file loader.
  const std::string c = Write("c.bin", {5, 6, 7});
  SetBound(c, 6);
  auto loaded = TokenFile::Load(c, 100);
  ASSERT_FALSE(loaded.ok());
  EXPECT_TRUE(absl::IsDataLoss(loaded.status()));
}

TEST_F(TokenShardsTest, ReadingTheWholeCorpusKeepsItOutOfResidentMemory) {
  // 3 shards of 4M uint16 tokens (24 MiB): read all of it in sample-sized pieces; the process's
  // resident memory grows by the buffers only, not by what was read (nothing is mapped).
  std::vector<std::string> names;
  for (int s = 0; s < 3; ++s) {
    names.push_back(Write("big_" + std::to_string(s) + ".bin", Tokens(4 << 20, 50000, 10 + s)));
  }
  auto shards = TokenShards::Open("data.path", names, 50000, TokenAccess::kSequential);
  ASSERT_TRUE(shards.ok()) << shards.status();
  std::vector<uint32_t> out(1025);
  const int64_t before = VmRss();
  uint64_t sum = 0;
  for (int64_t pos = 0; pos + 1025 <= (*shards)->size(); pos += 1025) {
    ASSERT_TRUE((*shards)->Read(pos, 1025, out.data()).ok());
    sum += out[0];
  }
  EXPECT_GT(sum, 0u);
  EXPECT_LT(VmRss() - before, 4 << 20);
}

}  // namespace
}  // namespace vp::data
