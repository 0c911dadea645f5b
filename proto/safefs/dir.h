// Files of a run folder opened without ever following a link.
//
// A run folder (checkpoint.dir) lives in a storage root that many users can write to, while
// the worker writes into it with the worker's own rights. A user who plants a symbolic link
// where a run file belongs (LOCK -> a file outside the root) would have the worker truncate or
// overwrite the link's target. So every file of a run folder is reached from a handle of the
// folder (opened with O_DIRECTORY|O_NOFOLLOW) by openat(..., O_NOFOLLOW), one path component
// at a time: a link anywhere below the folder is refused, naming it, and nothing is written.
// A file opened for writing in place must also be a regular file with one name (no FIFO that
// would block the writer, no hard link that would write a second name's content).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vp::safefs {

// An owned file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// What a name in a folder is, without following it.
enum class Kind { kMissing, kFile, kDirectory, kLink, kOther };

// A handle of an open folder. Names given to its methods are single path components (no '/',
// not "." or ".."); errors name the full path (path() + "/" + name) and never a link's target.
// A link where a file or folder is expected is PermissionDenied "PATH is a symbolic link ...".
class Dir {
 public:
  // Opens the folder at `path`; its last component must not be a link. The components above
  // it are resolved as usual (the storage-root check has resolved and confined them).
  static absl::StatusOr<Dir> Open(const std::string& path);
  // Open, after creating `path` and any missing parent (mode 0755, like mkdir -p).
  static absl::StatusOr<Dir> Create(const std::string& path);
  // A folder that is not a run folder (the data's folder, which the storage-root check resolved
  // with its links): its path may go through links; its files are still opened without.
  static absl::StatusOr<Dir> OpenFollowing(const std::string& path);

  Dir(Dir&&) noexcept = default;
  Dir& operator=(Dir&&) noexcept = default;

  // The sub-folder `name`; create: made first when missing (mkdirat).
  absl::StatusOr<Dir> Sub(std::string_view name, bool create = false) const;
  // The sub-folder at `relative` ("step_4/rank_1"), one component at a time.
  absl::StatusOr<Dir> Walk(std::string_view relative, bool create = false) const;

  // openat(fd, name, flags | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, mode). The file must be a
  // regular file; opened for writing without O_EXCL, it must also have exactly one name.
  // A missing file is NotFound.
  absl::StatusOr<UniqueFd> OpenFile(std::string_view name, int flags, mode_t mode = 0644) const;
  // The whole content of `name`, at most max_bytes (OutOfRange beyond).
  absl::StatusOr<std::string> ReadFile(std::string_view name, size_t max_bytes = 64 << 20) const;
  // Writes `text` to a new temporary name in this folder (O_CREAT|O_EXCL), fsyncs it when
  // `sync`, and renames it over `name`: readers never see a partial file, and a link at
  // `name` is replaced, never followed.
  absl::Status WriteFileAtomically(std::string_view name, std::string_view text,
                                   bool sync = false) const;
  // The temporary name WriteFileAtomically-style writers use for `name` in this process.
  static std::string TempName(std::string_view name);

  Kind KindOf(std::string_view name) const;
  // Removes the file (or link: the link itself) `name`; a missing one is fine.
  absl::Status Remove(std::string_view name) const;
  // Removes `name` and, for a folder, everything below it, never following a link (a link
  // below is removed as a link). A missing one is fine.
  absl::Status RemoveTree(std::string_view name) const;
  absl::Status Rename(std::string_view from, std::string_view to) const;
  // The names in the folder (no "." and ".."), unsorted.
  absl::StatusOr<std::vector<std::string>> List() const;
  absl::Status Sync() const;

  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  std::string PathOf(std::string_view name) const;

 private:
  Dir(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// Reads a whole open file (from its start) into a string, at most max_bytes.
absl::StatusOr<std::string> ReadAll(int fd, const std::string& path_for_errors,
                                    size_t max_bytes = 64 << 20);
// Writes all of `data` at the file's current offset.
absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path_for_errors);

}  // namespace vp::safefs
