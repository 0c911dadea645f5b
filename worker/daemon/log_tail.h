// The last non-empty line of a log file, as failure reasons quote it: a child process's or a
// rank's final words ("terminate called after throwing ...") without the rest of its log.
#pragma once

#include <fcntl.h>

#include <cstddef>
#include <filesystem>
#include <string>

#include "absl/strings/str_split.h"
#include "proto/safefs/dir.h"

namespace vp::daemon {

// At most the last max_bytes of that line; "" when the file is missing, has no such line, or
// is a link (the folder and the file are opened without following one: a rank log replaced by
// a link must not quote another file into a job's failure reason).
inline std::string LastLogLine(const std::string& path, size_t max_bytes) {
  const std::filesystem::path p(path);
  auto dir = safefs::Dir::Open(p.has_parent_path() ? p.parent_path().string() : ".");
  if (!dir.ok()) return "";
  auto text = dir->ReadFile(p.filename().string(), size_t{256} << 20);
  if (!text.ok()) return "";
  std::string last;
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    last = std::string(line);
  }
  if (last.size() > max_bytes) last = last.substr(last.size() - max_bytes);
  return last;
}

}  // namespace vp::daemon
