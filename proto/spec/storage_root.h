// Confined storage: with a storage root configured (`--storage-root DIR` on the coordinator
// and on the workers), every path of a job spec that the service reads or writes (data.path,
// checkpoint.dir, model.init_from) must resolve, after following symlinks, to a place inside
// that root. The coordinator checks at submit; each worker checks again before it touches the
// path (its own view of the file system and its own root). docs/operations.md, "Security".
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/safefs/run_owner.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::spec {

// Resolves a storage root given on the command line: it must exist and be a directory.
// Returns its canonical absolute path. `flag` names the flag in errors.
absl::StatusOr<std::string> ResolveStorageRoot(const std::string& dir,
                                               const std::string& flag = "--storage-root");

// OK when `path` (absolute) resolves inside `root` (a ResolveStorageRoot result): symlinks of
// the existing part of the path are followed, the rest is normalized lexically. Else
// PermissionDenied "FIELD: PATH is outside the storage root ROOT". `field` names the spec
// field. The message never names a symlink's target.
absl::Status CheckInsideRoot(const std::string& path, const std::string& root,
                             const std::string& field);

// CheckInsideRoot for data.path, data.val_path, checkpoint.dir and model.init_from of a spec
// with absolute paths, and for the tokenizer.model beside data.path when there is one. An empty
// root allows every path (no confinement configured).
absl::Status CheckSpecPaths(const vocabpipe::v1::JobSpec& spec, const std::string& root);

// The run folders a spec uses must belong to `user` (safefs/run_owner.h), unless they are an
// admin: checkpoint.dir's OWNER (written into or, with `resume`, resumed from), and for
// model.init_from the OWNER of the nearest folder at or above it (a step folder of a run lies
// inside the run folder), up to `root` (every ancestor when root is empty). Paths are
// resolved (links followed) first, so a link to another user's run is judged by its target.
// A folder without an owner (not a run folder, or not made yet) is anyone's.
// PermissionDenied naming the field and the owner; a link in place of checkpoint.dir is
// refused too (the workers never open a run folder through one).
absl::Status CheckSpecOwners(const vocabpipe::v1::JobSpec& spec, bool resume,
                             const safefs::RunUser& user, const std::string& root);

}  // namespace vp::spec
