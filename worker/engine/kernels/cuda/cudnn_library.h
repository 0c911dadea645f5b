// cuDNN, opened when the first CudnnAttention is created (VOCABPIPE_ATTENTION=cudnn), never at
// process start: like cuBLASLt (cublaslt_library.h), the library is costly to load and a CPU
// job or a run on the project's own attention kernels must not map it. Only the graph ("backend")
// API is used — descriptors, a finalized execution plan and one execute call:
//
//   absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
//   (*dnn)->cudnnBackendCreateDescriptor(CUDNN_BACKEND_TENSOR_DESCRIPTOR, &desc);
//
// Where it is looked for: its soname (VP_CUDNN_SONAME, read from the library this build found at
// configure time; LD_LIBRARY_PATH, the loader cache and default folders), then that file
// (VP_CUDNN_PATH). Builds without cuDNN's headers (VP_HAVE_CUDNN unset) have no table; LoadCudnn
// then returns Unavailable.
#pragma once

#if VP_HAVE_CUDNN
#include <cudnn_graph.h>
#endif

#include <string>

#include "absl/status/statusor.h"
#include "worker/sharedlib/shared_library.h"

namespace vp::engine::cuda {

#if VP_HAVE_CUDNN
// Every cuDNN function the CUDA engine calls: add one here before calling it.
// clang-format off
#define VP_CUDNN_FUNCTIONS(X) \
  X(cudnnGetVersion) \
  X(cudnnGetErrorString) \
  X(cudnnGetLastErrorString) \
  X(cudnnCreate) \
  X(cudnnDestroy) \
  X(cudnnSetStream) \
  X(cudnnBackendCreateDescriptor) \
  X(cudnnBackendDestroyDescriptor) \
  X(cudnnBackendSetAttribute) \
  X(cudnnBackendGetAttribute) \
  X(cudnnBackendFinalize) \
  X(cudnnBackendExecute)
// clang-format on

struct Cudnn {
  VP_CUDNN_FUNCTIONS(VP_SHAREDLIB_FUNCTION)
  std::string library;  // the name it was opened by
};
#else
struct Cudnn {
  std::string library;
};
#endif

// Opened once per process, on the first call; every later call returns the same table (or the
// same error: NotFound naming the library or the first function it lacks, Unavailable in a
// build without cuDNN's headers).
absl::StatusOr<const Cudnn*> LoadCudnn();

}  // namespace vp::engine::cuda
