// The pieces of a tensor-parallel layer on a CUDA device: the twin of ../parallel_linear.h (the
// CPU pieces, whose comment has the math and the sequence-parallel row split), with T = float or
// bf16 activations and weights and fp32 weight gradients, as DeviceLayerStack computes.
//
// One protocol, two maths: the same collectives in the same order as the CPU pieces, so a CPU
// rank's and a device rank's passes are interchangeable in a group's order. What differs:
//   - Row blocks travel through the communicator (which takes device floats). A gather moves
//     bytes and never adds, so bf16 rows travel as pairs packed in float slots (half the bytes;
//     a block of m·c bf16 values is m·c/2 slots, c being a multiple of 8 on the device).
//   - A reduction adds: the partial products that are reduce-scattered (the row-parallel
//     forward, the column-parallel input gradient) are written by the GEMM in fp32 (cuBLASLt's
//     fp32 C with T inputs), summed in fp32 and rounded to T once, on the rank's own rows.
// At t > 1 every call returns with ctx.stream idle (Finish), so a communicator (on its own
// stream) may read what the call produced; at t = 1 a call only enqueues, exactly the plain
// layer's GEMMs (the caller's pass ends with its own Finish).
//
// Letters: n token rows of the chunk, m = n/t this rank's rows, in/out the GEMM widths (out_r,
// in_r this rank's slice), t the group size, c a row width.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/tensor_parallel/parallel_linear.h"

namespace vp::engine::cuda::tp {

using engine::tp::TensorGroup;
using engine::tp::WeightLayout;

// n rows of width c, whole on this rank: a view of the caller's rows at t = 1, a gathered copy
// (from the context's allocator, charged to kActivations) otherwise.
template <typename T>
class DeviceGatheredRows {
 public:
  DeviceGatheredRows() = default;
  explicit DeviceGatheredRows(const T* view) : data_(view) {}
  explicit DeviceGatheredRows(DeviceArray<T> owned)
      : owned_(std::move(owned)), data_(owned_.data()) {}

  const T* data() const { return data_; }

 private:
  DeviceArray<T> owned_;
  const T* data_ = nullptr;
};

// The token-row exchanges of sequence parallelism on device rows.
template <typename T>
class DeviceSequenceParallel {
 public:
  DeviceSequenceParallel(TensorGroup group, const DeviceContext& ctx) : group_(group), ctx_(ctx) {}

  const TensorGroup& group() const { return group_; }
  const DeviceContext& ctx() const { return ctx_; }
  int LocalRows(int n) const { return n / group_.size(); }

  // All-gather: every rank's m rows (n, c) in rank order.
  absl::StatusOr<DeviceGatheredRows<T>> Gather(const T* local,  // (m, c)
                                               int n, int c) const;
  // The same into the caller's buffer (at t = 1 a copy).
  absl::Status GatherInto(const T* local,  // (m, c)
                          int n, int c,
                          T* full) const;  // (n, c)
  // Reduce-scatter: the fp32 `partial` (n, c) summed over the group, this rank's m rows rounded
  // to T into `local`. partial is clobbered.
  absl::Status ScatterSum(float* partial,  // (n, c)
                          int n, int c,
                          T* local) const;  // (m, c)

 private:
  TensorGroup group_;
  DeviceContext ctx_;
};

// One product's weights on the device: this rank's W_r (in × out in `layout`), its bias (null
// for none; kOutIn has none) and the fp32 gradient blocks they accumulate into.
template <typename T>
struct DeviceLinearWeights {
  WeightLayout layout = WeightLayout::kInOut;
  int in = 0, out = 0;
  const T* w = nullptr;
  const T* b = nullptr;
  float* dw = nullptr;
  float* db = nullptr;
};

// Y (n, out_r) = gather(X) (n, in) · W_r (in, out_r) + b_r.
template <typename T>
class DeviceColumnParallelLinear {
 public:
  DeviceColumnParallelLinear(const DeviceSequenceParallel<T>* sp, DeviceLinearWeights<T> p)
      : sp_(sp), p_(p) {}

  absl::Status Forward(T* y,              // (n, out_r)
                       const T* x_local,  // (m, in)
                       int n) const;
  // The same followed by GELU (GPT-2's c_fc): pre = Y, y = gelu(Y), in one GEMM under
  // VOCABPIPE_GEMM_EPILOGUE=gelu (LinearGeluForward).
  absl::Status ForwardGelu(T* y,              // (n, out_r)  gelu(pre)
                           T* pre,            // (n, out_r)
                           const T* x_local,  // (m, in)
                           int n) const;
  // B: dX_local (m, in) = reduce-scatter(dY · W_rᵀ) (overwrites).
  absl::Status BackwardInput(T* dx_local,  // (m, in)
                             const T* dy,  // (n, out_r)
                             int n) const;
  // W: dW_r += gather(X)ᵀ · dY, db_r += Σ_rows dY.
  absl::Status BackwardWeight(const T* dy,       // (n, out_r)
                              const T* x_local,  // (m, in)
                              int n) const;

 private:
  const DeviceSequenceParallel<T>* sp_;
  DeviceLinearWeights<T> p_;
};

// Y_local (m, out) = reduce-scatter(X_r (n, in_r) · W_r (in_r, out)) + b (b replicated: its
// gradient from the rank's own rows is summed over the group later).
template <typename T>
class DeviceRowParallelLinear {
 public:
  DeviceRowParallelLinear(const DeviceSequenceParallel<T>* sp, DeviceLinearWeights<T> p)
      : sp_(sp), p_(p) {}

  absl::Status Forward(T* y_local,  // (m, out)
                       const T* x,  // (n, in_r)
                       int n) const;
  // The same onto the residual stream (attention-out, FC2 / down): y_local = residual_local + the
  // product, residual_local not aliasing y_local. At t = 1 one GEMM under
  // VOCABPIPE_GEMM_EPILOGUE=residual (Linear(T)ResidualForward); at t > 1 added after the sum.
  absl::Status ForwardResidual(T* y_local,               // (m, out)
                               const T* x,               // (n, in_r)
                               const T* residual_local,  // (m, out)
                               int n) const;
  // B: dX (n, in_r) = gather(dY_local) · W_rᵀ (overwrites).
  absl::Status BackwardInput(T* dx,              // (n, in_r)
                             const T* dy_local,  // (m, out)
                             int n) const;
  // The same through the GELU that produced X = gelu(pre) (GPT-2's c_proj): dpre (n, in_r) =
  // dX ∘ gelu'(pre), in one GEMM under VOCABPIPE_GEMM_EPILOGUE=gelu (LinearBackwardInputGelu).
  absl::Status BackwardInputGelu(T* dpre,            // (n, in_r)
                                 const T* dy_local,  // (m, out)
                                 const T* pre,       // (n, in_r)
                                 int n) const;
  // W: dW_r += Xᵀ · gather(dY_local), db += Σ_rows dY_local (this rank's rows).
  absl::Status BackwardWeight(const T* dy_local,  // (m, out)
                              const T* x,         // (n, in_r)
                              int n) const;

 private:
  // Forward (residual_local null) and ForwardResidual.
  absl::Status ForwardOnto(T* y_local, const T* x, const T* residual_local, int n) const;

  const DeviceSequenceParallel<T>* sp_;
  DeviceLinearWeights<T> p_;
};

extern template class DeviceSequenceParallel<float>;
extern template class DeviceSequenceParallel<bf16>;
extern template class DeviceColumnParallelLinear<float>;
extern template class DeviceColumnParallelLinear<bf16>;
extern template class DeviceRowParallelLinear<float>;
extern template class DeviceRowParallelLinear<bf16>;

}  // namespace vp::engine::cuda::tp
