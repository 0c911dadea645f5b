#include "proto/spec/storage_root.h"

#include <filesystem>
#include <optional>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
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
  if (!spec.model().init_from().empty()) {
    if (auto st = CheckInsideRoot(spec.model().init_from(), root, "model.init_from"); !st.ok()) {
      return st;
    }
  }
  // The tokenizer beside the data is read and copied into every checkpoint: it is a path of the
  // spec too, and a link there must not reach out of the root.
  // Its folder: the first data entry itself when that is a folder, else the entry's folder (the
  // rule worker/data's DataFolder applies when it reads the tokenizer).
  std::error_code ec;
  const fs::path first(DataPathEntries(spec.data()).front());
  const bool is_folder = first.filename().string().find_first_of("*?[") == std::string::npos &&
                         fs::is_directory(fs::symlink_status(first, ec));
  const fs::path tokenizer = (is_folder ? first : first.parent_path()) / "tokenizer.model";
  if (fs::symlink_status(tokenizer, ec).type() != fs::file_type::not_found && !ec) {
    if (auto st = CheckInsideRoot(tokenizer.string(), root, "data.path's tokenizer.model");
        !st.ok()) {
      return st;
    }
  }
  return CheckInsideRoot(spec.checkpoint().dir(), root, "checkpoint.dir");
}

namespace {

// The owner recorded in the folder at `path`, if it is a folder with one (nullopt otherwise).
// links: the folder must also hold no link where a run file belongs.
absl::StatusOr<std::optional<std::string>> OwnerOf(const std::string& path, bool links = false) {
  auto dir = safefs::Dir::Open(path);
  if (!dir.ok()) {
    if (absl::IsNotFound(dir.status()) || absl::IsFailedPrecondition(dir.status())) {
      return std::nullopt;  // missing, or not a folder: nobody's run
    }
    return dir.status();
  }
  if (links) {
    if (auto st = safefs::CheckRunFolderLinks(*dir); !st.ok()) return st;
  }
  auto owner = safefs::ReadOwner(*dir);
  if (absl::IsNotFound(owner.status())) return std::nullopt;
  if (!owner.ok()) return owner.status();
  return std::optional<std::string>(std::move(*owner));
}

}  // namespace

absl::Status CheckSpecOwners(const vocabpipe::v1::JobSpec& spec, bool resume,
                             const safefs::RunUser& user, const std::string& root) {
  // checkpoint.dir: the folder itself (a link there is refused by Dir::Open, naming it).
  const std::string& dir = spec.checkpoint().dir();
  if (!dir.empty()) {
    auto owner = OwnerOf(dir, /*links=*/true);
    if (!owner.ok()) {
      if (absl::StartsWith(owner.status().message(), "checkpoint.dir: ")) return owner.status();
      return absl::Status(owner.status().code(),
                          absl::StrCat("checkpoint.dir: ", owner.status().message()));
    }
    if (*owner) {
      if (auto st = safefs::CheckOwner(**owner, user, "checkpoint.dir", dir,
                                       resume ? "resume from or write into" : "write into");
          !st.ok()) {
        return st;
      }
    }
  }
  const std::string& init = spec.model().init_from();
  if (init.empty() || !fs::path(init).is_absolute()) return absl::OkStatus();
  std::error_code ec;
  fs::path at = fs::weakly_canonical(init, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("model.init_from: \"", absl::CHexEscape(init),
                                                    "\" cannot be resolved: ", ec.message()));
  }
  const fs::path top = root.empty() ? fs::path("/") : fs::path(root);
  for (;;) {
    auto owner = OwnerOf(at.string());
    if (!owner.ok()) {
      return absl::Status(owner.status().code(),
                          absl::StrCat("model.init_from: ", owner.status().message()));
    }
    if (*owner) {
      return safefs::CheckOwner(**owner, user, "model.init_from", at.string(),
                                "read the weights of");
    }
    if (at == top || at == at.parent_path() || !at.has_relative_path()) break;
    at = at.parent_path();
  }
  return absl::OkStatus();
}

}  // namespace vp::spec
