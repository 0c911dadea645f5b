// The last non-empty line of a log file, as failure reasons quote it: a child process's or a
// rank's final words ("terminate called after throwing ...") without the rest of its log.
#pragma once

#include <cstddef>
#include <fstream>
#include <string>

namespace vp::daemon {

// At most the last max_bytes of that line; "" when the file is missing or has no such line.
inline std::string LastLogLine(const std::string& path, size_t max_bytes) {
  std::ifstream f(path);
  std::string line, last;
  while (std::getline(f, line)) {
    if (!line.empty()) last = line;
  }
  if (last.size() > max_bytes) last = last.substr(last.size() - max_bytes);
  return last;
}

}  // namespace vp::daemon
