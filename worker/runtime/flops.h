// Model FLOPs (the paper's Table 4; docs/engine.md, "FLOPs and memory") and the CPU's measured
// peak, for MFU.
#pragma once

#include <cstdint>
#include <string>

#include "worker/engine/config.h"

namespace vp::runtime {

// FLOPs of one microbatch of b samples, forward + backward, with the real (unpadded) V:
//   transformer layer  6·b·s·(4h² + 2·h·f) + 12·b·s²·h    (= b·s·h·(72h + 12s) when f = 4h)
//   output layer       6·b·s·h·V
//   input layer        3·b·s·h
double TransformerLayerFlops(const engine::ModelConfig& cfg, int b);
double OutputLayerFlops(const engine::ModelConfig& cfg, int b);
double InputLayerFlops(const engine::ModelConfig& cfg, int b);
double ModelFlopsPerMicrobatch(const engine::ModelConfig& cfg, int b);

// The CPU backend's "peak": one warm-up, then the best of `repeats` timed 1024³ sgemm runs on
// the current BLAS threads, in FLOP/s. Takes about a second on two cores.
double MeasureCpuPeakFlops(int repeats = 7);

// The sgemm peak MFU is measured against, and where it came from.
struct CpuPeak {
  double flops = 0;     // FLOP/s
  bool cached = false;  // read from the cache file, not measured by this call
  std::string source;   // "measured now" or "cached, measured 2026-11-27 12:00 UTC"
};

// The cache file of CPU peaks: $VOCABPIPE_CACHE_DIR/cpu_peak.json, else
// $XDG_CACHE_HOME/vocabpipe/cpu_peak.json, else ~/.cache/vocabpipe/cpu_peak.json.
std::string CpuPeakCachePath();

// The CPU sgemm peak for the current BLAS thread count on this host. A peak measured on a
// shared machine swings with the other jobs, so it is measured once (MeasureCpuPeakFlops) and
// kept in CpuPeakCachePath() under the host name, the CPU model and the thread count; later
// runs read it back. VOCABPIPE_MEASURE_PEAK=1 measures anew and replaces the entry. A cache
// that cannot be read or written is passed over (the peak is then measured every time).
CpuPeak CpuPeakFlops();

// MFU of `flops_per_second` against `peak` (0 when there is no peak), at most 1: a rate above
// the peak means the peak is stale (*over_peak set), never an MFU above 100%.
double ClampedMfu(double flops_per_second, double peak, bool* over_peak);

}  // namespace vp::runtime
