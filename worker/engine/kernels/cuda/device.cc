#include "worker/engine/kernels/cuda/device.h"

#include <cstdint>

#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/phase_timer.h"

namespace vp::engine::cuda {

absl::Status Finish(const DeviceContext& ctx) {
  MarkPhase(ctx.stream, Phase::kIdle);  // cuda_bench's breakdown: the stream waits from here
  VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
  if (ctx.alloc != nullptr) ctx.alloc->ReleasePending();
  return absl::OkStatus();
}

template <typename E>
absl::StatusOr<DeviceArray<E>> DeviceArray<E>::Create(const DeviceContext& ctx,
                                                      MemoryCategory category, size_t count,
                                                      bool zero) {
  if (count == 0) return DeviceArray();
  absl::StatusOr<DeviceBuffer> buf = ctx.alloc->Allocate(category, count * sizeof(E), ctx.stream);
  if (!buf.ok()) return buf.status();
  if (zero) VP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(buf->data(), 0, count * sizeof(E), ctx.stream));
  return DeviceArray(std::move(*buf), count);
}

template class DeviceArray<float>;
template class DeviceArray<bf16>;
template class DeviceArray<int32_t>;
template class DeviceArray<uint8_t>;
template class DeviceArray<double>;

}  // namespace vp::engine::cuda
