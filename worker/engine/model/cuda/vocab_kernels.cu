#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/model/cuda/vocab_kernels.h"

namespace vp::engine::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per output element, grid-stride: n·h is small (one microbatch of embeddings) and
// the row copy is bandwidth bound, so a plain coalesced elementwise loop is enough.
template <typename E>
__global__ void EmbeddingForwardToFloatKernel(float* out, const E* weight, const int32_t* tokens,
                                              int n, int h, int64_t begin, int64_t valid_rows) {
  const long total = static_cast<long>(n) * h;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long i = idx / h, k = idx % h;
    const int64_t local = static_cast<int64_t>(tokens[i]) - begin;
    // Tokens owned by another shard (or padding rows, which no token reaches) give a zero row,
    // so the IF_REDUCE sum adds exactly one non-zero row per token.
    out[idx] = (local >= 0 && local < valid_rows) ? ToFloat(weight[local * h + k]) : 0.0f;
  }
}

}  // namespace

template <typename E>
cudaError_t EmbeddingForwardToFloat(float* out, const E* weight, const int32_t* tokens, int n,
                                    int h, int64_t begin, int64_t valid_rows, cudaStream_t stream) {
  if (n <= 0 || h <= 0) return cudaSuccess;
  EmbeddingForwardToFloatKernel<E>
      <<<ElementwiseBlocks(static_cast<long>(n) * h, kThreads), kThreads, 0, stream>>>(
          out, weight, tokens, n, h, begin, valid_rows);
  return cudaGetLastError();
}

template cudaError_t EmbeddingForwardToFloat<float>(float*, const float*, const int32_t*, int, int,
                                                    int64_t, int64_t, cudaStream_t);
template cudaError_t EmbeddingForwardToFloat<bf16>(float*, const bf16*, const int32_t*, int, int,
                                                   int64_t, int64_t, cudaStream_t);

}  // namespace vp::engine::cuda
