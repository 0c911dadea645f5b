// The vocabulary layers' own kernels: the output layer's elementwise halves of S, C1 and T (the
// GEMMs are cuBLASLt calls in worker/engine/vocab/cuda/vocab_shards.cc; row statistics in fp32,
// one block per token row) and the input layer's lookup into fp32 for IF_REDUCE.
//
// The S and T row kernels also come in a 16-byte form (MemoryKernels::kVector), used where the
// shard's row width is a multiple of kVec<T> and the logits are 16-byte aligned: 8 bf16 logits per
// access, and the forward's max and sum in one pass over the row (an online softmax: each thread
// keeps its running max m and Σ exp(y − m), rescaled when m grows, and the block combines them
// at the block max), so it reads a row of logits twice instead of three times. The first GPU
// profile had the softmax halves at 39% of the output layer's S and 38% of its T.
#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

constexpr int kThreads = 256;

// A shard with no valid rows: m' = −inf, s' = 0 and no label logit, so C1 adds exactly 0.
__device__ __forceinline__ void EmptyShardStatistics(float* local_max, float* local_sum,
                                                     float* label_logit, int i) {
  local_max[i] = -INFINITY;
  local_sum[i] = 0.0f;
  label_logit[i] = 0.0f;
}

template <typename T>
__global__ void VocabSoftmaxForwardKernel(T* probs, float* local_max, float* local_sum,
                                          float* label_logit, const int32_t* local_label,
                                          int64_t rows, int64_t valid) {
  __shared__ float red[32];
  const int i = blockIdx.x;
  T* y = probs + static_cast<int64_t>(i) * rows;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, ToFloat(y[j]));
  mx = BlockMax(mx, red);
  if (valid == 0) {
    for (int64_t j = threadIdx.x; j < rows; j += blockDim.x) y[j] = FromFloat<T>(0.0f);
    if (threadIdx.x == 0) EmptyShardStatistics(local_max, local_sum, label_logit, i);
    return;
  }
  const int32_t label = local_label[i];
  // Read the label logit before the row is overwritten with exponentials.
  const float z = label >= 0 ? ToFloat(y[label]) - mx : 0.0f;
  __syncthreads();
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(ToFloat(y[j]) - mx);
  sum = BlockSum(sum, red);
  const float inv = 1.0f / sum;
  // Recompute the exponential rather than store it: for bf16 the stored value would be rounded
  // before the division.
  for (int64_t j = threadIdx.x; j < rows; j += blockDim.x) {
    y[j] = FromFloat<T>(j < valid ? expf(ToFloat(y[j]) - mx) * inv : 0.0f);
  }
  if (threadIdx.x == 0) {
    local_max[i] = mx;
    local_sum[i] = sum;
    label_logit[i] = z;
  }
}

// One block per token row, chunk c = V logits [c·V, c·V + V) of the shard's `rows`, V = kVec<T>.
template <typename T>
__global__ void VocabSoftmaxForwardVectorKernel(T* probs, float* local_max, float* local_sum,
                                                float* label_logit, const int32_t* local_label,
                                                int64_t rows, int64_t valid) {
  constexpr int V = kVec<T>;
  __shared__ float red[32];
  const int i = blockIdx.x;
  T* y = probs + static_cast<int64_t>(i) * rows;
  const int64_t chunks = rows / V;
  if (valid == 0) {
    float zero[V] = {};
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) StoreVec<T>(y + c * V, zero);
    if (threadIdx.x == 0) EmptyShardStatistics(local_max, local_sum, label_logit, i);
    return;
  }
  const int32_t label = local_label[i];
  // The label's logit, read before any thread overwrites the row (the last pass).
  const float y_label = label >= 0 && threadIdx.x == 0 ? ToFloat(y[label]) : 0.0f;
  float m = -INFINITY, s = 0.0f;  // this thread's running max and Σ exp(y − m)
  for (int64_t c = threadIdx.x; c * V < valid; c += blockDim.x) {
    float x[V];
    LoadVec<T>(x, y + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      if (c * V + e >= valid) break;
      if (x[e] > m) {
        s = s * expf(m - x[e]) + 1.0f;  // exp(−inf) = 0 on the first element
        m = x[e];
      } else {
        s += expf(x[e] - m);
      }
    }
  }
  const float mx = BlockMax(m, red);
  const float sum = BlockSum(m == -INFINITY ? 0.0f : s * expf(m - mx), red);
  const float inv = 1.0f / sum;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float x[V];
    LoadVec<T>(x, y + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = c * V + e < valid ? expf(x[e] - mx) * inv : 0.0f;
    StoreVec<T>(y + c * V, x);
  }
  if (threadIdx.x == 0) {
    local_max[i] = mx;
    local_sum[i] = sum;
    label_logit[i] = label >= 0 ? y_label - mx : 0.0f;
  }
}

template <typename T>
__global__ void VocabSoftmaxBackwardVectorKernel(T* probs, const float* scale,
                                                 const int32_t* local_label, float d, int64_t rows,
                                                 int64_t valid) {
  constexpr int V = kVec<T>;
  const int i = blockIdx.x;
  T* g = probs + static_cast<int64_t>(i) * rows;
  const float c_scale = d * scale[i];
  const int32_t label = local_label[i];
  for (int64_t c = threadIdx.x; c * V < valid; c += blockDim.x) {
    float x[V];
    LoadVec<T>(x, g + c * V);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int64_t j = c * V + e;
      if (j < valid) x[e] = x[e] * c_scale - (j == label ? d : 0.0f);  // padding stays 0
    }
    StoreVec<T>(g + c * V, x);
  }
}

__global__ void VocabC1PrepareKernel(float* sums, float* scale, const float* local_max,
                                     const float* global_max, const float* local_sum,
                                     const float* label_logit, const int32_t* local_label, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  // m' = −inf on an all-padding shard: exp(−inf) = 0 and s' = 0, so it adds exactly 0.
  const float delta = local_max[i] - global_max[i];
  const float rescaled = local_sum[i] * expf(delta);
  scale[i] = rescaled;
  sums[i] = rescaled;
  sums[n + i] = local_label[i] >= 0 ? label_logit[i] + delta : 0.0f;
}

__global__ void VocabC1FinishKernel(float* loss, float* scale, const float* sums, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = sums[i];
  loss[i] = logf(s) - sums[n + i];
  scale[i] /= s;
}

template <typename T>
__global__ void VocabGradInputFixKernel(float* grad_x, const float* scale, const T* weight,
                                        const int32_t* local_label, float d, int n, int h) {
  const long total = static_cast<long>(n) * h;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const long i = idx / h, k = idx % h;
    float g = grad_x[idx] * (d * scale[i]);
    const int32_t label = local_label[i];
    if (label >= 0) g -= d * ToFloat(weight[static_cast<long>(label) * h + k]);
    grad_x[idx] = g;
  }
}

template <typename T>
__global__ void VocabSoftmaxBackwardKernel(T* probs, const float* scale, const int32_t* local_label,
                                           float d, int64_t rows, int64_t valid) {
  const int i = blockIdx.x;
  T* g = probs + static_cast<int64_t>(i) * rows;
  const float c = d * scale[i];
  const int32_t label = local_label[i];
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
    float x = ToFloat(g[j]) * c;
    if (j == label) x -= d;
    g[j] = FromFloat<T>(x);
  }
}

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

template <typename T>
cudaError_t VocabSoftmaxForward(T* probs, float* local_max, float* local_sum, float* label_logit,
                                const int32_t* local_label, int n, int64_t rows, int64_t valid,
                                cudaStream_t stream, MemoryKernels kernels) {
  if (n <= 0) return cudaSuccess;
  if (valid < 0 || valid > rows) return cudaErrorInvalidValue;
  if (VectorFits<T>(kernels, rows, {probs})) {
    VocabSoftmaxForwardVectorKernel<T><<<n, kThreads, 0, stream>>>(
        probs, local_max, local_sum, label_logit, local_label, rows, valid);
    return cudaGetLastError();
  }
  VocabSoftmaxForwardKernel<T><<<n, kThreads, 0, stream>>>(probs, local_max, local_sum, label_logit,
                                                           local_label, rows, valid);
  return cudaGetLastError();
}

cudaError_t VocabC1Prepare(float* sums, float* scale, const float* local_max,
                           const float* global_max, const float* local_sum,
                           const float* label_logit, const int32_t* local_label, int n,
                           cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  VocabC1PrepareKernel<<<CeilDiv(n, kThreads), kThreads, 0, stream>>>(
      sums, scale, local_max, global_max, local_sum, label_logit, local_label, n);
  return cudaGetLastError();
}

cudaError_t VocabC1Finish(float* loss, float* scale, const float* sums, int n,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  VocabC1FinishKernel<<<CeilDiv(n, kThreads), kThreads, 0, stream>>>(loss, scale, sums, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t VocabGradInputFix(float* grad_x, const float* scale, const T* weight,
                              const int32_t* local_label, float d, int n, int h,
                              cudaStream_t stream) {
  if (n <= 0 || h <= 0) return cudaSuccess;
  VocabGradInputFixKernel<T>
      <<<ElementwiseBlocks(static_cast<long>(n) * h, kThreads), kThreads, 0, stream>>>(
          grad_x, scale, weight, local_label, d, n, h);
  return cudaGetLastError();
}

template <typename T>
cudaError_t VocabSoftmaxBackward(T* probs, const float* scale, const int32_t* local_label, float d,
                                 int n, int64_t rows, int64_t valid, cudaStream_t stream,
                                 MemoryKernels kernels) {
  if (n <= 0 || valid == 0) return cudaSuccess;
  if (VectorFits<T>(kernels, rows, {probs})) {
    VocabSoftmaxBackwardVectorKernel<T>
        <<<n, kThreads, 0, stream>>>(probs, scale, local_label, d, rows, valid);
    return cudaGetLastError();
  }
  VocabSoftmaxBackwardKernel<T>
      <<<n, kThreads, 0, stream>>>(probs, scale, local_label, d, rows, valid);
  return cudaGetLastError();
}

#define VP_INSTANTIATE(T)                                                                          \
  template cudaError_t VocabSoftmaxForward<T>(T*, float*, float*, float*, const int32_t*, int,     \
                                              int64_t, int64_t, cudaStream_t, MemoryKernels);      \
  template cudaError_t VocabGradInputFix<T>(float*, const float*, const T*, const int32_t*, float, \
                                            int, int, cudaStream_t);                               \
  template cudaError_t VocabSoftmaxBackward<T>(T*, const float*, const int32_t*, float, int,       \
                                               int64_t, int64_t, cudaStream_t, MemoryKernels);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

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
