#include "worker/runtime/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace vp::runtime {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string TempPath(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / "vp_safetensors_test";
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<float> b = {-1.5f};
  const std::string path = TempPath("rt.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"a", {2, 3}, a.data()}, {"b", {1}, b.data()}}, {{"format", "pt"}})
          .ok());
  auto file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata.at("format"), "pt");
  EXPECT_EQ(file->tensors.at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(file->tensors.at("a").data, a);
  EXPECT_EQ(file->tensors.at("b").data, b);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, RejectsTruncatedFile) {
  std::vector<float> a(100, 1.0f);
  const std::string path = TempPath("trunc.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", {100}, a.data()}}).ok());
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  auto file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  // Entries are named by position: the file's text is never echoed.
  EXPECT_THAT(file.status().message(),
              HasSubstr("header entry #0: shape holds more elements than the 396-byte data"));
}

TEST(Safetensors, RejectsGarbageHeader) {
  const std::string path = TempPath("garbage.safetensors");
  std::ofstream(path, std::ios::binary) << "\x05\0\0\0\0\0\0\0hello";
  auto file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("header length"));
  std::ofstream(path, std::ios::binary).write("\x05\0\0\0\0\0\0\0[1,2]", 13);
  file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("not a JSON object"));
}

TEST(Safetensors, RejectsShapeSizeMismatchAndOtherDtypes) {
  const std::string path = TempPath("mismatch.safetensors");
  auto write_raw = [&](const std::string& header, size_t data_bytes) {
    std::ofstream f(path, std::ios::binary);
    uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << std::string(data_bytes, '\0');
  };
  write_raw(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12);
  auto file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("8 bytes for shape [3] of F32"));
  write_raw(R"({"w":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})", 8);
  file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("not supported"));
  EXPECT_THAT(file.status().message(), Not(HasSubstr("BF16")));
  // A shape whose element count overflows (2^32 x 2^32) or exceeds the data section is
  // refused before anything is allocated.
  write_raw(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 8);
  file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("shape holds more elements than the 8-byte"));
  write_raw(R"({"secret-name":{"dtype":"F32","shape":"[1]","data_offsets":[0,4]}})", 4);
  file = ReadSafetensors(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("header entry #0: shape must be a list"));
  EXPECT_THAT(file.status().message(), Not(HasSubstr("secret")));
}

}  // namespace
}  // namespace vp::runtime
