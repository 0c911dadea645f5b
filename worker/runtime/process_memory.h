// This process's resident memory, as the kernel counts it (/proc/self): what a rank really
// holds, beyond the engine's own accounting (memory.h) — the program, its libraries, allocator
// slack, the token shards' mapped pages. Linux only; every function returns 0 / false where
// /proc cannot be read.
#pragma once

#include <cstdint>

namespace vp::runtime {

// VmRSS: resident bytes now.
int64_t ResidentBytes();
// VmHWM: the peak resident bytes since the process started: what the kernel counts as the
// process's ru_maxrss, the footprint a rank reports (memory.process) after each step.
int64_t PeakResidentBytes();

}  // namespace vp::runtime
