// The operator's kernel switches, checked where a CUDA rank (or cuda_bench) starts:
// VOCABPIPE_ATTENTION (kernels.h, AttentionKernels), VOCABPIPE_MEMORY_KERNELS (MemoryKernels)
// and VOCABPIPE_GEMM_EPILOGUE (gemm.h). The kernels read them where they run and take a value
// they do not know for the default — so without this check a misspelt switch would train, or a
// GPU benchmark measure, other kernels than the ones asked for, and say nothing.
#pragma once

#include "absl/status/status.h"

namespace vp::engine::cuda {

// OK when each switch is unset, empty or holds a value it knows; else InvalidArgument naming the
// variable, the value (escaped, at most 40 bytes) and the values it takes.
absl::Status CheckKernelSwitches();

}  // namespace vp::engine::cuda
