#include "proto/spec/storage_root.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "proto/spec/job_spec.h"

namespace vp::spec {
namespace fs = std::filesystem;

absl::StatusOr<std::string> ResolveStorageRoot(const std::string& dir, const std::string& flag) {
  if (dir.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": must not be empty"));
  std::error_code ec;
  const fs::path canonical = fs::canonical(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", absl::CHexEscape(dir), "\": ", ec.message()));
  }
  if (!fs::is_directory(canonical, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", absl::CHexEscape(dir), "\" is not a directory"));
  }
  return canonical.string();
}

absl::Status CheckInsideRoot(const std::string& path, const std::string& root,
                             const std::string& field) {
  const std::string shown = absl::StrCat("\"", absl::CHexEscape(path), "\"");
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not contain NUL bytes"));
  }
  if (!fs::path(path).is_absolute()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", shown, " must be absolute to be checked against the storage root"));
  }
  std::error_code ec;
  // weakly_canonical: symlinks of the existing prefix are followed (a link inside the root
  // that points out of it is outside), the missing rest is normalized (".." included).
  const fs::path resolved = fs::weakly_canonical(path, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", shown, " cannot be resolved: ", ec.message()));
  }
  const fs::path rel = resolved.lexically_relative(fs::path(root));
  const bool inside = !rel.empty() && *rel.begin() != ".." && rel.is_relative();
  if (!inside) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", shown, " is outside the storage root ", root,
                     " (paths must resolve inside it after following symlinks)"));
  }
  return absl::OkStatus();
}

absl::Status CheckSpecPaths(const vocabpipe::v1::JobSpec& spec, const std::string& root) {
  if (root.empty()) return absl::OkStatus();
  // Each entry (a file, a folder or a glob: its folder must resolve inside the root; the
  // shards in it are opened without following links, worker/data/token_shards.h).
  const auto check_all = [&](const std::vector<std::string>& entries, const std::string& one,
                             const std::string& many, bool listed) -> absl::Status {
    for (size_t i = 0; i < entries.size(); ++i) {
      const std::string field = listed ? absl::StrCat(many, "[", i, "]") : one;
      if (auto st = CheckInsideRoot(entries[i], root, field); !st.ok()) return st;
    }
    return absl::OkStatus();
  };
  if (auto st = check_all(DataPathEntries(spec.data()), "data.path", "data.paths",
                          !spec.data().paths().empty());
      !st.ok()) {
    return st;
  }
  if (auto st = check_all(ValPathEntries(spec.data()), "data.val_path", "data.val_paths",
                          !spec.data().val_paths().empty());
      !st.ok()) {
    return st;
  }
  return CheckInsideRoot(spec.checkpoint().dir(), root, "checkpoint.dir");
}

}  // namespace vp::spec
