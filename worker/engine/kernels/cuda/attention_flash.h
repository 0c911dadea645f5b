// The mma.sync flash attention kernels (attention_flash.cu), bf16 only, behind AttentionForward /
// AttentionBackward (kernels.h) with AttentionKernels::kFlash (VOCABPIPE_ATTENTION=flash) or, with
// FlashForm::kPipelined, kFlashPipelined (VOCABPIPE_ATTENTION=flash-pipelined: double-buffered
// cp.async tile loads and ldmatrix operands) or FlashForm::kWide, kFlashWide
// (VOCABPIPE_ATTENTION=flash-wide: 32 query rows per warp in the forward), which check the shape
// and compute delta first. Internal to the CUDA kernels.
#pragma once

#include <cuda_runtime_api.h>

#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {

// Which form of the flash kernels: kSynchronous (kFlash: each tile loaded, then computed on),
// kPipelined (kFlashPipelined: the next tile copied by cp.async while the warps compute on this
// one, ldmatrix operands), kWide (kFlashWide: the pipelined backward and a forward of 128 query
// rows per block, 32 per warp, so every key/value fragment feeds two products).
enum class FlashForm { kSynchronous, kPipelined, kWide };

// The shape is valid (AttentionForward checked it).
cudaError_t AttentionForwardFlash(bf16* out,      // (batch, q_len, heads*head_dim)
                                  float* lse,     // (batch, heads, q_len)
                                  const bf16* q,  // (batch, q_len, ldq)
                                  int ldq,
                                  const bf16* k,  // (batch, kv_rows, kv_heads*head_dim)
                                  const bf16* v,  // (batch, kv_rows, kv_heads*head_dim)
                                  const AttentionShape& shape, cudaStream_t stream, FlashForm form);

// delta (Σ_d dout·out per row) already computed; dq overwritten, dk/dv accumulated.
cudaError_t AttentionBackwardFlash(bf16* dq,            // (batch, q_len, ldq)
                                   bf16* dk,            // (batch, kv_rows, kv_width)
                                   bf16* dv,            // (batch, kv_rows, kv_width)
                                   const float* delta,  // (batch, heads, q_len)
                                   const bf16* dout,    // (batch, q_len, heads*head_dim)
                                   const float* lse,    // (batch, heads, q_len)
                                   const bf16* q,       // (batch, q_len, ldq)
                                   int ldq,
                                   const bf16* k,  // (batch, kv_rows, kv_width)
                                   const bf16* v,  // (batch, kv_rows, kv_width)
                                   const AttentionShape& shape, cudaStream_t stream,
                                   FlashForm form);

}  // namespace vp::engine::cuda
