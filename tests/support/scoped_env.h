// An environment variable a test changes for its scope: Set and Unset change it, the destructor
// restores what the process had before (its value, or its absence), so a test of an environment
// switch leaves the next test the environment it found.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace vp::testing {

class ScopedEnv {
 public:
  explicit ScopedEnv(std::string name) : name_(std::move(name)) {
    if (const char* v = std::getenv(name_.c_str()); v != nullptr) saved_ = v;
  }
  ~ScopedEnv() {
    if (saved_) {
      setenv(name_.c_str(), saved_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void Set(const std::string& value) const { setenv(name_.c_str(), value.c_str(), 1); }
  void Unset() const { unsetenv(name_.c_str()); }

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace vp::testing
