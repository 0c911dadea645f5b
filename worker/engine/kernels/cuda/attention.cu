// Causal attention for a query chunk against the key/value prefix, flash style: Q, K, V, dO are
// staged in shared memory in tiles of kTile rows (fp32), scores are recomputed tile by tile and
// the (q_len × q_end) probabilities never reach global memory. The forward keeps an online softmax
// (running max m and sum l per query row, rescaling the fp32 output accumulator when m grows) and
// stores lse = m + log l; the backward recomputes P = exp(scale·q·kᵀ − lse) from it.
//
// Work split (every block: kTile = 32 rows × kGroup = 8 threads per row = 256 threads):
//   forward   one block per (query tile, head, sequence), loop over the key tiles it can see;
//   delta     one warp per (query row, head, sequence): delta = Σ_d dO·O (= Σ_j P·dP);
//   dK/dV     one block per (key tile, key/value head, sequence), loop over the query heads of
//             its group (grouped-query attention: heads/kv_heads query heads share one K/V head)
//             and the query tiles that see it, accumulating dK, dV in registers and adding into
//             dk/dv once (no atomics, so the sum over the group is deterministic too);
//   dQ        one block per (query tile, head, sequence), loop over key tiles, dq overwritten.
// The thread owning tile row r holds output columns d = g, g+8, g+16, ... (g = its index in the
// row's group of 8) in registers and scores for tile columns g, g+8, g+16, g+24. head_dim is a
// runtime loop bound in the dot products; the register arrays are sized by a bucket D (64 or 128)
// and shared-memory columns [head_dim, D) are zero-filled, so they contribute nothing.
// Shared-memory rows have a stride of D + 1 floats: the 8 rows a warp reads at the same column d
// then fall in distinct banks.
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "worker/engine/kernels/cuda/attention_flash.h"
#include "worker/engine/kernels/cuda/attention_tc.h"
#include "worker/engine/kernels/cuda/common.cuh"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

constexpr int kTile = 32;                 // Br = Bc: query rows and key rows per tile
constexpr int kGroup = 8;                 // threads per tile row (one aligned 8-lane group)
constexpr int kThreads = kTile * kGroup;  // 256
constexpr int kCols = kTile / kGroup;     // score columns per thread in a tile (4)
constexpr int kMaxHeadDim = 128;          // largest supported head_dim
constexpr int kScoreLd = kTile + 1;       // row stride of the (kTile, kTile) score tiles

template <int D>
__host__ __device__ constexpr int RowLd() {
  return D + 1;  // row stride of a (kTile, D) tile in shared memory, floats
}
template <int D>
__host__ __device__ constexpr int TileFloats() {
  return kTile * RowLd<D>();
}
__host__ __device__ constexpr int ScoreFloats() { return kTile * kScoreLd; }

// Reductions over the 8 lanes of a row group (lanes 8k..8k+7 of a warp; xor 4, 2, 1 stays
// inside the group). Every thread of the block calls these together.
__device__ __forceinline__ float GroupMax(float x) {
  for (int o = kGroup / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float GroupSum(float x) {
  for (int o = kGroup / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// dst ← rows [first, first + kTile) of src (columns [0, head_dim)) as fp32; rows >= limit and
// columns [head_dim, D) are zero so that padded rows and columns add nothing to any product.
template <typename T, int D>
__device__ void LoadTile(float* dst,    // (kTile, D + 1) shared
                         const T* src,  // (>= limit, ld) global, head's column 0
                         long ld, int first, int limit, int head_dim) {
  for (int idx = threadIdx.x; idx < kTile * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = first + r;
    dst[r * RowLd<D>() + d] =
        row < limit && d < head_dim ? ToFloat(src[static_cast<long>(row) * ld + d]) : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: out = softmax(scale·Q·Kᵀ, causal)·V and lse per query row.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(T* out,      // (batch, q_len, heads*head_dim)
                           float* lse,  // (batch, heads, q_len)
                           const T* q,  // (batch, q_len, ldq)
                           int ldq,
                           const T* k,  // (batch, kv_rows, kv_heads*head_dim)
                           const T* v,  // (batch, kv_rows, kv_heads*head_dim)
                           AttentionShape s, float scale) {
  extern __shared__ float smem[];
  float* qs = smem;                  // (kTile, D+1) this block's queries
  float* ks = qs + TileFloats<D>();  // (kTile, D+1) current key tile
  float* vs = ks + TileFloats<D>();  // (kTile, D+1) current value tile
  float* ps = vs + TileFloats<D>();  // (kTile, kTile+1) probabilities (unnormalised)
  constexpr int kLd = RowLd<D>();
  constexpr int kAcc = D / kGroup;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i0 = blockIdx.x * kTile;  // first query row of the tile (chunk-relative)
  const int r = threadIdx.x / kGroup, g = threadIdx.x % kGroup;
  const int i = i0 + r;            // this thread's query row (may be padding)
  const int qpos = s.q_begin + i;  // absolute position: sees keys [0, qpos]
  const int n_keys = s.q_begin + min(i0 + kTile, q_len);  // keys the tile's last real row sees
  const int kvw = s.kv_width(), kvc = (h / (s.heads / s.num_kv_heads())) * hd;  // K/V columns
  const T* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
  const T* kh = k + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const T* vh = v + static_cast<long>(b) * s.kv_rows * kvw + kvc;

  LoadTile<T, D>(qs, qh, ldq, i0, q_len, hd);
  float m = -INFINITY;  // running max of this row's scaled scores
  float l = 0.0f;       // running Σ exp(score − m)
  float acc[kAcc];      // running Σ exp(score − m)·v, columns g + kGroup·c
#pragma unroll
  for (int c = 0; c < kAcc; ++c) acc[c] = 0.0f;

  // Key tiles past n_keys lie entirely above the causal diagonal of every row: not visited.
  for (int j0 = 0; j0 < n_keys; j0 += kTile) {
    __syncthreads();  // the previous tile's ks/vs/ps reads are done before overwriting
    LoadTile<T, D>(ks, kh, kvw, j0, n_keys, hd);
    LoadTile<T, D>(vs, vh, kvw, j0, n_keys, hd);
    __syncthreads();
    float sc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) sc[c] = 0.0f;
    for (int d = 0; d < hd; ++d) {
      const float qd = qs[r * kLd + d];
#pragma unroll
      for (int c = 0; c < kCols; ++c) sc[c] += qd * ks[(g + kGroup * c) * kLd + d];
    }
    // Causal mask at the diagonal tile; j < n_keys also keeps padding rows (i >= q_len) on
    // loaded keys. Key 0 is visible to every row, so after the first tile m is finite and
    // exp(m_old − m_new) below never sees −inf − (−inf).
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int j = j0 + g + kGroup * c;
      sc[c] = j <= qpos && j < n_keys ? sc[c] * scale : -INFINITY;
      tile_max = fmaxf(tile_max, sc[c]);
    }
    const float m_new = fmaxf(m, GroupMax(tile_max));
    const float correction = expf(m - m_new);  // rescales what was summed against the old max
    float psum = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float p = expf(sc[c] - m_new);  // masked: exp(−inf) = 0
      ps[r * kScoreLd + g + kGroup * c] = p;
      psum += p;
    }
    l = l * correction + GroupSum(psum);
    m = m_new;
    __syncwarp();  // row r's probabilities were written by its 8 lanes, all in this warp
#pragma unroll
    for (int c = 0; c < kAcc; ++c) acc[c] *= correction;
    for (int jj = 0; jj < kTile; ++jj) {
      const float p = ps[r * kScoreLd + jj];
#pragma unroll
      for (int c = 0; c < kAcc; ++c) acc[c] += p * vs[jj * kLd + g + kGroup * c];
    }
  }

  if (i < q_len) {
    const float inv = 1.0f / l;  // l >= 1: the row's max term contributes exp(0)
    T* orow = out + (static_cast<long>(b) * q_len + i) * width + h * hd;
#pragma unroll
    for (int c = 0; c < kAcc; ++c) {
      const int d = g + kGroup * c;
      if (d < hd) orow[d] = FromFloat<T>(acc[c] * inv);
    }
    if (g == 0) lse[(static_cast<long>(b) * s.heads + h) * q_len + i] = m + logf(l);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward step 1: delta[b, h, i] = Σ_d dout[b, i, h, d]·out[b, i, h, d]. Equals Σ_j P_ij·dP_ij
// (O = P·V, dP = dO·Vᵀ), the row term of the softmax backward, without touching P. One warp per
// (row, head, sequence), rows numbered in delta's (batch, heads, q_len) order.
template <typename T>
__global__ void AttentionDeltaKernel(float* delta,   // (batch, heads, q_len)
                                     const T* dout,  // (batch, q_len, heads*head_dim)
                                     const T* out,   // (batch, q_len, heads*head_dim)
                                     AttentionShape s) {
  constexpr int kWarps = kThreads / 32;
  const long row = static_cast<long>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int q_len = s.q_end - s.q_begin, hd = s.head_dim, width = s.heads * s.head_dim;
  if (row >= static_cast<long>(s.batch) * s.heads * q_len) return;
  const int i = static_cast<int>(row % q_len);
  const int h = static_cast<int>((row / q_len) % s.heads);
  const long b = row / (static_cast<long>(q_len) * s.heads);
  const long off = (b * q_len + i) * width + h * hd;
  float sum = 0.0f;
  for (int d = lane; d < hd; d += 32) sum += ToFloat(dout[off + d]) * ToFloat(out[off + d]);
  sum = WarpSum(sum);
  if (lane == 0) delta[row] = sum;
}

// Backward step 2: for one key tile of one key/value head, over the query heads of its group and
// the query rows of each that see the tile,
//   P = exp(scale·q·kᵀ − lse), dP = dO·vᵀ, dS = P∘(dP − delta),
//   dV += Pᵀ·dO, dK += scale·dSᵀ·Q,
// with the tile transposed (row r = key, columns = queries) so each thread accumulates dK, dV of
// its own key row in registers. dk, dv are read-modified-written once at the end (+=).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardKeyValueKernel(T* dk,               // (batch, kv_rows, kv_heads*head_dim)
                                    T* dv,               // (batch, kv_rows, kv_heads*head_dim)
                                    const T* dout,       // (batch, q_len, heads*head_dim)
                                    const float* lse,    // (batch, heads, q_len)
                                    const float* delta,  // (batch, heads, q_len)
                                    const T* q,          // (batch, q_len, ldq)
                                    int ldq,
                                    const T* k,  // (batch, kv_rows, kv_heads*head_dim)
                                    const T* v,  // (batch, kv_rows, kv_heads*head_dim)
                                    AttentionShape s, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;                     // (kTile, D+1) this block's keys
  float* vs = ks + TileFloats<D>();     // (kTile, D+1) this block's values
  float* qs = vs + TileFloats<D>();     // (kTile, D+1) current query tile
  float* dos = qs + TileFloats<D>();    // (kTile, D+1) current dout tile
  float* pts = dos + TileFloats<D>();   // (kTile, kTile+1) Pᵀ: [key][query]
  float* dsts = pts + ScoreFloats();    // (kTile, kTile+1) dSᵀ: [key][query]
  float* lse_s = dsts + ScoreFloats();  // (kTile)
  float* delta_s = lse_s + kTile;       // (kTile)
  constexpr int kLd = RowLd<D>();
  constexpr int kAcc = D / kGroup;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int kvh = blockIdx.y, b = blockIdx.z;  // key/value head, sequence
  const int group = s.heads / s.num_kv_heads(), kvw = s.kv_width();
  const int j0 = blockIdx.x * kTile;  // first key of the tile (absolute position)
  const int r = threadIdx.x / kGroup, g = threadIdx.x % kGroup;
  const int j = j0 + r;  // this thread's key (padding when >= q_end)
  const long kv_head = static_cast<long>(b) * s.kv_rows * kvw + kvh * hd;

  LoadTile<T, D>(ks, k + kv_head, kvw, j0, s.q_end, hd);
  LoadTile<T, D>(vs, v + kv_head, kvw, j0, s.q_end, hd);
  float dk_acc[kAcc], dv_acc[kAcc];  // columns g + kGroup·c of key row j, summed over the group
#pragma unroll
  for (int c = 0; c < kAcc; ++c) dk_acc[c] = dv_acc[c] = 0.0f;

  // Query row i (absolute q_begin + i) sees key j0 iff q_begin + i >= j0: earlier rows of the
  // chunk see none of this tile and are skipped. j0 < q_end, so i_first < q_len.
  const int i_first = max(0, j0 - s.q_begin);
  for (int hg = 0; hg < group; ++hg) {
    const int h = kvh * group + hg;  // query head
    const T* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
    const T* doh = dout + static_cast<long>(b) * q_len * width + h * hd;
    const long stats = (static_cast<long>(b) * s.heads + h) * q_len;  // lse/delta of this head
    for (int i0 = i_first; i0 < q_len; i0 += kTile) {
      __syncthreads();  // previous query tile's reads are done; on entry, orders the K/V loads
      LoadTile<T, D>(qs, qh, ldq, i0, q_len, hd);
      LoadTile<T, D>(dos, doh, width, i0, q_len, hd);
      if (const int t = threadIdx.x; t < kTile) {
        const int i = i0 + t;  // padding rows get 0: their P is masked to 0 anyway
        lse_s[t] = i < q_len ? lse[stats + i] : 0.0f;
        delta_s[t] = i < q_len ? delta[stats + i] : 0.0f;
      }
      __syncthreads();
      float sc[kCols], dp[kCols];  // q·k and dO·v for queries i0 + g + kGroup·c
#pragma unroll
      for (int c = 0; c < kCols; ++c) sc[c] = dp[c] = 0.0f;
      for (int d = 0; d < hd; ++d) {
        const float kd = ks[r * kLd + d], vd = vs[r * kLd + d];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          sc[c] += qs[(g + kGroup * c) * kLd + d] * kd;
          dp[c] += dos[(g + kGroup * c) * kLd + d] * vd;
        }
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int ic = g + kGroup * c, i = i0 + ic;
        const bool visible = i < q_len && j < s.q_end && j <= s.q_begin + i;
        const float p = visible ? expf(sc[c] * scale - lse_s[ic]) : 0.0f;
        pts[r * kScoreLd + ic] = p;
        dsts[r * kScoreLd + ic] = p * (dp[c] - delta_s[ic]);
      }
      __syncwarp();  // key row r's Pᵀ/dSᵀ come from its 8 lanes, all in this warp
      for (int ic = 0; ic < kTile; ++ic) {
        const float p = pts[r * kScoreLd + ic], ds = dsts[r * kScoreLd + ic];
#pragma unroll
        for (int c = 0; c < kAcc; ++c) {
          dv_acc[c] += p * dos[ic * kLd + g + kGroup * c];
          dk_acc[c] += ds * qs[ic * kLd + g + kGroup * c];
        }
      }
    }
  }  // query heads of the group

  if (j < s.q_end) {
    const long row = kv_head + static_cast<long>(j) * kvw;
#pragma unroll
    for (int c = 0; c < kAcc; ++c) {
      const int d = g + kGroup * c;
      if (d < hd) {
        dk[row + d] = FromFloat<T>(ToFloat(dk[row + d]) + scale * dk_acc[c]);
        dv[row + d] = FromFloat<T>(ToFloat(dv[row + d]) + dv_acc[c]);
      }
    }
  }
}

// Backward step 3: for one query tile, over the key tiles it sees, dQ = scale·dS·K with dS
// recomputed as in step 2 (row r = query). dq overwritten (its q columns only).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardQueryKernel(T* dq,               // (batch, q_len, ldq)
                                 const T* dout,       // (batch, q_len, heads*head_dim)
                                 const float* lse,    // (batch, heads, q_len)
                                 const float* delta,  // (batch, heads, q_len)
                                 const T* q,          // (batch, q_len, ldq)
                                 int ldq,
                                 const T* k,  // (batch, kv_rows, kv_heads*head_dim)
                                 const T* v,  // (batch, kv_rows, kv_heads*head_dim)
                                 AttentionShape s, float scale) {
  extern __shared__ float smem[];
  float* qs = smem;                   // (kTile, D+1) this block's queries
  float* dos = qs + TileFloats<D>();  // (kTile, D+1) this block's dout rows
  float* ks = dos + TileFloats<D>();  // (kTile, D+1) current key tile
  float* vs = ks + TileFloats<D>();   // (kTile, D+1) current value tile
  float* dss = vs + TileFloats<D>();  // (kTile, kTile+1) dS: [query][key]
  constexpr int kLd = RowLd<D>();
  constexpr int kAcc = D / kGroup;
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i0 = blockIdx.x * kTile;
  const int r = threadIdx.x / kGroup, g = threadIdx.x % kGroup;
  const int i = i0 + r;
  const int qpos = s.q_begin + i;
  const int n_keys = s.q_begin + min(i0 + kTile, q_len);
  const T* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
  const T* doh = dout + static_cast<long>(b) * q_len * width + h * hd;
  const int kvw = s.kv_width(), kvc = (h / (s.heads / s.num_kv_heads())) * hd;  // K/V columns
  const T* kh = k + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const T* vh = v + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const long stat = (static_cast<long>(b) * s.heads + h) * q_len + i;
  const float row_lse = i < q_len ? lse[stat] : 0.0f;
  const float row_delta = i < q_len ? delta[stat] : 0.0f;

  LoadTile<T, D>(qs, qh, ldq, i0, q_len, hd);
  LoadTile<T, D>(dos, doh, width, i0, q_len, hd);
  float dq_acc[kAcc];  // columns g + kGroup·c of query row i
#pragma unroll
  for (int c = 0; c < kAcc; ++c) dq_acc[c] = 0.0f;

  for (int j0 = 0; j0 < n_keys; j0 += kTile) {
    __syncthreads();  // previous key tile's reads are done; on entry, orders the Q/dO loads
    LoadTile<T, D>(ks, kh, kvw, j0, n_keys, hd);
    LoadTile<T, D>(vs, vh, kvw, j0, n_keys, hd);
    __syncthreads();
    float sc[kCols], dp[kCols];  // q·k and dO·v for keys j0 + g + kGroup·c
#pragma unroll
    for (int c = 0; c < kCols; ++c) sc[c] = dp[c] = 0.0f;
    for (int d = 0; d < hd; ++d) {
      const float qd = qs[r * kLd + d], dod = dos[r * kLd + d];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        sc[c] += qd * ks[(g + kGroup * c) * kLd + d];
        dp[c] += dod * vs[(g + kGroup * c) * kLd + d];
      }
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int jc = g + kGroup * c, j = j0 + jc;
      const bool visible = i < q_len && j <= qpos && j < n_keys;
      const float p = visible ? expf(sc[c] * scale - row_lse) : 0.0f;
      dss[r * kScoreLd + jc] = p * (dp[c] - row_delta);
    }
    __syncwarp();  // query row r's dS comes from its 8 lanes, all in this warp
    for (int jc = 0; jc < kTile; ++jc) {
      const float ds = dss[r * kScoreLd + jc];
#pragma unroll
      for (int c = 0; c < kAcc; ++c) dq_acc[c] += ds * ks[jc * kLd + g + kGroup * c];
    }
  }

  if (i < q_len) {
    T* dqrow = dq + (static_cast<long>(b) * q_len + i) * ldq + h * hd;
#pragma unroll
    for (int c = 0; c < kAcc; ++c) {
      const int d = g + kGroup * c;
      if (d < hd) dqrow[d] = FromFloat<T>(scale * dq_acc[c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers. Shared memory is dynamic: at D = 128 the tiles need 53–75 KiB, above the
// 48 KiB a launch gets without opting in through cudaFuncSetAttribute (per kernel, cheap).

template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

bool BadShape(const AttentionShape& s) {
  return s.batch <= 0 || s.heads <= 0 || s.head_dim <= 0 || s.head_dim > kMaxHeadDim ||
         s.q_begin < 0 || s.q_end <= s.q_begin || s.kv_rows < s.q_end || s.batch > 65535 ||
         s.heads > 65535 || s.kv_heads < 0 || s.heads % s.num_kv_heads() != 0;
}

float Scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

template <typename T, int D>
cudaError_t LaunchForward(T* out, float* lse, const T* q, int ldq, const T* k, const T* v,
                          const AttentionShape& s, cudaStream_t stream) {
  const size_t smem = (3 * TileFloats<D>() + ScoreFloats()) * sizeof(float);
  if (cudaError_t e = AllowSharedMemory(AttentionForwardKernel<T, D>, smem); e != cudaSuccess) {
    return e;
  }
  const dim3 grid(CeilDiv(s.q_len(), kTile), s.heads, s.batch);
  AttentionForwardKernel<T, D>
      <<<grid, kThreads, smem, stream>>>(out, lse, q, ldq, k, v, s, Scale(s));
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchBackward(T* dq, T* dk, T* dv, const float* delta, const T* dout, const float* lse,
                           const T* q, int ldq, const T* k, const T* v, const AttentionShape& s,
                           cudaStream_t stream) {
  const size_t kv_smem = (4 * TileFloats<D>() + 2 * ScoreFloats() + 2 * kTile) * sizeof(float);
  if (cudaError_t e = AllowSharedMemory(AttentionBackwardKeyValueKernel<T, D>, kv_smem);
      e != cudaSuccess) {
    return e;
  }
  AttentionBackwardKeyValueKernel<T, D>
      <<<dim3(CeilDiv(s.q_end, kTile), s.num_kv_heads(), s.batch), kThreads, kv_smem, stream>>>(
          dk, dv, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const size_t q_smem = (4 * TileFloats<D>() + ScoreFloats()) * sizeof(float);
  if (cudaError_t e = AllowSharedMemory(AttentionBackwardQueryKernel<T, D>, q_smem);
      e != cudaSuccess) {
    return e;
  }
  AttentionBackwardQueryKernel<T, D>
      <<<dim3(CeilDiv(s.q_len(), kTile), s.heads, s.batch), kThreads, q_smem, stream>>>(
          dq, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  return cudaGetLastError();
}

// The kernels T's attention runs on: fp32 always on the FMA ones; bf16 as asked, kDefault
// resolved through VOCABPIPE_ATTENTION; kCudnn (a library, run by CudnnAttention where the
// caller has one) on the flash kernels here, the shapes cuDNN does not cover.
template <typename T>
AttentionKernels Resolve(AttentionKernels kernels) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return AttentionKernels::kFma;
  } else {
    if (kernels == AttentionKernels::kDefault) kernels = DefaultAttentionKernels();
    return kernels == AttentionKernels::kCudnn ? AttentionKernels::kFlash : kernels;
  }
}

// VOCABPIPE_ATTENTION's values.
struct NamedAttentionKernels {
  std::string_view name;
  AttentionKernels kernels;
};
constexpr NamedAttentionKernels kAttentionKernelNames[] = {
    {"fma", AttentionKernels::kFma},
    {"tensor-core", AttentionKernels::kTensorCore},
    {"flash", AttentionKernels::kFlash},
    {"flash-pipelined", AttentionKernels::kFlashPipelined},
    {"flash-wide", AttentionKernels::kFlashWide},
    {"cudnn", AttentionKernels::kCudnn},
};

}  // namespace

AttentionKernels DefaultAttentionKernels() {
  if (const char* env = std::getenv("VOCABPIPE_ATTENTION"); env != nullptr) {
    for (const NamedAttentionKernels& k : kAttentionKernelNames) {
      if (k.name == env) return k.kernels;
    }
  }
  return AttentionKernels::kFlash;  // measured fastest on an H100 (docs/benchmarks.md §7.4)
}

std::vector<std::string_view> AttentionKernelsNames() {
  std::vector<std::string_view> names;
  for (const NamedAttentionKernels& k : kAttentionKernelNames) names.push_back(k.name);
  return names;
}

std::string_view AttentionKernelsName(AttentionKernels kernels) {
  if (kernels == AttentionKernels::kDefault) kernels = DefaultAttentionKernels();
  for (const NamedAttentionKernels& k : kAttentionKernelNames) {
    if (k.kernels == kernels) return k.name;
  }
  return "flash";
}

template <typename T>
cudaError_t AttentionForward(T* out, float* lse, const T* q, int ldq, const T* k, const T* v,
                             const AttentionShape& shape, cudaStream_t stream,
                             AttentionKernels kernels) {
  if (BadShape(shape)) return cudaErrorInvalidValue;
  if constexpr (std::is_same_v<T, bf16>) {
    switch (Resolve<T>(kernels)) {
      case AttentionKernels::kTensorCore:
        return AttentionForwardTensorCore(out, lse, q, ldq, k, v, shape, stream);
      case AttentionKernels::kFlash:
        return AttentionForwardFlash(out, lse, q, ldq, k, v, shape, stream,
                                     FlashForm::kSynchronous);
      case AttentionKernels::kFlashPipelined:
        return AttentionForwardFlash(out, lse, q, ldq, k, v, shape, stream, FlashForm::kPipelined);
      case AttentionKernels::kFlashWide:
        return AttentionForwardFlash(out, lse, q, ldq, k, v, shape, stream, FlashForm::kWide);
      default:
        break;
    }
  }
  // Two head_dim buckets: GPT-2's 64 (and the small test sizes), and up to 128.
  if (shape.head_dim <= 64) return LaunchForward<T, 64>(out, lse, q, ldq, k, v, shape, stream);
  return LaunchForward<T, 128>(out, lse, q, ldq, k, v, shape, stream);
}

template <typename T>
cudaError_t AttentionBackward(T* dq, T* dk, T* dv, float* delta, const T* dout, const T* out,
                              const float* lse, const T* q, int ldq, const T* k, const T* v,
                              const AttentionShape& shape, cudaStream_t stream,
                              AttentionKernels kernels) {
  if (BadShape(shape)) return cudaErrorInvalidValue;
  const long rows = static_cast<long>(shape.batch) * shape.heads * shape.q_len();
  AttentionDeltaKernel<T>
      <<<CeilDiv(rows, kThreads / 32), kThreads, 0, stream>>>(delta, dout, out, shape);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if constexpr (std::is_same_v<T, bf16>) {
    switch (Resolve<T>(kernels)) {
      case AttentionKernels::kTensorCore:
        return AttentionBackwardTensorCore(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape,
                                           stream);
      case AttentionKernels::kFlash:
        return AttentionBackwardFlash(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream,
                                      FlashForm::kSynchronous);
      case AttentionKernels::kFlashPipelined:
        return AttentionBackwardFlash(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream,
                                      FlashForm::kPipelined);
      case AttentionKernels::kFlashWide:
        return AttentionBackwardFlash(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream,
                                      FlashForm::kWide);
      default:
        break;
    }
  }
  if (shape.head_dim <= 64) {
    return LaunchBackward<T, 64>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream);
  }
  return LaunchBackward<T, 128>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream);
}

#define VP_INSTANTIATE(T)                                                                          \
  template cudaError_t AttentionForward<T>(T*, float*, const T*, int, const T*, const T*,          \
                                           const AttentionShape&, cudaStream_t, AttentionKernels); \
  template cudaError_t AttentionBackward<T>(                                                       \
      T*, T*, T*, float*, const T*, const T*, const float*, const T*, int, const T*, const T*,     \
      const AttentionShape&, cudaStream_t, AttentionKernels);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
