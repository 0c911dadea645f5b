// Confined storage: with a storage root configured (`--storage-root DIR` on the coordinator
// and on the workers), every path of a job spec that the service reads or writes (data.path,
// checkpoint.dir) must resolve, after following symlinks, to a place inside that root. The
// coordinator checks at submit; each worker checks again before it touches the path (its own
// view of the file system and its own root). docs/operations.md, "Security".
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// CheckInsideRoot for data.path and checkpoint.dir of a spec with absolute paths. An empty
// root allows every path (no confinement configured).
absl::Status CheckSpecPaths(const vocabpipe::v1::JobSpec& spec, const std::string& root);

}  // namespace vp::spec
