// The Llama ops on device, mirroring worker/engine/kernels/cpu/llama.cc: RMSNorm, rotary position
// embeddings, SwiGLU. (The nn.Linear-layout linears are GEMMs: gemm.h, LinearT*.)
//
// Letters: n rows (b·t tokens), c channels, t chunk length, d head dimension, f MLP width.
// RMSNorm: one warp per row (statistic in fp32) and column-slice reductions for the weight
// gradient, as layernorm.cu. RoPE: one thread per rotated pair; angles in double exactly as the
// CPU forms them (pos · theta^(−2i/d), then cos/sin rounded to float once), so a chunk that
// starts mid-sequence rotates bit-for-bit like the CPU does. SwiGLU: one thread per column, or
// per 16 bytes of columns (MemoryKernels::kVector).
#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/norm_vector.h"

namespace vp::engine::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block for the row kernels
constexpr int kThreads = 256;     // elementwise kernels

template <typename T>
__global__ void RmsNormForwardKernel(T* out, float* rstd, const T* inp, const T* weight, int n,
                                     int c, float eps) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const long off = static_cast<long>(row) * c;
  float ss = 0.0f;
  for (int j = lane; j < c; j += 32) {
    const float x = ToFloat(inp[off + j]);
    ss += x * x;
  }
  const float r = 1.0f / sqrtf(WarpSum(ss) / c + eps);
  for (int j = lane; j < c; j += 32) {
    out[off + j] = FromFloat<T>(ToFloat(inp[off + j]) * r * ToFloat(weight[j]));
  }
  if (lane == 0) rstd[row] = r;
}

// dinp = skip + r·(g − x̂·mean(g·x̂)), g = dout·weight, x̂ = inp·r (skip may be dinp, as in
// LayerNorm's kernel).
template <typename T>
__global__ void RmsNormBackwardInputKernel(T* dinp, const T* skip, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, int n, int c) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const long off = static_cast<long>(row) * c;
  const float r = rstd[row];
  float dot = 0.0f;
  for (int j = lane; j < c; j += 32) {
    dot += ToFloat(dout[off + j]) * ToFloat(weight[j]) * (ToFloat(inp[off + j]) * r);
  }
  const float m = WarpSum(dot) / c;
  for (int j = lane; j < c; j += 32) {
    const float g = ToFloat(dout[off + j]) * ToFloat(weight[j]);
    const float xhat = ToFloat(inp[off + j]) * r;
    dinp[off + j] = FromFloat<T>(ToFloat(skip[off + j]) + r * (g - xhat * m));
  }
}

// Block (32, 8) over 32 columns and a slice of rows; one atomic per column and block.
template <typename T>
__global__ void RmsNormBackwardWeightKernel(float* dweight, const T* dout, const T* inp,
                                            const float* rstd, int n, int c, int rows_per_block) {
  __shared__ float part[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  const int row_begin = blockIdx.y * rows_per_block;
  const int row_end = min(n, row_begin + rows_per_block);
  float acc = 0.0f;
  if (col < c) {
    for (int r = row_begin + threadIdx.y; r < row_end; r += 8) {
      const long idx = static_cast<long>(r) * c + col;
      acc += ToFloat(dout[idx]) * (ToFloat(inp[idx]) * rstd[r]);
    }
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    float sum = 0.0f;
    for (int y = 0; y < 8; ++y) sum += part[y][threadIdx.x];
    atomicAdd(&dweight[col], sum);
  }
}

// One thread per (row, head, pair i): v[i], v[i + d/2] rotated by sign · pos · theta^(−2i/d).
// Rows are (batch, t), row stride ld; pos = start_pos + the row's position in the chunk.
template <typename T>
__global__ void RopeKernel(T* x, int ld, int batch, int t, int heads, int d, int start_pos,
                           float theta, float sign) {
  const int half = d / 2;
  const long total = static_cast<long>(batch) * t * heads * half;
  for (long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int h = static_cast<int>((idx / half) % heads);
    const long row = idx / (static_cast<long>(half) * heads);  // b·t + j
    const int j = static_cast<int>(row % t);
    const double inv_freq = pow(static_cast<double>(theta), -2.0 * i / d);
    const double angle = static_cast<double>(start_pos + j) * inv_freq;
    const float cs = static_cast<float>(cos(angle));
    const float sn = sign * static_cast<float>(sin(angle));
    T* v = x + row * ld + static_cast<long>(h) * d;
    const float a = ToFloat(v[i]), b = ToFloat(v[i + half]);
    v[i] = FromFloat<T>(a * cs - b * sn);
    v[i + half] = FromFloat<T>(b * cs + a * sn);
  }
}

// silu(g)·u and its two partial derivatives times dy: the one math of the element and the
// vector kernels.
__device__ __forceinline__ float Swiglu(float g, float u) {
  const float sig = 1.0f / (1.0f + expf(-g));
  return g * sig * u;
}
__device__ __forceinline__ void SwigluGrad(float g, float u, float dy, float& dg, float& du) {
  const float sig = 1.0f / (1.0f + expf(-g));
  dg = dy * u * sig * (1.0f + g * (1.0f - sig));
  du = dy * g * sig;
}

template <typename T>
__global__ void SwigluForwardKernel(T* out, const T* gu, long n, int f) {
  const long total = n * f;
  for (long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = idx / f;
    const int j = static_cast<int>(idx % f);
    out[idx] = FromFloat<T>(Swiglu(ToFloat(gu[r * 2 * f + j]), ToFloat(gu[r * 2 * f + f + j])));
  }
}

template <typename T>
__global__ void SwigluBackwardKernel(T* dgu, const T* gu, const T* dout, long n, int f) {
  const long total = n * f;
  for (long idx = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long r = idx / f;
    const int j = static_cast<int>(idx % f);
    const long gi = r * 2 * f + j, ui = gi + f;
    float dg, du;
    SwigluGrad(ToFloat(gu[gi]), ToFloat(gu[ui]), ToFloat(dout[idx]), dg, du);
    dgu[gi] = FromFloat<T>(dg);
    dgu[ui] = FromFloat<T>(du);
  }
}

// The 16-byte forms (MemoryKernels::kVector): chunk c is V = kVec<T> columns [j, j + V) of row r
// of out (n, f); f is a multiple of V, so the gate and up halves of gu hold the same chunk at
// r·2f + j and r·2f + f + j.
template <typename T>
__global__ void SwigluForwardVectorKernel(T* out, const T* gu, long chunks, int f) {
  constexpr int V = kVec<T>;
  const int row_chunks = f / V;
  for (long c = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    const long gate = (c / row_chunks) * 2 * f + (c % row_chunks) * V;
    float g[V], u[V];
    LoadVec<T>(g, gu + gate);
    LoadVec<T>(u, gu + gate + f);
#pragma unroll
    for (int e = 0; e < V; ++e) g[e] = Swiglu(g[e], u[e]);
    StoreVec<T>(out + c * V, g);
  }
}

template <typename T>
__global__ void SwigluBackwardVectorKernel(T* dgu, const T* gu, const T* dout, long chunks, int f) {
  constexpr int V = kVec<T>;
  const int row_chunks = f / V;
  for (long c = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<long>(gridDim.x) * blockDim.x) {
    const long gate = (c / row_chunks) * 2 * f + (c % row_chunks) * V;
    float g[V], u[V], dy[V], dg[V], du[V];
    LoadVec<T>(g, gu + gate);
    LoadVec<T>(u, gu + gate + f);
    LoadVec<T>(dy, dout + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) SwigluGrad(g[e], u[e], dy[e], dg[e], du[e]);
    StoreVec<T>(dgu + gate, dg);
    StoreVec<T>(dgu + gate + f, du);
  }
}

template <typename T>
cudaError_t LaunchRope(T* x, int ld, int batch, int t, int heads, int head_dim, int start_pos,
                       float theta, float sign, cudaStream_t stream) {
  if (head_dim % 2 != 0 || head_dim <= 0 || start_pos < 0) return cudaErrorInvalidValue;
  const long total = static_cast<long>(batch) * t * heads * (head_dim / 2);
  if (total <= 0) return cudaSuccess;
  RopeKernel<T><<<ElementwiseBlocks(total, kThreads), kThreads, 0, stream>>>(
      x, ld, batch, t, heads, head_dim, start_pos, theta, sign);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t RmsNormForward(T* out, float* rstd, const T* inp, const T* weight, int n, int c,
                           float eps, cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormForwardVector<T>(out, nullptr, rstd, inp, weight, nullptr, n, c, eps, stream);
    if (e != cudaErrorNotSupported) return e;  // else: the element kernel below
  }
  RmsNormForwardKernel<T><<<CeilDiv(n, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(
      out, rstd, inp, weight, n, c, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RmsNormBackwardInput(T* dinp, const T* skip, const T* dout, const T* inp,
                                 const T* weight, const float* rstd, int n, int c,
                                 cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormBackwardInputVector<T>(dinp, skip, dout, inp, weight, nullptr, rstd, n, c, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  RmsNormBackwardInputKernel<T><<<CeilDiv(n, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream>>>(
      dinp, skip, dout, inp, weight, rstd, n, c);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RmsNormBackwardWeight(float* dweight, const T* dout, const T* inp, const float* rstd,
                                  int n, int c, cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0 || c <= 0) return cudaSuccess;
  if (UseVectorKernels(kernels)) {
    const cudaError_t e =
        NormBackwardWeightVector<T>(dweight, nullptr, dout, inp, nullptr, rstd, n, c, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  const int rows_per_block = 256;
  const dim3 grid(CeilDiv(c, 32), CeilDiv(n, rows_per_block));
  RmsNormBackwardWeightKernel<T>
      <<<grid, dim3(32, 8), 0, stream>>>(dweight, dout, inp, rstd, n, c, rows_per_block);
  return cudaGetLastError();
}

template <typename T>
cudaError_t RopeForward(T* x, int ld, int batch, int t, int heads, int head_dim, int start_pos,
                        float theta, cudaStream_t stream) {
  return LaunchRope(x, ld, batch, t, heads, head_dim, start_pos, theta, 1.0f, stream);
}

template <typename T>
cudaError_t RopeBackward(T* dx, int ld, int batch, int t, int heads, int head_dim, int start_pos,
                         float theta, cudaStream_t stream) {
  // y = R·x with R orthogonal: dx = Rᵀ·dy, the rotation by the opposite angle.
  return LaunchRope(dx, ld, batch, t, heads, head_dim, start_pos, theta, -1.0f, stream);
}

template <typename T>
cudaError_t SwigluForward(T* out, const T* gu, long n, int f, cudaStream_t stream,
                          MemoryKernels kernels) {
  if (n <= 0 || f <= 0) return cudaSuccess;
  if (VectorFits<T>(kernels, f, {out, gu})) {
    const long chunks = n * f / kVec<T>;
    SwigluForwardVectorKernel<T>
        <<<ElementwiseBlocks(chunks, kThreads), kThreads, 0, stream>>>(out, gu, chunks, f);
    return cudaGetLastError();
  }
  SwigluForwardKernel<T>
      <<<ElementwiseBlocks(n * f, kThreads), kThreads, 0, stream>>>(out, gu, n, f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t SwigluBackward(T* dgu, const T* gu, const T* dout, long n, int f, cudaStream_t stream,
                           MemoryKernels kernels) {
  if (n <= 0 || f <= 0) return cudaSuccess;
  if (VectorFits<T>(kernels, f, {dgu, gu, dout})) {
    const long chunks = n * f / kVec<T>;
    SwigluBackwardVectorKernel<T>
        <<<ElementwiseBlocks(chunks, kThreads), kThreads, 0, stream>>>(dgu, gu, dout, chunks, f);
    return cudaGetLastError();
  }
  SwigluBackwardKernel<T>
      <<<ElementwiseBlocks(n * f, kThreads), kThreads, 0, stream>>>(dgu, gu, dout, n, f);
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                      \
  template cudaError_t RmsNormForward<T>(T*, float*, const T*, const T*, int, int, float,      \
                                         cudaStream_t, MemoryKernels);                         \
  template cudaError_t RmsNormBackwardInput<T>(T*, const T*, const T*, const T*, const T*,     \
                                               const float*, int, int, cudaStream_t,           \
                                               MemoryKernels);                                 \
  template cudaError_t RmsNormBackwardWeight<T>(float*, const T*, const T*, const float*, int, \
                                                int, cudaStream_t, MemoryKernels);             \
  template cudaError_t RopeForward<T>(T*, int, int, int, int, int, int, float, cudaStream_t);  \
  template cudaError_t RopeBackward<T>(T*, int, int, int, int, int, int, float, cudaStream_t); \
  template cudaError_t SwigluForward<T>(T*, const T*, long, int, cudaStream_t, MemoryKernels); \
  template cudaError_t SwigluBackward<T>(T*, const T*, const T*, long, int, cudaStream_t,      \
                                         MemoryKernels);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
