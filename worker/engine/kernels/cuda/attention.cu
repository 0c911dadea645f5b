// Causal attention for a query chunk against the key/value prefix: a plain row-per-block kernel
// (correctness over speed; the materialised fp32 probabilities match the CPU contract, which the
// backward reads). One block per (query row, head, sequence).
#include <cmath>

#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

constexpr int kThreads = 128;

// scores → softmax → out for query row i of head h, sequence b.
template <typename T>
__global__ void AttentionForwardKernel(T* out, float* att, const T* q, int ldq, const T* k,
                                       const T* v, AttentionShape s, float scale) {
  extern __shared__ float smem[];  // q row (head_dim) then 32 floats for reductions
  float* qrow = smem;
  float* red = smem + s.head_dim;
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int len = s.q_begin + i + 1;  // keys 0..q_begin+i
  const T* qp = q + (static_cast<long>(b) * q_len + i) * ldq + h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qrow[d] = ToFloat(qp[d]);
  __syncthreads();
  float* arow = att + ((static_cast<long>(b) * s.heads + h) * q_len + i) * s.q_end;
  const T* kb = k + static_cast<long>(b) * s.kv_rows * width + h * hd;
  const T* vb = v + static_cast<long>(b) * s.kv_rows * width + h * hd;

  float mx = -INFINITY;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const T* kr = kb + static_cast<long>(j) * width;
    float dot = 0.0f;
    for (int d = 0; d < hd; ++d) dot += qrow[d] * ToFloat(kr[d]);
    dot *= scale;
    arow[j] = dot;
    mx = fmaxf(mx, dot);
  }
  mx = BlockMax(mx, red);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const float e = expf(arow[j] - mx);
    arow[j] = e;
    sum += e;
  }
  sum = BlockSum(sum, red);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < s.q_end; j += blockDim.x) {
    arow[j] = j < len ? arow[j] * inv : 0.0f;
  }
  __syncthreads();  // the whole probability row is read below
  T* op = out + (static_cast<long>(b) * q_len + i) * width + h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < len; ++j) acc += arow[j] * ToFloat(vb[static_cast<long>(j) * width + d]);
    op[d] = FromFloat<T>(acc);
  }
}

// Per query row: dscores = att ⊙ (datt − Σ att·datt), datt = dout·vᵀ, into scratch; then
// dq = scale · dscores · k (overwrites).
template <typename T>
__global__ void AttentionBackwardQueryKernel(T* dq, float* scratch, const T* dout, const float* att,
                                             int ldq, const T* k, const T* v, AttentionShape s,
                                             float scale) {
  extern __shared__ float smem[];  // dout row (head_dim) then 32 floats
  float* grow = smem;
  float* red = smem + s.head_dim;
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int len = s.q_begin + i + 1;
  const T* gp = dout + (static_cast<long>(b) * q_len + i) * width + h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) grow[d] = ToFloat(gp[d]);
  __syncthreads();
  const long row = ((static_cast<long>(b) * s.heads + h) * q_len + i) * s.q_end;
  const float* arow = att + row;
  float* srow = scratch + row;
  const T* kb = k + static_cast<long>(b) * s.kv_rows * width + h * hd;
  const T* vb = v + static_cast<long>(b) * s.kv_rows * width + h * hd;

  float dot = 0.0f;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    const T* vr = vb + static_cast<long>(j) * width;
    float datt = 0.0f;
    for (int d = 0; d < hd; ++d) datt += grow[d] * ToFloat(vr[d]);
    srow[j] = datt;
    dot += arow[j] * datt;
  }
  dot = BlockSum(dot, red);
  for (int j = threadIdx.x; j < s.q_end; j += blockDim.x) {
    srow[j] = j < len ? arow[j] * (srow[j] - dot) : 0.0f;
  }
  __syncthreads();
  T* dqp = dq + (static_cast<long>(b) * q_len + i) * ldq + h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < len; ++j) acc += srow[j] * ToFloat(kb[static_cast<long>(j) * width + d]);
    dqp[d] = FromFloat<T>(scale * acc);
  }
}

// Per key row j: dk[j] += scale · Σ_i dscores[i, j] q[i];  dv[j] += Σ_i att[i, j] dout[i], over
// the chunk's queries that see key j (absolute position >= j). No atomics: one block owns j.
template <typename T>
__global__ void AttentionBackwardKeyKernel(T* dk, T* dv, const float* scratch, const T* dout,
                                           const float* att, const T* q, int ldq, AttentionShape s,
                                           float scale) {
  const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int i0 = j > s.q_begin ? j - s.q_begin : 0;
  const long head_rows = (static_cast<long>(b) * s.heads + h) * q_len;
  const long kv = (static_cast<long>(b) * s.kv_rows + j) * width + h * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float gk = 0.0f, gv = 0.0f;
    for (int i = i0; i < q_len; ++i) {
      const long a = (head_rows + i) * s.q_end + j;
      const long qi = static_cast<long>(b) * q_len + i;
      gk += scratch[a] * ToFloat(q[qi * ldq + h * hd + d]);
      gv += att[a] * ToFloat(dout[qi * width + h * hd + d]);
    }
    dk[kv + d] = FromFloat<T>(ToFloat(dk[kv + d]) + scale * gk);
    dv[kv + d] = FromFloat<T>(ToFloat(dv[kv + d]) + gv);
  }
}

bool BadShape(const AttentionShape& s) {
  return s.batch <= 0 || s.heads <= 0 || s.head_dim <= 0 || s.q_begin < 0 || s.q_end <= s.q_begin ||
         s.kv_rows < s.q_end || s.batch > 65535 || s.heads > 65535;
}

}  // namespace

template <typename T>
cudaError_t AttentionForward(T* out, float* att, const T* q, int ldq, const T* k, const T* v,
                             const AttentionShape& shape, cudaStream_t stream) {
  if (BadShape(shape)) return cudaErrorInvalidValue;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  const dim3 grid(shape.q_len(), shape.heads, shape.batch);
  const size_t smem = (shape.head_dim + 32) * sizeof(float);
  AttentionForwardKernel<T><<<grid, kThreads, smem, stream>>>(out, att, q, ldq, k, v, shape, scale);
  return cudaGetLastError();
}

template <typename T>
cudaError_t AttentionBackward(T* dq, T* dk, T* dv, float* scratch, const T* dout, const float* att,
                              const T* q, int ldq, const T* k, const T* v,
                              const AttentionShape& shape, cudaStream_t stream) {
  if (BadShape(shape)) return cudaErrorInvalidValue;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  const size_t smem = (shape.head_dim + 32) * sizeof(float);
  AttentionBackwardQueryKernel<T>
      <<<dim3(shape.q_len(), shape.heads, shape.batch), kThreads, smem, stream>>>(
          dq, scratch, dout, att, ldq, k, v, shape, scale);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  AttentionBackwardKeyKernel<T><<<dim3(shape.q_end, shape.heads, shape.batch), 64, 0, stream>>>(
      dk, dv, scratch, dout, att, q, ldq, shape, scale);
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                         \
  template cudaError_t AttentionForward<T>(T*, float*, const T*, int, const T*, const T*,         \
                                           const AttentionShape&, cudaStream_t);                  \
  template cudaError_t AttentionBackward<T>(T*, T*, T*, float*, const T*, const float*, const T*, \
                                            int, const T*, const T*, const AttentionShape&,       \
                                            cudaStream_t);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
