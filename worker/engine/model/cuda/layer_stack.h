// A pipeline stage's transformer layers [first, first+count) on a CUDA device: the same passes,
// order rules and error messages as the CPU LayerStack (worker/engine/transformer.h) — F per
// (microbatch, sequence chunk) slot with a per-layer key/value cache across a microbatch's
// chunks, B (input gradient) in reverse chunk order accumulating dK/dV, W (parameter gradients)
// after B — with T = float (matches the CPU engine to rounding) or bf16 parameters and
// activations. Weight gradients are fp32 and accumulate across slots.
//
// Parameters are read from `params` (T, count·LayerParamCount(cfg) elements, layer-major in the
// CPU engine's layout and tensor order); gradients go to `grads` (fp32, same layout). Both are
// owned by the caller (the device rank model). Activations come from ctx.alloc and are charged
// to kActivations while live. Every public pass returns after Finish(ctx) (device.h).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/model/cuda/device.h"
#include "worker/engine/transformer.h"

namespace vp::engine::cuda {

template <typename T>
class DeviceLayerStack {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceLayerStack>> Create(
      const ModelConfig& cfg, int first_layer, int count, int microbatch_size,
      std::vector<int> chunk_bounds, const T* params, float* grads, const DeviceContext& ctx);
  ~DeviceLayerStack();

  int first_layer() const;
  int count() const;
  int num_chunks() const;
  SeqChunk chunk(int q) const;
  int live_slots() const;  // forwarded and not yet released by W

  // F of a slot: x and out (b, chunk_len, h) on the device. Chunks of a microbatch in order.
  absl::Status Forward(SlotKey slot, const T* x, T* out);
  // B of a slot: dout, dx (b, chunk_len, h); dx overwritten. Needs all k chunks forwarded;
  // chunks in reverse order.
  absl::Status BackwardInput(SlotKey slot, const T* dout, T* dx);
  // W of a slot, after its B: accumulates parameter gradients (fp32), frees the slot.
  absl::Status BackwardWeight(SlotKey slot);
  // B followed by W.
  absl::Status Backward(SlotKey slot, const T* dout, T* dx);

  struct Impl;  // defined in the .cc
  explicit DeviceLayerStack(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

extern template class DeviceLayerStack<float>;
extern template class DeviceLayerStack<bf16>;

}  // namespace vp::engine::cuda
