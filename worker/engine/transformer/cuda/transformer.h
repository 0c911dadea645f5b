// A pipeline stage's transformer layers [first, first+count) on a CUDA device: the same passes,
// order rules and error messages as the CPU LayerStack (../transformer.h; the rules are
// ../slot_order.h) — F per (microbatch, sequence chunk) slot with a per-layer key/value cache
// across a microbatch's sequence chunks, B (input gradient) in reverse order accumulating dK/dV,
// W (parameter gradients) after B — with T = float (matches the CPU engine to rounding) or bf16
// parameters and activations. Weight gradients are fp32 and accumulate across slots.
//
// Tensor parallelism (docs/tensor-parallel.md; `group` of t > 1 ranks): the layers are this
// tensor rank's slices, a pass's x / out / dout / dx are the rank's b·len/t sequence-parallel
// rows, and the four products exchange rows with the group inside the pass
// (tensor_parallel/cuda/parallel_linear.h). Every rank of the group runs the same passes in the
// same order. The replicated tensors' gradients are the rank's own rows' (summed over the group
// by the caller, as on the CPU).
//
// Parameters are read from `params` (T, count·LayerParamCount(cfg, t) elements, layer-major in
// the CPU engine's layout and tensor order); gradients go to `grads` (fp32, same layout). Both are
// owned by the caller (the device rank model). Activations come from ctx.alloc and are charged
// to kActivations while live. Every public pass returns after Finish(ctx) (device.h).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/tensor_parallel/parallel_linear.h"
#include "worker/engine/transformer/transformer.h"

namespace vp::engine::cuda {

template <typename T>
class DeviceLayerStack {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceLayerStack>> Create(
      const ModelConfig& cfg, int first_layer, int count, int microbatch_size,
      std::vector<int> seq_bounds, const T* params, float* grads, const DeviceContext& ctx,
      engine::tp::TensorGroup group = {});
  ~DeviceLayerStack();

  int first_layer() const;
  int count() const;
  int num_seq_chunks() const;
  SeqChunk seq_chunk(int q) const;
  int live_slots() const;  // forwarded and not yet released by W

  // The passes keep the order of ../slot_order.h (F in sequence order, B in reverse, W after B).
  // F of a slot: x and out (b, len, h) on the device, len the sequence chunk's length.
  absl::Status Forward(SlotKey slot, const T* x, T* out);
  // B of a slot: dout, dx (b, len, h); dx overwritten.
  absl::Status BackwardInput(SlotKey slot, const T* dout, T* dx);
  // W of a slot, after its B: accumulates parameter gradients (fp32), frees the slot.
  absl::Status BackwardWeight(SlotKey slot);
  // B followed by W.
  absl::Status Backward(SlotKey slot, const T* dout, T* dx);
  // Forward-only evaluation: frees every forwarded slot of `microbatch` and its K/V cache
  // without running B or W (after draining the stream, which may still read them).
  void DiscardMicrobatch(int microbatch);

  struct Impl;  // defined in the .cc
  explicit DeviceLayerStack(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

extern template class DeviceLayerStack<float>;
extern template class DeviceLayerStack<bf16>;

}  // namespace vp::engine::cuda
