// CUDA and cuBLAS error codes as absl::Status, with the failing expression and file:line.
//
//   VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...));
//   VP_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(...));
//
// Mapping: out of memory → ResourceExhausted; no device / driver too old → FailedPrecondition;
// invalid value or configuration → InvalidArgument; everything else → Internal (a sticky
// device error such as an illegal address makes the context unusable; the caller must stop).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace vp::engine::cuda {

absl::Status CudaStatus(cudaError_t error, const char* expr, const char* file, int line);
absl::Status CublasStatus(cublasStatus_t status, const char* expr, const char* file, int line);

}  // namespace vp::engine::cuda

#define VP_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                  \
    const cudaError_t vp_cuda_error_ = (expr);                                          \
    if (vp_cuda_error_ != cudaSuccess) {                                                \
      return ::vp::engine::cuda::CudaStatus(vp_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)

#define VP_CUBLAS_RETURN_IF_ERROR(expr)                                                      \
  do {                                                                                       \
    const cublasStatus_t vp_cublas_status_ = (expr);                                         \
    if (vp_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                        \
      return ::vp::engine::cuda::CublasStatus(vp_cublas_status_, #expr, __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)
