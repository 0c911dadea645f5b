// Small CUDA kernels of the device vocabulary shards (vocab_shards.cc) that the shared kernel
// library (worker/engine/kernels/cuda/kernels.h) does not have. Same conventions: the wrapper
// enqueues on `stream` and returns cudaGetLastError(); float and bf16 instantiations only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {

// IF, local part, into an fp32 output: out[i, :] = float(weight[tokens[i] − begin, :]) for
// tokens in [begin, begin + valid_rows), 0 for every other token. Overwrites out. fp32 (not E)
// so that IF_REDUCE sums in fp32 — exactly one shard contributes each token's row, so the sum is
// the exact lookup whatever E is.
template <typename E>
cudaError_t EmbeddingForwardToFloat(float* out,             // (n, h)
                                    const E* weight,        // (>= valid_rows, h)
                                    const int32_t* tokens,  // (n) global token ids
                                    int n, int h, int64_t begin, int64_t valid_rows,
                                    cudaStream_t stream);

}  // namespace vp::engine::cuda
