// LayerNorm and RMSNorm with 16-byte loads and stores (MemoryKernels::kVector): the math, the fp32
// statistics and the accumulate rules of layernorm.cu and llama.cu, for rows whose width is a
// multiple of V = kVec<T> (4 fp32 or 8 bf16 values) on 16-byte aligned pointers.
//
// Why: the element kernels move 2 bytes per lane and instruction for bf16, 64 bytes per warp
// load, and the first GPU profile (docs/benchmarks.md §7.4) had the norms at 28% of a GPT-2
// layer's backward input pass, far below the memory bandwidth. A 16-byte load moves 512 bytes
// per warp instruction, 8× fewer instructions for the same bytes.
//
// Letters: n rows, c channels, V = kVec<T>, x̂ the normalised input ((x − mean)·rstd for
// LayerNorm, x·rstd for RMSNorm). kLayerNorm selects LayerNorm (mean and bias) or RMSNorm.
//   forward, input gradient   one warp per row; lane L takes the V-wide chunks L, L + 32, ...
//   weight gradient           block (32, 8): lane x owns the V columns [(32·bx + x)·V, +V),
//                             row y of the block the rows y, y + 8, ... of its row slice; the 8
//                             partial sums meet in shared memory, one atomic per column and block.
#include <algorithm>

#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/norm_vector.h"

namespace vp::engine::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block (forward, input gradient)

template <typename T, bool kLayerNorm>
__global__ void NormForwardVectorKernel(T* out, float* mean, float* rstd, const T* inp,
                                        const T* weight, const T* bias, int n, int c, float eps) {
  constexpr int V = kVec<T>;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const T* x = inp + static_cast<long>(row) * c;
  const int chunks = c / V;
  float m = 0.0f;
  if constexpr (kLayerNorm) {
    float sum = 0.0f;
    for (int j = lane; j < chunks; j += 32) {
      float v[V];
      LoadVec<T>(v, x + j * V);
#pragma unroll
      for (int e = 0; e < V; ++e) sum += v[e];
    }
    m = WarpSum(sum) / c;
  }
  float ss = 0.0f;  // Σ (x − m)² (LayerNorm, centred as the CPU does) or Σ x² (RMSNorm)
  for (int j = lane; j < chunks; j += 32) {
    float v[V];
    LoadVec<T>(v, x + j * V);
#pragma unroll
    for (int e = 0; e < V; ++e) ss += (v[e] - m) * (v[e] - m);
  }
  const float s = 1.0f / sqrtf(WarpSum(ss) / c + eps);
  T* y = out + static_cast<long>(row) * c;
  for (int j = lane; j < chunks; j += 32) {
    float v[V], w[V], b[V], o[V];
    LoadVec<T>(v, x + j * V);
    LoadVec<T>(w, weight + j * V);
    if constexpr (kLayerNorm) LoadVec<T>(b, bias + j * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      o[e] = kLayerNorm ? (v[e] - m) * s * w[e] + b[e] : v[e] * s * w[e];
    }
    StoreVec<T>(y + j * V, o);
  }
  if (lane == 0) {
    if constexpr (kLayerNorm) mean[row] = m;
    rstd[row] = s;
  }
}

// LayerNorm: dinp = skip + (dnorm − mean(dnorm) − x̂·mean(dnorm·x̂))·rstd, dnorm = dout·weight.
// RMSNorm:   dinp = skip + rstd·(dnorm − x̂·mean(dnorm·x̂)). skip may be dinp (each chunk is read
// before it is written, by the same lane).
template <typename T, bool kLayerNorm>
__global__ void NormBackwardInputVectorKernel(T* dinp, const T* skip, const T* dout, const T* inp,
                                              const T* weight, const float* mean, const float* rstd,
                                              int n, int c) {
  constexpr int V = kVec<T>;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const long off = static_cast<long>(row) * c;
  const int chunks = c / V;
  const float m = kLayerNorm ? mean[row] : 0.0f, s = rstd[row];
  float a = 0.0f, b = 0.0f;
  for (int j = lane; j < chunks; j += 32) {
    float g[V], w[V], x[V];
    LoadVec<T>(g, dout + off + j * V);
    LoadVec<T>(w, weight + j * V);
    LoadVec<T>(x, inp + off + j * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float dnorm = g[e] * w[e];
      a += dnorm;
      b += dnorm * ((x[e] - m) * s);
    }
  }
  a = kLayerNorm ? WarpSum(a) / c : 0.0f;
  b = WarpSum(b) / c;
  for (int j = lane; j < chunks; j += 32) {
    float g[V], w[V], x[V], d[V];
    LoadVec<T>(g, dout + off + j * V);
    LoadVec<T>(w, weight + j * V);
    LoadVec<T>(x, inp + off + j * V);
    LoadVec<T>(d, skip + off + j * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float xhat = (x[e] - m) * s;
      d[e] += (g[e] * w[e] - a - xhat * b) * s;
    }
    StoreVec<T>(dinp + off + j * V, d);
  }
}

template <typename T, bool kLayerNorm>
__global__ void NormBackwardWeightVectorKernel(float* dweight, float* dbias, const T* dout,
                                               const T* inp, const float* mean, const float* rstd,
                                               int n, int c, int rows_per_block) {
  constexpr int V = kVec<T>;
  constexpr int kSlots = 32 * (V + 1);  // lane x's V sums at [x·(V+1), +V): no bank conflicts
  __shared__ float pw[8][kSlots];
  __shared__ float pb[kLayerNorm ? 8 : 1][kSlots];
  const int col0 = (blockIdx.x * 32 + threadIdx.x) * V;
  const int row_begin = blockIdx.y * rows_per_block;
  const int row_end = min(n, row_begin + rows_per_block);
  float aw[V], ab[V];
#pragma unroll
  for (int e = 0; e < V; ++e) aw[e] = ab[e] = 0.0f;
  if (col0 < c) {  // c is a multiple of V: the whole chunk is in range
    for (int r = row_begin + threadIdx.y; r < row_end; r += 8) {
      const long idx = static_cast<long>(r) * c + col0;
      float g[V], x[V];
      LoadVec<T>(g, dout + idx);
      LoadVec<T>(x, inp + idx);
      const float m = kLayerNorm ? mean[r] : 0.0f, s = rstd[r];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        aw[e] += g[e] * ((x[e] - m) * s);
        ab[e] += g[e];
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    pw[threadIdx.y][threadIdx.x * (V + 1) + e] = aw[e];
    if constexpr (kLayerNorm) pb[threadIdx.y][threadIdx.x * (V + 1) + e] = ab[e];
  }
  __syncthreads();
  const int tid = threadIdx.y * 32 + threadIdx.x;  // one thread per column of the block's 32·V
  const int col = blockIdx.x * 32 * V + tid;
  if (tid < 32 * V && col < c) {
    const int slot = (tid / V) * (V + 1) + tid % V;
    float sw = 0.0f, sb = 0.0f;
    for (int y = 0; y < 8; ++y) {
      sw += pw[y][slot];
      if constexpr (kLayerNorm) sb += pb[y][slot];
    }
    atomicAdd(&dweight[col], sw);
    if constexpr (kLayerNorm) atomicAdd(&dbias[col], sb);
  }
}

// Rows per block of the weight gradient: at least 64 (8 per thread row), and at most 512 row
// slices, so the atomics per column stay few while small n still fills the device.
int WeightRowsPerBlock(int n) {
  const int rows = std::max(64, static_cast<int>(CeilDiv(n, 512)));
  return (rows + 7) / 8 * 8;
}

}  // namespace

template <typename T>
cudaError_t NormForwardVector(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                              const T* bias, int n, int c, float eps, cudaStream_t stream) {
  if (!VectorFits<T>(MemoryKernels::kVector, c, {out, inp, weight, bias})) {
    return cudaErrorNotSupported;
  }
  if (n <= 0) return cudaSuccess;
  const unsigned blocks = CeilDiv(n, kRowsPerBlock), threads = 32 * kRowsPerBlock;
  if (mean != nullptr) {
    NormForwardVectorKernel<T, true>
        <<<blocks, threads, 0, stream>>>(out, mean, rstd, inp, weight, bias, n, c, eps);
  } else {
    NormForwardVectorKernel<T, false>
        <<<blocks, threads, 0, stream>>>(out, mean, rstd, inp, weight, bias, n, c, eps);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t NormBackwardInputVector(T* dinp, const T* skip, const T* dout, const T* inp,
                                    const T* weight, const float* mean, const float* rstd, int n,
                                    int c, cudaStream_t stream) {
  if (!VectorFits<T>(MemoryKernels::kVector, c, {dinp, skip, dout, inp, weight})) {
    return cudaErrorNotSupported;
  }
  if (n <= 0) return cudaSuccess;
  const unsigned blocks = CeilDiv(n, kRowsPerBlock), threads = 32 * kRowsPerBlock;
  if (mean != nullptr) {
    NormBackwardInputVectorKernel<T, true>
        <<<blocks, threads, 0, stream>>>(dinp, skip, dout, inp, weight, mean, rstd, n, c);
  } else {
    NormBackwardInputVectorKernel<T, false>
        <<<blocks, threads, 0, stream>>>(dinp, skip, dout, inp, weight, mean, rstd, n, c);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t NormBackwardWeightVector(float* dweight, float* dbias, const T* dout, const T* inp,
                                     const float* mean, const float* rstd, int n, int c,
                                     cudaStream_t stream) {
  if (!VectorFits<T>(MemoryKernels::kVector, c, {dout, inp})) return cudaErrorNotSupported;
  if (n <= 0 || c <= 0) return cudaSuccess;
  const int rows_per_block = WeightRowsPerBlock(n);
  const dim3 grid(CeilDiv(c, 32 * kVec<T>), CeilDiv(n, rows_per_block));
  if (mean != nullptr) {
    NormBackwardWeightVectorKernel<T, true><<<grid, dim3(32, 8), 0, stream>>>(
        dweight, dbias, dout, inp, mean, rstd, n, c, rows_per_block);
  } else {
    NormBackwardWeightVectorKernel<T, false><<<grid, dim3(32, 8), 0, stream>>>(
        dweight, dbias, dout, inp, mean, rstd, n, c, rows_per_block);
  }
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                          \
  template cudaError_t NormForwardVector<T>(T*, float*, float*, const T*, const T*, const T*, int, \
                                            int, float, cudaStream_t);                             \
  template cudaError_t NormBackwardInputVector<T>(T*, const T*, const T*, const T*, const T*,      \
                                                  const float*, const float*, int, int,            \
                                                  cudaStream_t);                                   \
  template cudaError_t NormBackwardWeightVector<T>(                                                \
      float*, float*, const T*, const T*, const float*, const float*, int, int, cudaStream_t);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
