// An exclusive claim on a run directory (checkpoint.dir) by one run: two jobs writing shards,
// metrics and job.yaml into the same folder would corrupt each other's resume state.
//
// <dir>/LOCK holds the owning run's id. Every process of the owning run (the launcher or the
// worker daemon, and each rank process) holds a shared flock(2) on it; a process of another
// run finds it held under a different id and is refused, naming the directory and the owner.
// The kernel drops a lock when its holder exits (kill -9 included), so a dead job never
// blocks the next one. Checks and updates of the owner happen under an exclusive flock on the
// directory itself, so two runs racing for a free directory cannot both win.
// flock is per host (and emulated over NFS by the client's locks): ranks of one job on
// several hosts share the id, so they never refuse each other.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace vp::launch {

class RunDirLock {
 public:
  // Claims `dir` for run `run_id` (non-empty). FailedPrecondition naming the directory and the
  // other run's id when a live process of another run holds it.
  static absl::StatusOr<RunDirLock> Acquire(const std::string& dir, const std::string& run_id);

  RunDirLock(RunDirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  RunDirLock& operator=(RunDirLock&& other) noexcept;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  ~RunDirLock();

 private:
  explicit RunDirLock(int fd) : fd_(fd) {}
  int fd_ = -1;  // <dir>/LOCK, held shared
};

std::string LockPath(const std::string& dir);

}  // namespace vp::launch
