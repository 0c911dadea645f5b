// Device helpers shared by the .cu files: fp32 conversion of T, warp and block reductions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <initializer_list>

#include "worker/engine/kernels/cuda/kernels.h"

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

// 16-byte vectors: kVec<T> elements of T (4 fp32 or 8 bf16) moved by one load or store, which
// the caller has checked are 16-byte aligned (Aligned16).
template <typename T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
__device__ __forceinline__ void LoadVec(float (&dst)[kVec<T>], const T* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) dst[i] = ToFloat(e[i]);
}

template <typename T>
__device__ __forceinline__ void StoreVec(T* p, const float (&src)[kVec<T>]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) e[i] = FromFloat<T>(src[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
// Every pointer of the list 16-byte aligned (a null one, an absent operand, passes).
inline bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && !Aligned16(p)) return false;
  }
  return true;
}

// MemoryKernels::kDefault resolved (VOCABPIPE_MEMORY_KERNELS): true for the 16-byte kernels.
inline bool UseVectorKernels(MemoryKernels kernels) {
  return (kernels == MemoryKernels::kDefault ? DefaultMemoryKernels() : kernels) ==
         MemoryKernels::kVector;
}
// The 16-byte form of an elementwise kernel runs: asked for, `count` (the elements, or a row's
// width) a multiple of kVec<T>, and every pointer 16-byte aligned.
template <typename T>
bool VectorFits(MemoryKernels kernels, long count, std::initializer_list<const void*> pointers) {
  return UseVectorKernels(kernels) && count % kVec<T> == 0 && Aligned16(pointers);
}

inline unsigned CeilDiv(long a, long b) { return static_cast<unsigned>((a + b - 1) / b); }

// Grid for an elementwise kernel over n items with a grid-stride loop (capped grid).
inline unsigned ElementwiseBlocks(long n, int threads) {
  const long blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65535L * 8 ? (blocks > 0 ? blocks : 1) : 65535L * 8);
}

}  // namespace vp::engine::cuda
