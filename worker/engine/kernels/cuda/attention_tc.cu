// Causal flash attention on tensor cores, bf16 only: the same rules, shapes and lse/delta
// contract as attention.cu (see kernels.h), with every matrix product on WMMA 16×16×16 bf16
// fragments accumulating in fp32.
//
// Letters: B sequences, H query heads, G = H / kv_heads query heads per key/value head, D the
// head_dim bucket (64 or 128; columns [head_dim, D) are zero in shared memory so they add
// nothing), Br = Bc = kRows = 64 rows per tile, w a warp's 16 rows of a tile.
//
// Work split (every block: kWarps = 4 warps, 128 threads; warp w owns tile rows [16w, 16w+16)):
//   forward   one block per (query tile, head, sequence), loop over the key tiles it can see:
//             S_w = Q_w·Kᵀ (fp32, to shared memory), an online softmax on it by two lanes per
//             row (row max m, row sum l in fp32; P rounded to bf16 for the product), O_w (fp32,
//             in shared memory, rescaled by the row's correction) += P_w·V; out = O/l and
//             lse = m + log l at the end;
//   dK/dV     one block per (key tile, key/value head, sequence), loop over the G query heads of
//             the group and the query tiles that see the tile: Sᵀ_w = K_w·Qᵀ, dPᵀ_w = V_w·dOᵀ,
//             Pᵀ = exp(scale·Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − delta) (bf16), then dV_w += Pᵀ_w·dO and
//             dK_w += dSᵀ_w·Q in register fragments, added into dk/dv once (no atomics);
//   dQ        one block per (query tile, head, sequence), loop over key tiles: S_w, dP_w = dO_w·Vᵀ,
//             dS_w (bf16), dQ_w += dS_w·K in register fragments; dq overwritten.
// delta = Σ_d dO·O comes from attention.cu's kernel (AttentionBackward computes it first).
//
// WMMA needs 32-byte-aligned fragment pointers and leading dimensions that are multiples of 8
// (bf16) or 4 (fp32) elements: every shared region below is a multiple of 32 bytes, every row
// stride keeps 16-row and 16-column offsets 32-byte aligned, and the strides are padded (+8 bf16,
// +4 fp32) to spread the rows over the shared-memory banks.
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "worker/engine/kernels/cuda/attention_tc.h"
#include "worker/engine/kernels/cuda/common.cuh"

namespace vp::engine::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kRows = 64;              // Br = Bc: rows of a query or key tile
constexpr int kWarps = 4;              // warp w owns tile rows [16w, 16w + 16)
constexpr int kThreads = kWarps * 32;  // 128
constexpr int kF = 16;                 // WMMA fragment edge (m = n = k = 16)
constexpr int kScoreLd = kRows + 4;    // fp32 (kRows, kRows) score tiles: row stride, floats
constexpr int kProbLd = kRows + 8;     // bf16 (kRows, kRows) probability tiles: row stride

template <int D>
__host__ __device__ constexpr int TileLd() {
  return D + 8;  // bf16 (kRows, D) tiles of Q, K, V, dO: row stride, elements
}
template <int D>
__host__ __device__ constexpr int AccLd() {
  return D + 4;  // fp32 (kRows, D) accumulator tiles: row stride, floats
}
template <int D>
__host__ __device__ constexpr size_t TileBytes() {
  return size_t(kRows) * TileLd<D>() * sizeof(bf16);
}
template <int D>
__host__ __device__ constexpr size_t AccBytes() {
  return size_t(kRows) * AccLd<D>() * sizeof(float);
}
constexpr size_t kScoreBytes = size_t(kRows) * kScoreLd * sizeof(float);
constexpr size_t kProbBytes = size_t(kRows) * kProbLd * sizeof(bf16);
constexpr size_t kStatBytes = size_t(kRows) * sizeof(float);

using FragA = wmma::fragment<wmma::matrix_a, kF, kF, kF, bf16, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, kF, kF, kF, bf16, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, kF, kF, kF, bf16, wmma::col_major>;  // transposed
using FragC = wmma::fragment<wmma::accumulator, kF, kF, kF, float>;

// dst ← rows [first, first + kRows) of src (columns [0, head_dim)); rows >= limit and columns
// [head_dim, D) are zero. 16-byte vector copies when the head's rows allow them (head_dim and ld
// multiples of 8, src 16-byte aligned), element copies otherwise.
template <int D>
__device__ void LoadTile(bf16* dst,        // (kRows, D + 8) shared
                         const bf16* src,  // (>= limit, ld) global, the head's column 0
                         long ld, int first, int limit, int head_dim) {
  const bool vec = head_dim % 8 == 0 && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec) {
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
    for (int idx = threadIdx.x; idx < kRows * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, d = (idx % kChunks) * 8, row = first + r;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (row < limit && d < head_dim) {
        val = *reinterpret_cast<const uint4*>(src + static_cast<long>(row) * ld + d);
      }
      *reinterpret_cast<uint4*>(dst + r * TileLd<D>() + d) = val;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = first + r;
    dst[r * TileLd<D>() + d] =
        row < limit && d < head_dim ? src[static_cast<long>(row) * ld + d] : __float2bfloat16(0.0f);
  }
}

// out (16, kRows) fp32 at `out` (row stride kScoreLd) ← a_rows (16, D) · b_rowsᵀ, where a_rows
// and b_rows are bf16 tiles (row stride TileLd<D>) of 16 and kRows rows: one warp.
template <int D>
__device__ void ProductWithTransposed(float* out, const bf16* a_rows, const bf16* b_rows) {
#pragma unroll
  for (int c = 0; c < kRows / kF; ++c) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D; kk += kF) {
      FragA a;
      FragBt bt;
      wmma::load_matrix_sync(a, a_rows + kk, TileLd<D>());
      wmma::load_matrix_sync(bt, b_rows + c * kF * TileLd<D>() + kk, TileLd<D>());
      wmma::mma_sync(acc, a, bt, acc);
    }
    wmma::store_matrix_sync(out + c * kF, acc, kScoreLd, wmma::mem_row_major);
  }
}

// acc[c] (16, 16) += p (16, kRows) bf16 (row stride kProbLd) · rows (kRows, D) bf16 (row stride
// TileLd<D>), columns [16c, 16c + 16): one warp, fragments held by the caller.
template <int D>
__device__ void AccumulateProduct(FragC (&acc)[D / kF], const bf16* p, const bf16* rows) {
#pragma unroll
  for (int kk = 0; kk < kRows; kk += kF) {
    FragA a;
    wmma::load_matrix_sync(a, p + kk, kProbLd);
#pragma unroll
    for (int c = 0; c < D / kF; ++c) {
      FragB bm;
      wmma::load_matrix_sync(bm, rows + kk * TileLd<D>() + c * kF, TileLd<D>());
      wmma::mma_sync(acc[c], a, bm, acc[c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: out = softmax(scale·Q·Kᵀ, causal)·V and lse per query row.
template <int D>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardTcKernel(bf16* out,      // (batch, q_len, heads*head_dim)
                             float* lse,     // (batch, heads, q_len)
                             const bf16* q,  // (batch, q_len, ldq)
                             int ldq,
                             const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                             const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                             AttentionShape s, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);                    // (kRows, D+8) queries
  bf16* ks = qs + kRows * TileLd<D>();                         // (kRows, D+8) key tile
  bf16* vs = ks + kRows * TileLd<D>();                         // (kRows, D+8) value tile
  bf16* ps = vs + kRows * TileLd<D>();                         // (kRows, kRows+8) P
  float* ss = reinterpret_cast<float*>(ps + kRows * kProbLd);  // (kRows, kRows+4) scores
  float* os = ss + kRows * kScoreLd;                           // (kRows, D+4) output acc.
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i0 = blockIdx.x * kRows;  // first query row of the tile (chunk-relative)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w0 = warp * kF;
  const int rr = lane / 2, half = lane % 2;  // softmax: row w0 + rr, columns [32·half, +32)
  const int i = i0 + w0 + rr;                // this lane's query row (may be padding)
  const int qpos = s.q_begin + i;            // absolute position: sees keys [0, qpos]
  const int n_keys = s.q_begin + min(i0 + kRows, q_len);  // keys the tile's last real row sees
  const bool warp_real = i0 + w0 < q_len;                 // the warp has a real row
  const int warp_last = s.q_begin + min(i0 + w0 + kF, q_len) - 1;  // its last real row's key
  const int kvw = s.kv_width(), kvc = (h / (s.heads / s.num_kv_heads())) * hd;
  const bf16* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
  const bf16* kh = k + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const bf16* vh = v + static_cast<long>(b) * s.kv_rows * kvw + kvc;

  LoadTile<D>(qs, qh, ldq, i0, q_len, hd);
  for (int idx = lane; idx < kF * D; idx += 32) os[(w0 + idx / D) * AccLd<D>() + idx % D] = 0.0f;
  float m = -INFINITY;  // running max of this row's scaled scores
  float l = 0.0f;       // running Σ exp(score − m), fp32

  for (int j0 = 0; j0 < n_keys; j0 += kRows) {
    __syncthreads();  // the previous tile's ks/vs reads are done before overwriting
    LoadTile<D>(ks, kh, kvw, j0, n_keys, hd);
    LoadTile<D>(vs, vh, kvw, j0, n_keys, hd);
    __syncthreads();
    // No key of this tile is visible to the warp's rows (or it has none): nothing to add. The
    // first tile is always visible to a real row (key 0), so m is finite after it.
    if (!warp_real || j0 > warp_last) continue;
    ProductWithTransposed<D>(ss + w0 * kScoreLd, qs + w0 * TileLd<D>(), ks);
    __syncwarp();
    float* srow = ss + (w0 + rr) * kScoreLd + 32 * half;
    float tile_max = -INFINITY;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const int j = j0 + 32 * half + c;
      const float x = j <= qpos && j < n_keys ? srow[c] * scale : -INFINITY;
      srow[c] = x;
      tile_max = fmaxf(tile_max, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float correction = expf(m - m_new);  // exp(−inf) = 0 on the first tile
    bf16* prow = ps + (w0 + rr) * kProbLd + 32 * half;
    float psum = 0.0f;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float p = expf(srow[c] - m_new);  // masked: exp(−inf) = 0
      prow[c] = __float2bfloat16(p);
      psum += p;
    }
    l = l * correction + psum + __shfl_xor_sync(0xffffffffu, psum, 1);
    m = m_new;
    float* orow = os + (w0 + rr) * AccLd<D>() + (D / 2) * half;
#pragma unroll 8
    for (int d = 0; d < D / 2; ++d) orow[d] *= correction;
    __syncwarp();  // P_w and the rescaled O_w are in shared memory
    FragC acc[D / kF];
#pragma unroll
    for (int c = 0; c < D / kF; ++c) {
      wmma::load_matrix_sync(acc[c], os + w0 * AccLd<D>() + c * kF, AccLd<D>(),
                             wmma::mem_row_major);
    }
    AccumulateProduct<D>(acc, ps + w0 * kProbLd, vs);
#pragma unroll
    for (int c = 0; c < D / kF; ++c) {
      wmma::store_matrix_sync(os + w0 * AccLd<D>() + c * kF, acc[c], AccLd<D>(),
                              wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (warp_real && i < q_len) {
    const float inv = 1.0f / l;  // l >= 1: the row's max term contributes exp(0)
    bf16* orow = out + (static_cast<long>(b) * q_len + i) * width + h * hd;
    const float* acc_row = os + (w0 + rr) * AccLd<D>();
    for (int d = half; d < hd; d += 2) orow[d] = __float2bfloat16(acc_row[d] * inv);
    if (half == 0) lse[(static_cast<long>(b) * s.heads + h) * q_len + i] = m + logf(l);
  }
}

// Writes a warp's 16 rows of fragments (16, D) through `stage` (fp32, row stride AccLd<D>) and
// adds scale·value into rows [row0, row0 + 16) of dst (row stride ld) for rows < limit, columns
// < head_dim (accumulate) or stores it (overwrite).
template <int D>
__device__ void WriteRows(bf16* dst, long ld, int row0, int limit, int head_dim,
                          const FragC (&acc)[D / kF], float* stage, float scale, bool accumulate) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < D / kF; ++c) {
    wmma::store_matrix_sync(stage + c * kF, acc[c], AccLd<D>(), wmma::mem_row_major);
  }
  __syncwarp();
  for (int idx = lane; idx < kF * head_dim; idx += 32) {
    const int r = idx / head_dim, d = idx % head_dim, row = row0 + r;
    if (row >= limit) continue;
    bf16& out = dst[static_cast<long>(row) * ld + d];
    const float value = scale * stage[r * AccLd<D>() + d];
    out = __float2bfloat16(accumulate ? __bfloat162float(out) + value : value);
  }
  __syncwarp();  // the stage is reused
}

// Backward, dK/dV: one block per key tile of one key/value head (rows = keys).
template <int D>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardKeyValueTcKernel(bf16* dk,            // (batch, kv_rows, kv_heads*head_dim)
                                      bf16* dv,            // (batch, kv_rows, kv_heads*head_dim)
                                      const bf16* dout,    // (batch, q_len, heads*head_dim)
                                      const float* lse,    // (batch, heads, q_len)
                                      const float* delta,  // (batch, heads, q_len)
                                      const bf16* q,       // (batch, q_len, ldq)
                                      int ldq,
                                      const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                                      const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                                      AttentionShape s, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem);                       // (kRows, D+8) keys
  bf16* vs = ks + kRows * TileLd<D>();                            // (kRows, D+8) values
  bf16* qs = vs + kRows * TileLd<D>();                            // (kRows, D+8) query tile
  bf16* dos = qs + kRows * TileLd<D>();                           // (kRows, D+8) dout tile
  bf16* pts = dos + kRows * TileLd<D>();                          // (kRows, kRows+8) Pᵀ
  bf16* dsts = pts + kRows * kProbLd;                             // (kRows, kRows+8) dSᵀ
  float* sts = reinterpret_cast<float*>(dsts + kRows * kProbLd);  // (kRows, kRows+4) Sᵀ
  float* dpts = sts + kRows * kScoreLd;                           // (kRows, kRows+4) dPᵀ
  float* lse_s = dpts + kRows * kScoreLd;                         // (kRows)
  float* delta_s = lse_s + kRows;                                 // (kRows)
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = s.heads / s.num_kv_heads(), kvw = s.kv_width();
  const int j0 = blockIdx.x * kRows;  // first key of the tile (absolute position)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w0 = warp * kF;
  const int rr = lane / 2, half = lane % 2;  // row w0 + rr (a key), queries [32·half, +32)
  const int j = j0 + w0 + rr;                // this lane's key (padding when >= q_end)
  const long kv_head = static_cast<long>(b) * s.kv_rows * kvw + kvh * hd;

  LoadTile<D>(ks, k + kv_head, kvw, j0, s.q_end, hd);
  LoadTile<D>(vs, v + kv_head, kvw, j0, s.q_end, hd);
  FragC dk_acc[D / kF], dv_acc[D / kF];  // the warp's 16 keys × D, summed over the group
#pragma unroll
  for (int c = 0; c < D / kF; ++c) {
    wmma::fill_fragment(dk_acc[c], 0.0f);
    wmma::fill_fragment(dv_acc[c], 0.0f);
  }

  // Query row i (absolute q_begin + i) sees key j0 iff q_begin + i >= j0.
  const int i_first = max(0, j0 - s.q_begin);
  for (int hg = 0; hg < group; ++hg) {
    const int h = kvh * group + hg;
    const bf16* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
    const bf16* doh = dout + static_cast<long>(b) * q_len * width + h * hd;
    const long stats = (static_cast<long>(b) * s.heads + h) * q_len;
    for (int i0 = i_first; i0 < q_len; i0 += kRows) {
      __syncthreads();  // previous query tile's reads are done; on entry, orders the K/V loads
      LoadTile<D>(qs, qh, ldq, i0, q_len, hd);
      LoadTile<D>(dos, doh, width, i0, q_len, hd);
      for (int t = threadIdx.x; t < kRows; t += blockDim.x) {
        const int i = i0 + t;  // padding rows: their P is masked to 0
        lse_s[t] = i < q_len ? lse[stats + i] : 0.0f;
        delta_s[t] = i < q_len ? delta[stats + i] : 0.0f;
      }
      __syncthreads();
      // The tile's last real query (absolute) against the warp's first key.
      const int last_query = s.q_begin + min(i0 + kRows, q_len) - 1;
      if (j0 + w0 >= s.q_end || j0 + w0 > last_query) continue;
      ProductWithTransposed<D>(sts + w0 * kScoreLd, ks + w0 * TileLd<D>(), qs);
      ProductWithTransposed<D>(dpts + w0 * kScoreLd, vs + w0 * TileLd<D>(), dos);
      __syncwarp();
      const float* srow = sts + (w0 + rr) * kScoreLd + 32 * half;
      const float* dprow = dpts + (w0 + rr) * kScoreLd + 32 * half;
      bf16* prow = pts + (w0 + rr) * kProbLd + 32 * half;
      bf16* dsrow = dsts + (w0 + rr) * kProbLd + 32 * half;
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int ic = 32 * half + c, i = i0 + ic;
        const bool visible = i < q_len && j < s.q_end && j <= s.q_begin + i;
        const float p = visible ? expf(srow[c] * scale - lse_s[ic]) : 0.0f;
        prow[c] = __float2bfloat16(p);
        dsrow[c] = __float2bfloat16(p * (dprow[c] - delta_s[ic]));
      }
      __syncwarp();
      AccumulateProduct<D>(dv_acc, pts + w0 * kProbLd, dos);
      AccumulateProduct<D>(dk_acc, dsts + w0 * kProbLd, qs);
    }
  }  // query heads of the group

  __syncthreads();  // every warp is done with qs/dos: they become the fp32 stage
  float* stage = reinterpret_cast<float*>(qs) + w0 * AccLd<D>();  // (16, D+4) per warp
  WriteRows<D>(dk + kv_head, kvw, j0 + w0, s.q_end, hd, dk_acc, stage, scale, true);
  WriteRows<D>(dv + kv_head, kvw, j0 + w0, s.q_end, hd, dv_acc, stage, 1.0f, true);
}

// Backward, dQ: one block per query tile of one head (rows = queries).
template <int D>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardQueryTcKernel(bf16* dq,            // (batch, q_len, ldq)
                                   const bf16* dout,    // (batch, q_len, heads*head_dim)
                                   const float* lse,    // (batch, heads, q_len)
                                   const float* delta,  // (batch, heads, q_len)
                                   const bf16* q,       // (batch, q_len, ldq)
                                   int ldq,
                                   const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                                   const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                                   AttentionShape s, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);                     // (kRows, D+8) queries
  bf16* dos = qs + kRows * TileLd<D>();                         // (kRows, D+8) dout rows
  bf16* ks = dos + kRows * TileLd<D>();                         // (kRows, D+8) key tile
  bf16* vs = ks + kRows * TileLd<D>();                          // (kRows, D+8) value tile
  bf16* dss = vs + kRows * TileLd<D>();                         // (kRows, kRows+8) dS
  float* ss = reinterpret_cast<float*>(dss + kRows * kProbLd);  // (kRows, kRows+4) S
  float* dps = ss + kRows * kScoreLd;                           // (kRows, kRows+4) dP
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const int i0 = blockIdx.x * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w0 = warp * kF;
  const int rr = lane / 2, half = lane % 2;
  const int i = i0 + w0 + rr;
  const int qpos = s.q_begin + i;
  const int n_keys = s.q_begin + min(i0 + kRows, q_len);
  const bool warp_real = i0 + w0 < q_len;
  const int warp_last = s.q_begin + min(i0 + w0 + kF, q_len) - 1;
  const bf16* qh = q + static_cast<long>(b) * q_len * ldq + h * hd;
  const bf16* doh = dout + static_cast<long>(b) * q_len * width + h * hd;
  const int kvw = s.kv_width(), kvc = (h / (s.heads / s.num_kv_heads())) * hd;
  const bf16* kh = k + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const bf16* vh = v + static_cast<long>(b) * s.kv_rows * kvw + kvc;
  const long stat = (static_cast<long>(b) * s.heads + h) * q_len + i;
  const float row_lse = i < q_len ? lse[stat] : 0.0f;
  const float row_delta = i < q_len ? delta[stat] : 0.0f;

  LoadTile<D>(qs, qh, ldq, i0, q_len, hd);
  LoadTile<D>(dos, doh, width, i0, q_len, hd);
  FragC dq_acc[D / kF];  // the warp's 16 queries × D
#pragma unroll
  for (int c = 0; c < D / kF; ++c) wmma::fill_fragment(dq_acc[c], 0.0f);

  for (int j0 = 0; j0 < n_keys; j0 += kRows) {
    __syncthreads();  // previous key tile's reads are done; on entry, orders the Q/dO loads
    LoadTile<D>(ks, kh, kvw, j0, n_keys, hd);
    LoadTile<D>(vs, vh, kvw, j0, n_keys, hd);
    __syncthreads();
    if (!warp_real || j0 > warp_last) continue;
    ProductWithTransposed<D>(ss + w0 * kScoreLd, qs + w0 * TileLd<D>(), ks);
    ProductWithTransposed<D>(dps + w0 * kScoreLd, dos + w0 * TileLd<D>(), vs);
    __syncwarp();
    const float* srow = ss + (w0 + rr) * kScoreLd + 32 * half;
    const float* dprow = dps + (w0 + rr) * kScoreLd + 32 * half;
    bf16* dsrow = dss + (w0 + rr) * kProbLd + 32 * half;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const int j = j0 + 32 * half + c;
      const bool visible = i < q_len && j <= qpos && j < n_keys;
      const float p = visible ? expf(srow[c] * scale - row_lse) : 0.0f;
      dsrow[c] = __float2bfloat16(p * (dprow[c] - row_delta));
    }
    __syncwarp();
    AccumulateProduct<D>(dq_acc, dss + w0 * kProbLd, ks);
  }

  __syncthreads();  // every warp is done with ks/vs: they become the fp32 stage
  float* stage = reinterpret_cast<float*>(ks) + w0 * AccLd<D>();  // (16, D+4) per warp
  WriteRows<D>(dq + static_cast<long>(b) * q_len * ldq + h * hd, ldq, i0 + w0, q_len, hd, dq_acc,
               stage, scale, false);
}

// ---------------------------------------------------------------------------------------------
// Launch helpers. Shared memory (bytes, D = 128 / 64): forward 110 / 70 KiB, dK/dV 120 / 88 KiB,
// dQ 111 / 77 KiB: every launch opts in above the default 48 KiB (cudaFuncSetAttribute, cheap).

template <int D>
constexpr size_t ForwardSmem() {
  return 3 * TileBytes<D>() + kProbBytes + kScoreBytes + AccBytes<D>();
}
template <int D>
constexpr size_t KeyValueSmem() {
  return 4 * TileBytes<D>() + 2 * kProbBytes + 2 * kScoreBytes + 2 * kStatBytes;
}
template <int D>
constexpr size_t QuerySmem() {
  return 4 * TileBytes<D>() + kProbBytes + 2 * kScoreBytes;
}
// The fp32 stages of the backward epilogues reuse two bf16 tiles.
static_assert(2 * TileBytes<64>() >= size_t(kF) * kWarps * AccLd<64>() * sizeof(float));
static_assert(2 * TileBytes<128>() >= size_t(kF) * kWarps * AccLd<128>() * sizeof(float));
static_assert(TileBytes<64>() % 128 == 0 && kProbBytes % 128 == 0 && kScoreBytes % 128 == 0 &&
              AccBytes<64>() % 128 == 0 && AccBytes<128>() % 128 == 0 && kStatBytes % 128 == 0);

template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

float Scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

template <int D>
cudaError_t LaunchForward(bf16* out, float* lse, const bf16* q, int ldq, const bf16* k,
                          const bf16* v, const AttentionShape& s, cudaStream_t stream) {
  if (cudaError_t e = AllowSharedMemory(AttentionForwardTcKernel<D>, ForwardSmem<D>());
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(CeilDiv(s.q_len(), kRows), s.heads, s.batch);
  AttentionForwardTcKernel<D>
      <<<grid, kThreads, ForwardSmem<D>(), stream>>>(out, lse, q, ldq, k, v, s, Scale(s));
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchBackward(bf16* dq, bf16* dk, bf16* dv, const float* delta, const bf16* dout,
                           const float* lse, const bf16* q, int ldq, const bf16* k, const bf16* v,
                           const AttentionShape& s, cudaStream_t stream) {
  if (cudaError_t e = AllowSharedMemory(AttentionBackwardKeyValueTcKernel<D>, KeyValueSmem<D>());
      e != cudaSuccess) {
    return e;
  }
  AttentionBackwardKeyValueTcKernel<D>
      <<<dim3(CeilDiv(s.q_end, kRows), s.num_kv_heads(), s.batch), kThreads, KeyValueSmem<D>(),
         stream>>>(dk, dv, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (cudaError_t e = AllowSharedMemory(AttentionBackwardQueryTcKernel<D>, QuerySmem<D>());
      e != cudaSuccess) {
    return e;
  }
  AttentionBackwardQueryTcKernel<D>
      <<<dim3(CeilDiv(s.q_len(), kRows), s.heads, s.batch), kThreads, QuerySmem<D>(), stream>>>(
          dq, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  return cudaGetLastError();
}

}  // namespace

cudaError_t AttentionForwardTensorCore(bf16* out, float* lse, const bf16* q, int ldq, const bf16* k,
                                       const bf16* v, const AttentionShape& shape,
                                       cudaStream_t stream) {
  if (shape.head_dim <= 64) return LaunchForward<64>(out, lse, q, ldq, k, v, shape, stream);
  return LaunchForward<128>(out, lse, q, ldq, k, v, shape, stream);
}

cudaError_t AttentionBackwardTensorCore(bf16* dq, bf16* dk, bf16* dv, const float* delta,
                                        const bf16* dout, const float* lse, const bf16* q, int ldq,
                                        const bf16* k, const bf16* v, const AttentionShape& shape,
                                        cudaStream_t stream) {
  if (shape.head_dim <= 64) {
    return LaunchBackward<64>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream);
  }
  return LaunchBackward<128>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream);
}

}  // namespace vp::engine::cuda
