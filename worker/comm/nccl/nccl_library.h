// NCCL, opened when the first communicator connects instead of when the process starts, for the
// same reason as cuBLASLt (worker/engine/kernels/cuda/cublaslt_library.h): a CPU job of a
// CUDA-enabled build must not map the GPU vendor libraries. The functions keep their names:
//
//   absl::StatusOr<const Nccl*> nccl = LoadNccl();
//   (*nccl)->ncclGetUniqueId(&id);
//
// Where it is looked for: its soname (VP_NCCL_SONAME, read from the library this build linked
// against at configure time), then the file this build found (VP_NCCL_PATH).
#pragma once

#include <nccl.h>

#include <string>

#include "absl/status/statusor.h"
#include "worker/sharedlib/shared_library.h"

namespace vp::comm {

// Every NCCL function the communicator calls: add one here before calling it.
// clang-format off
#define VP_NCCL_FUNCTIONS(X) \
  X(ncclGetUniqueId) \
  X(ncclCommInitRankConfig) \
  X(ncclCommSplit) \
  X(ncclCommCount) \
  X(ncclCommUserRank) \
  X(ncclCommFinalize) \
  X(ncclCommDestroy) \
  X(ncclCommAbort) \
  X(ncclCommGetAsyncError) \
  X(ncclGetErrorString) \
  X(ncclGroupStart) \
  X(ncclGroupEnd) \
  X(ncclAllReduce) \
  X(ncclBroadcast) \
  X(ncclReduce) \
  X(ncclSend) \
  X(ncclRecv)
// clang-format on

struct Nccl {
  VP_NCCL_FUNCTIONS(VP_SHAREDLIB_FUNCTION)
  std::string library;  // the name it was opened by
};

// Opened once per process, on the first call; every later call returns the same table (or the
// same error: NotFound naming the library, or the first function it lacks).
absl::StatusOr<const Nccl*> LoadNccl();

}  // namespace vp::comm
