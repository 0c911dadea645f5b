// CUDA kernels of the transformer layer and the vocabulary layers, mirroring
// worker/engine/kernels/cpu/kernels.h and the vocab passes (llm.c style forward/backward pairs).
//
// Precision (docs/cuda.md, "Precision"): T is float (fp32 path, matches the CPU engine to 1e-5) or
// bf16 (parameters and activations). Statistics — LayerNorm mean/rstd, softmax max/sum, losses —
// are fp32 in both paths, and so are every *weight* gradient (accumulated over many microbatches,
// where bf16 would lose the small updates) and the AdamW master weights and moments.
//
// Every wrapper enqueues on `stream` and returns cudaGetLastError() (launch errors only; a
// fault inside a kernel surfaces at the next synchronisation). Accumulate/overwrite rules are
// the CPU ones and are repeated per function. Explicit instantiations: float and bf16 only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace vp::engine::cuda {

using bf16 = __nv_bfloat16;

inline constexpr float kLayerNormEps = 1e-5f;

// ---------------------------------------------------------------------------------------------
// Input layer (a vocabulary shard of rows [begin, begin + valid_rows) of wte).

// out[i, :] = weight[tokens[i] − begin, :] for tokens in the shard, 0 for tokens outside it (so a
// sum all-reduce over shards yields the full lookup). Overwrites out.
template <typename T>
cudaError_t EmbeddingForward(T* out,                 // (n, h)
                             const T* weight,        // (>= valid_rows, h)
                             const int32_t* tokens,  // (n) global token ids
                             int n, int h, int64_t begin, int64_t valid_rows, cudaStream_t stream);

// IF, local part, into an fp32 output: out[i, :] = float(weight[tokens[i] − begin, :]) for
// tokens in [begin, begin + valid_rows), 0 for every other token. Overwrites out. fp32 (not T)
// so that IF_REDUCE sums in fp32 — exactly one shard contributes each token's row, so the sum is
// the exact lookup whatever T is.
template <typename T>
cudaError_t EmbeddingForwardToFloat(float* out,             // (n, h)
                                    const T* weight,        // (>= valid_rows, h)
                                    const int32_t* tokens,  // (n) global token ids
                                    int n, int h, int64_t begin, int64_t valid_rows,
                                    cudaStream_t stream);

// dweight[tokens[i] − begin, :] += dout[i, :] for tokens in the shard (scatter-add; a repeated
// token adds once per occurrence). fp32 atomics.
template <typename T>
cudaError_t EmbeddingBackward(float* dweight,         // (>= valid_rows, h)
                              const T* dout,          // (n, h)
                              const int32_t* tokens,  // (n)
                              int n, int h, int64_t begin, int64_t valid_rows, cudaStream_t stream);

// x[b, t, :] += wpe[start_pos + t, :].
template <typename T>
cudaError_t PositionEmbeddingForward(T* x,          // (batch, t, c)
                                     const T* wpe,  // (>= start_pos + t, c)
                                     int batch, int t, int c, int start_pos, cudaStream_t stream);

// dwpe[start_pos + t, :] += Σ_b dx[b, t, :] (accumulates; deterministic, no atomics).
template <typename T>
cudaError_t PositionEmbeddingBackward(float* dwpe,  // (>= start_pos + t, c)
                                      const T* dx,  // (batch, t, c)
                                      int batch, int t, int c, int start_pos, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Which kernels run the memory-bound passes: LayerNorm and RMSNorm, GELU, SwiGLU, the residual
// adds, the bias add and the output layer's softmax rows (VocabSoftmaxForward/Backward). kElement:
// one element per thread (a row's elements per lane of one warp for the norms) with 2- or 4-byte
// accesses (layernorm.cu, llama.cu, elementwise.cu). kVector: the same math with 16-byte loads and
// stores, 8 bf16 or 4 fp32 values at a time (norm_vector.cu and the vector kernels beside each
// element one), where the width is a multiple of 16 bytes and every pointer is 16-byte aligned,
// else kElement. Statistics, accumulation order within an element, and the CPU tolerances are the
// same. kDefault: the VOCABPIPE_MEMORY_KERNELS environment variable ("element" or "vector"), else
// kElement until the vector kernels have passed on a GPU.
enum class MemoryKernels { kDefault, kElement, kVector };
// The kernels kDefault resolves to now (reads VOCABPIPE_MEMORY_KERNELS).
MemoryKernels DefaultMemoryKernels();
// Every value VOCABPIPE_MEMORY_KERNELS takes.
std::vector<std::string_view> MemoryKernelsNames();

// LayerNorm over the last dimension, fp32 statistics, eps 1e-5.

template <typename T>
cudaError_t LayerNormForward(T* out,           // (n, c)
                             float* mean,      // (n)
                             float* rstd,      // (n)
                             const T* inp,     // (n, c)
                             const T* weight,  // (c)
                             const T* bias,    // (c)
                             int n, int c, cudaStream_t stream,
                             MemoryKernels kernels = MemoryKernels::kDefault);

// B part: dinp = skip + dL/dinp, skip the residual stream's gradient from the skip path (skip may
// be dinp: accumulates in place). Taking skip apart saves the copy of it into dinp that
// cpu::LayerNormBackwardInput's accumulate-only form would need.
template <typename T>
cudaError_t LayerNormBackwardInput(T* dinp,            // (n, c)
                                   const T* skip,      // (n, c)
                                   const T* dout,      // (n, c)
                                   const T* inp,       // (n, c)
                                   const T* weight,    // (c)
                                   const float* mean,  // (n)
                                   const float* rstd,  // (n)
                                   int n, int c, cudaStream_t stream,
                                   MemoryKernels kernels = MemoryKernels::kDefault);

// W part: dweight += Σ_rows dout·xhat, dbias += Σ_rows dout (fp32, accumulates).
template <typename T>
cudaError_t LayerNormBackwardWeight(float* dweight,     // (c)
                                    float* dbias,       // (c)
                                    const T* dout,      // (n, c)
                                    const T* inp,       // (n, c)
                                    const float* mean,  // (n)
                                    const float* rstd,  // (n)
                                    int n, int c, cudaStream_t stream,
                                    MemoryKernels kernels = MemoryKernels::kDefault);

// ---------------------------------------------------------------------------------------------
// Elementwise.

// tanh-approximation GELU (GPT-2 gelu_new); never compiled with fast-math.
template <typename T>
cudaError_t GeluForward(T* out, const T* inp, long n, cudaStream_t stream,
                        MemoryKernels kernels = MemoryKernels::kDefault);  // all (n)
// dinp = dout · gelu'(inp) (overwrites; dinp may alias dout).
template <typename T>
cudaError_t GeluBackward(T* dinp, const T* inp, const T* dout, long n, cudaStream_t stream,
                         MemoryKernels kernels = MemoryKernels::kDefault);  // all (n)

// out = a + b (out may alias a or b).
template <typename T>
cudaError_t ResidualForward(T* out, const T* a, const T* b, long n, cudaStream_t stream,
                            MemoryKernels kernels = MemoryKernels::kDefault);
// da += dout, db += dout.
template <typename T>
cudaError_t ResidualBackward(T* da, T* db, const T* dout, long n, cudaStream_t stream,
                             MemoryKernels kernels = MemoryKernels::kDefault);

// out[i, :] += bias (the linear layer's bias, added after the GEMM).
template <typename T>
cudaError_t AddBias(T* out,         // (n, c)
                    const T* bias,  // (c)
                    int n, int c, cudaStream_t stream,
                    MemoryKernels kernels = MemoryKernels::kDefault);
// dbias += Σ_rows dout (fp32, accumulates).
template <typename T>
cudaError_t BiasBackward(float* dbias,   // (c)
                         const T* dout,  // (n, c)
                         int n, int c, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Causal attention for one query chunk against the key/value prefix (same shapes and rules as
// cpu::AttentionForward/Backward: queries at absolute positions [q_begin, q_end), keys/values
// [0, q_end) from a cache of kv_rows rows per sequence, scale 1/sqrt(head_dim)).
struct AttentionShape {
  int batch = 0;
  int heads = 0;
  int head_dim = 0;
  int q_begin = 0;
  int q_end = 0;
  int kv_rows = 0;
  // Grouped-query attention (Llama): key/value heads, dividing heads; query head i reads
  // key/value head i / (heads / kv_heads). 0 means heads (multi-head attention, GPT-2).
  int kv_heads = 0;

  __host__ __device__ int q_len() const { return q_end - q_begin; }
  __host__ __device__ int width() const { return heads * head_dim; }
  __host__ __device__ int num_kv_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  __host__ __device__ int kv_width() const { return num_kv_heads() * head_dim; }
};

// Which kernels compute bf16 attention. kTensorCore: bf16 tensor cores (WMMA) with fp32
// accumulation, P and dS rounded to bf16 before their products as in FlashAttention
// (attention_tc.cu); kFma: fp32 FMA on CUDA cores over bf16 inputs (the first kernels, exact fp32
// arithmetic, ~3x slower); kFlash: mma.sync m16n8k16 tensor cores with scores, probabilities and
// accumulators in registers, FlashAttention-2 style (attention_flash.cu; the fastest on an H100,
// 1.37x the tensor-core kernels' step at GPT-2 h = 2048); kFlashPipelined: the flash kernels with
// double-buffered cp.async tile loads and ldmatrix operand loads (attention_flash.cu; opt-in until
// it has passed and been timed on a GPU); kFlashWide: the pipelined backward and a forward of 128
// query rows per block, 32 per warp, so each key/value fragment read from shared memory feeds two
// products (opt-in likewise). kCudnn: cuDNN's fused flash attention through its graph API, run
// by a CudnnAttention (attention_cudnn.h) that the caller's DeviceContext holds, for the shapes it
// covers (opt-in until it has passed and been timed on a GPU); the functions below, which have no
// such runner, run kFlash for it. kDefault: the VOCABPIPE_ATTENTION environment variable ("fma",
// "tensor-core", "flash", "flash-pipelined", "flash-wide" or "cudnn"), else kFlash. fp32
// attention always uses kFma: its results must equal the CPU's to fp32 rounding.
enum class AttentionKernels {
  kDefault,
  kFma,
  kTensorCore,
  kFlash,
  kFlashPipelined,
  kFlashWide,
  kCudnn
};
// The kernels kDefault resolves to for bf16 now (reads VOCABPIPE_ATTENTION).
AttentionKernels DefaultAttentionKernels();
// The VOCABPIPE_ATTENTION value that selects `kernels` (kDefault: the one it resolves to now).
std::string_view AttentionKernelsName(AttentionKernels kernels);
// Every value VOCABPIPE_ATTENTION takes.
std::vector<std::string_view> AttentionKernelsNames();

// k, v, dk, dv rows are kv_width() wide (= width() without grouping); with kv_heads < heads the
// backward sums dK, dV over the heads/kv_heads query heads that share a key/value head.
// Flash-style (tiled, online softmax): the (q_len × q_end) probabilities are never stored. The
// forward keeps only lse, the per-row log-sum-exp of the scaled scores (fp32), from which the
// backward recomputes the probabilities tile by tile.
template <typename T>
cudaError_t AttentionForward(T* out,      // (batch, q_len, heads*head_dim)
                             float* lse,  // (batch, heads, q_len)
                             const T* q,  // (batch, q_len, ldq)
                             int ldq,
                             const T* k,  // (batch, kv_rows, kv_heads*head_dim)
                             const T* v,  // (batch, kv_rows, kv_heads*head_dim)
                             const AttentionShape& shape, cudaStream_t stream,
                             AttentionKernels kernels = AttentionKernels::kDefault);

// dq overwritten; dk, dv accumulated (+=) for key positions [0, q_end) (rows a later chunk's
// backward already filled keep their contribution). delta is scratch for Σ_d dout·out per row.
// Deterministic: no atomics (one pass over key tiles for dk/dv, one over query tiles for dq).
template <typename T>
cudaError_t AttentionBackward(T* dq,             // (batch, q_len, ldq)
                              T* dk,             // (batch, kv_rows, kv_heads*head_dim)
                              T* dv,             // (batch, kv_rows, kv_heads*head_dim)
                              float* delta,      // (batch, heads, q_len) scratch
                              const T* dout,     // (batch, q_len, heads*head_dim)
                              const T* out,      // (batch, q_len, heads*head_dim) forward output
                              const float* lse,  // (batch, heads, q_len) from the forward
                              const T* q,        // (batch, q_len, ldq)
                              int ldq,
                              const T* k,  // (batch, kv_rows, kv_heads*head_dim)
                              const T* v,  // (batch, kv_rows, kv_heads*head_dim)
                              const AttentionShape& shape, cudaStream_t stream,
                              AttentionKernels kernels = AttentionKernels::kDefault);

// ---------------------------------------------------------------------------------------------
// Llama ops (llama.cu), same rules as cpu::RmsNorm*, cpu::Rope*, cpu::Swiglu*. Statistics and
// weight gradients fp32; the nn.Linear-layout linears are gemm.h's LinearT*.

// out = inp · rstd · weight, rstd = 1/√(mean(inp²) + eps) (fp32).
template <typename T>
cudaError_t RmsNormForward(T* out,           // (n, c)
                           float* rstd,      // (n)
                           const T* inp,     // (n, c)
                           const T* weight,  // (c)
                           int n, int c, float eps, cudaStream_t stream,
                           MemoryKernels kernels = MemoryKernels::kDefault);
// B part: dinp = skip + rstd · (g − x̂ · mean(g · x̂)), g = dout·weight, x̂ = inp·rstd (skip may be
// dinp, as for LayerNorm).
template <typename T>
cudaError_t RmsNormBackwardInput(T* dinp,            // (n, c)
                                 const T* skip,      // (n, c)
                                 const T* dout,      // (n, c)
                                 const T* inp,       // (n, c)
                                 const T* weight,    // (c)
                                 const float* rstd,  // (n)
                                 int n, int c, cudaStream_t stream,
                                 MemoryKernels kernels = MemoryKernels::kDefault);
// W part: dweight += Σ_rows dout · x̂ (fp32, accumulates).
template <typename T>
cudaError_t RmsNormBackwardWeight(float* dweight,     // (c)
                                  const T* dout,      // (n, c)
                                  const T* inp,       // (n, c)
                                  const float* rstd,  // (n)
                                  int n, int c, cudaStream_t stream,
                                  MemoryKernels kernels = MemoryKernels::kDefault);

// Rotary position embedding in place on `heads` heads of head_dim columns from column 0 of each
// row (row stride ld), "rotate half" pairing, angle (start_pos + row's chunk position) ·
// theta^(−2i/d): a Seq1F1B chunk passes its first absolute position as start_pos. head_dim even.
template <typename T>
cudaError_t RopeForward(T* x,  // (batch, t, ld)
                        int ld, int batch, int t, int heads, int head_dim, int start_pos,
                        float theta, cudaStream_t stream);
// The rotation by the opposite angle, in place on the gradient.
template <typename T>
cudaError_t RopeBackward(T* dx,  // (batch, t, ld)
                         int ld, int batch, int t, int heads, int head_dim, int start_pos,
                         float theta, cudaStream_t stream);

// out = silu(gate) · up; gate, up the two halves of each row of gu.
template <typename T>
cudaError_t SwigluForward(T* out,       // (n, f)
                          const T* gu,  // (n, 2f)
                          long n, int f, cudaStream_t stream,
                          MemoryKernels kernels = MemoryKernels::kDefault);
// dgu = [dout · up · silu'(gate), dout · silu(gate)] (overwrites).
template <typename T>
cudaError_t SwigluBackward(T* dgu,         // (n, 2f)
                           const T* gu,    // (n, 2f)
                           const T* dout,  // (n, f)
                           long n, int f, cudaStream_t stream,
                           MemoryKernels kernels = MemoryKernels::kDefault);

// ---------------------------------------------------------------------------------------------
// Output layer (vocabulary shard of `rows` rows, the first `valid` real; see
// worker/engine/vocab/output_layer.h). local_label[i] is the label's row in this shard or −1.

// S pass, after the logits GEMM: per row, m' = max over valid columns, z = y_label − m' (0 where
// the label is not local), s' = Σ exp(y − m') in fp32, and P' = exp(y − m')/s' written in place.
// Padding columns are set to 0. valid = 0 gives m' = −inf, s' = 0, P' = 0.
template <typename T>
cudaError_t VocabSoftmaxForward(T* probs,                    // (n, rows) logits in, P' out
                                float* local_max,            // (n)
                                float* local_sum,            // (n)
                                float* label_logit,          // (n)
                                const int32_t* local_label,  // (n)
                                int n, int64_t rows, int64_t valid, cudaStream_t stream,
                                MemoryKernels kernels = MemoryKernels::kDefault);

// C1, before the sum all-reduce (global_max already all-reduced with max):
//   scale[i] = s'·exp(m' − m);  sums[i] = scale[i];  sums[n+i] = z + m' − m where local, else 0.
cudaError_t VocabC1Prepare(float* sums,                 // (2n)
                           float* scale,                // (n)
                           const float* local_max,      // (n)
                           const float* global_max,     // (n)
                           const float* local_sum,      // (n)
                           const float* label_logit,    // (n)
                           const int32_t* local_label,  // (n)
                           int n, cudaStream_t stream);
// C1, after the sum all-reduce: loss[i] = log sums[i] − sums[n+i]; scale[i] /= sums[i].
cudaError_t VocabC1Finish(float* loss,        // (n)
                          float* scale,       // (n)
                          const float* sums,  // (2n)
                          int n, cudaStream_t stream);
// Algorithm 2, C1: grad_x = d·(A·scale − W_r[label]) where the label is local (A = P'·W_r).
template <typename T>
cudaError_t VocabGradInputFix(float* grad_x,               // (n, h) A in, ∇X partial out
                              const float* scale,          // (n)
                              const T* weight,             // (rows, h)
                              const int32_t* local_label,  // (n)
                              float d, int n, int h, cudaStream_t stream);

// T pass, before the ∇W GEMM: probs = d·scale·P' − d·onehot(label) in place (valid columns).
template <typename T>
cudaError_t VocabSoftmaxBackward(T* probs,                    // (n, rows)
                                 const float* scale,          // (n)
                                 const int32_t* local_label,  // (n)
                                 float d, int n, int64_t rows, int64_t valid, cudaStream_t stream,
                                 MemoryKernels kernels = MemoryKernels::kDefault);

// ---------------------------------------------------------------------------------------------
// AdamW (torch semantics, same as vp::engine::AdamW::Step) on fp32 master weights, writing the
// bf16 working copy. decay[i] = 1 where weight decay applies. bc1 = 1 − β1^t, bc2 = 1 − β2^t
// (computed by the caller in double, as the CPU optimizer does). params may be null. With
// MemoryKernels::kVector, four elements per access where the pointers allow (bit-identical).
struct AdamWParams {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float grad_scale = 1.0f;
  double bc1 = 1.0;
  double bc2 = 1.0;
};
cudaError_t AdamWStep(float* master,         // (count)
                      bf16* params,          // (count) or null
                      const float* grads,    // (count)
                      float* m,              // (count)
                      float* v,              // (count)
                      const uint8_t* decay,  // (count)
                      size_t count, const AdamWParams& p, cudaStream_t stream,
                      MemoryKernels kernels = MemoryKernels::kDefault);

// fp32 ↔ bf16 conversions (round to nearest even), for uploads and comparisons.
cudaError_t FloatToBf16(bf16* out, const float* inp, long n, cudaStream_t stream);
cudaError_t Bf16ToFloat(float* out, const bf16* inp, long n, cudaStream_t stream);

}  // namespace vp::engine::cuda
