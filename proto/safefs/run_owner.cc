#include "proto/safefs/run_owner.h"

#include <fcntl.h>
#include <pwd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace vp::safefs {
namespace {

// Names of the top level of a run folder that a run uses.
bool IsRunName(const std::string& name) {
  static constexpr const char* kFixed[] = {"LOCK",     "OWNER",         "job.yaml",
                                           "plan.txt", "metrics.jsonl", "store"};
  for (const char* f : kFixed) {
    if (name == f) return true;
  }
  for (const char* prefix : {"plan_rank_", "rank_", "daemon_", "step_", "."}) {
    if (name.rfind(prefix, 0) == 0) return true;  // "." : the writers' temporaries
  }
  return false;
}

absl::Status LinkFound(const std::string& path) {
  return absl::PermissionDeniedError(absl::StrCat(
      "checkpoint.dir: ", path,
      " is a symbolic link where a run file belongs: the run folder is refused (files of a run "
      "are never opened through a link; remove the link, or give the job another "
      "checkpoint.dir)"));
}

// Every entry below `dir` (a step folder), depth-first; a link anywhere is refused.
absl::Status NoLinksBelow(const Dir& dir, int depth) {
  auto names = dir.List();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    switch (dir.KindOf(name)) {
      case Kind::kLink:
        return LinkFound(dir.PathOf(name));
      case Kind::kDirectory:
        if (depth > 0) {
          auto sub = dir.Sub(name);
          if (!sub.ok()) return sub.status();
          if (auto st = NoLinksBelow(*sub, depth - 1); !st.ok()) return st;
        }
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

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
  for (int tries = 0; tries < 2; ++tries) {
    auto owner = ReadOwner(dir);
    if (owner.ok()) return CheckOwner(*owner, user, field, dir.path(), use);
    if (!absl::IsNotFound(owner.status()) || dir.KindOf(kOwnerFile) != Kind::kMissing) {
      return owner.status();
    }
    // No owner yet: this run's user becomes it. The file is written in full under a fresh
    // name (O_CREAT|O_EXCL|O_NOFOLLOW) and then given its name with link(2), which never
    // replaces or follows an existing entry: a reader sees no OWNER or a complete one, and of
    // two claims racing for a fresh folder exactly one wins (the other reads the winner).
    const std::string tmp = Dir::TempName(kOwnerFile);
    {
      auto fd = dir.OpenFile(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
      if (!fd.ok()) return fd.status();
      const std::string line = user.name + "\n";
      absl::Status st = WriteAll(fd->get(), line.data(), line.size(), dir.PathOf(kOwnerFile));
      if (st.ok() && fsync(fd->get()) != 0) {
        st = absl::InternalError(absl::StrCat(dir.PathOf(kOwnerFile), ": fsync failed"));
      }
      if (!st.ok()) {
        dir.Remove(tmp).IgnoreError();
        return st;
      }
    }
    const int rc = linkat(dir.fd(), tmp.c_str(), dir.fd(), kOwnerFile, 0);
    const int err = errno;
    dir.Remove(tmp).IgnoreError();
    if (rc == 0) return dir.Sync();
    if (err == EEXIST) continue;  // another claim won: check against its owner
    if (err != EPERM && err != ENOTSUP && err != EOPNOTSUPP && err != EMLINK) {
      return absl::InternalError(
          absl::StrCat(dir.PathOf(kOwnerFile), ": cannot create: ", std::strerror(err)));
    }
    // A file system without hard links: create the name itself exclusively (the run lock
    // keeps other claims out meanwhile).
    auto fd = dir.OpenFile(kOwnerFile, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (absl::IsAlreadyExists(fd.status())) continue;
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
  return absl::AbortedError(absl::StrCat(dir.PathOf(kOwnerFile), ": claimed concurrently; retry"));
}

absl::Status CheckRunFolderLinks(const Dir& dir) {
  auto names = dir.List();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    if (!IsRunName(name)) continue;
    const Kind kind = dir.KindOf(name);
    if (kind == Kind::kLink) return LinkFound(dir.PathOf(name));
    // step_N/rank_R/<files>: two levels below a step folder.
    if (kind == Kind::kDirectory && name.rfind("step_", 0) == 0) {
      auto sub = dir.Sub(name);
      if (!sub.ok()) return sub.status();
      if (auto st = NoLinksBelow(*sub, 1); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
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
