#include "worker/runtime/process_memory.h"

#include <fstream>
#include <string>
#include <string_view>

namespace vp::runtime {
namespace {

// The value of a "Name:   1234 kB" line of /proc/self/status, in bytes.
int64_t StatusBytes(std::string_view name) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.size() > name.size() && line.compare(0, name.size(), name) == 0 &&
        line[name.size()] == ':') {
      return std::stoll(line.substr(name.size() + 1)) * 1024;
    }
  }
  return 0;
}

}  // namespace

int64_t ResidentBytes() { return StatusBytes("VmRSS"); }

int64_t PeakResidentBytes() { return StatusBytes("VmHWM"); }

}  // namespace vp::runtime
