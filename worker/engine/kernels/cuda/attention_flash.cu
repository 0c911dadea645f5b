// Causal flash attention on mma.sync tensor cores (FlashAttention-2 style), bf16 only, behind
// VOCABPIPE_ATTENTION=flash (AttentionKernels::kFlash): the same rules, shapes and lse/delta
// contract as attention.cu and attention_tc.cu (kernels.h).
//
// Why a third kernel set: the WMMA kernels (attention_tc.cu) keep scores, probabilities and the
// output accumulator in shared memory, because a WMMA fragment's element layout is opaque, and
// do the softmax with two lanes per row; on an H100 they reach ~25-30 TFLOP/s, so attention is
// over half of a GPT-2 layer (docs/benchmarks.md §7.4). Here every product is an
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate) whose accumulator layout is documented, so scores,
// probabilities, the output and the dK/dV/dQ accumulators stay in registers: a score tile's
// accumulator is reused in place as the next product's A operand (no shared-memory round trip),
// and the softmax statistics are reduced with two shuffles per row.
//
// Letters: D the head_dim bucket (64 or 128; columns [head_dim, D) are zero in shared memory),
// kRows = 64 rows per query or key tile, 4 warps of 16 rows each (warp w: tile rows [16w, +16)).
// Per lane: g = lane / 4 (rows g and g + 8 of the warp's 16), t = lane % 4 (columns 2t, 2t + 1
// of every 8-column tile), the m16n8k16 register layout:
//   A (16×16 row-major): a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16×8, k × n):     b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16×8 fp32):       c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// (two bf16 in a register: the lower index in the low half). A B operand whose n index runs
// along a shared row (Kᵀ for Q·Kᵀ) is two 32-bit loads; one whose k index runs along the rows
// (V for P·V) comes from ldmatrix.trans.
//
// Work split (as attention_tc.cu):
//   forward  one block per (query tile, head, sequence), the heaviest (last) query tiles first;
//            loop over the visible key tiles: S = Q·Kᵀ, online softmax in the exp2 domain (m, l
//            per row in fp32), O = O·corr + P·V with P rounded to bf16; out = O / l, lse.
//   dK/dV    one block per (key tile, key/value head, sequence), loop over the group's query
//            heads and the query tiles that see the tile: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ,
//            Pᵀ = exp(scale·Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − delta), dV += Pᵀ·dO, dK += dSᵀ·Q; added
//            into dk, dv once at the end (no atomics, deterministic).
//   dQ       one block per (query tile, head, sequence): S, dP = dO·Vᵀ, dS, dQ += dS·K; dq
//            overwritten.
// Shared memory: the forward 2 bf16 tiles (34 KiB at D = 128; the queries stay in registers),
// the backward kernels 4 (68 KiB, opt-in above the 48 KiB default).
//
// kPipelined (AttentionKernels::kFlashPipelined, VOCABPIPE_ATTENTION=flash-pipelined): the same
// kernels with the streamed tiles (K/V in the forward and dQ, Q/dO/lse/delta in dK/dV) double
// buffered: while the warps compute on one stage, cp.async copies the next tile into the other,
// so a block no longer waits for global memory between tiles (at D = 128 the forward fits only
// 2 blocks, 8 warps, per SM, too few to hide a load); and the A and row-B operands come from
// ldmatrix.x4 (one instruction for what took four 32-bit loads). Shared memory: 4 tiles in the
// forward (68 KiB at D = 128), 6 in the backward (102 KiB). Rows that 16-byte copies cannot
// serve (head_dim not a multiple of 8, unaligned rows) are loaded synchronously into the same
// stages, so every shape runs either way.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "worker/engine/kernels/cuda/attention_flash.h"
#include "worker/engine/kernels/cuda/common.cuh"

namespace vp::engine::cuda {
namespace {

constexpr int kRows = 64;              // rows of a query or key tile
constexpr int kWarps = 4;              // warp w owns tile rows [16w, 16w + 16)
constexpr int kThreads = kWarps * 32;  // 128
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
__host__ __device__ constexpr int Ld() {
  return D + 8;  // bf16 tile row stride: 16-byte aligned rows, conflict-free 32-bit fragment loads
}

// One warp: c (16×8 fp32) += a (16×16 bf16) · b (16×8 bf16).
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The B operands of two adjacent 8-column tiles from a row-major (k rows, n columns) shared tile
// at `p` = &tile[k0 + (lane % 16)][n0 + (lane / 16)·8]: r0, r1 for columns [n0, n0+8), r2, r3
// for [n0+8, n0+16). Row addresses must be 16-byte aligned.
__device__ __forceinline__ void LoadBTransposed(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ uint32_t Load32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Four 8×8 bf16 matrices from shared memory, not transposed: lane l gives the address of row
// l % 8 of matrix l / 8 (16-byte aligned) and receives, from matrix i in r[i], the elements
// (row l / 4, columns 2(l % 4), 2(l % 4) + 1): the m16n8k16 A/B fragment layout above.
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], const bf16* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16 bytes global → shared without passing through registers (sm_80+), in the current group.
__device__ __forceinline__ void CopyAsync16(bf16* shared_dst, const bf16* global_src) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(global_src));
}
// Closes the group of the copies issued since the last commit.
__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups are still in flight; the
// block's __syncthreads after it makes every thread's copies visible.
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A operand (16×16) of rows [r0, r0+16), columns [c0, c0+16) of a row-major shared tile.
template <int D, bool kPipelined>
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const bf16* tile, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  if constexpr (kPipelined) {
    // Matrices a0..a3: (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8).
    const int m = lane / 8;
    LoadMatrices(a, tile + (r0 + (m % 2) * 8 + lane % 8) * Ld<D>() + c0 + (m / 2) * 8);
  } else {
    const int g = lane / 4, t = lane % 4;
    const bf16* p = tile + (r0 + g) * Ld<D>() + c0 + 2 * t;
    a[0] = Load32(p);
    a[1] = Load32(p + 8 * Ld<D>());
    a[2] = Load32(p + 8);
    a[3] = Load32(p + 8 * Ld<D>() + 8);
  }
}

// The B operand (16×8, k × n) = rowsᵀ for n = rows [n0, n0+8) and k = columns [k0, k0+16) of a
// row-major shared tile (B[k][n] = tile[n0 + n][k0 + k]): the Kᵀ of Q·Kᵀ.
template <int D>
__device__ __forceinline__ void LoadBRows(uint32_t& b0, uint32_t& b1, const bf16* tile, int n0,
                                          int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const bf16* p = tile + (n0 + g) * Ld<D>() + k0 + 2 * t;
  b0 = Load32(p);
  b1 = Load32(p + 8);
}

// The same for two adjacent 8-column tiles n0 and n0 + 8 in one ldmatrix.x4: r0, r1 the B
// operand of rows [n0, n0+8), r2, r3 that of rows [n0+8, n0+16).
template <int D>
__device__ __forceinline__ void LoadBRowsPair(uint32_t (&r)[4], const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32, m = lane / 8;
  // Matrices: (rows +0, cols +0), (+0, +8), (+8, +0), (+8, +8).
  LoadMatrices(r, tile + (n0 + (m / 2) * 8 + lane % 8) * Ld<D>() + k0 + (m % 2) * 8);
}

// 16-byte chunks of a (kRows, D) tile per thread (blocks are kThreads wide): 8 at D = 128.
template <int D>
constexpr int kChunksPerThread = kRows*(D / 8) / kThreads;
static_assert(kRows * (64 / 8) % kThreads == 0, "whole chunks per thread");

// LoadTile (below) one element at a time, for rows that 16-byte copies cannot serve.
template <int D>
__device__ void LoadTileByElement(bf16* dst, const bf16* src, long ld, int first, int limit,
                                  int head_dim) {
  for (int idx = threadIdx.x; idx < kRows * D; idx += blockDim.x) {
    const int r = idx / D, d = idx % D, row = first + r;
    dst[r * Ld<D>() + d] =
        row < limit && d < head_dim ? src[static_cast<long>(row) * ld + d] : __float2bfloat16(0.0f);
  }
}

// dst (kRows, Ld<D>) ← rows [first, first + kRows) of src (columns [0, head_dim)); rows >= limit
// and columns [head_dim, D) are zero. 16-byte copies when the rows allow them, kBatch loads issued
// before their stores, so a tile at D = 128 costs 8 / kBatch memory latencies, not eight (a store
// to shared memory between two loads orders them: the compiler cannot tell that the pointers do
// not alias). kBatch 1 where the registers are short: the backward kernels stream their tiles
// beside 64-128 accumulator registers, and two loads in flight made ptxas spill in the dK/dV
// kernel and cost the dQ kernel a block per SM (163 → 180 registers).
template <int D, int kBatch = 4>
__device__ void LoadTile(bf16* dst, const bf16* src, long ld, int first, int limit, int head_dim) {
  const bool vec = head_dim % 8 == 0 && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vec && kBatch == 1) {
    constexpr int kChunks = D / 8;
    for (int idx = threadIdx.x; idx < kRows * kChunks; idx += blockDim.x) {
      const int r = idx / kChunks, d = (idx % kChunks) * 8, row = first + r;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (row < limit && d < head_dim) {
        val = *reinterpret_cast<const uint4*>(src + static_cast<long>(row) * ld + d);
      }
      *reinterpret_cast<uint4*>(dst + r * Ld<D>() + d) = val;
    }
    return;
  }
  if (vec) {
    constexpr int kChunks = D / 8;
    static_assert(kChunksPerThread<D> % kBatch == 0, "whole batches");
#pragma unroll
    for (int n0 = 0; n0 < kChunksPerThread<D>; n0 += kBatch) {
      uint4 val[kBatch];
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int idx = threadIdx.x + (n0 + n) * kThreads;
        const int r = idx / kChunks, d = (idx % kChunks) * 8, row = first + r;
        val[n] = row < limit && d < head_dim
                     ? *reinterpret_cast<const uint4*>(src + static_cast<long>(row) * ld + d)
                     : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int idx = threadIdx.x + (n0 + n) * kThreads;
        *reinterpret_cast<uint4*>(dst + (idx / kChunks) * Ld<D>() + (idx % kChunks) * 8) = val[n];
      }
    }
    return;
  }
  LoadTileByElement<D>(dst, src, ld, first, limit, head_dim);
}

// LoadTile as cp.async copies in the current group (the padding zeros and rows that 16-byte
// copies cannot serve are stored at once): complete after WaitCopies and a __syncthreads.
template <int D>
__device__ void LoadTileAsync(bf16* dst, const bf16* src, long ld, int first, int limit,
                              int head_dim) {
  const bool vec = head_dim % 8 == 0 && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (!vec) {
    LoadTileByElement<D>(dst, src, ld, first, limit, head_dim);
    return;
  }
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += blockDim.x) {
    const int r = idx / kChunks, d = (idx % kChunks) * 8, row = first + r;
    bf16* to = dst + r * Ld<D>() + d;
    if (row < limit && d < head_dim) {
      CopyAsync16(to, src + static_cast<long>(row) * ld + d);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
}

// One tile: asynchronously in the pipelined kernels, else at once (kBatch loads in flight).
template <int D, bool kPipelined, int kBatch = 4>
__device__ __forceinline__ void LoadTileFor(bf16* dst, const bf16* src, long ld, int first,
                                            int limit, int head_dim) {
  if constexpr (kPipelined) {
    LoadTileAsync<D>(dst, src, ld, first, limit, head_dim);
  } else {
    LoadTile<D, kBatch>(dst, src, ld, first, limit, head_dim);
  }
}

// One step of the loop over key/value tiles (forward, wide forward, dQ), between the block's two
// barriers: the first orders the previous tile's reads (on entry: the first loads') before a
// stage is refilled, the second makes this tile visible. Pipelined: tile it + 1 (keys from
// (it + 1)·kRows) starts copying into k_dst / v_dst, the other stage, while this tile's copies
// complete; else tile it loads at once into k_dst / v_dst (kBatch loads in flight).
template <int D, bool kPipelined, int kBatch = 4>
__device__ __forceinline__ void StepKeyValueTiles(bf16* k_dst, bf16* v_dst, const bf16* kh,
                                                  const bf16* vh, int kvw, int it, int n_tiles,
                                                  int n_keys, int head_dim) {
  __syncthreads();
  if constexpr (kPipelined) {
    if (it + 1 < n_tiles) {
      LoadTileAsync<D>(k_dst, kh, kvw, (it + 1) * kRows, n_keys, head_dim);
      LoadTileAsync<D>(v_dst, vh, kvw, (it + 1) * kRows, n_keys, head_dim);
      CommitCopies();
      WaitCopies<1>();  // this tile's group is done, the next one may fly
    } else {
      WaitCopies<0>();
    }
  } else {
    LoadTile<D, kBatch>(k_dst, kh, kvw, it * kRows, n_keys, head_dim);
    LoadTile<D, kBatch>(v_dst, vh, kvw, it * kRows, n_keys, head_dim);
  }
  __syncthreads();
}

// Column 0 of query head h of sequence b in q, and of the key/value head it reads in k and v
// (grouped-query: head h / (heads / kv_heads)).
struct HeadRows {
  const bf16* q;  // (q_len rows, stride ldq)
  const bf16* k;  // (kv_rows rows, stride kv_width)
  const bf16* v;  // (kv_rows rows, stride kv_width)
};
__device__ __forceinline__ HeadRows RowsOfHead(const bf16* q, int ldq, const bf16* k, const bf16* v,
                                               const AttentionShape& s, int b, int h) {
  const int hd = s.head_dim, q_len = s.q_end - s.q_begin, kvw = s.kv_width();
  const long kv_offset =
      static_cast<long>(b) * s.kv_rows * kvw + (h / (s.heads / s.num_kv_heads())) * hd;
  return {q + static_cast<long>(b) * q_len * ldq + h * hd, k + kv_offset, v + kv_offset};
}

// Bytes of one (kRows, D + 8) bf16 tile.
template <int D>
constexpr size_t TileBytes() {
  return size_t(kRows) * Ld<D>() * sizeof(bf16);
}

// acc[nt] (16 rows × 8 columns [8nt, 8nt+8)) += p (16 × 64, as 8 score accumulators, rounded to
// bf16) · rows (64 × D, row-major shared): the P·V / Pᵀ·dO / dSᵀ·Q / dS·K products.
template <int D>
__device__ __forceinline__ void AccumulateScoresTimesRows(float (&acc)[D / 8][4],
                                                          const float (&p)[kRows / 8][4],
                                                          const bf16* rows) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    // A for keys [16kk, 16kk+16): two score tiles' accumulators, in place.
    const uint32_t a[4] = {Pack(p[2 * kk][0], p[2 * kk][1]), Pack(p[2 * kk][2], p[2 * kk][3]),
                           Pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           Pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int n2 = 0; n2 < D / 16; ++n2) {
      uint32_t b[4];
      LoadBTransposed(b, rows + (16 * kk + lane % 16) * Ld<D>() + 16 * n2 + (lane / 16) * 8);
      Mma(acc[2 * n2], a, b[0], b[1]);
      Mma(acc[2 * n2 + 1], a, b[2], b[3]);
    }
  }
}

// s[nt] (16 × 8 columns [8nt, 8nt+8) of a 64-column tile) = a_rows (rows [r0, r0+16) of a shared
// (., D) tile) · b_rows (64 rows of a shared (64, D) tile)ᵀ: Q·Kᵀ, K·Qᵀ, V·dOᵀ, dO·Vᵀ.
// s[nt] += a (16×16, columns [16kk, +16)) · the kk-th 16 columns of the 64 b_rows, transposed.
template <int D, bool kPipelined>
__device__ __forceinline__ void ScoreColumns(float (&s)[kRows / 8][4], const uint32_t (&a)[4],
                                             const bf16* b_rows, int kk) {
  if constexpr (kPipelined) {
#pragma unroll
    for (int nt = 0; nt < kRows / 8; nt += 2) {
      uint32_t b[4];
      LoadBRowsPair<D>(b, b_rows, 8 * nt, 16 * kk);
      Mma(s[nt], a, b[0], b[1]);
      Mma(s[nt + 1], a, b[2], b[3]);
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
      uint32_t b0, b1;
      LoadBRows<D>(b0, b1, b_rows, 8 * nt, 16 * kk);
      Mma(s[nt], a, b0, b1);
    }
  }
}

template <int D, bool kPipelined>
__device__ __forceinline__ void ScoreTile(float (&s)[kRows / 8][4], const bf16* a_tile, int r0,
                                          const bf16* b_rows) {
#pragma unroll
  for (int nt = 0; nt < kRows / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    LoadA<D, kPipelined>(a, a_tile, r0, 16 * kk);
    ScoreColumns<D, kPipelined>(s, a, b_rows, kk);
  }
}

// The same with the A rows already in registers (a[kk]: columns [16kk, 16kk+16)).
template <int D, bool kPipelined>
__device__ __forceinline__ void ScoreTile(float (&s)[kRows / 8][4], const uint32_t (&a)[D / 16][4],
                                          const bf16* b_rows) {
#pragma unroll
  for (int nt = 0; nt < kRows / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ScoreColumns<D, kPipelined>(s, a[kk], b_rows, kk);
}

// ---------------------------------------------------------------------------------------------
// Forward: out = softmax(scale·Q·Kᵀ, causal)·V and lse per query row.

// The online softmax of a warp's 16 query rows (this lane's rows g and g + 8) over the key tiles,
// in the exp2 domain, and the output rows it finally writes.
struct OnlineSoftmax {
  float m0 = -INFINITY, m1 = -INFINITY;  // running row max of the log2-scaled scores
  float l0 = 0.0f, l1 = 0.0f;            // this lane's part of the running Σ 2^(x − m)

  // sc (16 rows × the 64 keys [j0, j0+64) of one tile, raw Q·Kᵀ) becomes the rows'
  // probabilities relative to the new running max, masked where a key lies after the row
  // (pos0: this lane's first row's absolute position) or at or past n_keys; o (16 × D) is
  // rescaled to that max.
  template <int kOutTiles>  // D / 8
  __device__ __forceinline__ void Step(float (&sc)[kRows / 8][4], float (&o)[kOutTiles][4], int j0,
                                       int pos0, int n_keys, float scale_log2) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int pos1 = pos0 + 8;
    const bool diagonal = j0 + kRows - 1 > pos0 - g;  // some key may lie after some row
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + 8 * nt + 2 * t + (e & 1);
        const int pos = e < 2 ? pos0 : pos1;
        float x = sc[nt][e] * scale_log2;
        if (diagonal && (key > pos || key >= n_keys)) x = -INFINITY;
        sc[nt][e] = x;
      }
      mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
    }
    // The 4 lanes of a row (same g) hold its 64 columns.
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // Every row sees key 0 in the first tile, so m is finite from then on and a fully masked
    // row of a later tile keeps m (exp2(−inf − m) = 0).
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float corr0 = exp2f(m0 - mn0), corr1 = exp2f(m1 - mn1);  // 0 on the first tile
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
      sc[nt][0] = exp2f(sc[nt][0] - mn0);
      sc[nt][1] = exp2f(sc[nt][1] - mn0);
      sc[nt][2] = exp2f(sc[nt][2] - mn1);
      sc[nt][3] = exp2f(sc[nt][3] - mn1);
      sum0 += sc[nt][0] + sc[nt][1];
      sum1 += sc[nt][2] + sc[nt][3];
    }
    l0 = l0 * corr0 + sum0;
    l1 = l1 * corr1 + sum1;
#pragma unroll
    for (int nt = 0; nt < kOutTiles; ++nt) {
      o[nt][0] *= corr0;
      o[nt][1] *= corr0;
      o[nt][2] *= corr1;
      o[nt][3] *= corr1;
    }
  }

  // out rows [row0, row0 + 16) (chunk-relative; those < q_len) of head h of sequence b ← o / l,
  // and their lse. Call once, after the last tile.
  template <int kOutTiles>  // D / 8
  __device__ __forceinline__ void Write(bf16* out, float* lse, const float (&o)[kOutTiles][4],
                                        const AttentionShape& s, int b, int h, int row0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;  // l >= 1: the row max contributes 2^0
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row0 + g + 8 * half;  // chunk-relative query row
      if (i >= q_len) continue;
      const float inv = half == 0 ? inv0 : inv1;
      bf16* orow = out + (static_cast<long>(b) * q_len + i) * width + h * hd;
#pragma unroll
      for (int nt = 0; nt < kOutTiles; ++nt) {
        const int d = 8 * nt + 2 * t;
        if (d < hd) orow[d] = __float2bfloat16(o[nt][2 * half] * inv);
        if (d + 1 < hd) orow[d + 1] = __float2bfloat16(o[nt][2 * half + 1] * inv);
      }
      if (t == 0) {
        const float m = half == 0 ? m0 : m1, l = half == 0 ? l0 : l1;
        lse[(static_cast<long>(b) * s.heads + h) * q_len + i] = (m + log2f(l)) * kLn2;
      }
    }
  }
};

// The query rows a block and warp of the forward and dQ kernels own: the block rows
// [i0, i0 + block_rows) of the chunk (the heaviest, last, tiles first under the causal mask), the
// warp rows [i0 + w0, + warp_rows).
struct QueryTileRows {
  int i0, w0;
  int n_keys;      // keys the block's last real row sees (absolute positions [0, n_keys))
  bool warp_real;  // the warp has a row < q_len
  int warp_last;   // the absolute position of the warp's last real row
  int pos0;        // the absolute position of this lane's first row (row g of the warp)
  __device__ QueryTileRows(const AttentionShape& s, int block_rows, int warp_rows) {
    const int q_len = s.q_end - s.q_begin, warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
    i0 = (gridDim.x - 1 - blockIdx.x) * block_rows;
    w0 = warp * warp_rows;
    n_keys = s.q_begin + min(i0 + block_rows, q_len);
    warp_real = i0 + w0 < q_len;
    warp_last = s.q_begin + min(i0 + w0 + warp_rows, q_len) - 1;
    pos0 = s.q_begin + i0 + w0 + g;
  }
};

template <int D>
constexpr size_t ForwardSmem(bool pipelined) {
  return (pipelined ? 4 : 2) * TileBytes<D>();
}

template <int D, bool kPipelined>
__global__ void __launch_bounds__(kThreads)
    FlashForwardKernel(bf16* out,      // (batch, q_len, heads*head_dim)
                       float* lse,     // (batch, heads, q_len)
                       const bf16* q,  // (batch, q_len, ldq)
                       int ldq,
                       const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                       const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                       AttentionShape s, float scale_log2) {
  // ForwardSmem: stage st's key tile at 2·st, its value tile at 2·st + 1 (one stage unless
  // pipelined). The queries live in registers, staged through the last key tile.
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* const tiles = reinterpret_cast<bf16*>(smem);
  constexpr int kTile = kRows * Ld<D>();
  constexpr int kStages = kPipelined ? 2 : 1;
  const int hd = s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const QueryTileRows mine(s, kRows, 16);
  const int i0 = mine.i0, w0 = mine.w0, n_keys = mine.n_keys, warp_last = mine.warp_last;
  const bool warp_real = mine.warp_real;
  const int pos0 = mine.pos0;  // padding rows compute garbage, never written
  const int kvw = s.kv_width();
  const HeadRows rows_of = RowsOfHead(q, ldq, k, v, s, b, h);
  const bf16 *qh = rows_of.q, *kh = rows_of.k, *vh = rows_of.v;
  const int n_tiles = (n_keys + kRows - 1) / kRows;

  if constexpr (kPipelined) {  // the first key/value tile flies while the queries load
    LoadTileAsync<D>(tiles, kh, kvw, 0, n_keys, hd);
    LoadTileAsync<D>(tiles + kTile, vh, kvw, 0, n_keys, hd);
    CommitCopies();
  }
  bf16* const q_stage = tiles + (2 * kStages - 2) * kTile;
  LoadTile<D>(q_stage, qh, ldq, i0, q_len, hd);
  __syncthreads();
  uint32_t qf[D / 16][4];  // the warp's 16 query rows as A operands
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) LoadA<D, kPipelined>(qf[kk], q_stage, w0, 16 * kk);
  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  OnlineSoftmax row;

  for (int it = 0; it < n_tiles; ++it) {
    const int j0 = it * kRows;
    const int stage = kPipelined ? it % 2 : 0;
    const bf16* ks = tiles + 2 * stage * kTile;  // (64, D+8) key tile
    const bf16* vs = ks + kTile;                 // (64, D+8) value tile
    // Pipelined: the next tile into the other stage; else this one into the only stage.
    bf16* const k_dst = kPipelined ? tiles + 2 * (1 - stage) * kTile : tiles;
    StepKeyValueTiles<D, kPipelined>(k_dst, k_dst + kTile, kh, vh, kvw, it, n_tiles, n_keys, hd);
    if (!warp_real || j0 > warp_last) continue;  // nothing visible to the warp's rows
    float sc[kRows / 8][4];
    ScoreTile<D, kPipelined>(sc, qf, ks);
    row.Step(sc, o, j0, pos0, n_keys, scale_log2);
    AccumulateScoresTimesRows<D>(o, sc, vs);
  }

  if (!warp_real) return;
  row.Write(out, lse, o, s, b, h, i0 + w0);
}

// The wide forward (AttentionKernels::kFlashWide): 128 query rows per block, 32 per warp as two
// 16-row m-tiles (mt = 0, 1: rows [w0 + 16mt, +16)), K/V double buffered as in the pipelined
// kernel. Why: with 16 rows per warp every K/V fragment read from shared memory feeds one
// m16n8k16 (256 bytes per product), more than shared memory can deliver at the tensor cores'
// rate; here each fragment feeds two. The queries stay in shared memory (both m-tiles' fragments
// in registers would not fit beside the two output accumulators) and are read per key tile with
// ldmatrix.x4: 192 bytes per product for S, 128 for P·V, against 256 and 256.
constexpr int kWideRows = 2 * kRows;  // 128 query rows per block
constexpr int kWideMTiles = 2;        // 16-row m-tiles per warp

// The queries (128 rows) and two stages of key + value tiles: 102 KiB at D = 128.
template <int D>
constexpr size_t WideForwardSmem() {
  return (2 + 4) * TileBytes<D>();
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    FlashForwardWideKernel(bf16* out,      // (batch, q_len, heads*head_dim)
                           float* lse,     // (batch, heads, q_len)
                           const bf16* q,  // (batch, q_len, ldq)
                           int ldq,
                           const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                           const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                           AttentionShape s, float scale_log2) {
  // WideForwardSmem: the (128, D+8) query rows, then stage st's key tile at 2 + 2·st and its
  // value tile at 3 + 2·st (in kTile units).
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * Ld<D>();
  bf16* const qs = reinterpret_cast<bf16*>(smem);
  bf16* const kv = qs + 2 * kTile;
  const int hd = s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const QueryTileRows mine(s, kWideRows, 16 * kWideMTiles);
  const int i0 = mine.i0, w0 = mine.w0, n_keys = mine.n_keys, warp_last = mine.warp_last;
  const bool warp_real = mine.warp_real;
  const int pos0 = mine.pos0;  // this lane's first row in m-tile 0; +16 in m-tile 1
  const int kvw = s.kv_width();
  const HeadRows rows_of = RowsOfHead(q, ldq, k, v, s, b, h);
  const bf16 *qh = rows_of.q, *kh = rows_of.k, *vh = rows_of.v;
  const int n_tiles = (n_keys + kRows - 1) / kRows;

  LoadTileAsync<D>(qs, qh, ldq, i0, q_len, hd);
  LoadTileAsync<D>(qs + kTile, qh, ldq, i0 + kRows, q_len, hd);
  LoadTileAsync<D>(kv, kh, kvw, 0, n_keys, hd);
  LoadTileAsync<D>(kv + kTile, vh, kvw, 0, n_keys, hd);
  CommitCopies();
  float o[kWideMTiles][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kWideMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
      o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
  }
  OnlineSoftmax rows[kWideMTiles];

  for (int it = 0; it < n_tiles; ++it) {
    const int j0 = it * kRows;
    const int stage = it % 2;
    const bf16* ks = kv + 2 * stage * kTile;  // (64, D+8) key tile
    const bf16* vs = ks + kTile;              // (64, D+8) value tile
    bf16* const next = kv + 2 * (1 - stage) * kTile;
    StepKeyValueTiles<D, true>(next, next + kTile, kh, vh, kvw, it, n_tiles, n_keys, hd);
    if (!warp_real || j0 > warp_last) continue;  // nothing visible to the warp's rows
    // S = Q·Kᵀ for both m-tiles: each key fragment pair feeds four products.
    float sc[kWideMTiles][kRows / 8][4];
#pragma unroll
    for (int mt = 0; mt < kWideMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kRows / 8; ++nt) {
        sc[mt][nt][0] = sc[mt][nt][1] = sc[mt][nt][2] = sc[mt][nt][3] = 0.0f;
      }
    }
#pragma unroll 1  // kk only moves the shared addresses: rolled, it needs fewer registers
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kWideMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kWideMTiles; ++mt) LoadA<D, true>(a[mt], qs, w0 + 16 * mt, 16 * kk);
#pragma unroll
      for (int nt = 0; nt < kRows / 8; nt += 2) {
        uint32_t bk[4];
        LoadBRowsPair<D>(bk, ks, 8 * nt, 16 * kk);
#pragma unroll
        for (int mt = 0; mt < kWideMTiles; ++mt) {
          Mma(sc[mt][nt], a[mt], bk[0], bk[1]);
          Mma(sc[mt][nt + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
    // The probabilities as bf16 A operands (keys [16kk, 16kk+16) in p[mt][kk]), packed before the
    // products so the fp32 scores are dead while the output accumulators are updated.
    uint32_t p[kWideMTiles][kRows / 16][4];
#pragma unroll
    for (int mt = 0; mt < kWideMTiles; ++mt) {
      rows[mt].Step(sc[mt], o[mt], j0, pos0 + 16 * mt, n_keys, scale_log2);
#pragma unroll
      for (int kk = 0; kk < kRows / 16; ++kk) {
        p[mt][kk][0] = Pack(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
        p[mt][kk][1] = Pack(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
        p[mt][kk][2] = Pack(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
        p[mt][kk][3] = Pack(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
      }
    }
    // O += P·V for both m-tiles: each value fragment pair feeds four products.
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < D / 16; ++n2) {
        uint32_t bv[4];
        LoadBTransposed(bv, vs + (16 * kk + lane % 16) * Ld<D>() + 16 * n2 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < kWideMTiles; ++mt) {
          Mma(o[mt][2 * n2], p[mt][kk], bv[0], bv[1]);
          Mma(o[mt][2 * n2 + 1], p[mt][kk], bv[2], bv[3]);
        }
      }
    }
  }

  WaitCopies<0>();  // none in flight at exit
  if (!warp_real) return;
#pragma unroll
  for (int mt = 0; mt < kWideMTiles; ++mt)
    rows[mt].Write(out, lse, o[mt], s, b, h, i0 + w0 + 16 * mt);
}

// Adds (or stores, accumulate = false) scale·acc of a warp's 16 rows [row0, row0+16) into dst
// (row stride ld) for rows < limit and columns < head_dim.
template <int D>
__device__ void WriteRows(bf16* dst, long ld, int row0, int limit, int head_dim,
                          const float (&acc)[D / 8][4], float scale, bool accumulate) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= limit) continue;
    bf16* r = dst + static_cast<long>(row) * ld;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = 8 * nt + 2 * t + e;
        if (d >= head_dim) continue;
        const float value = scale * acc[nt][2 * half + e];
        r[d] = __float2bfloat16(accumulate ? __bfloat162float(r[d]) + value : value);
      }
    }
  }
}

// Backward, dK/dV: one block per key tile of one key/value head (warp rows = keys). It streams
// the (query head of the group, query tile) pairs that see the tile, in order.
template <int D, bool kPipelined>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardKeyValueKernel(bf16* dk,            // (batch, kv_rows, kv_heads*head_dim)
                                bf16* dv,            // (batch, kv_rows, kv_heads*head_dim)
                                const bf16* dout,    // (batch, q_len, heads*head_dim)
                                const float* lse,    // (batch, heads, q_len)
                                const float* delta,  // (batch, heads, q_len)
                                const bf16* q,       // (batch, q_len, ldq)
                                int ldq,
                                const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                                const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                                AttentionShape s, float scale) {
  // BackwardSmem: keys, values, then per stage a query tile and a dout tile.
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * Ld<D>();
  bf16* const ks = reinterpret_cast<bf16*>(smem);       // (64, D+8) keys
  bf16* const vs = ks + kTile;                          // (64, D+8) values
  __shared__ float lse_s[2][kRows], delta_s[2][kRows];  // per stage, lse in log2 units
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = s.heads / s.num_kv_heads(), kvw = s.kv_width();
  const int j0 = blockIdx.x * kRows;  // first key; the first tiles are the busiest (causal)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int w0 = warp * 16;
  const int key0 = j0 + w0 + g, key1 = key0 + 8;  // this lane's two keys (rows of Sᵀ)
  const long kv_head = static_cast<long>(b) * s.kv_rows * kvw + kvh * hd;
  const float scale_log2 = scale * kLog2e;
  // Query row i sees key j0 iff q_begin + i >= j0; i_first < q_len as j0 < q_end (the grid).
  const int i_first = max(0, j0 - s.q_begin);
  const int per_head = (q_len - i_first + kRows - 1) / kRows;  // query tiles per head
  const int n_items = group * per_head;

  // Item `it` (query head kvh·group + it / per_head, tile i_first + (it % per_head)·kRows) into
  // stage `stage`: the query and dout tiles (asynchronously when pipelined), lse and delta.
  auto load_item = [&](int it, int stage) {
    const int h = kvh * group + it / per_head, i0 = i_first + (it % per_head) * kRows;
    bf16* qs = vs + (1 + 2 * stage) * kTile;
    LoadTileFor<D, kPipelined, 1>(qs, q + static_cast<long>(b) * q_len * ldq + h * hd, ldq, i0,
                                  q_len, hd);
    LoadTileFor<D, kPipelined, 1>(qs + kTile, dout + static_cast<long>(b) * q_len * width + h * hd,
                                  width, i0, q_len, hd);
    const long stats = (static_cast<long>(b) * s.heads + h) * q_len;
    for (int r = threadIdx.x; r < kRows; r += blockDim.x) {
      const int i = i0 + r;  // padding rows: P is masked to 0
      lse_s[stage][r] = i < q_len ? lse[stats + i] * kLog2e : 0.0f;
      delta_s[stage][r] = i < q_len ? delta[stats + i] : 0.0f;
    }
  };

  LoadTileFor<D, kPipelined>(ks, k + kv_head, kvw, j0, s.q_end, hd);
  LoadTileFor<D, kPipelined>(vs, v + kv_head, kvw, j0, s.q_end, hd);
  if constexpr (kPipelined) {
    if (n_items > 0) load_item(0, 0);
    CommitCopies();
  }
  float dk_acc[D / 8][4], dv_acc[D / 8][4];  // the warp's 16 keys × D, summed over the group
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[nt][e] = dv_acc[nt][e] = 0.0f;
  }

  for (int it = 0; it < n_items; ++it) {
    const int i0 = i_first + (it % per_head) * kRows;
    const int stage = kPipelined ? it % 2 : 0;
    // Orders the previous item's reads (on entry: K/V's loads) before the stage is refilled.
    __syncthreads();
    if constexpr (kPipelined) {
      if (it + 1 < n_items) {
        load_item(it + 1, 1 - stage);
        CommitCopies();
        WaitCopies<1>();
      } else {
        WaitCopies<0>();
      }
    } else {
      load_item(it, 0);
    }
    __syncthreads();
    const bf16* qs = vs + (1 + 2 * stage) * kTile;  // (64, D+8) query tile
    const bf16* dos = qs + kTile;                   // (64, D+8) dout tile
    const float* lse_t = lse_s[stage];
    const float* delta_t = delta_s[stage];
    const int last_query = s.q_begin + min(i0 + kRows, q_len) - 1;  // absolute
    if (j0 + w0 >= s.q_end || j0 + w0 > last_query) continue;       // the warp sees nothing
    float st[kRows / 8][4], dpt[kRows / 8][4];
    ScoreTile<D, kPipelined>(st, ks, w0, qs);    // Sᵀ = K·Qᵀ (16 keys × 64 queries)
    ScoreTile<D, kPipelined>(dpt, vs, w0, dos);  // dPᵀ = V·dOᵀ
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * nt + 2 * t + (e & 1), i = i0 + c;  // query (column)
        const int key = e < 2 ? key0 : key1;
        const bool visible = i < q_len && key < s.q_end && key <= s.q_begin + i;
        const float p = visible ? exp2f(st[nt][e] * scale_log2 - lse_t[c]) : 0.0f;
        st[nt][e] = p;                               // Pᵀ
        dpt[nt][e] = p * (dpt[nt][e] - delta_t[c]);  // dSᵀ
      }
    }
    AccumulateScoresTimesRows<D>(dv_acc, st, dos);  // dV += Pᵀ·dO
    AccumulateScoresTimesRows<D>(dk_acc, dpt, qs);  // dK += dSᵀ·Q
  }
  if constexpr (kPipelined) WaitCopies<0>();  // none in flight at exit, even with no items
  WriteRows<D>(dk + kv_head, kvw, j0 + w0, s.q_end, hd, dk_acc, scale, true);
  WriteRows<D>(dv + kv_head, kvw, j0 + w0, s.q_end, hd, dv_acc, 1.0f, true);
}

// Backward, dQ: one block per query tile of one head (warp rows = queries); streams the key
// tiles the query tile sees.
template <int D, bool kPipelined>
__global__ void __launch_bounds__(kThreads)
    FlashBackwardQueryKernel(bf16* dq,            // (batch, q_len, ldq)
                             const bf16* dout,    // (batch, q_len, heads*head_dim)
                             const float* lse,    // (batch, heads, q_len)
                             const float* delta,  // (batch, heads, q_len)
                             const bf16* q,       // (batch, q_len, ldq)
                             int ldq,
                             const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                             const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                             AttentionShape s, float scale) {
  // BackwardSmem: queries, dout rows, then per stage a key tile and a value tile.
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * Ld<D>();
  bf16* const qs = reinterpret_cast<bf16*>(smem);  // (64, D+8) queries
  bf16* const dos = qs + kTile;                    // (64, D+8) dout rows
  const int hd = s.head_dim, width = s.heads * s.head_dim, q_len = s.q_end - s.q_begin;
  const int h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const QueryTileRows mine(s, kRows, 16);
  const int i0 = mine.i0, w0 = mine.w0, n_keys = mine.n_keys, warp_last = mine.warp_last;
  const bool warp_real = mine.warp_real;
  const int pos0 = mine.pos0, pos1 = pos0 + 8;
  const bf16* doh = dout + static_cast<long>(b) * q_len * width + h * hd;
  const int kvw = s.kv_width();
  const HeadRows rows_of = RowsOfHead(q, ldq, k, v, s, b, h);
  const bf16 *qh = rows_of.q, *kh = rows_of.k, *vh = rows_of.v;
  const float scale_log2 = scale * kLog2e;
  // This lane's two rows' statistics (padding rows: 0, their P is masked).
  const long stat = (static_cast<long>(b) * s.heads + h) * q_len + i0 + w0 + g;
  const bool real0 = i0 + w0 + g < q_len, real1 = i0 + w0 + g + 8 < q_len;
  const float lse0 = real0 ? lse[stat] * kLog2e : 0.0f,
              lse1 = real1 ? lse[stat + 8] * kLog2e : 0.0f;
  const float delta0 = real0 ? delta[stat] : 0.0f, delta1 = real1 ? delta[stat + 8] : 0.0f;

  const int n_tiles = (n_keys + kRows - 1) / kRows;

  LoadTileFor<D, kPipelined>(qs, qh, ldq, i0, q_len, hd);
  LoadTileFor<D, kPipelined>(dos, doh, width, i0, q_len, hd);
  if constexpr (kPipelined) {
    LoadTileAsync<D>(dos + kTile, kh, kvw, 0, n_keys, hd);
    LoadTileAsync<D>(dos + 2 * kTile, vh, kvw, 0, n_keys, hd);
    CommitCopies();
  }
  float dq_acc[D / 8][4];  // the warp's 16 queries × D
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
    dq_acc[nt][0] = dq_acc[nt][1] = dq_acc[nt][2] = dq_acc[nt][3] = 0.0f;
  // Pipelined at D = 128: the warp's query and dout rows as A operands, read from shared memory
  // once (after the first tile's wait) instead of once per key tile. The 64 registers are free
  // there (246 in all: 2 blocks per SM, as shared memory already allows); at D = 64 they would
  // cost a block per SM.
  constexpr bool kRowsInRegisters = kPipelined && D == 128;
  uint32_t qf[kRowsInRegisters ? D / 16 : 1][4], dof[kRowsInRegisters ? D / 16 : 1][4];

  for (int it = 0; it < n_tiles; ++it) {
    const int j0 = it * kRows;
    const int stage = kPipelined ? it % 2 : 0;
    bf16* const ks = dos + (1 + 2 * stage) * kTile;  // (64, D+8) key tile
    bf16* const vs = ks + kTile;                     // (64, D+8) value tile
    // Pipelined: the next tile into the other stage; else this one into the only stage.
    bf16* const k_dst = kPipelined ? dos + (1 + 2 * (1 - stage)) * kTile : ks;
    StepKeyValueTiles<D, kPipelined, 1>(k_dst, k_dst + kTile, kh, vh, kvw, it, n_tiles, n_keys, hd);
    if constexpr (kRowsInRegisters) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          LoadA<D, true>(qf[kk], qs, w0, 16 * kk);
          LoadA<D, true>(dof[kk], dos, w0, 16 * kk);
        }
      }
    }
    if (!warp_real || j0 > warp_last) continue;
    float sc[kRows / 8][4], dp[kRows / 8][4];
    if constexpr (kRowsInRegisters) {
      ScoreTile<D, true>(sc, qf, ks);   // S = Q·Kᵀ
      ScoreTile<D, true>(dp, dof, vs);  // dP = dO·Vᵀ
    } else {
      ScoreTile<D, kPipelined>(sc, qs, w0, ks);
      ScoreTile<D, kPipelined>(dp, dos, w0, vs);
    }
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + 8 * nt + 2 * t + (e & 1);
        const bool lower = e < 2;
        const bool visible =
            (lower ? real0 : real1) && key <= (lower ? pos0 : pos1) && key < n_keys;
        const float p = visible ? exp2f(sc[nt][e] * scale_log2 - (lower ? lse0 : lse1)) : 0.0f;
        sc[nt][e] = p * (dp[nt][e] - (lower ? delta0 : delta1));  // dS
      }
    }
    AccumulateScoresTimesRows<D>(dq_acc, sc, ks);  // dQ += dS·K
  }
  if (!warp_real) return;
  WriteRows<D>(dq + static_cast<long>(b) * q_len * ldq + h * hd, ldq, i0 + w0, q_len, hd, dq_acc,
               scale, false);
}

// Both backward kernels: 4 bf16 tiles, 68 KiB at D = 128 (opt-in above the 48 KiB default); 6
// when pipelined (102 KiB).
template <int D>
constexpr size_t BackwardSmem(bool pipelined) {
  return (pipelined ? 6 : 4) * TileBytes<D>();
}

template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

float Scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

template <int D, bool kPipelined>
cudaError_t LaunchForward(bf16* out, float* lse, const bf16* q, int ldq, const bf16* k,
                          const bf16* v, const AttentionShape& s, cudaStream_t stream) {
  constexpr size_t smem = ForwardSmem<D>(kPipelined);
  if (cudaError_t e = AllowSharedMemory(FlashForwardKernel<D, kPipelined>, smem);
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(CeilDiv(s.q_len(), kRows), s.heads, s.batch);
  FlashForwardKernel<D, kPipelined>
      <<<grid, kThreads, smem, stream>>>(out, lse, q, ldq, k, v, s, Scale(s) * kLog2e);
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchForwardWide(bf16* out, float* lse, const bf16* q, int ldq, const bf16* k,
                              const bf16* v, const AttentionShape& s, cudaStream_t stream) {
  constexpr size_t smem = WideForwardSmem<D>();
  if (cudaError_t e = AllowSharedMemory(FlashForwardWideKernel<D>, smem); e != cudaSuccess) {
    return e;
  }
  const dim3 grid(CeilDiv(s.q_len(), kWideRows), s.heads, s.batch);
  FlashForwardWideKernel<D>
      <<<grid, kThreads, smem, stream>>>(out, lse, q, ldq, k, v, s, Scale(s) * kLog2e);
  return cudaGetLastError();
}

template <int D, bool kPipelined>
cudaError_t LaunchBackward(bf16* dq, bf16* dk, bf16* dv, const float* delta, const bf16* dout,
                           const float* lse, const bf16* q, int ldq, const bf16* k, const bf16* v,
                           const AttentionShape& s, cudaStream_t stream) {
  constexpr size_t smem = BackwardSmem<D>(kPipelined);
  if (cudaError_t e = AllowSharedMemory(FlashBackwardKeyValueKernel<D, kPipelined>, smem);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = AllowSharedMemory(FlashBackwardQueryKernel<D, kPipelined>, smem);
      e != cudaSuccess) {
    return e;
  }
  FlashBackwardKeyValueKernel<D, kPipelined>
      <<<dim3(CeilDiv(s.q_end, kRows), s.num_kv_heads(), s.batch), kThreads, smem, stream>>>(
          dk, dv, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  FlashBackwardQueryKernel<D, kPipelined>
      <<<dim3(CeilDiv(s.q_len(), kRows), s.heads, s.batch), kThreads, smem, stream>>>(
          dq, dout, lse, delta, q, ldq, k, v, s, Scale(s));
  return cudaGetLastError();
}

}  // namespace

cudaError_t AttentionForwardFlash(bf16* out, float* lse, const bf16* q, int ldq, const bf16* k,
                                  const bf16* v, const AttentionShape& shape, cudaStream_t stream,
                                  FlashForm form) {
  if (form == FlashForm::kWide) {
    return shape.head_dim <= 64 ? LaunchForwardWide<64>(out, lse, q, ldq, k, v, shape, stream)
                                : LaunchForwardWide<128>(out, lse, q, ldq, k, v, shape, stream);
  }
  const bool pipelined = form == FlashForm::kPipelined;
  if (shape.head_dim <= 64) {
    return pipelined ? LaunchForward<64, true>(out, lse, q, ldq, k, v, shape, stream)
                     : LaunchForward<64, false>(out, lse, q, ldq, k, v, shape, stream);
  }
  return pipelined ? LaunchForward<128, true>(out, lse, q, ldq, k, v, shape, stream)
                   : LaunchForward<128, false>(out, lse, q, ldq, k, v, shape, stream);
}

cudaError_t AttentionBackwardFlash(bf16* dq, bf16* dk, bf16* dv, const float* delta,
                                   const bf16* dout, const float* lse, const bf16* q, int ldq,
                                   const bf16* k, const bf16* v, const AttentionShape& shape,
                                   cudaStream_t stream, FlashForm form) {
  const bool pipelined = form != FlashForm::kSynchronous;  // the wide form's backward too
  if (shape.head_dim <= 64) {
    return pipelined
               ? LaunchBackward<64, true>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream)
               : LaunchBackward<64, false>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape,
                                           stream);
  }
  return pipelined
             ? LaunchBackward<128, true>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape, stream)
             : LaunchBackward<128, false>(dq, dk, dv, delta, dout, lse, q, ldq, k, v, shape,
                                          stream);
}

}  // namespace vp::engine::cuda
