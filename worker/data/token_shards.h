// A corpus of llm.c token shards (token_file.h), read in place: each sample's tokens are read
// from the open shard with pread, so the tokens are never copied whole into memory, nothing is
// mapped, and a rank's resident memory does not grow with the corpus (the kernel's page cache,
// shared and evictable, holds what was read recently). Why not a memory map: a mapping's pages
// stay in the process's resident set once touched, so it must release them (MADV_DONTNEED) to
// stay flat, and on the development VM a shuffled read then cost a page fault and a release:
// 1.8M tokens/s against pread's ~90M (docs/benchmarks.md, "Data loading").
//
// A data path names its shards in one of three ways (ResolveTokenShards):
//   a file          data/train.bin                       that one shard;
//   a folder        data/kjv/                            every *.bin file directly inside it;
//   a glob          data/kjv/kjv_train_*.bin             the files matching it (*, ?, [...] in the
//                                                        last component only);
// a list (data.paths) is the concatenation of its entries' shards, in the list's order. A folder
// or glob's shards are sorted by name, so `NAME_train_000000.bin, NAME_train_000001.bin, ...`
// come in the order `vocabpipe data tokenize` wrote them. The corpus is the concatenation of the
// shards' tokens: sample k is the same token window whether the tokens sit in one file or in
// many (sample_reader.h).
//
// Checks, from the headers alone (CheckTokenShards, the launcher's and the submit's): every shard
// exists, is a regular file (not a link), has a valid header whose token count matches its size,
// and has the same token width as the first; a shard whose header records a vocabulary bound
// (header[3], written by vocabpipe since 2026-11: every id < bound) above model.vocab_size is
// refused. Shards without a bound (other writers leave header[3] zero) have their ids checked as
// they are read: an id >= vocab_size fails the read naming the shard and the token's offset.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/data/token_file.h"

namespace vp::data {

// The shard files a data path names, in order (see above). `field` names the spec field in
// errors ("data.path"). An empty folder or a glob that matches nothing is an error naming it.
absl::StatusOr<std::vector<std::string>> ResolveTokenShards(const std::string& field,
                                                            const std::string& path);
// The concatenation of every entry's shards, in order (data.paths).
absl::StatusOr<std::vector<std::string>> ResolveTokenShardList(
    const std::string& field, const std::vector<std::string>& paths);

// The folder a data path's shards live in: the path itself when it is a folder, else the
// folder of the file or of the glob. `vocabpipe data tokenize` writes tokenizer.model there.
std::string DataFolder(const std::string& path);

struct TokenShard {
  std::string path;
  TokenFileHeader header;
  int64_t first_token = 0;  // index of its first token in the corpus
};

// Validates every shard's header (see above) without reading token data; returns them with
// their offsets in the corpus. vocab_size <= 0 skips the vocabulary-bound check.
absl::StatusOr<std::vector<TokenShard>> CheckTokenShards(const std::string& field,
                                                         const std::vector<std::string>& shards,
                                                         int64_t vocab_size);

// How a corpus will be read: kRandom (shuffled samples) tells the kernel not to read ahead.
enum class TokenAccess { kSequential, kRandom };

// The shards, open read-only. Thread-safe for concurrent Reads.
class TokenShards final : public TokenSource {
 public:
  static absl::StatusOr<std::shared_ptr<TokenShards>> Open(const std::string& field,
                                                           const std::vector<std::string>& shards,
                                                           int64_t vocab_size, TokenAccess access);
  ~TokenShards() override;
  TokenShards(const TokenShards&) = delete;
  TokenShards& operator=(const TokenShards&) = delete;

  int64_t size() const override { return total_tokens_; }
  // Copies tokens [start, start + count), across shard boundaries, and checks their ids when
  // the shard's header records no vocabulary bound.
  absl::Status Read(int64_t start, int64_t count, uint32_t* out) const override;

  const std::vector<TokenShard>& shards() const { return shards_; }

 private:
  TokenShards() = default;
  absl::Status ReadShard(size_t shard, int64_t start, int64_t count, uint32_t* out) const;

  std::vector<TokenShard> shards_;
  std::vector<int> fds_;  // one open descriptor per shard (O_RDONLY, no link followed)
  int64_t total_tokens_ = 0;
  int64_t vocab_size_ = 0;
};

// Resolves data path entries ({data.path}, or data.paths), checks the headers and opens the
// shards: what a rank reads its samples from. `field` names the spec field in errors
// ("data.path" / "data.paths" from one entry or several).
absl::StatusOr<std::shared_ptr<TokenShards>> OpenTokenShards(
    const std::string& field, const std::vector<std::string>& entries, int64_t vocab_size,
    TokenAccess access);
// The same up to the headers (no mapping): the launcher's and the submit's check.
absl::StatusOr<std::vector<TokenShard>> CheckTokenShardEntries(
    const std::string& field, const std::vector<std::string>& entries, int64_t vocab_size);

}  // namespace vp::data
