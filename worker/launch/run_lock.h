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
//
// The run that claims the folder (the launcher or the worker daemon, given the job's user)
// also claims its owner (proto/safefs/run_owner.h): <dir>/OWNER is written on the first claim
// and checked on every later one, under the same directory lock. Before anything is written
// the folder is searched for links where run files belong (safefs::CheckRunFolderLinks); the
// folder and LOCK are opened without following links.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/safefs/dir.h"
#include "proto/safefs/run_owner.h"

namespace vp::launch {

class RunDirLock {
 public:
  // Claims `dir` for run `run_id` (non-empty). FailedPrecondition naming the directory and the
  // other run's id when a live process of another run holds it. With `owner` (a run claiming
  // the folder for its user): PermissionDenied when the folder belongs to another user
  // (checkpoint.dir: DIR belongs to alice; ...), or holds a link where a run file belongs
  // (naming it); otherwise OWNER is recorded when missing. Without `owner` (a rank process
  // joining the claim its launcher or daemon made) the owner is not looked at.
  static absl::StatusOr<RunDirLock> Acquire(const std::string& dir, const std::string& run_id,
                                            const std::optional<safefs::RunUser>& owner = {});

  RunDirLock(RunDirLock&& other) noexcept = default;
  RunDirLock& operator=(RunDirLock&& other) noexcept = default;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  ~RunDirLock() = default;  // closing LOCK drops the flock

 private:
  explicit RunDirLock(safefs::UniqueFd fd) : fd_(std::move(fd)) {}
  safefs::UniqueFd fd_;  // <dir>/LOCK, held shared
};

std::string LockPath(const std::string& dir);

}  // namespace vp::launch
