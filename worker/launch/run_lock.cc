#include "worker/launch/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace vp::launch {
namespace {

// Closes a descriptor at scope exit (the directory's, used as the owner-update mutex).
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

std::string ReadOwner(int fd) {
  std::string out;
  char buf[256];
  if (lseek(fd, 0, SEEK_SET) < 0) return out;
  ssize_t n = 0;
  while ((n = read(fd, buf, sizeof(buf))) > 0 && out.size() < 4096) out.append(buf, n);
  return std::string(absl::StripAsciiWhitespace(out));
}

}  // namespace

std::string LockPath(const std::string& dir) {
  return (std::filesystem::path(dir) / "LOCK").string();
}

RunDirLock& RunDirLock::operator=(RunDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) close(fd_);  // drops the flock
}

absl::StatusOr<RunDirLock> RunDirLock::Acquire(const std::string& dir, const std::string& run_id) {
  if (run_id.empty() || run_id.find('\n') != std::string::npos) {
    return absl::InvalidArgumentError("run id: must be one non-empty line");
  }
  Fd mutex{open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (mutex.fd < 0) {
    return absl::InternalError(absl::StrCat(dir, ": cannot open: ", std::strerror(errno)));
  }
  if (flock(mutex.fd, LOCK_EX) != 0) {
    return absl::InternalError(absl::StrCat(dir, ": cannot lock: ", std::strerror(errno)));
  }
  const std::string path = LockPath(dir);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  RunDirLock lock(fd);
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
    // Nobody holds it: whatever id is in the file is a finished run's. Claim it.
    const std::string line = run_id + "\n";
    if (ftruncate(fd, 0) != 0 ||
        pwrite(fd, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size()) ||
        fsync(fd) != 0) {
      return absl::InternalError(absl::StrCat(path, ": cannot write: ", std::strerror(errno)));
    }
  } else {
    const std::string owner = ReadOwner(fd);
    if (owner != run_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir ", dir, " is in use by run ", owner.empty() ? "(unknown)" : owner,
          ": two jobs cannot share a run directory (give this job another checkpoint.dir, or "
          "wait for that run to end)"));
    }
  }
  // Shared: the other processes of this run join it (conversion is safe under the mutex).
  if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot lock: ", std::strerror(errno)));
  }
  return lock;
}

}  // namespace vp::launch
