// cuBLASLt, opened when the first GemmRunner is created instead of when the process starts.
//
// Loading libcublasLt makes a process ~150 MiB resident before it runs a single GEMM (measured:
// a program that only dlopens it, 149 MiB RSS); linked normally, a CUDA-enabled build charged
// that to every CPU rank, CLI call and daemon. Opened here on first use, a CPU job of the same
// binary never maps it (docs/benchmarks.md §13). The functions keep their cuBLASLt names:
//
//   absl::StatusOr<const CublasLt*> lt = LoadCublasLt();
//   (*lt)->cublasLtCreate(&handle);
//
// Where it is looked for: its soname (VP_CUBLASLT_SONAME, read from the library this build
// linked against at configure time; LD_LIBRARY_PATH, the loader cache and default folders),
// then the file this build found (VP_CUBLASLT_PATH).
#pragma once

#include <cublasLt.h>

#include <string>

#include "absl/status/statusor.h"
#include "worker/sharedlib/shared_library.h"

namespace vp::engine::cuda {

// Every cuBLASLt function the CUDA engine calls: add one here before calling it.
// clang-format off
#define VP_CUBLASLT_FUNCTIONS(X) \
  X(cublasLtCreate) \
  X(cublasLtDestroy) \
  X(cublasLtMatmul) \
  X(cublasLtMatmulAlgoGetHeuristic) \
  X(cublasLtMatmulDescCreate) \
  X(cublasLtMatmulDescDestroy) \
  X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatrixLayoutCreate) \
  X(cublasLtMatrixLayoutDestroy) \
  X(cublasLtMatmulPreferenceCreate) \
  X(cublasLtMatmulPreferenceDestroy) \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtGetStatusName) \
  X(cublasLtGetStatusString)
// clang-format on

struct CublasLt {
  VP_CUBLASLT_FUNCTIONS(VP_SHAREDLIB_FUNCTION)
  std::string library;  // the name it was opened by
};

// Opened once per process, on the first call; every later call returns the same table (or the
// same error: NotFound naming the library, or the first function it lacks).
absl::StatusOr<const CublasLt*> LoadCublasLt();

}  // namespace vp::engine::cuda
