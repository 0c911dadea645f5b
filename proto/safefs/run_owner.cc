#include "proto/safefs/run_owner.h"

#include <fcntl.h>
#include <pwd.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace vp::safefs {

bool ValidOwnerName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '@')) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::string> ReadOwner(const Dir& dir) {
  auto text = dir.ReadFile(kOwnerFile, 4096);
  if (!text.ok()) {
    if (absl::IsOutOfRange(text.status())) {
      return absl::DataLossError(
          absl::StrCat(dir.PathOf(kOwnerFile), ": not a run folder's owner file (too large)"));
    }
    return text.status();
  }
  std::string name = *text;
  if (!name.empty() && name.back() == '\n') name.pop_back();
  if (name.empty()) {
    // Created but not written yet (a claim in progress, or one that crashed right there).
    return absl::NotFoundError(absl::StrCat(dir.PathOf(kOwnerFile), ": empty"));
  }
  if (!ValidOwnerName(name)) {
    return absl::DataLossError(absl::StrCat(dir.PathOf(kOwnerFile),
                                            ": not a run folder's owner file (one user name "
                                            "of [A-Za-z0-9._@-]); an admin may remove it"));
  }
  return name;
}

absl::Status CheckOwner(std::string_view owner, const RunUser& user, std::string_view field,
                        const std::string& path, std::string_view use) {
  if (owner == user.name || user.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      std::string(field), ": ", path, " belongs to ", std::string(owner), "; user ", user.name,
      " may not ", std::string(use),
      " it (a run folder is its owner's: only they or an admin may use it; give the job a "
      "checkpoint.dir of its own)"));
}

absl::Status ClaimOwner(const Dir& dir, const RunUser& user, std::string_view field,
                        std::string_view use) {
  if (!ValidOwnerName(user.name)) {
    return absl::InvalidArgumentError(absl::StrCat("run owner: \"", absl::CEscape(user.name),
                                                   "\" is not a user name of [A-Za-z0-9._@-]"));
  }
  auto owner = ReadOwner(dir);
  if (owner.ok()) return CheckOwner(*owner, user, field, dir.path(), use);
  if (!absl::IsNotFound(owner.status())) return owner.status();
  // No owner yet: this run's user becomes it. An empty OWNER (a claim that crashed before its
  // write) is replaced; O_EXCL on the new name makes sure nothing else is written through.
  if (auto st = dir.Remove(kOwnerFile); !st.ok() && dir.KindOf(kOwnerFile) == Kind::kFile) {
    return st;
  }
  auto fd = dir.OpenFile(kOwnerFile, O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (!fd.ok()) return fd.status();
  const std::string line = user.name + "\n";
  if (auto st = WriteAll(fd->get(), line.data(), line.size(), dir.PathOf(kOwnerFile)); !st.ok()) {
    return st;
  }
  if (fsync(fd->get()) != 0) {
    return absl::InternalError(absl::StrCat(dir.PathOf(kOwnerFile), ": fsync failed"));
  }
  return dir.Sync();
}

std::string LocalUserName() {
  const uid_t uid = geteuid();
  long size = sysconf(_SC_GETPW_R_SIZE_MAX);
  std::vector<char> buf(size > 0 ? static_cast<size_t>(size) : 16384);
  struct passwd pw;
  struct passwd* found = nullptr;
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr &&
      ValidOwnerName(found->pw_name)) {
    return found->pw_name;
  }
  return absl::StrCat("uid-", uid);
}

}  // namespace vp::safefs
