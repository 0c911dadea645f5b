// llm.c token files (.bin): a 1024-byte header of 256 little-endian int32
//   [0] magic, [1] version, [2] token count,
//   [3] vocabulary bound: every id < it (vocabpipe writes max id + 1; 0 = not recorded, as
//       llm.c and other writers leave it), [4..255] zero
// followed by the tokens:
//   magic 20240520, version 1: uint16 tokens (vocabularies up to 65536, GPT-2)
//   magic 20240801, version 7: uint32 tokens (larger vocabularies, e.g. Llama 3)
// File size must be exactly 1024 + count * bytes_per_token. docs/formats.md has the details.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vp::data {

inline constexpr int32_t kMagicV1 = 20240520;  // uint16 tokens
inline constexpr int32_t kVersionV1 = 1;
inline constexpr int32_t kMagicV7 = 20240801;  // uint32 tokens
inline constexpr int32_t kVersionV7 = 7;
inline constexpr int64_t kHeaderInts = 256;
inline constexpr int64_t kHeaderBytes = kHeaderInts * 4;

enum class TokenFormat {
  kAuto,      // writer: v1 when every id < 65536, v7 otherwise
  kUint16V1,  // magic 20240520, version 1
  kUint32V7,  // magic 20240801, version 7
};

struct TokenFileHeader {
  int32_t magic = 0;
  int32_t version = 0;
  int64_t num_tokens = 0;                   // header[2]
  int64_t vocab_bound = 0;                  // header[3]: every id < it; 0 = not recorded
  int bytes_per_token = 0;                  // 2 (v1) or 4 (v7)
  int64_t file_bytes = 0;                   // the file's size on disk
  TokenFormat format = TokenFormat::kAuto;  // kUint16V1 or kUint32V7 once validated
};

// "uint16, version 1" / "uint32, version 7".
std::string FormatName(TokenFormat format);

// Checks a header (h: its 256 ints) against the file's size: magic, version, a count that
// matches the size exactly, a vocabulary bound that fits the token width. Errors start with path.
absl::StatusOr<TokenFileHeader> CheckTokenFileHeader(const std::string& path, const int32_t* h,
                                                     int64_t file_bytes);

// Where the tokens of a sample come from: random access to token ranges (an in-memory file,
// or memory-mapped shards, token_shards.h).
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual int64_t size() const = 0;
  // Copies tokens [start, start + count) into out; 0 <= start, start + count <= size(). Fails
  // for an id the source finds out of range (naming the file and the token's offset).
  virtual absl::Status Read(int64_t start, int64_t count, uint32_t* out) const = 0;
};

// A token file loaded into memory and fully validated.
class TokenFile final : public TokenSource {
 public:
  // Reads and validates the header (magic, version, count vs file size) and every token id
  // against vocab_size (ids must be < vocab_size; vocab_size <= 0 skips the id check). Errors
  // start with the path; an out-of-range id names its token index and byte offset.
  static absl::StatusOr<TokenFile> Load(const std::string& path, int64_t vocab_size);

  // In-memory tokens (tests, synthetic data): no file behind them.
  static TokenFile FromTokens(std::vector<uint32_t> tokens);

  const std::string& path() const { return path_; }
  const TokenFileHeader& header() const { return header_; }
  std::span<const uint32_t> tokens() const { return tokens_; }
  uint32_t max_id() const { return max_id_; }

  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  absl::Status Read(int64_t start, int64_t count, uint32_t* out) const override;

 private:
  std::string path_;
  TokenFileHeader header_;
  std::vector<uint32_t> tokens_;
  uint32_t max_id_ = 0;
};

// Reads and validates only the header against the file size (no token data is read).
absl::StatusOr<TokenFileHeader> ReadTokenFileHeader(const std::string& path);

// Writes tokens as an llm.c .bin file, atomically (a temporary file renamed into place), with the
// vocabulary bound max id + 1 in header[3].
// kAuto picks v1 when every id < 65536 and v7 otherwise; an explicit kUint16V1 with an id
// >= 65536 is an error naming the token. At most 2^31 - 1 tokens (the header count is int32).
// Returns the format written.
absl::StatusOr<TokenFormat> WriteTokenFile(const std::string& path,
                                           std::span<const uint32_t> tokens,
                                           TokenFormat format = TokenFormat::kAuto);

}  // namespace vp::data
