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

std::string ReadOwner(int fd) {
  std::string out;
  char buf[256];
  ssize_t n = 0;
  off_t offset = 0;
  while ((n = pread(fd, buf, sizeof(buf), offset)) > 0 && out.size() < 4096) {
    out.append(buf, n);
    offset += n;
  }
  return std::string(absl::StripAsciiWhitespace(out));
}

}  // namespace

std::string LockPath(const std::string& dir) {
  return (std::filesystem::path(dir) / "LOCK").string();
}

absl::StatusOr<RunDirLock> RunDirLock::Acquire(const std::string& dir, const std::string& run_id,
                                               const std::optional<safefs::RunUser>& owner) {
  if (run_id.empty() || run_id.find('\n') != std::string::npos) {
    return absl::InvalidArgumentError("run id: must be one non-empty line");
  }
  // The folder by handle (a link in its place is refused), also the owner-update mutex.
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) {
    return absl::Status(folder.status().code(),
                        absl::StrCat("checkpoint.dir: ", folder.status().message()));
  }
  if (flock(folder->fd(), LOCK_EX) != 0) {
    return absl::InternalError(absl::StrCat(dir, ": cannot lock: ", std::strerror(errno)));
  }
  if (owner) {
    if (auto st = safefs::CheckRunFolderLinks(*folder); !st.ok()) return st;
    if (auto st = safefs::ClaimOwner(*folder, *owner); !st.ok()) return st;
  }
  auto fd = folder->OpenFile("LOCK", O_RDWR | O_CREAT, 0644);
  if (!fd.ok()) {
    if (absl::IsPermissionDenied(fd.status())) {
      return absl::Status(fd.status().code(),
                          absl::StrCat("checkpoint.dir: ", fd.status().message()));
    }
    return fd.status();
  }
  const int lock_fd = fd->get();
  RunDirLock lock(std::move(*fd));
  if (flock(lock_fd, LOCK_EX | LOCK_NB) == 0) {
    // Nobody holds it: whatever id is in the file is a finished run's. Claim it.
    const std::string line = run_id + "\n";
    if (ftruncate(lock_fd, 0) != 0 ||
        pwrite(lock_fd, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size()) ||
        fsync(lock_fd) != 0) {
      return absl::InternalError(
          absl::StrCat(LockPath(dir), ": cannot write: ", std::strerror(errno)));
    }
  } else {
    const std::string holder = ReadOwner(lock_fd);
    if (holder != run_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir ", dir, " is in use by run ", holder.empty() ? "(unknown)" : holder,
          ": two jobs cannot share a run directory (give this job another checkpoint.dir, or "
          "wait for that run to end)"));
    }
  }
  // Shared: the other processes of this run join it (conversion is safe under the mutex).
  if (flock(lock_fd, LOCK_SH | LOCK_NB) != 0) {
    return absl::InternalError(
        absl::StrCat(LockPath(dir), ": cannot lock: ", std::strerror(errno)));
  }
  return lock;
}

}  // namespace vp::launch
