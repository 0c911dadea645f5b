// Polling a CUDA stream without leaving an error behind.
//
// cudaStreamQuery returns cudaErrorNotReady while work is still queued. That is a state, not a
// failure, but the runtime may also record it as the calling thread's last error; every kernel
// wrapper of the engine returns cudaGetLastError() after its launch, so the next launch on the
// polling thread (the communication thread runs the vocabulary barriers' kernels) would report
// a NotReady "launch failure". QueryStream clears it.
#pragma once

#include <cuda_runtime_api.h>

namespace vp::comm {

// cudaSuccess when the stream is idle, cudaErrorNotReady while work is queued (the thread's
// last error is reset to cudaSuccess), any other value is the stream's error.
inline cudaError_t QueryStream(cudaStream_t stream) {
  const cudaError_t q = cudaStreamQuery(stream);
  if (q == cudaErrorNotReady) (void)cudaGetLastError();
  return q;
}

}  // namespace vp::comm
