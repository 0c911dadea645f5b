// Device helpers shared by the .cu files: fp32 conversion of T, warp and block reductions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace vp::engine::cuda {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);  // round to nearest even
}

__device__ __forceinline__ float WarpSum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide reductions; every thread gets the result. blockDim.x must be a multiple of 32 and
// at most 1024. `shared` holds 32 floats; consecutive calls must not reuse it without a sync,
// which the trailing __syncthreads provides.
__device__ __forceinline__ float BlockSum(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = WarpSum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float r = lane < warps ? shared[lane] : 0.0f;
  r = WarpSum(r);
  __syncthreads();
  return r;
}
__device__ __forceinline__ float BlockMax(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = WarpMax(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float r = lane < warps ? shared[lane] : -INFINITY;
  r = WarpMax(r);
  __syncthreads();
  return r;
}

inline unsigned CeilDiv(long a, long b) { return static_cast<unsigned>((a + b - 1) / b); }

// Grid for an elementwise kernel over n items with a grid-stride loop (capped grid).
inline unsigned ElementwiseBlocks(long n, int threads) {
  const long blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535L * 8 ? (blocks > 0 ? blocks : 1) : 65535L * 8);
}

}  // namespace vp::engine::cuda
