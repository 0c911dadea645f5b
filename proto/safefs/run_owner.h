// The owner of a run folder: <checkpoint.dir>/OWNER, one line with the name of the user whose
// run first claimed the folder. It is created once (O_CREAT|O_EXCL|O_NOFOLLOW) and never
// rewritten, so a finished run's folder keeps belonging to its user: another user's job that
// names it as checkpoint.dir, resumes from it or starts from its weights (model.init_from) is
// refused, by the coordinator at submit and by the worker when the run claims the folder.
// Admins may use any folder (the owner stays who it was). docs/formats.md, "Run folder owner".
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/safefs/dir.h"

namespace vp::safefs {

inline constexpr char kOwnerFile[] = "OWNER";

// Who acts on a run folder: the job's owner, and whether they were an admin at submit.
struct RunUser {
  std::string name;
  bool admin = false;
};

// A name as recorded in OWNER: 1 to 64 bytes of [A-Za-z0-9._@-]. Also the check of a token's
// user name (vp::auth), as a run's owner is its user.
bool ValidOwnerName(std::string_view name);

// The owner recorded in an open folder. NotFound when it has no OWNER; DataLoss for a file that
// is not one valid name (its content is never shown); PermissionDenied for a link.
absl::StatusOr<std::string> ReadOwner(const Dir& dir);

// OK when `user` may use a folder that belongs to `owner`: the same name, or an admin. Else
// PermissionDenied "FIELD: PATH belongs to OWNER; user USER may not USE it (...)".
absl::Status CheckOwner(std::string_view owner, const RunUser& user, std::string_view field,
                        const std::string& path, std::string_view use);

// A run claims `dir`: records user.name as its owner when the folder has none, else checks the
// recorded owner (CheckOwner). OWNER appears complete or not at all (written under a fresh
// name, then linked into place without replacing anything), so of two racing claims of a
// fresh folder one wins and the other is judged against it.
absl::Status ClaimOwner(const Dir& dir, const RunUser& user,
                        std::string_view field = "checkpoint.dir",
                        std::string_view use = "write into");

// OK when no entry of the run folder that a run creates, reads or removes (LOCK, OWNER,
// job.yaml, plan files, rank_R.pid/.log/.jsonl, daemon_R.log, metrics.jsonl, store, step_N and
// everything below step_N) is a symbolic link; else PermissionDenied naming the first one
// found ("checkpoint.dir: PATH is a symbolic link where a run file belongs ...").
absl::Status CheckRunFolderLinks(const Dir& dir);

// The name of the account running this process (the owner of a local run), or "uid-N" when the
// account has no name (or one outside the OWNER alphabet).
std::string LocalUserName();

}  // namespace vp::safefs
