// CPU fp32 kernels of the transformer layer, as forward/backward pairs (llm.c style).
//
// Layout: row-major, activations (b, t, c) flattened to n = b*t rows where the kernel does not
// care about positions. Every backward that produces a *weight* gradient accumulates (+=),
// because weight gradients accumulate over microbatches and sequence chunks; backward passes
// that produce *input* gradients say per function whether they overwrite or accumulate.
// Backward passes are split into an input-gradient part (the B pass) and a weight-gradient part
// (the W pass) so that zero-bubble schedules can run them at different times.
//
// Every matrix product goes through cpu::Gemm. Threads: each kernel runs on the OpenMP team of
// its calling thread (the count SetBlasThreads set, blas.h), the same team OpenBLAS uses; work
// is split so that each output element is computed by one thread exactly as on one thread
// (rows, column strips for sums over rows, attention heads), so results do not depend on the
// thread count. Small calls stay on the calling thread.
//
// Letters: n rows (b·t tokens), c channels, h model width, f MLP width, t chunk length, s
// sequence length, nh query heads, nkv key/value heads, d head dimension.
#pragma once

namespace vp::engine::cpu {

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension, eps 1e-5 (GPT-2).
inline constexpr float kLayerNormEps = 1e-5f;

// out = (inp - mean) * rstd * weight + bias; caches mean and rstd per row for the backward.
void LayerNormForward(float* out,           // (n, c)
                      float* mean,          // (n)
                      float* rstd,          // (n)
                      const float* inp,     // (n, c)
                      const float* weight,  // (c)
                      const float* bias,    // (c)
                      int n, int c);

// B part: dinp += dL/dinp. Accumulates, because a LayerNorm input is always a residual stream
// whose gradient already holds the skip-path contribution.
void LayerNormBackwardInput(float* dinp,          // (n, c)
                            const float* dout,    // (n, c)
                            const float* inp,     // (n, c)
                            const float* weight,  // (c)
                            const float* mean,    // (n)
                            const float* rstd,    // (n)
                            int n, int c);

// W part: dweight += Σ_rows dout * xhat, dbias += Σ_rows dout.
void LayerNormBackwardWeight(float* dweight,     // (c)
                             float* dbias,       // (c)
                             const float* dout,  // (n, c)
                             const float* inp,   // (n, c)
                             const float* mean,  // (n)
                             const float* rstd,  // (n)
                             int n, int c);

// ---------------------------------------------------------------------------------------------
// Linear layer with the weight in Hugging Face Conv1D layout [in, out], so a checkpoint tensor
// is a memcpy of the parameter. bias may be null (no bias).

// out = inp · weight + bias.
void LinearForward(float* out,           // (n, out_dim)
                   const float* inp,     // (n, in_dim)
                   const float* weight,  // (in_dim, out_dim)
                   const float* bias,    // (out_dim) or null
                   int n, int in_dim, int out_dim);

// B part: dinp = dout · weightᵀ (overwrites).
void LinearBackwardInput(float* dinp,          // (n, in_dim)
                         const float* dout,    // (n, out_dim)
                         const float* weight,  // (in_dim, out_dim)
                         int n, int in_dim, int out_dim);

// W part: dweight += inpᵀ · dout, dbias += Σ_rows dout (dbias may be null).
void LinearBackwardWeight(float* dweight,     // (in_dim, out_dim)
                          float* dbias,       // (out_dim) or null
                          const float* dout,  // (n, out_dim)
                          const float* inp,   // (n, in_dim)
                          int n, int in_dim, int out_dim);

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2 "gelu_new"). Never compiled with fast-math.

void GeluForward(float* out,        // (n)
                 const float* inp,  // (n)
                 long n);

// dinp = dout * gelu'(inp) (overwrites; dinp may alias dout).
void GeluBackward(float* dinp,        // (n)
                  const float* inp,   // (n)
                  const float* dout,  // (n)
                  long n);

// ---------------------------------------------------------------------------------------------
// Residual add.

// out = a + b (out may alias a or b).
void ResidualForward(float* out, const float* a, const float* b, long n);  // all (n)

// da += dout, db += dout (the gradient of a sum flows unchanged to both summands).
void ResidualBackward(float* da, float* db, const float* dout, long n);  // all (n)

// ---------------------------------------------------------------------------------------------
// Learned position embedding for a sequence chunk whose first token is at absolute position
// start_pos (Seq1F1B chunks start mid-sequence).

// x[b, t, :] += wpe[start_pos + t, :].
void PositionEmbeddingForward(float* x,          // (batch, t, c)
                              const float* wpe,  // (>= start_pos + t, c)
                              int batch, int t, int c, int start_pos);

// dwpe[start_pos + t, :] += Σ_b dx[b, t, :] (accumulates over microbatches and chunks).
void PositionEmbeddingBackward(float* dwpe,      // (>= start_pos + t, c)
                               const float* dx,  // (batch, t, c)
                               int batch, int t, int c, int start_pos);

// ---------------------------------------------------------------------------------------------
// Causal multi-head attention for one query chunk.
//
// Queries are the tokens at absolute positions [q_begin, q_end) of each sequence; keys and
// values are read for positions [0, q_end) from a per-sequence cache holding kv_rows positions.
// Query position i attends to keys 0..i; scale 1/sqrt(head_dim). Head h occupies columns
// [h*head_dim, (h+1)*head_dim) of q, k, v and out. The whole sequence is the chunk [0, s).
struct AttentionShape {
  int batch = 0;
  int heads = 0;
  int head_dim = 0;
  int q_begin = 0;
  int q_end = 0;
  int kv_rows = 0;  // rows per sequence in the k/v cache (>= q_end)
  // Grouped-query attention: key/value heads, dividing heads; query head i reads key/value
  // head i / (heads / kv_heads). 0 means heads (multi-head attention).
  int kv_heads = 0;

  int q_len() const { return q_end - q_begin; }
  int width() const { return heads * head_dim; }
  int num_kv_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int kv_width() const { return num_kv_heads() * head_dim; }
};

// k, v and dk, dv rows are kv_width() wide (= width() without grouping).
// Flash-style (attention.cc): lse gets each query row's log-sum-exp of its scaled scores,
// log Σ_j exp(scale·q·k_j), all the backward needs besides the output to recompute the
// probabilities tile by tile. Memory is linear in q_end; no (q_len, q_end) block is kept.
void AttentionForward(float* out,      // (batch, q_len, heads*head_dim)
                      float* lse,      // (batch, heads, q_len)
                      const float* q,  // (batch, q_len, ldq)
                      int ldq,         // row stride of q (3h when q sits inside a qkv tensor)
                      const float* k,  // (batch, kv_rows, heads*head_dim)
                      const float* v,  // (batch, kv_rows, heads*head_dim)
                      const AttentionShape& shape);

// dq is overwritten for the chunk's queries; dk and dv are *accumulated* for key positions
// [0, q_end), since later query chunks also reach back to earlier keys. out and lse are the
// forward's.
void AttentionBackward(float* dq,          // (batch, q_len, lddq)
                       int lddq,           // row stride of dq (may differ from q's: 3h in d_qkv)
                       float* dk,          // (batch, kv_rows, heads*head_dim)
                       float* dv,          // (batch, kv_rows, heads*head_dim)
                       float* scratch,     // AttentionBackwardScratch(shape) floats
                       const float* dout,  // (batch, q_len, heads*head_dim)
                       const float* out,   // (batch, q_len, heads*head_dim)
                       const float* lse,   // (batch, heads, q_len)
                       const float* q,     // (batch, q_len, ldq)
                       int ldq,
                       const float* k,  // (batch, kv_rows, heads*head_dim)
                       const float* v,  // (batch, kv_rows, heads*head_dim)
                       const AttentionShape& shape);

// Floats of AttentionBackward's workspace: two score tiles and a tile's row sums per thread it
// will use, for the calling thread's count (at most batch · num_kv_heads() threads); a few
// hundred KiB whatever the sequence length.
long AttentionBackwardScratch(const AttentionShape& shape);

// ---------------------------------------------------------------------------------------------
// Llama ops (kernels/cpu/llama.cc).

// Linear layer with the weight in torch nn.Linear layout [out, in] (Llama's checkpoints), no
// bias: out = inp · weightᵀ.
void LinearTForward(float* out,           // (n, out_dim)
                    const float* inp,     // (n, in_dim)
                    const float* weight,  // (out_dim, in_dim)
                    int n, int in_dim, int out_dim);
// B part: dinp = dout · weight (overwrites).
void LinearTBackwardInput(float* dinp,          // (n, in_dim)
                          const float* dout,    // (n, out_dim)
                          const float* weight,  // (out_dim, in_dim)
                          int n, int in_dim, int out_dim);
// W part: dweight += doutᵀ · inp.
void LinearTBackwardWeight(float* dweight,     // (out_dim, in_dim)
                           const float* dout,  // (n, out_dim)
                           const float* inp,   // (n, in_dim)
                           int n, int in_dim, int out_dim);

// RMSNorm over the last dimension: out = inp · rstd · weight, rstd = 1/√(mean(inp²) + eps).
void RmsNormForward(float* out,           // (n, c)
                    float* rstd,          // (n) cached for the backward
                    const float* inp,     // (n, c)
                    const float* weight,  // (c)
                    int n, int c, float eps);
// B part: dinp += dL/dinp (accumulates, like LayerNorm: the input is a residual stream).
// With x̂ = inp·rstd and g = dout·weight: dinp += rstd · (g − x̂ · mean(g · x̂)).
void RmsNormBackwardInput(float* dinp,          // (n, c)
                          const float* dout,    // (n, c)
                          const float* inp,     // (n, c)
                          const float* weight,  // (c)
                          const float* rstd,    // (n)
                          int n, int c);
// W part: dweight += Σ_rows dout · x̂.
void RmsNormBackwardWeight(float* dweight,     // (c)
                           const float* dout,  // (n, c)
                           const float* inp,   // (n, c)
                           const float* rstd,  // (n)
                           int n, int c);

// Rotary position embedding, in place, on `heads` heads of d columns that start at column 0 of
// each row of x (row stride ld): Hugging Face Llama's "rotate half" pairing, dimension i with
// i + d/2 rotated by the angle pos · theta^(−2i/d), pos = start_pos + row's position in the
// chunk. Rows are (batch, t). Positions come from start_pos so a Seq1F1B chunk starting
// mid-sequence rotates exactly like the same tokens of the whole sequence.
void RopeForward(float* x,  // (batch, t, ld), heads·d columns used
                 int ld, int batch, int t, int heads, int head_dim, int start_pos, float theta);
// The backward of a rotation is the rotation by the opposite angle (in place on the gradient).
void RopeBackward(float* dx,  // (batch, t, ld)
                  int ld, int batch, int t, int heads, int head_dim, int start_pos, float theta);

// SwiGLU: out = silu(gate) · up, silu(g) = g · σ(g); gate and up are the two halves of each
// row of gu (gate_proj's output then up_proj's, one GEMM for both).
void SwigluForward(float* out,       // (n, f)
                   const float* gu,  // (n, 2f)
                   long n, int f);
// dgu = [dout · up · silu'(gate), dout · silu(gate)] (overwrites),
// silu'(g) = σ(g) · (1 + g · (1 − σ(g))).
void SwigluBackward(float* dgu,         // (n, 2f)
                    const float* gu,    // (n, 2f)
                    const float* dout,  // (n, f)
                    long n, int f);

}  // namespace vp::engine::cpu
