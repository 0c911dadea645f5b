// Small kernels of the device rank model that sit between its layers (not part of any layer's
// contract): the first stage's chunk embedding and the optimizer's gradient norm.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {

// x[b, t, :] = T(emb[b, start + t, :] + wpe[start + t, :]) for t < len: one sequence chunk of
// the fp32 embedding output (summed over the vocabulary shards) plus its position embeddings,
// rounded once to T. wpe null (Llama, rotary positions inside the layers): the embedding alone.
template <typename T>
cudaError_t EmbedSeqChunkForward(T* x,              // (batch, len, h)
                                 const float* emb,  // (batch, s, h)
                                 const T* wpe,      // (>= start + len, h) or null
                                 int batch, int s, int len, int h, int start, cudaStream_t stream);

// Σ g² of `count` fp32 values in fp64: `blocks` partial sums written to partial[0..blocks)
// (summed on the host in a fixed order, so the norm is deterministic).
inline constexpr int kSquaredNormBlocks = 256;
cudaError_t SquaredNormPartials(double* partial,  // (kSquaredNormBlocks)
                                const float* g,   // (count)
                                size_t count, cudaStream_t stream);

}  // namespace vp::engine::cuda
