#include "proto/safefs/dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace vp::safefs {
namespace {

absl::Status Errno(const std::string& path, std::string_view what, int err) {
  const std::string message = absl::StrCat(path, ": ", std::string(what), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status LinkRefused(const std::string& path) {
  return absl::PermissionDeniedError(
      absl::StrCat(path,
                   " is a symbolic link: files of a run folder are never opened through a "
                   "link (remove it, or give the job another checkpoint.dir)"));
}

absl::Status CheckName(std::string_view name, const std::string& dir) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": \"", std::string(name), "\" is not a single file name"));
  }
  return absl::OkStatus();
}

Kind KindAt(int dirfd, const std::string& name) {
  struct stat st;
  if (fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? Kind::kMissing : Kind::kOther;
  }
  if (S_ISLNK(st.st_mode)) return Kind::kLink;
  if (S_ISDIR(st.st_mode)) return Kind::kDirectory;
  if (S_ISREG(st.st_mode)) return Kind::kFile;
  return Kind::kOther;
}

// The folder `name` below dirfd (AT_FDCWD: a path), refusing a link in the last component.
absl::StatusOr<UniqueFd> OpenDirAt(int dirfd, const std::string& name, const std::string& shown) {
  UniqueFd fd(openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.valid()) return fd;
  const int err = errno;
  // O_NOFOLLOW gives ELOOP for a link (ENOTDIR on some kernels with O_DIRECTORY).
  if (err == ELOOP || err == ENOTDIR) {
    if (KindAt(dirfd, name) == Kind::kLink) return LinkRefused(shown);
    if (err == ENOTDIR) return absl::FailedPreconditionError(absl::StrCat(shown, ": not a folder"));
  }
  return Errno(shown, "cannot open", err);
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::string> ReadAll(int fd, const std::string& path, size_t max_bytes) {
  std::string out;
  char buf[1 << 16];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = pread(fd, buf, sizeof(buf), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(path, "read failed", errno);
    }
    if (n == 0) break;
    if (out.size() + static_cast<size_t>(n) > max_bytes) {
      return absl::OutOfRangeError(absl::StrCat(path, ": larger than ", max_bytes, " bytes"));
    }
    out.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  return out;
}

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(path, "write failed", errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<Dir> Dir::Open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("folder path: must not be empty");
  // "dir/" would make O_NOFOLLOW look through a link named dir: open "dir" itself.
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto fd = OpenDirAt(AT_FDCWD, p, p);
  if (!fd.ok()) return fd.status();
  return Dir(std::move(*fd), p);
}

absl::StatusOr<Dir> Dir::OpenFollowing(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("folder path: must not be empty");
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return Errno(path, "cannot open", errno);
  return Dir(std::move(fd), path);
}

absl::StatusOr<Dir> Dir::Create(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  // An existing link is reported by Open, by name.
  if (ec && ec != std::errc::file_exists && ec != std::errc::not_a_directory) {
    return absl::InternalError(absl::StrCat(path, ": cannot create: ", ec.message()));
  }
  return Open(path);
}

std::string Dir::PathOf(std::string_view name) const {
  return path_ == "/" ? absl::StrCat("/", std::string(name))
                      : absl::StrCat(path_, "/", std::string(name));
}

absl::StatusOr<Dir> Dir::Sub(std::string_view name, bool create) const {
  if (auto st = CheckName(name, path_); !st.ok()) return st;
  const std::string n(name);
  if (create && mkdirat(fd(), n.c_str(), 0755) != 0 && errno != EEXIST) {
    return Errno(PathOf(name), "cannot create", errno);
  }
  auto fd = OpenDirAt(this->fd(), n, PathOf(name));
  if (!fd.ok()) return fd.status();
  return Dir(std::move(*fd), PathOf(name));
}

absl::StatusOr<Dir> Dir::Walk(std::string_view relative, bool create) const {
  const Dir* at = this;
  std::optional<Dir> held;
  for (absl::string_view part : absl::StrSplit(absl::string_view(relative.data(), relative.size()),
                                               '/', absl::SkipEmpty())) {
    auto next = at->Sub(std::string_view(part.data(), part.size()), create);
    if (!next.ok()) return next.status();
    held.emplace(std::move(*next));
    at = &*held;
  }
  if (!held) {  // "" or "/": this folder again, as its own handle
    UniqueFd fd(fcntl(this->fd(), F_DUPFD_CLOEXEC, 0));
    if (!fd.valid()) return Errno(path_, "cannot duplicate the handle", errno);
    return Dir(std::move(fd), path_);
  }
  return std::move(*held);
}

absl::StatusOr<UniqueFd> Dir::OpenFile(std::string_view name, int flags, mode_t mode) const {
  if (auto st = CheckName(name, path_); !st.ok()) return st;
  const std::string n(name), shown = PathOf(name);
  // O_NONBLOCK for the open only: a FIFO planted under a run file's name must not block it.
  UniqueFd fd(
      openat(this->fd(), n.c_str(), flags | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, mode));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ELOOP || (err == EEXIST && KindAt(this->fd(), n) == Kind::kLink)) {
      if (KindAt(this->fd(), n) == Kind::kLink) return LinkRefused(shown);
    }
    if (err == ENXIO) {
      return absl::FailedPreconditionError(absl::StrCat(shown, ": not a regular file"));
    }
    if (err == EEXIST) return absl::AlreadyExistsError(absl::StrCat(shown, ": already exists"));
    return Errno(shown, "cannot open", err);
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return Errno(shown, "cannot stat", errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(shown, ": not a regular file"));
  }
  const bool writes = (flags & O_ACCMODE) != O_RDONLY;
  if (writes && !(flags & O_EXCL) && st.st_nlink > 1) {
    return absl::PermissionDeniedError(
        absl::StrCat(shown, ": has ", st.st_nlink,
                     " names (a hard link): a run file is written only when it has one name"));
  }
  const int fl = fcntl(fd.get(), F_GETFL);
  if (fl < 0 || fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0) {
    return Errno(shown, "cannot clear O_NONBLOCK", errno);
  }
  return fd;
}

absl::StatusOr<std::string> Dir::ReadFile(std::string_view name, size_t max_bytes) const {
  auto fd = OpenFile(name, O_RDONLY);
  if (!fd.ok()) return fd.status();
  return ReadAll(fd->get(), PathOf(name), max_bytes);
}

std::string Dir::TempName(std::string_view name) {
  // Unique per process and call: the worker daemons of one job write the same run files.
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(".", std::string(name), ".tmp.", getpid(), ".", counter.fetch_add(1));
}

absl::Status Dir::WriteFileAtomically(std::string_view name, std::string_view text,
                                      bool sync) const {
  if (auto st = CheckName(name, path_); !st.ok()) return st;
  const std::string tmp = TempName(name);
  {
    auto fd = OpenFile(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (!fd.ok()) return fd.status();
    absl::Status st = WriteAll(fd->get(), text.data(), text.size(), PathOf(name));
    if (st.ok() && sync && fsync(fd->get()) != 0) st = Errno(PathOf(name), "fsync failed", errno);
    if (!st.ok()) {
      unlinkat(this->fd(), tmp.c_str(), 0);
      return st;
    }
  }
  if (auto st = Rename(tmp, name); !st.ok()) {
    unlinkat(this->fd(), tmp.c_str(), 0);
    return st;
  }
  return absl::OkStatus();
}

Kind Dir::KindOf(std::string_view name) const {
  if (!CheckName(name, path_).ok()) return Kind::kOther;
  return KindAt(fd(), std::string(name));
}

absl::Status Dir::Remove(std::string_view name) const {
  if (auto st = CheckName(name, path_); !st.ok()) return st;
  const std::string n(name);
  if (unlinkat(fd(), n.c_str(), 0) != 0 && errno != ENOENT) {
    return Errno(PathOf(name), "cannot remove", errno);
  }
  return absl::OkStatus();
}

absl::Status Dir::RemoveTree(std::string_view name) const {
  if (auto st = CheckName(name, path_); !st.ok()) return st;
  const std::string n(name);
  if (KindAt(fd(), n) != Kind::kDirectory) return Remove(name);
  {
    auto sub = Sub(name);
    if (!sub.ok()) return absl::IsNotFound(sub.status()) ? absl::OkStatus() : sub.status();
    auto names = sub->List();
    if (!names.ok()) return names.status();
    for (const std::string& child : *names) {
      if (auto st = sub->RemoveTree(child); !st.ok()) return st;
    }
  }
  if (unlinkat(fd(), n.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
    return Errno(PathOf(name), "cannot remove", errno);
  }
  return absl::OkStatus();
}

absl::Status Dir::Rename(std::string_view from, std::string_view to) const {
  if (auto st = CheckName(from, path_); !st.ok()) return st;
  if (auto st = CheckName(to, path_); !st.ok()) return st;
  const std::string f(from), t(to);
  if (renameat(fd(), f.c_str(), fd(), t.c_str()) != 0) {
    return Errno(PathOf(to), "rename failed", errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> Dir::List() const {
  // fdopendir takes over the descriptor it is given: hand it a duplicate.
  const int dup = fcntl(fd(), F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return Errno(path_, "cannot list", errno);
  DIR* d = fdopendir(dup);
  if (d == nullptr) {
    const int err = errno;
    close(dup);
    return Errno(path_, "cannot list", err);
  }
  rewinddir(d);
  std::vector<std::string> out;
  while (const dirent* e = readdir(d)) {
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") out.emplace_back(n);
  }
  closedir(d);
  return out;
}

absl::Status Dir::Sync() const {
  if (fsync(fd()) != 0) return Errno(path_, "fsync failed", errno);
  return absl::OkStatus();
}

}  // namespace vp::safefs
