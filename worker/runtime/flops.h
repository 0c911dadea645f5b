// Model FLOPs (the paper's Table 4; docs/engine.md, "FLOPs and memory") and the CPU's measured
// peak, for MFU.
#pragma once

#include <cstdint>

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

// The CPU backend's "peak": the best of a few large sgemm runs on the current BLAS threads,
// in FLOP/s. Takes a fraction of a second.
double MeasureCpuPeakFlops();

}  // namespace vp::runtime
