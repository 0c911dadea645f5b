// cuDNN's fused flash attention, through its graph ("backend") API, in place of the project's
// bf16 attention kernels (VOCABPIPE_ATTENTION=cudnn; opt-in until it has passed and been timed
// on a GPU). Same inputs, outputs and rules as AttentionForward/Backward (kernels.h): causal,
// scale 1/√head_dim, grouped-query attention, q inside the fused q|k|v rows (row stride ldq),
// lse the natural-log log-sum-exp of each row's scaled scores — so a cuDNN forward and a kernel
// backward (or the reverse) agree, and a shape cuDNN does not cover runs on the kernels.
//
// Why a library: the project's flash kernels reached 6-8% of the H100's bf16 peak in run 4 (the
// GEMMs ~70%) and attention was 40% of GPT-2's layer forward; cuDNN's fused kernels are the ones
// PyTorch's scaled_dot_product_attention picks on Hopper.
//
// Letters: b batch, hq query heads, hk key/value heads (hq when not grouped), sq the chunk's
// query rows (q_len), skv the key rows they see (q_end), d head_dim, w = hq·d, kvw = hk·d.
//
// The graphs are the published composition of cuDNN's SDPA (matmul, scale, causal mask from
// generated row/column indices, softmax with its statistics, matmul; the backward's dV = Pᵀ·dO,
// dP = dO·Vᵀ, dS = P·(dP − Σ dO·O), dK = dSᵀ·Q, dQ = dS·K accumulated in fp32), written here
// against the backend descriptors so no C++ frontend is needed. cuDNN's fusion engines then
// compile one kernel per graph (NVRTC at first use: the first call of a shape takes longer).
//
// What it covers (else the kernels run): bf16; head_dim a multiple of 8 up to 128; q and the
// row strides 16-byte aligned; whole sequences and Seq1F1B's chunks, forward and backward. A
// chunk's queries [q_begin, q_end) see keys [0, q_end): the causal diagonal is aligned to the
// bottom right of its (q_len × q_end) scores — row i sees columns j ≤ i + q_begin — which the
// mask forms as row + q_end − q_len ≥ column, as cuDNN's frontend does (cuDNN before 9.6 runs
// that mask only on lengths that are multiples of 64: other chunks go to the kernels there).
// dK/dV: a whole sequence's are written in place, which equals the kernels' accumulation
// because its backward is the first and only one to touch its zeroed dK/dV rows (the layers zero
// them: transformer.cc); a chunk's are written to the workspace and added to rows [0, q_end)
// (an earlier-run later chunk's contribution is kept, as the kernels keep it). dQ's fp32
// accumulation may use atomics: unlike the kernels, the backward is not bit-for-bit
// deterministic. Version quirks, as cuDNN's frontend handles them: 9.10.0/9.10.1 refused; up to
// 9.15 a backward whose key length is no multiple of 128 gets a padding mask and M/N/K overrides
// (the lengths equal the dims; before 9.10 the mask twice), the frontend's workaround for those
// versions' kernels; a backward of one query on one key, and up to 9.9 a forward of one query
// row, which the frontend refuses, run on the kernels. A shape these rules cover but for which
// cuDNN finds no engine on the GPU at hand (planning returns Unimplemented) also runs on the
// kernels, through RunAttentionForward/Backward: see refused_shapes().
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {

struct Cudnn;

class CudnnAttention {
 public:
  // Loads cuDNN (cudnn_library.h) and creates its handle on the current device; the workspace
  // (cuDNN's own, plus the backward's fp32 dQ, 4·b·sq·w bytes, and a chunk's dK/dV, 4·b·skv·kvw)
  // comes from `workspace_alloc`, charged to kActivations and kept between calls. NotFound /
  // Unavailable when the library or this build's cuDNN headers are missing, or the library is a
  // version whose bf16 attention cuDNN itself lists as broken (9.10.0 and 9.10.1).
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(CachingAllocator* workspace_alloc);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Whether Forward / Backward run `shape` with q rows ldq elements apart on cuDNN `version`
  // (cudnnGetVersion(), e.g. 91900; the rules above).
  static bool CoversForward(const AttentionShape& shape, int ldq, int64_t version);
  static bool CoversBackward(const AttentionShape& shape, int ldq, int64_t version);

  // AttentionForward's contract on ctx.stream, for a covered shape (InvalidArgument otherwise).
  absl::Status Forward(const DeviceContext& ctx,
                       bf16* out,               // (b, sq, w)
                       float* lse,              // (b, hq, sq)
                       const bf16* q, int ldq,  // (b, sq, ldq), q in columns [0, w)
                       const bf16* k,           // (b, kv_rows, kvw)
                       const bf16* v,           // (b, kv_rows, kvw)
                       const AttentionShape& shape);
  // AttentionBackward's contract: dq's q columns written; dk and dv written over rows [0, skv)
  // for a whole sequence (zero before: see above), added to them for a chunk; delta holds
  // Σ_d dO·O per row after.
  absl::Status Backward(const DeviceContext& ctx,
                        bf16* dq,          // (b, sq, ldq)
                        bf16* dk,          // (b, kv_rows, kvw)
                        bf16* dv,          // (b, kv_rows, kvw)
                        float* delta,      // (b, hq, sq) scratch
                        const bf16* dout,  // (b, sq, w)
                        const bf16* out,   // (b, sq, w)
                        const float* lse,  // (b, hq, sq)
                        const bf16* q, int ldq, const bf16* k, const bf16* v,
                        const AttentionShape& shape);

  // Device-free: builds and finalizes every tensor and operation descriptor of both graphs for
  // `shape`, checks their wiring and finalizes each operation graph without a handle (all but the
  // engine and plan, which need a GPU), so a wrong attribute or a dangling tensor shows without a
  // device; with cuDNN's API log on, the graphs are printed as JSON (compare_cudnn_graphs.py holds
  // them to cuDNN's own frontend's). `as_version` > 0 builds them as for that cuDNN version (the
  // backward's padding workaround up to 9.15), else as for the loaded one. Errors as Create.
  static absl::Status CheckDescriptors(const AttentionShape& shape, int ldq,
                                       int64_t as_version = 0);

  // cudnnGetVersion() of the loaded library, e.g. 91900 for 9.19.0.
  int64_t version() const { return version_; }

  // Shapes the static rules cover but for which cuDNN found no engine on this GPU (planning
  // returned Unimplemented: an architecture or version its kernels do not support, NVRTC
  // missing). Forward/Backward return Unimplemented for them, RunAttentionForward/Backward run
  // them on the kernels instead; each is tried once, and counted here so a test or benchmark
  // can tell cuDNN's numbers from the fallback's.
  int refused_shapes() const { return refused_shapes_; }
  const std::string& last_refusal() const { return last_refusal_; }

  // A finalized execution plan and what its variant pack needs (defined and used in the .cc
  // only; public so the .cc's graph builder can fill one).
  struct Plan;

 private:
  CudnnAttention(const Cudnn* dnn, int64_t version, CachingAllocator* alloc);
  absl::StatusOr<const Plan*> PlanFor(const DeviceContext& ctx, bool backward,
                                      const AttentionShape& shape, int ldq);
  // Device memory of at least `bytes` for ctx.stream, kept between calls (one stream: reuse is
  // ordered by the stream).
  absl::StatusOr<void*> Workspace(const DeviceContext& ctx, int64_t bytes);

  const Cudnn* dnn_;
  void* handle_ = nullptr;  // cudnnHandle_t (void*: this header needs no cuDNN headers)
  int64_t version_;
  CachingAllocator* alloc_;
  // Keyed by (backward, b, hq, hk, sq, skv, d, ldq, kv_rows): sq < skv is a chunk. A null plan
  // is a shape cuDNN refused.
  std::map<std::array<int64_t, 9>, std::unique_ptr<Plan>> plans_;
  int refused_shapes_ = 0;
  std::string last_refusal_;
  DeviceArray<uint8_t> workspace_;
};

// The runner a context gets: cuDNN's attention when VOCABPIPE_ATTENTION=cudnn — an error naming
// the variable if cuDNN cannot be opened, since the operator asked for it — else none (null: the
// attention kernels). The one place the engine, cuda_bench and the layer tests decide it.
absl::StatusOr<std::unique_ptr<CudnnAttention>> ChosenCudnnAttention(
    CachingAllocator* workspace_alloc);

// The attention of a layer on ctx.stream: cuDNN where ctx.attention is set and covers the shape
// (bf16 only), else AttentionForward / AttentionBackward with the default kernels.
template <typename T>
absl::Status RunAttentionForward(const DeviceContext& ctx, T* out, float* lse, const T* q, int ldq,
                                 const T* k, const T* v, const AttentionShape& shape);
template <typename T>
absl::Status RunAttentionBackward(const DeviceContext& ctx, T* dq, T* dk, T* dv, float* delta,
                                  const T* dout, const T* out, const float* lse, const T* q,
                                  int ldq, const T* k, const T* v, const AttentionShape& shape);

}  // namespace vp::engine::cuda
