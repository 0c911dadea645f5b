// The 16-byte LayerNorm and RMSNorm kernels (norm_vector.cu), behind the LayerNorm* and RmsNorm*
// functions of kernels.h with MemoryKernels::kVector (VOCABPIPE_MEMORY_KERNELS=vector). Internal
// to the CUDA kernels: each returns cudaErrorNotSupported, launching nothing, where the shape or a
// pointer does not allow 16-byte accesses (the caller then runs the element kernels).
#pragma once

#include <cuda_runtime_api.h>

#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {

// mean == nullptr and bias == nullptr: RMSNorm (x̂ = x·rstd, eps the caller's); else LayerNorm.
template <typename T>
cudaError_t NormForwardVector(T* out,           // (n, c)
                              float* mean,      // (n) or nullptr (RMSNorm)
                              float* rstd,      // (n)
                              const T* inp,     // (n, c)
                              const T* weight,  // (c)
                              const T* bias,    // (c) or nullptr (RMSNorm)
                              int n, int c, float eps, cudaStream_t stream);

// dinp = skip + the input gradient (mean == nullptr: RMSNorm's); skip may be dinp.
template <typename T>
cudaError_t NormBackwardInputVector(T* dinp,            // (n, c)
                                    const T* skip,      // (n, c)
                                    const T* dout,      // (n, c)
                                    const T* inp,       // (n, c)
                                    const T* weight,    // (c)
                                    const float* mean,  // (n) or nullptr (RMSNorm)
                                    const float* rstd,  // (n)
                                    int n, int c, cudaStream_t stream);

// dweight += Σ_rows dout·x̂ and, for LayerNorm (dbias != nullptr), dbias += Σ_rows dout.
template <typename T>
cudaError_t NormBackwardWeightVector(float* dweight,     // (c)
                                     float* dbias,       // (c) or nullptr (RMSNorm)
                                     const T* dout,      // (n, c)
                                     const T* inp,       // (n, c)
                                     const float* mean,  // (n) or nullptr (RMSNorm)
                                     const float* rstd,  // (n)
                                     int n, int c, cudaStream_t stream);

}  // namespace vp::engine::cuda
