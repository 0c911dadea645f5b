// Embeddings, GELU, residual, bias, conversions and AdamW: memory-bound elementwise kernels with
// grid-stride loops; all arithmetic in fp32. GELU, the residual adds, the bias add and AdamW also
// come as 16-byte kernels (MemoryKernels::kVector: V = kVec<T> values per thread and access, the
// same per-element math), used where the sizes are multiples of V and the pointers 16-byte aligned.
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

constexpr int kThreads = 256;
// sqrt(2/π) and the cubic coefficient of tanh-GELU (the CPU engine's constants).
constexpr float kGeluScale = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

template <typename T>
__global__ void EmbeddingForwardKernel(T* out, const T* weight, const int32_t* tokens, int n, int h,
                                       int64_t begin, int64_t valid_rows) {
  const long total = static_cast<long>(n) * h;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long i = idx / h, k = idx % h;
    const int64_t local = static_cast<int64_t>(tokens[i]) - begin;
    out[idx] = (local >= 0 && local < valid_rows) ? weight[local * h + k] : FromFloat<T>(0.0f);
  }
}

template <typename T>
__global__ void EmbeddingBackwardKernel(float* dweight, const T* dout, const int32_t* tokens, int n,
                                        int h, int64_t begin, int64_t valid_rows) {
  const long total = static_cast<long>(n) * h;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long i = idx / h, k = idx % h;
    const int64_t local = static_cast<int64_t>(tokens[i]) - begin;
    if (local >= 0 && local < valid_rows) atomicAdd(&dweight[local * h + k], ToFloat(dout[idx]));
  }
}

template <typename T>
__global__ void PositionForwardKernel(T* x, const T* wpe, int batch, int t, int c, int start_pos) {
  const long total = static_cast<long>(batch) * t * c;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long tc = idx % (static_cast<long>(t) * c);
    x[idx] = FromFloat<T>(ToFloat(x[idx]) + ToFloat(wpe[static_cast<long>(start_pos) * c + tc]));
  }
}

// One thread per (t, c): sums over the batch, so no atomics and a fixed summation order.
template <typename T>
__global__ void PositionBackwardKernel(float* dwpe, const T* dx, int batch, int t, int c,
                                       int start_pos) {
  const long tc_total = static_cast<long>(t) * c;
  for (long tc = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; tc < tc_total;
       tc += static_cast<long>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < batch; ++b) acc += ToFloat(dx[b * tc_total + tc]);
    dwpe[static_cast<long>(start_pos) * c + tc] += acc;
  }
}

// tanh(u) = 1 − 2/(exp(2u) + 1), the CPU engine's form (exact at the extremes).
__device__ __forceinline__ float GeluTanh(float u) { return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f); }

// gelu(x) and dy · gelu'(x): the one math of the element and the vector kernels.
__device__ __forceinline__ float Gelu(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + GeluTanh(u));
}
__device__ __forceinline__ float GeluGrad(float x, float dy) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  const float t = GeluTanh(u);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
}

template <typename T>
__global__ void GeluForwardKernel(T* out, const T* inp, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = FromFloat<T>(Gelu(ToFloat(inp[i])));
  }
}

template <typename T>
__global__ void GeluBackwardKernel(T* dinp, const T* inp, const T* dout, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    dinp[i] = FromFloat<T>(GeluGrad(ToFloat(inp[i]), ToFloat(dout[i])));
  }
}

template <typename T>
__global__ void ResidualForwardKernel(T* out, const T* a, const T* b, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
  }
}

template <typename T>
__global__ void ResidualBackwardKernel(T* da, T* db, const T* dout, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const float g = ToFloat(dout[i]);
    da[i] = FromFloat<T>(ToFloat(da[i]) + g);
    db[i] = FromFloat<T>(ToFloat(db[i]) + g);
  }
}

template <typename T>
__global__ void AddBiasKernel(T* out, const T* bias, int n, int c) {
  const long total = static_cast<long>(n) * c;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    out[idx] = FromFloat<T>(ToFloat(out[idx]) + ToFloat(bias[idx % c]));
  }
}

// Column sums: block (32, 8) covers 32 columns; the 8 row lanes of each block stride over a
// slice of rows (blockIdx.y), reduce in shared memory, and one atomic per column and block.
template <typename T>
__global__ void ColumnSumKernel(float* dbias, const T* dout, int n, int c, int rows_per_block) {
  __shared__ float partial[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const int row_begin = blockIdx.y * rows_per_block;
  const int row_end = min(n, row_begin + rows_per_block);
  float acc = 0.0f;
  if (col < c) {
    for (int r = row_begin + threadIdx.y; r < row_end; r += 8) {
      acc += ToFloat(dout[static_cast<long>(r) * c + col]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float s = 0.0f;
    for (int y = 0; y < 8; ++y) s += partial[y][threadIdx.x];
    atomicAdd(&dbias[col], s);
  }
}

// ---- The 16-byte forms: chunk c covers elements [c·V, c·V + V), V = kVec<T>.

// out = op(a, b) element by element (b null: op(a, 0)), 16 bytes at a time: GELU, its gradient
// and the residual add, with the same per-element functions as the element kernels.
template <typename T, typename Op>
__global__ void MapVectorKernel(T* out, const T* a, const T* b, long chunks, Op op) {
  constexpr int V = kVec<T>;
  for (long c = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    float x[V], y[V] = {};
    LoadVec<T>(x, a + c * V);
    if (b != nullptr) LoadVec<T>(y, b + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = op(x[e], y[e]);
    StoreVec<T>(out + c * V, x);
  }
}
struct GeluOp {
  __device__ float operator()(float x, float) const { return Gelu(x); }
};
struct GeluGradOp {  // a = inp, b = dout
  __device__ float operator()(float x, float dy) const { return GeluGrad(x, dy); }
};
struct AddOp {
  __device__ float operator()(float x, float y) const { return x + y; }
};

template <typename T, typename Op>
cudaError_t LaunchMapVector(T* out, const T* a, const T* b, long n, cudaStream_t stream, Op op) {
  const long chunks = n / kVec<T>;
  MapVectorKernel<T, Op>
      <<<ElementwiseBlocks(chunks, kThreads), kThreads, 0, stream>>>(out, a, b, chunks, op);
  return cudaGetLastError();
}

template <typename T>
__global__ void ResidualBackwardVectorKernel(T* da, T* db, const T* dout, long chunks) {
  constexpr int V = kVec<T>;
  for (long c = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    float g[V], x[V], y[V];
    LoadVec<T>(g, dout + c * V);
    LoadVec<T>(x, da + c * V);
    LoadVec<T>(y, db + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      x[e] += g[e];
      y[e] += g[e];
    }
    StoreVec<T>(da + c * V, x);
    StoreVec<T>(db + c * V, y);
  }
}

// out (n, c) += bias (c) per row; c is a multiple of V, so a chunk never straddles two rows.
template <typename T>
__global__ void AddBiasVectorKernel(T* out, const T* bias, long chunks, int row_chunks) {
  constexpr int V = kVec<T>;
  for (long c = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    float x[V], b[V];
    LoadVec<T>(x, out + c * V);
    LoadVec<T>(b, bias + (c % row_chunks) * V);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] += b[e];
    StoreVec<T>(out + c * V, x);
  }
}

__global__ void FloatToBf16Kernel(__nv_bfloat16* out, const float* inp, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(inp[i]);
  }
}
__global__ void Bf16ToFloatKernel(float* out, const __nv_bfloat16* inp, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(inp[i]);
  }
}

// AdamW's per-step constants (AdamWStep derives them from AdamWParams).
struct AdamWScalars {
  float b1, b2, eps, decay_factor, grad_scale, step_size, bc2_sqrt;
};

// One element: the CPU optimizer's arithmetic in its order, so the fp32 master weights agree to
// rounding and both kernels below agree bit for bit. Returns the new weight; updates m and v.
__device__ __forceinline__ float AdamWElement(float p, float grad, float& m, float& v, bool decay,
                                              const AdamWScalars& a) {
  const float g = grad * a.grad_scale;
  if (decay) p *= a.decay_factor;
  m = a.b1 * m + (1.0f - a.b1) * g;
  v = a.b2 * v + (1.0f - a.b2) * g * g;
  const float denom = sqrtf(v) / a.bc2_sqrt + a.eps;
  return p - a.step_size * m / denom;
}

// Elements [first, count), one per thread and step of the grid-stride loop.
__device__ __forceinline__ void AdamWElements(float* master, __nv_bfloat16* params,
                                              const float* grads, float* m, float* v,
                                              const uint8_t* decay, size_t first, size_t count,
                                              const AdamWScalars& a) {
  for (size_t i = first + blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float mi = m[i], vi = v[i];
    const float p = AdamWElement(master[i], grads[i], mi, vi, decay[i] != 0, a);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if (params != nullptr) params[i] = __float2bfloat16(p);
  }
}

__global__ void AdamWKernel(float* master, __nv_bfloat16* params, const float* grads, float* m,
                            float* v, const uint8_t* decay, size_t count, AdamWScalars a) {
  AdamWElements(master, params, grads, m, v, decay, 0, count, a);
}

// MemoryKernels::kVector: four elements per thread and access (16-byte fp32 loads and stores,
// 8-byte bf16 stores, 4-byte decay flags); the last count % 4 elements one at a time. Needs
// master, grads, m, v 16-byte, params 8-byte and decay 4-byte aligned (AdamWStep checks).
__global__ void AdamWVectorKernel(float* master, __nv_bfloat16* params, const float* grads,
                                  float* m, float* v, const uint8_t* decay, size_t count,
                                  AdamWScalars a) {
  const size_t quads = count / 4;
  for (size_t q = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float4 p4 = reinterpret_cast<const float4*>(master)[q];
    const float4 g4 = reinterpret_cast<const float4*>(grads)[q];
    float4 m4 = reinterpret_cast<const float4*>(m)[q];
    float4 v4 = reinterpret_cast<const float4*>(v)[q];
    const uchar4 d4 = reinterpret_cast<const uchar4*>(decay)[q];
    const float4 out = make_float4(AdamWElement(p4.x, g4.x, m4.x, v4.x, d4.x != 0, a),
                                   AdamWElement(p4.y, g4.y, m4.y, v4.y, d4.y != 0, a),
                                   AdamWElement(p4.z, g4.z, m4.z, v4.z, d4.z != 0, a),
                                   AdamWElement(p4.w, g4.w, m4.w, v4.w, d4.w != 0, a));
    reinterpret_cast<float4*>(m)[q] = m4;
    reinterpret_cast<float4*>(v)[q] = v4;
    reinterpret_cast<float4*>(master)[q] = out;
    if (params != nullptr) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(out.x, out.y),
                           hi = __floats2bfloat162_rn(out.z, out.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(params)[q] = packed;
    }
  }
  AdamWElements(master, params, grads, m, v, decay, quads * 4, count, a);
}

}  // namespace

template <typename T>
cudaError_t EmbeddingForward(T* out, const T* weight, const int32_t* tokens, int n, int h,
                             int64_t begin, int64_t valid_rows, cudaStream_t stream) {
  EmbeddingForwardKernel<T>
      <<<ElementwiseBlocks(static_cast<long>(n) * h, kThreads), kThreads, 0, stream>>>(
          out, weight, tokens, n, h, begin, valid_rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t EmbeddingBackward(float* dweight, const T* dout, const int32_t* tokens, int n, int h,
                              int64_t begin, int64_t valid_rows, cudaStream_t stream) {
  EmbeddingBackwardKernel<T>
      <<<ElementwiseBlocks(static_cast<long>(n) * h, kThreads), kThreads, 0, stream>>>(
          dweight, dout, tokens, n, h, begin, valid_rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PositionEmbeddingForward(T* x, const T* wpe, int batch, int t, int c, int start_pos,
                                     cudaStream_t stream) {
  PositionForwardKernel<T>
      <<<ElementwiseBlocks(static_cast<long>(batch) * t * c, kThreads), kThreads, 0, stream>>>(
          x, wpe, batch, t, c, start_pos);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PositionEmbeddingBackward(float* dwpe, const T* dx, int batch, int t, int c,
                                      int start_pos, cudaStream_t stream) {
  PositionBackwardKernel<T>
      <<<ElementwiseBlocks(static_cast<long>(t) * c, kThreads), kThreads, 0, stream>>>(
          dwpe, dx, batch, t, c, start_pos);
  return cudaGetLastError();
}

MemoryKernels DefaultMemoryKernels() {
  const char* env = std::getenv("VOCABPIPE_MEMORY_KERNELS");
  if (env != nullptr && std::string_view(env) == "vector") return MemoryKernels::kVector;
  return MemoryKernels::kElement;  // until the vector kernels have passed on a GPU
}

std::vector<std::string_view> MemoryKernelsNames() { return {"element", "vector"}; }

template <typename T>
cudaError_t GeluForward(T* out, const T* inp, long n, cudaStream_t stream, MemoryKernels kernels) {
  if (VectorFits<T>(kernels, n, {out, inp})) {
    return LaunchMapVector<T>(out, inp, nullptr, n, stream, GeluOp{});
  }
  GeluForwardKernel<T><<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t GeluBackward(T* dinp, const T* inp, const T* dout, long n, cudaStream_t stream,
                         MemoryKernels kernels) {
  if (VectorFits<T>(kernels, n, {dinp, inp, dout})) {
    return LaunchMapVector<T>(dinp, inp, dout, n, stream, GeluGradOp{});
  }
  GeluBackwardKernel<T>
      <<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(dinp, inp, dout, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ResidualForward(T* out, const T* a, const T* b, long n, cudaStream_t stream,
                            MemoryKernels kernels) {
  if (VectorFits<T>(kernels, n, {out, a, b})) {
    return LaunchMapVector<T>(out, a, b, n, stream, AddOp{});
  }
  ResidualForwardKernel<T><<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(out, a, b, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ResidualBackward(T* da, T* db, const T* dout, long n, cudaStream_t stream,
                             MemoryKernels kernels) {
  if (VectorFits<T>(kernels, n, {da, db, dout})) {
    const long chunks = n / kVec<T>;
    ResidualBackwardVectorKernel<T>
        <<<ElementwiseBlocks(chunks, kThreads), kThreads, 0, stream>>>(da, db, dout, chunks);
    return cudaGetLastError();
  }
  ResidualBackwardKernel<T>
      <<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(da, db, dout, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t AddBias(T* out, const T* bias, int n, int c, cudaStream_t stream,
                    MemoryKernels kernels) {
  const long total = static_cast<long>(n) * c;
  if (VectorFits<T>(kernels, c, {out, bias})) {
    const long chunks = total / kVec<T>;
    AddBiasVectorKernel<T><<<ElementwiseBlocks(chunks, kThreads), kThreads, 0, stream>>>(
        out, bias, chunks, c / kVec<T>);
    return cudaGetLastError();
  }
  AddBiasKernel<T><<<ElementwiseBlocks(total, kThreads), kThreads, 0, stream>>>(out, bias, n, c);
  return cudaGetLastError();
}

template <typename T>
cudaError_t BiasBackward(float* dbias, const T* dout, int n, int c, cudaStream_t stream) {
  if (n <= 0 || c <= 0) return cudaSuccess;
  const int rows_per_block = 256;
  const dim3 grid(CeilDiv(c, 32), CeilDiv(n, rows_per_block));
  ColumnSumKernel<T><<<grid, dim3(32, 8), 0, stream>>>(dbias, dout, n, c, rows_per_block);
  return cudaGetLastError();
}

cudaError_t FloatToBf16(bf16* out, const float* inp, long n, cudaStream_t stream) {
  FloatToBf16Kernel<<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

cudaError_t Bf16ToFloat(float* out, const bf16* inp, long n, cudaStream_t stream) {
  Bf16ToFloatKernel<<<ElementwiseBlocks(n, kThreads), kThreads, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

cudaError_t AdamWStep(float* master, bf16* params, const float* grads, float* m, float* v,
                      const uint8_t* decay, size_t count, const AdamWParams& p, cudaStream_t stream,
                      MemoryKernels kernels) {
  if (count == 0) return cudaSuccess;
  const AdamWScalars a{.b1 = p.beta1,
                       .b2 = p.beta2,
                       .eps = p.eps,
                       .decay_factor = 1.0f - p.lr * p.weight_decay,
                       .grad_scale = p.grad_scale,
                       .step_size = static_cast<float>(p.lr / p.bc1),
                       .bc2_sqrt = static_cast<float>(std::sqrt(p.bc2))};
  const bool vector = UseVectorKernels(kernels) && Aligned16({master, grads, m, v}) &&
                      reinterpret_cast<uintptr_t>(params) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(decay) % 4 == 0;
  if (vector) {
    AdamWVectorKernel<<<ElementwiseBlocks(static_cast<long>(count / 4) + 1, kThreads), kThreads, 0,
                        stream>>>(master, params, grads, m, v, decay, count, a);
  } else {
    AdamWKernel<<<ElementwiseBlocks(static_cast<long>(count), kThreads), kThreads, 0, stream>>>(
        master, params, grads, m, v, decay, count, a);
  }
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                          \
  template cudaError_t EmbeddingForward<T>(T*, const T*, const int32_t*, int, int, int64_t,        \
                                           int64_t, cudaStream_t);                                 \
  template cudaError_t EmbeddingBackward<T>(float*, const T*, const int32_t*, int, int, int64_t,   \
                                            int64_t, cudaStream_t);                                \
  template cudaError_t PositionEmbeddingForward<T>(T*, const T*, int, int, int, int,               \
                                                   cudaStream_t);                                  \
  template cudaError_t PositionEmbeddingBackward<T>(float*, const T*, int, int, int, int,          \
                                                    cudaStream_t);                                 \
  template cudaError_t GeluForward<T>(T*, const T*, long, cudaStream_t, MemoryKernels);            \
  template cudaError_t GeluBackward<T>(T*, const T*, const T*, long, cudaStream_t, MemoryKernels); \
  template cudaError_t ResidualForward<T>(T*, const T*, const T*, long, cudaStream_t,              \
                                          MemoryKernels);                                          \
  template cudaError_t ResidualBackward<T>(T*, T*, const T*, long, cudaStream_t, MemoryKernels);   \
  template cudaError_t AddBias<T>(T*, const T*, int, int, cudaStream_t, MemoryKernels);            \
  template cudaError_t BiasBackward<T>(float*, const T*, int, int, cudaStream_t);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
