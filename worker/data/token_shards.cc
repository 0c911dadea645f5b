#include "worker/data/token_shards.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace vp::data {
namespace fs = std::filesystem;
namespace {

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

bool HasGlob(const std::string& name) { return name.find_first_of("*?[") != std::string::npos; }

// Regular files of `folder` whose name matches `pattern` (fnmatch; every file when empty and
// `suffix` matches), sorted by name. Links are listed too: CheckTokenShards refuses them by name.
absl::StatusOr<std::vector<std::string>> ListFolder(const std::string& field,
                                                    const fs::path& folder,
                                                    const std::string& pattern,
                                                    const std::string& suffix) {
  std::error_code ec;
  std::vector<std::string> names;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;  // hidden files and temporaries
    if (!pattern.empty() ? fnmatch(pattern.c_str(), name.c_str(), FNM_PERIOD) != 0
                         : !name.ends_with(suffix)) {
      continue;
    }
    std::error_code type_ec;
    if (it->is_directory(type_ec)) continue;
    names.push_back(name);
  }
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", folder.string(), ": cannot list the folder: ", ec.message()));
  }
  std::sort(names.begin(), names.end());
  std::vector<std::string> out;
  out.reserve(names.size());
  for (const std::string& n : names) out.push_back((folder / n).string());
  return out;
}

// Reads the 1024-byte header of an open file.
absl::StatusOr<TokenFileHeader> HeaderOf(const std::string& path, int fd, int64_t file_bytes) {
  if (file_bytes < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", file_bytes,
                                            " bytes, too small for the 1024-byte header; not an "
                                            "llm.c token file"));
  }
  int32_t h[kHeaderInts];
  if (pread(fd, h, kHeaderBytes, 0) != kHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read the header"));
  }
  return CheckTokenFileHeader(path, h, file_bytes);
}

// Opens a shard without following a link; fills its size.
absl::StatusOr<int> OpenShard(const std::string& field, const std::string& path,
                              int64_t* file_bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(field, ": ", path, ": no such token file"));
    }
    if (err == ELOOP) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", path, ": is a symbolic link; name the shard itself"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path, ": cannot open: ", ErrnoText(err)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path, ": not a regular file (a token shard is a .bin file)"));
  }
  *file_bytes = static_cast<int64_t>(st.st_size);
  return fd;
}

// The shard's header against the first shard's width and the model's vocabulary.
absl::Status CheckAgainst(const std::string& field, const std::string& path,
                          const TokenFileHeader& h, const TokenFileHeader* first,
                          const std::string& first_path, int64_t vocab_size) {
  if (first != nullptr && h.format != first->format) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", path, ": ", FormatName(h.format), " tokens, but ", first_path, " has ",
        FormatName(first->format), " tokens; every shard of a corpus has the same token width"));
  }
  if (vocab_size > 0 && h.vocab_bound > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path, ": written for a vocabulary of ", h.vocab_bound,
                     " tokens (its header's bound), larger than model.vocab_size ", vocab_size));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DataFolder(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (!HasGlob(p.filename().string()) && fs::is_directory(fs::symlink_status(p, ec))) {
    return p.string();
  }
  return p.parent_path().string();
}

absl::StatusOr<std::vector<std::string>> ResolveTokenShards(const std::string& field,
                                                            const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty path"));
  const fs::path p(path);
  const std::string last = p.filename().string();
  if (HasGlob(last)) {
    if (HasGlob(p.parent_path().string())) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", path, ": a glob may only be in the last component (the file name)"));
    }
    auto files = ListFolder(field, p.parent_path(), last, "");
    if (!files.ok()) return files.status();
    if (files->empty()) {
      return absl::NotFoundError(absl::StrCat(field, ": ", path, ": no file matches the glob"));
    }
    return files;
  }
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (!ec && fs::is_directory(st)) {
    auto files = ListFolder(field, p, "", ".bin");
    if (!files.ok()) return files.status();
    if (files->empty()) {
      return absl::NotFoundError(
          absl::StrCat(field, ": ", path, ": the folder holds no .bin token shards"));
    }
    return files;
  }
  return std::vector<std::string>{path};
}

absl::StatusOr<std::vector<std::string>> ResolveTokenShardList(
    const std::string& field, const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (size_t i = 0; i < paths.size(); ++i) {
    auto shards = ResolveTokenShards(absl::StrCat(field, "[", i, "]"), paths[i]);
    if (!shards.ok()) return shards.status();
    out.insert(out.end(), shards->begin(), shards->end());
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": no shards"));
  return out;
}

absl::StatusOr<std::vector<TokenShard>> CheckTokenShards(const std::string& field,
                                                         const std::vector<std::string>& shards,
                                                         int64_t vocab_size) {
  if (shards.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": no shards"));
  std::vector<TokenShard> out;
  out.reserve(shards.size());
  int64_t total = 0;
  for (const std::string& path : shards) {
    int64_t bytes = 0;
    auto fd = OpenShard(field, path, &bytes);
    if (!fd.ok()) return fd.status();
    auto header = HeaderOf(path, *fd, bytes);
    close(*fd);
    if (!header.ok()) {
      return absl::Status(header.status().code(),
                          absl::StrCat(field, ": ", header.status().message()));
    }
    if (auto st = CheckAgainst(field, path, *header, out.empty() ? nullptr : &out[0].header,
                               out.empty() ? "" : out[0].path, vocab_size);
        !st.ok()) {
      return st;
    }
    out.push_back({.path = path, .header = *header, .first_token = total});
    total += header->num_tokens;
  }
  if (total == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the shards hold no tokens"));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<TokenShards>> TokenShards::Open(
    const std::string& field, const std::vector<std::string>& shards, int64_t vocab_size,
    TokenAccess access) {
  std::shared_ptr<TokenShards> out(new TokenShards());
  out->vocab_size_ = vocab_size;
  int64_t total = 0;
  for (const std::string& path : shards) {
    int64_t bytes = 0;
    auto fd = OpenShard(field, path, &bytes);
    if (!fd.ok()) return fd.status();
    out->fds_.push_back(*fd);  // closed by the destructor from here on
    auto header = HeaderOf(path, *fd, bytes);
    if (!header.ok()) {
      return absl::Status(header.status().code(),
                          absl::StrCat(field, ": ", header.status().message()));
    }
    if (auto st = CheckAgainst(field, path, *header,
                               out->shards_.empty() ? nullptr : &out->shards_[0].header,
                               out->shards_.empty() ? "" : out->shards_[0].path, vocab_size);
        !st.ok()) {
      return st;
    }
    posix_fadvise(*fd, 0, 0,
                  access == TokenAccess::kRandom ? POSIX_FADV_RANDOM : POSIX_FADV_SEQUENTIAL);
    out->shards_.push_back({.path = path, .header = *header, .first_token = total});
    total += header->num_tokens;
  }
  if (total == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": the shards hold no tokens"));
  }
  out->total_tokens_ = total;
  return out;
}

TokenShards::~TokenShards() {
  for (int fd : fds_) close(fd);
}

absl::Status TokenShards::ReadShard(size_t shard, int64_t start, int64_t count,
                                    uint32_t* out) const {
  const TokenShard& s = shards_[shard];
  const int width = s.header.bytes_per_token;
  const off_t offset = kHeaderBytes + start * width;
  // uint32 tokens land in `out` directly; uint16 ones go through a buffer and are widened.
  std::vector<uint16_t> narrow(width == 2 ? static_cast<size_t>(count) : 0);
  char* dst = width == 2 ? reinterpret_cast<char*>(narrow.data()) : reinterpret_cast<char*>(out);
  const size_t bytes = static_cast<size_t>(count) * width;
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = pread(fds_[shard], dst + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(s.path, ": cannot read tokens ", start, "..",
                                              start + count, ": ",
                                              n < 0 ? ErrnoText(errno) : "the file got shorter"));
    }
    done += static_cast<size_t>(n);
  }
  if (width == 2) std::copy(narrow.begin(), narrow.end(), out);
  // Ids are checked here unless the header's bound already vouched for them at Open.
  if (vocab_size_ > 0 && s.header.vocab_bound == 0) {
    for (int64_t i = 0; i < count; ++i) {
      if (static_cast<int64_t>(out[i]) >= vocab_size_) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.path, ": token ", start + i, " (byte offset ", kHeaderBytes + (start + i) * width,
            ") has id ", out[i], ", not < vocab size ", vocab_size_));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status TokenShards::Read(int64_t start, int64_t count, uint32_t* out) const {
  // The shard holding `start`: the last one whose first token is <= start.
  auto it = std::upper_bound(shards_.begin(), shards_.end(), start,
                             [](int64_t v, const TokenShard& s) { return v < s.first_token; });
  size_t shard = static_cast<size_t>(it - shards_.begin()) - 1;
  while (count > 0) {
    const TokenShard& s = shards_[shard];
    const int64_t local = start - s.first_token;
    const int64_t len = std::min(count, s.header.num_tokens - local);
    if (len > 0) {
      if (auto st = ReadShard(shard, local, len, out); !st.ok()) return st;
      start += len;
      count -= len;
      out += len;
    }
    ++shard;  // empty shards are skipped
  }
  return absl::OkStatus();
}

}  // namespace vp::data

namespace vp::data {
namespace {

absl::StatusOr<std::vector<std::string>> ResolveEntries(const std::string& field,
                                                        const std::vector<std::string>& entries) {
  if (entries.size() == 1) return ResolveTokenShards(field, entries[0]);
  return ResolveTokenShardList(field, entries);
}

}  // namespace

absl::StatusOr<std::shared_ptr<TokenShards>> OpenTokenShards(
    const std::string& field, const std::vector<std::string>& entries, int64_t vocab_size,
    TokenAccess access) {
  auto shards = ResolveEntries(field, entries);
  if (!shards.ok()) return shards.status();
  return TokenShards::Open(field, *shards, vocab_size, access);
}

absl::StatusOr<std::vector<TokenShard>> CheckTokenShardEntries(
    const std::string& field, const std::vector<std::string>& entries, int64_t vocab_size) {
  auto shards = ResolveEntries(field, entries);
  if (!shards.ok()) return shards.status();
  return CheckTokenShards(field, *shards, vocab_size);
}

}  // namespace vp::data
