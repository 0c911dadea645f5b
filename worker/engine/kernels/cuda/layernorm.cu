// LayerNorm: one warp per row for the forward and the input gradient (rows of c <= a few
// thousand fit a warp's strided loop), column-slice reductions for the weight gradient.
// Statistics in fp32, two passes over the row (mean, then the centred variance), like the CPU.
#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/norm_vector.h"

namespace vp::engine::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block

template <typename T>
__global__ void LayerNormForwardKernel(T* out, float* mean, float* rstd, const T* inp,
                                       const T* weight, const T* bias, int n, int c) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const T* x = inp + static_cast<long>(row) * c;
  float sum = 0.0f;
  for (int j = lane; j < c; j += 32) sum += ToFloat(x[j]);
  const float m = WarpSum(sum) / c;
  float var = 0.0f;
  for (int j = lane; j < c; j += 32) {
    const float d = ToFloat(x[j]) - m;
    var += d * d;
  }
  const float s = 1.0f / sqrtf(WarpSum(var) / c + kLayerNormEps);
  T* y = out + static_cast<long>(row) * c;
  for (int j = lane; j < c; j += 32) {
    y[j] = FromFloat<T>((ToFloat(x[j]) - m) * s * ToFloat(weight[j]) + ToFloat(bias[j]));
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dinp = skip + (dnorm − mean(dnorm) − xhat·mean(dnorm·xhat))·rstd, dnorm = dout·weight. skip may
// be dinp: each element is read before it is written, by the same thread.
template <typename T>
__global__ void LayerNormBackwardInputKernel(T* dinp, const T* skip, const T* dout, const T* inp,
                                             const T* weight, const float* mean, const float* rstd,
                                             int n, int c) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const long off = static_cast<long>(row) * c;
  const float m = mean[row], s = rstd[row];
  float a = 0.0f, b = 0.0f;
  for (int j = lane; j < c; j += 32) {
    const float dnorm = ToFloat(dout[off + j]) * ToFloat(weight[j]);
    a += dnorm;
    b += dnorm * ((ToFloat(inp[off + j]) - m) * s);
  }
  a = WarpSum(a) / c;
  b = WarpSum(b) / c;
  for (int j = lane; j < c; j += 32) {
    const float dnorm = ToFloat(dout[off + j]) * ToFloat(weight[j]);
    const float xhat = (ToFloat(inp[off + j]) - m) * s;
    dinp[off + j] = FromFloat<T>(ToFloat(skip[off + j]) + (dnorm - a - xhat * b) * s);
  }
}

// Block (32, 8) over 32 columns and a slice of rows; one atomic per column and block.
template <typename T>
__global__ void LayerNormBackwardWeightKernel(float* dweight, float* dbias, const T* dout,
                                              const T* inp, const float* mean, const float* rstd,
                                              int n, int c, int rows_per_block) {
  __shared__ float pw[8][33];
  __shared__ float pb[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const int row_begin = blockIdx.y * rows_per_block;
  const int row_end = min(n, row_begin + rows_per_block);
  float aw = 0.0f, ab = 0.0f;
  if (col < c) {
    for (int r = row_begin + threadIdx.y; r < row_end; r += 8) {
      const long idx = static_cast<long>(r) * c + col;
      const float g = ToFloat(dout[idx]);
      aw += g * ((ToFloat(inp[idx]) - mean[r]) * rstd[r]);
      ab += g;
    }
  }
  pw[threadIdx.y][threadIdx.x] = aw;
  pb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float sw = 0.0f, sb = 0.0f;
    for (int y = 0; y < 8; ++y) {
      sw += pw[y][threadIdx.x];
      sb += pb[y][threadIdx.x];
    }
    atomicAdd(&dweight[col], sw);
    atomicAdd(&dbias[col], sb);
  }
}

}  // namespace

template <typename T>
cudaError_t LayerNormForward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                             const T* bias, int n, int c, cudaStream_t stream,
                             MemoryKernels kernels) {
  if (n <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormForwardVector(out, mean, rstd, inp, weight, bias, n, c, kLayerNormEps, stream);
    if (e != cudaErrorNotSupported) return e;  // else: the element kernel below
  }
  LayerNormForwardKernel<T><<<CeilDiv(n, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(
      out, mean, rstd, inp, weight, bias, n, c);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LayerNormBackwardInput(T* dinp, const T* skip, const T* dout, const T* inp,
                                   const T* weight, const float* mean, const float* rstd, int n,
                                   int c, cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormBackwardInputVector(dinp, skip, dout, inp, weight, mean, rstd, n, c, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  LayerNormBackwardInputKernel<T><<<CeilDiv(n, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(
      dinp, skip, dout, inp, weight, mean, rstd, n, c);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LayerNormBackwardWeight(float* dweight, float* dbias, const T* dout, const T* inp,
                                    const float* mean, const float* rstd, int n, int c,
                                    cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0 || c <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormBackwardWeightVector(dweight, dbias, dout, inp, mean, rstd, n, c, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  const int rows_per_block = 256;
  const dim3 grid(CeilDiv(c, 32), CeilDiv(n, rows_per_block));
  LayerNormBackwardWeightKernel<T><<<grid, dim3(32, 8), 0, stream>>>(
      dweight, dbias, dout, inp, mean, rstd, n, c, rows_per_block);
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                         \
  template cudaError_t LayerNormForward<T>(T*, float*, float*, const T*, const T*, const T*, int, \
                                           int, cudaStream_t, MemoryKernels);                     \
  template cudaError_t LayerNormBackwardInput<T>(T*, const T*, const T*, const T*, const T*,      \
                                                 const float*, const float*, int, int,            \
                                                 cudaStream_t, MemoryKernels);                    \
  template cudaError_t LayerNormBackwardWeight<T>(float*, float*, const T*, const T*,             \
                                                  const float*, const float*, int, int,           \
                                                  cudaStream_t, MemoryKernels);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
