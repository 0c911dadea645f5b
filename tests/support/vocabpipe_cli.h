// Test helpers that drive the real `vocabpipe` binary in a child process (header-only; the
// tests that include it are compiled with VP_BINARY_DIR).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace vp::testing {

struct CliResult {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `vocabpipe <args>` from the build tree, with the environment assignments `env` (may be
// empty) in front, and collects its output and exit code.
inline CliResult Vocabpipe(const std::string& env, const std::string& args) {
  const std::string cmd =
      absl::StrCat(env, " ", VP_BINARY_DIR, "/client/vocabpipe ", args, " 2>&1");
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline CliResult Vocabpipe(const std::string& args) { return Vocabpipe("", args); }

// One JSON object per line (metrics.jsonl, rank_<R>.jsonl).
inline std::vector<nlohmann::json> ReadJsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace vp::testing
