// SharedLibrary: opening by soname or path, the errors for a missing library or symbol, and
// IsMapped, which the CUDA tests use to prove that a vendor library is opened only on first use.
#include "worker/sharedlib/shared_library.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>

namespace vp::sharedlib {
namespace {

using ::testing::HasSubstr;

TEST(SharedLibraryTest, OpensTheFirstNameThatLoadsAndFindsItsFunctions) {
  // libz is not linked into this test (so not mapped until opened), and every Debian has it.
  EXPECT_FALSE(IsMapped("libz.so"));
  absl::StatusOr<SharedLibrary> lib =
      SharedLibrary::Open("zlib", {"libvp-does-not-exist.so.1", "libz.so.1"});
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_EQ(lib->name(), "libz.so.1");
  EXPECT_TRUE(IsMapped("libz.so"));
  using ZlibVersion = const char*();
  absl::StatusOr<ZlibVersion*> version = lib->Function<ZlibVersion>("zlibVersion");
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(std::string((*version)()).substr(0, 1), "1");  // zlib 1.x
}

// The X-macro table the CUDA backend's cuBLASLt and NCCL tables are built like.
#define VP_TEST_ZLIB_FUNCTIONS(X) X(zlibVersion) X(crc32)
struct Zlib {
  VP_TEST_ZLIB_FUNCTIONS(VP_SHAREDLIB_FUNCTION)
};
absl::StatusOr<Zlib> LoadZlib(const SharedLibrary& lib) {
  Zlib table;
  VP_TEST_ZLIB_FUNCTIONS(VP_SHAREDLIB_BIND)
  return table;
}

TEST(SharedLibraryTest, AnXMacroTableBindsEveryFunctionUnderItsOwnName) {
  absl::StatusOr<SharedLibrary> lib = SharedLibrary::Open("zlib", {"libz.so.1"});
  ASSERT_TRUE(lib.ok()) << lib.status();
  absl::StatusOr<Zlib> zlib = LoadZlib(*lib);
  ASSERT_TRUE(zlib.ok()) << zlib.status();
  const unsigned char bytes[] = {'a', 'b', 'c'};
  EXPECT_EQ(zlib->crc32(0, bytes, 3), 0x352441c2u);  // CRC-32 of "abc"
  EXPECT_STREQ(zlib->zlibVersion(), ZLIB_VERSION);
}

TEST(SharedLibraryTest, NamesEveryCandidateWhenNoneLoads) {
  absl::StatusOr<SharedLibrary> lib =
      SharedLibrary::Open("cuBLASLt", {"libvp-missing-a.so.1", "/nonexistent/libvp-missing-b.so"});
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lib.status().message(), HasSubstr("cuBLASLt could not be loaded"));
  EXPECT_THAT(lib.status().message(), HasSubstr("libvp-missing-a.so.1"));
  EXPECT_THAT(lib.status().message(), HasSubstr("/nonexistent/libvp-missing-b.so"));
  EXPECT_THAT(lib.status().message(), HasSubstr("LD_LIBRARY_PATH"));
  EXPECT_EQ(SharedLibrary::Open("x", {}).status().code(), absl::StatusCode::kNotFound);
}

TEST(SharedLibraryTest, AMissingFunctionNamesTheLibraryAndTheSymbol) {
  absl::StatusOr<SharedLibrary> lib = SharedLibrary::Open("libm", {"libm.so.6"});
  ASSERT_TRUE(lib.ok()) << lib.status();
  absl::StatusOr<double (*)(double)> cosine = lib->Function<double(double)>("cos");
  ASSERT_TRUE(cosine.ok()) << cosine.status();
  EXPECT_DOUBLE_EQ((*cosine)(0.0), 1.0);
  absl::StatusOr<void (*)()> missing = lib->Function<void()>("vp_no_such_function");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("libm (libm.so.6)"));
  EXPECT_THAT(missing.status().message(), HasSubstr("vp_no_such_function"));
}

TEST(SharedLibraryTest, IsMappedSeesThisProcessesLibrariesOnly) {
  EXPECT_TRUE(IsMapped("libc.so"));
  EXPECT_TRUE(IsMapped("shared_library_test"));  // the executable itself
  EXPECT_FALSE(IsMapped("libvp-never-loaded"));
}

}  // namespace
}  // namespace vp::sharedlib
