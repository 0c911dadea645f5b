#include "worker/engine/tensor_parallel/cuda/parallel_linear.h"

#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda::tp {

namespace {

template <typename T>
constexpr DType kType = std::is_same_v<T, float> ? DType::kF32 : DType::kBF16;

// Elements of T per float slot of the communicator: 1, or 2 bf16 values packed in one slot.
template <typename T>
constexpr size_t kPerSlot = sizeof(float) / sizeof(T);

absl::Status CheckRows(int n, int t) {
  if (n % t == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("sequence parallelism: ", n, " token rows do not split over ", t,
                   " tensor ranks (a sequence chunk's length must be divisible by t)"));
}

// y (n, out) = x (n, in) · W (+ b), T out, in either layout (kOutIn has no bias).
template <typename T>
absl::Status Product(GemmRunner& gemm, WeightLayout layout, T* y, const T* x, const T* w,
                     const T* b, int n, int in, int out, cudaStream_t s) {
  if (layout == WeightLayout::kInOut) return LinearForward<T>(gemm, y, x, w, b, n, in, out, s);
  return LinearTForward<T>(gemm, y, x, w, n, in, out, s);
}

// y (n, out) = residual + x (n, in) · W (+ b), T out, in either layout: one GEMM where the
// residual epilogue is on (gemm.h Linear(T)ResidualForward). residual must not alias y.
template <typename T>
absl::Status ProductOnto(GemmRunner& gemm, WeightLayout layout, T* y, const T* x, const T* w,
                         const T* b, const T* residual, int n, int in, int out, cudaStream_t s) {
  if (layout == WeightLayout::kInOut) {
    return LinearResidualForward<T>(gemm, y, x, w, b, residual, n, in, out, s);
  }
  return LinearTResidualForward<T>(gemm, y, x, w, residual, n, in, out, s);
}

// y (n, out) = x (n, in) · W in fp32 (a partial product the group then sums), no bias.
template <typename T>
absl::Status ProductToFloat(GemmRunner& gemm, WeightLayout layout, float* y, const T* x, const T* w,
                            int n, int in, int out, cudaStream_t s) {
  if (layout == WeightLayout::kInOut) {  // W (in, out)
    return gemm.Gemm(false, false, n, out, in, 1.0f, x, in, w, out, 0.0f, y, out, kType<T>,
                     DType::kF32, s);
  }
  return gemm.Gemm(false, true, n, out, in, 1.0f, x, in, w, in, 0.0f, y, out,
                   kType<T>,  // (out, in)
                   DType::kF32, s);
}

// dx (n, in) = dy (n, out) · Wᵀ, T out.
template <typename T>
absl::Status ProductBackwardInput(GemmRunner& gemm, WeightLayout layout, T* dx, const T* dy,
                                  const T* w, int n, int in, int out, cudaStream_t s) {
  if (layout == WeightLayout::kInOut) return LinearBackwardInput<T>(gemm, dx, dy, w, n, in, out, s);
  return LinearTBackwardInput<T>(gemm, dx, dy, w, n, in, out, s);
}

// The same in fp32 (a partial input gradient the group then sums).
template <typename T>
absl::Status ProductBackwardInputToFloat(GemmRunner& gemm, WeightLayout layout, float* dx,
                                         const T* dy, const T* w, int n, int in, int out,
                                         cudaStream_t s) {
  if (layout == WeightLayout::kInOut) {  // dX = dY · Wᵀ, W (in, out)
    return gemm.Gemm(false, true, n, in, out, 1.0f, dy, out, w, out, 0.0f, dx, in, kType<T>,
                     DType::kF32, s);
  }
  return gemm.Gemm(false, false, n, in, out, 1.0f, dy, out, w, in, 0.0f, dx, in,  // W (out, in)
                   kType<T>, DType::kF32, s);
}

// dW += xᵀ · dy (layout-wise), db += Σ_rows dy when db is not null (kInOut only).
template <typename T>
absl::Status ProductBackwardWeight(GemmRunner& gemm, WeightLayout layout, float* dw, float* db,
                                   const T* dy, const T* x, int n, int in, int out,
                                   cudaStream_t s) {
  if (layout == WeightLayout::kInOut) {
    return LinearBackwardWeight<T>(gemm, dw, db, dy, x, n, in, out, s);
  }
  return LinearTBackwardWeight<T>(gemm, dw, dy, x, n, in, out, s);
}

// The end of a product: at t > 1 the stream drained (a collective follows or preceded it on the
// communicator's own stream); at t = 1 nothing — the plain layer's GEMMs only enqueue.
absl::Status Done(const TensorGroup& group, const DeviceContext& ctx) {
  return group.size() > 1 ? Finish(ctx) : absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DeviceSequenceParallel.

template <typename T>
absl::StatusOr<DeviceGatheredRows<T>> DeviceSequenceParallel<T>::Gather(const T* local, int n,
                                                                        int c) const {
  if (group_.size() == 1) return DeviceGatheredRows<T>(local);
  auto full = DeviceArray<T>::Create(ctx_, MemoryCategory::kActivations, static_cast<size_t>(n) * c,
                                     /*zero=*/false);
  if (!full.ok()) return full.status();
  if (absl::Status s = GatherInto(local, n, c, full->data()); !s.ok()) return s;
  return DeviceGatheredRows<T>(std::move(*full));
}

template <typename T>
absl::Status DeviceSequenceParallel<T>::GatherInto(const T* local, int n, int c, T* full) const {
  const int t = group_.size();
  const size_t count = static_cast<size_t>(n) * c;
  if (t > 1) {
    if (absl::Status s = CheckRows(n, t); !s.ok()) return s;
    if (count % (kPerSlot<T> * t) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence parallelism: a block of ", count / t,
                                                     " values does not fill whole slots"));
    }
  }
  const size_t mine = count / t;
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(full + group_.rank() * mine, local, mine * sizeof(T),
                                          cudaMemcpyDeviceToDevice, ctx_.stream));
  if (t == 1) return absl::OkStatus();
  if (absl::Status s = Finish(ctx_); !s.ok()) return s;  // the communicator has its own stream
  // Block r of t equal blocks is RangeOf's range r (t divides the slot count): a byte move.
  return group_.comm()->AllGather(reinterpret_cast<float*>(full), count / kPerSlot<T>);
}

template <typename T>
absl::Status DeviceSequenceParallel<T>::ScatterSum(float* partial, int n, int c, T* local) const {
  const int t = group_.size();
  if (t > 1) {
    if (absl::Status s = CheckRows(n, t); !s.ok()) return s;
  }
  const size_t count = static_cast<size_t>(n) * c, mine = count / t;
  if (absl::Status s = Finish(ctx_); !s.ok()) return s;  // the GEMM wrote partial on ctx.stream
  if (t > 1) {
    if (absl::Status s = group_.comm()->ReduceScatterSum(partial, count); !s.ok()) return s;
  }
  const float* rows = partial + group_.rank() * mine;
  if constexpr (std::is_same_v<T, float>) {
    VP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(local, rows, mine * sizeof(float), cudaMemcpyDeviceToDevice, ctx_.stream));
  } else {
    VP_CUDA_RETURN_IF_ERROR(FloatToBf16(local, rows, static_cast<long>(mine), ctx_.stream));
  }
  return Finish(ctx_);
}

// ---------------------------------------------------------------------------------------------
// DeviceColumnParallelLinear.

template <typename T>
absl::Status DeviceColumnParallelLinear<T>::Forward(T* y, const T* x_local, int n) const {
  auto x = sp_->Gather(x_local, n, p_.in);
  if (!x.ok()) return x.status();
  const DeviceContext& ctx = sp_->ctx();
  if (absl::Status s =
          Product<T>(*ctx.gemm, p_.layout, y, x->data(), p_.w, p_.b, n, p_.in, p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  return Done(sp_->group(), ctx);
}

template <typename T>
absl::Status DeviceColumnParallelLinear<T>::ForwardGelu(T* y, T* pre, const T* x_local,
                                                        int n) const {
  auto x = sp_->Gather(x_local, n, p_.in);
  if (!x.ok()) return x.status();
  const DeviceContext& ctx = sp_->ctx();
  if (p_.layout == WeightLayout::kInOut) {
    if (absl::Status s = LinearGeluForward<T>(*ctx.gemm, y, pre, x->data(), p_.w, p_.b, n, p_.in,
                                              p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
  } else {
    if (absl::Status s = Product<T>(*ctx.gemm, p_.layout, pre, x->data(), p_.w, p_.b, n, p_.in,
                                    p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
    VP_CUDA_RETURN_IF_ERROR(GeluForward<T>(y, pre, static_cast<long>(n) * p_.out, ctx.stream));
  }
  return Done(sp_->group(), ctx);
}

template <typename T>
absl::Status DeviceColumnParallelLinear<T>::BackwardInput(T* dx_local, const T* dy, int n) const {
  const DeviceContext& ctx = sp_->ctx();
  if (sp_->group().size() == 1) {  // the plain layer's input gradient
    if (absl::Status s = ProductBackwardInput<T>(*ctx.gemm, p_.layout, dx_local, dy, p_.w, n, p_.in,
                                                 p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
    return Done(sp_->group(), ctx);
  }
  auto partial = DeviceArray<float>::Create(ctx, MemoryCategory::kActivations,
                                            static_cast<size_t>(n) * p_.in, /*zero=*/false);
  if (!partial.ok()) return partial.status();
  if (absl::Status s = ProductBackwardInputToFloat<T>(*ctx.gemm, p_.layout, partial->data(), dy,
                                                      p_.w, n, p_.in, p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  return sp_->ScatterSum(partial->data(), n, p_.in, dx_local);
}

template <typename T>
absl::Status DeviceColumnParallelLinear<T>::BackwardWeight(const T* dy, const T* x_local,
                                                           int n) const {
  auto x = sp_->Gather(x_local, n, p_.in);
  if (!x.ok()) return x.status();
  const DeviceContext& ctx = sp_->ctx();
  if (absl::Status s = ProductBackwardWeight<T>(*ctx.gemm, p_.layout, p_.dw, p_.db, dy, x->data(),
                                                n, p_.in, p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  return Done(sp_->group(), ctx);
}

// ---------------------------------------------------------------------------------------------
// DeviceRowParallelLinear.

template <typename T>
absl::Status DeviceRowParallelLinear<T>::Forward(T* y_local, const T* x, int n) const {
  return ForwardOnto(y_local, x, nullptr, n);
}

template <typename T>
absl::Status DeviceRowParallelLinear<T>::ForwardResidual(T* y_local, const T* x,
                                                         const T* residual_local, int n) const {
  if (residual_local == nullptr || residual_local == y_local) {
    return absl::InvalidArgumentError(
        "row-parallel forward: the residual must be given and must not alias the output");
  }
  return ForwardOnto(y_local, x, residual_local, n);
}

template <typename T>
absl::Status DeviceRowParallelLinear<T>::ForwardOnto(T* y_local, const T* x,
                                                     const T* residual_local, int n) const {
  const DeviceContext& ctx = sp_->ctx();
  if (sp_->group().size() == 1) {  // the plain layer: bias (and residual) inside the product
    const absl::Status s =
        residual_local == nullptr
            ? Product<T>(*ctx.gemm, p_.layout, y_local, x, p_.w, p_.b, n, p_.in, p_.out, ctx.stream)
            : ProductOnto<T>(*ctx.gemm, p_.layout, y_local, x, p_.w, p_.b, residual_local, n, p_.in,
                             p_.out, ctx.stream);
    if (!s.ok()) return s;
    return Done(sp_->group(), ctx);
  }
  auto partial = DeviceArray<float>::Create(ctx, MemoryCategory::kActivations,
                                            static_cast<size_t>(n) * p_.out, /*zero=*/false);
  if (!partial.ok()) return partial.status();
  if (absl::Status s = ProductToFloat<T>(*ctx.gemm, p_.layout, partial->data(), x, p_.w, n, p_.in,
                                         p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = sp_->ScatterSum(partial->data(), n, p_.out, y_local); !s.ok()) return s;
  const int m = sp_->LocalRows(n);
  if (p_.b != nullptr) {  // the replicated bias, once per row after the sum
    VP_CUDA_RETURN_IF_ERROR(AddBias<T>(y_local, p_.b, m, p_.out, ctx.stream));
  }
  if (residual_local != nullptr) {
    VP_CUDA_RETURN_IF_ERROR(ResidualForward<T>(y_local, y_local, residual_local,
                                               static_cast<long>(m) * p_.out, ctx.stream));
  }
  return Done(sp_->group(), ctx);
}

template <typename T>
absl::Status DeviceRowParallelLinear<T>::BackwardInput(T* dx, const T* dy_local, int n) const {
  auto dy = sp_->Gather(dy_local, n, p_.out);
  if (!dy.ok()) return dy.status();
  const DeviceContext& ctx = sp_->ctx();
  if (absl::Status s = ProductBackwardInput<T>(*ctx.gemm, p_.layout, dx, dy->data(), p_.w, n, p_.in,
                                               p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  return Done(sp_->group(), ctx);
}

template <typename T>
absl::Status DeviceRowParallelLinear<T>::BackwardInputGelu(T* dpre, const T* dy_local, const T* pre,
                                                           int n) const {
  auto dy = sp_->Gather(dy_local, n, p_.out);
  if (!dy.ok()) return dy.status();
  const DeviceContext& ctx = sp_->ctx();
  if (p_.layout == WeightLayout::kInOut) {
    if (absl::Status s = LinearBackwardInputGelu<T>(*ctx.gemm, dpre, dy->data(), p_.w, pre, n,
                                                    p_.in, p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
  } else {
    if (absl::Status s = ProductBackwardInput<T>(*ctx.gemm, p_.layout, dpre, dy->data(), p_.w, n,
                                                 p_.in, p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
    VP_CUDA_RETURN_IF_ERROR(
        GeluBackward<T>(dpre, pre, dpre, static_cast<long>(n) * p_.in, ctx.stream));
  }
  return Done(sp_->group(), ctx);
}

template <typename T>
absl::Status DeviceRowParallelLinear<T>::BackwardWeight(const T* dy_local, const T* x,
                                                        int n) const {
  const DeviceContext& ctx = sp_->ctx();
  if (sp_->group().size() == 1) {
    if (absl::Status s = ProductBackwardWeight<T>(*ctx.gemm, p_.layout, p_.dw, p_.db, dy_local, x,
                                                  n, p_.in, p_.out, ctx.stream);
        !s.ok()) {
      return s;
    }
    return Done(sp_->group(), ctx);
  }
  auto dy = sp_->Gather(dy_local, n, p_.out);
  if (!dy.ok()) return dy.status();
  if (absl::Status s = ProductBackwardWeight<T>(*ctx.gemm, p_.layout, p_.dw, nullptr, dy->data(), x,
                                                n, p_.in, p_.out, ctx.stream);
      !s.ok()) {
    return s;
  }
  if (p_.db != nullptr) {  // this rank's rows only; the group sum comes with the replicated tensors
    VP_CUDA_RETURN_IF_ERROR(
        BiasBackward<T>(p_.db, dy_local, sp_->LocalRows(n), p_.out, ctx.stream));
  }
  return Done(sp_->group(), ctx);
}

template class DeviceSequenceParallel<float>;
template class DeviceSequenceParallel<bf16>;
template class DeviceColumnParallelLinear<float>;
template class DeviceColumnParallelLinear<bf16>;
template class DeviceRowParallelLinear<float>;
template class DeviceRowParallelLinear<bf16>;

}  // namespace vp::engine::cuda::tp
