#include <algorithm>

#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/model/cuda/model_kernels.h"

namespace vp::engine::cuda {
namespace {

template <typename T>
__global__ void EmbedSeqChunkForwardKernel(T* x, const float* emb, const T* wpe, int batch, int s,
                                           int len, int h, int start) {
  const long total = static_cast<long>(batch) * len * h;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % h);
    const long row = i / h;  // b·len + t
    const int t = static_cast<int>(row % len);
    const long b = row / len;
    const float e = emb[(b * s + start + t) * h + c];
    // No position table (Llama: RoPE in the layers) gives the embedding alone.
    const float p = wpe != nullptr ? ToFloat(wpe[static_cast<long>(start + t) * h + c]) : 0.0f;
    x[i] = FromFloat<T>(e + p);
  }
}

__global__ void SquaredNormKernel(double* partial, const float* g, size_t count) {
  __shared__ double red[256];
  double acc = 0.0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double v = g[i];
    acc += v * v;
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {  // fixed tree: deterministic
    if (threadIdx.x < stride) red[threadIdx.x] += red[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = red[0];
}

}  // namespace

template <typename T>
cudaError_t EmbedSeqChunkForward(T* x, const float* emb, const T* wpe, int batch, int s, int len,
                                 int h, int start, cudaStream_t stream) {
  const long total = static_cast<long>(batch) * len * h;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<long>((total + threads - 1) / threads, 4096));
  EmbedSeqChunkForwardKernel<T>
      <<<blocks, threads, 0, stream>>>(x, emb, wpe, batch, s, len, h, start);
  return cudaGetLastError();
}

cudaError_t SquaredNormPartials(double* partial, const float* g, size_t count,
                                cudaStream_t stream) {
  SquaredNormKernel<<<kSquaredNormBlocks, 256, 0, stream>>>(partial, g, count);
  return cudaGetLastError();
}

template cudaError_t EmbedSeqChunkForward<float>(float*, const float*, const float*, int, int, int,
                                                 int, int, cudaStream_t);
template cudaError_t EmbedSeqChunkForward<bf16>(bf16*, const float*, const bf16*, int, int, int,
                                                int, int, cudaStream_t);

}  // namespace vp::engine::cuda
