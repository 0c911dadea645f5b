#include "worker/data/token_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace vp::data {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class TokenFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("vp_token_file_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a raw file: a header with the given ints, then `payload` bytes.
  std::string WriteRaw(const std::string& name, int32_t magic, int32_t version, int32_t count,
                       const std::vector<char>& payload) {
    int32_t h[256] = {};
    h[0] = magic;
    h[1] = version;
    h[2] = count;
    std::ofstream out(Path(name), std::ios::binary);
    out.write(reinterpret_cast<const char*>(h), sizeof(h));
    out.write(payload.data(), static_cast<std::streamsize>(payload.size()));
    return Path(name);
  }

  std::filesystem::path dir_;
};

TEST_F(TokenFileTest, V1RoundTrip) {
  const std::vector<uint32_t> tokens = {0, 1, 65535, 42, 7, 50256};
  absl::StatusOr<TokenFormat> f = WriteTokenFile(Path("a.bin"), tokens);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f, TokenFormat::kUint16V1);
  EXPECT_EQ(std::filesystem::file_size(Path("a.bin")), 1024u + 2 * tokens.size());

  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("a.bin"), 65536);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header().magic, kMagicV1);
  EXPECT_EQ(file->header().version, 1);
  EXPECT_EQ(file->header().num_tokens, 6);
  EXPECT_EQ(file->header().bytes_per_token, 2);
  EXPECT_EQ(file->header().format, TokenFormat::kUint16V1);
  EXPECT_EQ(std::vector<uint32_t>(file->tokens().begin(), file->tokens().end()), tokens);
  EXPECT_EQ(file->max_id(), 65535u);
  EXPECT_EQ(file->size(), 6);
}

TEST_F(TokenFileTest, V7RoundTrip) {
  const std::vector<uint32_t> tokens = {0, 128255, 65536, 3, 100000};
  absl::StatusOr<TokenFormat> f = WriteTokenFile(Path("b.bin"), tokens);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f, TokenFormat::kUint32V7);  // auto: an id >= 65536
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("b.bin"), 128256);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header().magic, kMagicV7);
  EXPECT_EQ(file->header().version, 7);
  EXPECT_EQ(file->header().bytes_per_token, 4);
  EXPECT_EQ(std::vector<uint32_t>(file->tokens().begin(), file->tokens().end()), tokens);
  // Explicit v7 for small ids, and reading the header alone.
  ASSERT_TRUE(
      WriteTokenFile(Path("c.bin"), std::vector<uint32_t>{1, 2, 3}, TokenFormat::kUint32V7).ok());
  absl::StatusOr<TokenFileHeader> h = ReadTokenFileHeader(Path("c.bin"));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->format, TokenFormat::kUint32V7);
  EXPECT_EQ(h->num_tokens, 3);
  EXPECT_EQ(h->file_bytes, 1024 + 12);
}

TEST_F(TokenFileTest, ExplicitV1RejectsLargeIds) {
  absl::StatusOr<TokenFormat> f =
      WriteTokenFile(Path("d.bin"), std::vector<uint32_t>{1, 70000}, TokenFormat::kUint16V1);
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("token 1 has id 70000"));
  EXPECT_FALSE(std::filesystem::exists(Path("d.bin")));
}

TEST_F(TokenFileTest, EmptyFileIsValid) {
  ASSERT_TRUE(WriteTokenFile(Path("e.bin"), std::vector<uint32_t>{}).ok());
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("e.bin"), 10);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 0);
}

TEST_F(TokenFileTest, TruncatedFile) {
  ASSERT_TRUE(WriteTokenFile(Path("t.bin"), std::vector<uint32_t>(100, 5)).ok());
  std::filesystem::resize_file(Path("t.bin"), 1024 + 150);
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("t.bin"), 10);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(),
              HasSubstr(Path("t.bin") + ": truncated: the header says 100 tokens (1224 bytes "
                                        "with the header) but the file has 1174 bytes"));
  // Shorter than the header itself.
  std::filesystem::resize_file(Path("t.bin"), 100);
  EXPECT_THAT(TokenFile::Load(Path("t.bin"), 10).status().message(),
              HasSubstr("100 bytes, too small for the 1024-byte header"));
  // Trailing bytes are an error too (the count would be wrong).
  WriteRaw("x.bin", kMagicV1, 1, 2, std::vector<char>(6, 0));
  EXPECT_THAT(TokenFile::Load(Path("x.bin"), 10).status().message(), HasSubstr("trailing data"));
}

TEST_F(TokenFileTest, WrongMagic) {
  const std::string p = WriteRaw("m.bin", 12345, 1, 0, {});
  absl::StatusOr<TokenFile> file = TokenFile::Load(p, 10);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(),
              HasSubstr(p + ": bad magic (expected 20240520 for uint16 tokens or "
                            "20240801 for uint32 tokens)"));
  // The file's bytes are not echoed (any file could be handed in as data.path).
  EXPECT_THAT(file.status().message(), Not(HasSubstr("12345")));
}

TEST_F(TokenFileTest, TextFileIsNotEchoed) {
  const std::string p = Path("passwd");
  {
    std::ofstream f(p);
    f << "root:x:0:0:root:/root:/bin/bash\n";
    f << std::string(2000, 'z') << "\n";
  }
  absl::StatusOr<TokenFile> file = TokenFile::Load(p, 10);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("bad magic"));
  // "root" read as a little-endian int32 is 1953460082.
  EXPECT_THAT(file.status().message(), Not(HasSubstr("1953460082")));
  EXPECT_THAT(file.status().message(), Not(HasSubstr("root:x")));
}

TEST_F(TokenFileTest, WrongVersion) {
  std::string p = WriteRaw("v.bin", kMagicV1, 7, 0, {});
  EXPECT_THAT(TokenFile::Load(p, 10).status().message(),
              HasSubstr(p + ": unsupported version 7 for magic 20240520 (expected 1"));
  p = WriteRaw("w.bin", kMagicV7, 1, 0, {});
  EXPECT_THAT(TokenFile::Load(p, 10).status().message(),
              HasSubstr(p + ": unsupported version 1 for magic 20240801 (expected 7"));
  p = WriteRaw("n.bin", kMagicV1, 1, -3, {});
  EXPECT_THAT(TokenFile::Load(p, 10).status().message(), HasSubstr("negative token count -3"));
}

TEST_F(TokenFileTest, OutOfRangeTokenNamesIndexAndOffset) {
  std::vector<uint32_t> tokens(20, 3);
  tokens[13] = 1000;
  ASSERT_TRUE(WriteTokenFile(Path("o.bin"), tokens).ok());
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("o.bin"), 1000);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  // v1: byte offset 1024 + 13 * 2.
  EXPECT_THAT(file.status().message(),
              HasSubstr(Path("o.bin") +
                        ": token 13 (byte offset 1050) has id 1000, not < vocab size 1000"));
  EXPECT_TRUE(TokenFile::Load(Path("o.bin"), 1001).ok());
  EXPECT_TRUE(TokenFile::Load(Path("o.bin"), 0).ok());  // no id check

  ASSERT_TRUE(WriteTokenFile(Path("o7.bin"), tokens, TokenFormat::kUint32V7).ok());
  EXPECT_THAT(TokenFile::Load(Path("o7.bin"), 1000).status().message(),
              HasSubstr("token 13 (byte offset 1076) has id 1000"));
}

TEST_F(TokenFileTest, MissingFile) {
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("none.bin"), 10);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("none.bin"));
}

TEST_F(TokenFileTest, WriteIsAtomicOverAnExistingFile) {
  ASSERT_TRUE(WriteTokenFile(Path("r.bin"), std::vector<uint32_t>{1, 2}).ok());
  ASSERT_TRUE(WriteTokenFile(Path("r.bin"), std::vector<uint32_t>{4, 5, 6}).ok());
  absl::StatusOr<TokenFile> file = TokenFile::Load(Path("r.bin"), 10);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->size(), 3);
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1);  // no temporary left behind
}

}  // namespace
}  // namespace vp::data
