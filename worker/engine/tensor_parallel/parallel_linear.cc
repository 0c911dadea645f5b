#include "worker/engine/tensor_parallel/parallel_linear.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::engine::tp {

namespace {

absl::Status CheckRows(int n, int t) {
  if (n % t == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("sequence parallelism: ", n, " token rows do not split over ", t,
                   " tensor ranks (a sequence chunk's length must be divisible by t)"));
}

// y (n, out) = x (n, in) · W, W in either layout; bias may be null (kOutIn has none).
void Product(WeightLayout layout, float* y, const float* x, const float* w, const float* b, int n,
             int in, int out) {
  if (layout == WeightLayout::kInOut) {
    cpu::LinearForward(y, x, w, b, n, in, out);
  } else {
    cpu::LinearTForward(y, x, w, n, in, out);
  }
}

void ProductBackwardInput(WeightLayout layout, float* dx, const float* dy, const float* w, int n,
                          int in, int out) {
  if (layout == WeightLayout::kInOut) {
    cpu::LinearBackwardInput(dx, dy, w, n, in, out);
  } else {
    cpu::LinearTBackwardInput(dx, dy, w, n, in, out);
  }
}

void ProductBackwardWeight(WeightLayout layout, float* dw, float* db, const float* dy,
                           const float* x, int n, int in, int out) {
  if (layout == WeightLayout::kInOut) {
    cpu::LinearBackwardWeight(dw, db, dy, x, n, in, out);
  } else {
    cpu::LinearTBackwardWeight(dw, dy, x, n, in, out);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SequenceParallel.

absl::StatusOr<GatheredRows> SequenceParallel::Gather(const float* local, int n, int c) const {
  if (group_.size() == 1) return GatheredRows(local);
  PooledBuffer full = pool_->Acquire(static_cast<size_t>(n) * c);
  if (absl::Status s = GatherInto(local, n, c, full.data()); !s.ok()) return s;
  return GatheredRows(std::move(full));
}

absl::Status SequenceParallel::GatherInto(const float* local, int n, int c, float* full) const {
  const int t = group_.size();
  const size_t count = static_cast<size_t>(n) * c;
  if (t == 1) {
    std::memcpy(full, local, sizeof(float) * count);
    return absl::OkStatus();
  }
  if (absl::Status s = CheckRows(n, t); !s.ok()) return s;
  const size_t mine = count / t;
  // AllGather works in place on the whole buffer: this rank contributes its block (RangeOf
  // gives block r of t equal blocks, since t divides the count).
  std::memcpy(full + group_.rank() * mine, local, sizeof(float) * mine);
  return group_.comm()->AllGather(full, count);
}

absl::Status SequenceParallel::ScatterSum(float* partial, int n, int c, float* local) const {
  const int t = group_.size();
  if (t == 1) {
    if (partial != local) std::memcpy(local, partial, sizeof(float) * n * c);
    return absl::OkStatus();
  }
  if (absl::Status s = CheckRows(n, t); !s.ok()) return s;
  const size_t count = static_cast<size_t>(n) * c;
  const size_t mine = count / t;
  if (absl::Status s = group_.comm()->ReduceScatterSum(partial, count); !s.ok()) return s;
  std::memcpy(local, partial + group_.rank() * mine, sizeof(float) * mine);
  return absl::OkStatus();
}

float* SequenceParallel::PartialBuffer(PooledBuffer& holder, float* local, int n, int c) const {
  if (group_.size() == 1) return local;
  holder = pool_->Acquire(static_cast<size_t>(n) * c);
  return holder.data();
}

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear.

absl::Status ColumnParallelLinear::Forward(float* y, const float* x_local, int n) const {
  absl::StatusOr<GatheredRows> x = sp_->Gather(x_local, n, in_);
  if (!x.ok()) return x.status();
  Product(layout_, y, x->data(), w_, b_, n, in_, out_);
  return absl::OkStatus();
}

absl::Status ColumnParallelLinear::BackwardInput(float* dx_local, const float* dy, int n) const {
  PooledBuffer holder;
  float* partial = sp_->PartialBuffer(holder, dx_local, n, in_);
  ProductBackwardInput(layout_, partial, dy, w_, n, in_, out_);
  return sp_->ScatterSum(partial, n, in_, dx_local);
}

absl::Status ColumnParallelLinear::BackwardWeight(const float* dy, const float* x_local,
                                                  int n) const {
  absl::StatusOr<GatheredRows> x = sp_->Gather(x_local, n, in_);
  if (!x.ok()) return x.status();
  ProductBackwardWeight(layout_, dw_, db_, dy, x->data(), n, in_, out_);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear.

absl::Status RowParallelLinear::Forward(float* y_local, const float* x, int n) const {
  if (sp_->group().size() == 1) {  // the plain layer: bias inside the product, as at t = 1
    Product(layout_, y_local, x, w_, b_, n, in_, out_);
    return absl::OkStatus();
  }
  PooledBuffer holder;
  float* partial = sp_->PartialBuffer(holder, y_local, n, out_);
  Product(layout_, partial, x, w_, nullptr, n, in_, out_);
  if (absl::Status s = sp_->ScatterSum(partial, n, out_, y_local); !s.ok()) return s;
  if (b_ != nullptr) {  // the replicated bias, once per row after the sum
    const int m = sp_->LocalRows(n);
    for (int i = 0; i < m; ++i) {
      float* row = y_local + static_cast<size_t>(i) * out_;
      for (int j = 0; j < out_; ++j) row[j] += b_[j];
    }
  }
  return absl::OkStatus();
}

absl::Status RowParallelLinear::BackwardInput(float* dx, const float* dy_local, int n) const {
  absl::StatusOr<GatheredRows> dy = sp_->Gather(dy_local, n, out_);
  if (!dy.ok()) return dy.status();
  ProductBackwardInput(layout_, dx, dy->data(), w_, n, in_, out_);
  return absl::OkStatus();
}

absl::Status RowParallelLinear::BackwardWeight(const float* dy_local, const float* x, int n) const {
  if (sp_->group().size() == 1) {
    ProductBackwardWeight(layout_, dw_, db_, dy_local, x, n, in_, out_);
    return absl::OkStatus();
  }
  absl::StatusOr<GatheredRows> dy = sp_->Gather(dy_local, n, out_);
  if (!dy.ok()) return dy.status();
  ProductBackwardWeight(layout_, dw_, nullptr, dy->data(), x, n, in_, out_);
  if (db_ != nullptr) {  // this rank's rows only; the group sum comes with the replicated tensors
    const int m = sp_->LocalRows(n);
    for (int i = 0; i < m; ++i) {
      const float* row = dy_local + static_cast<size_t>(i) * out_;
      for (int j = 0; j < out_; ++j) db_[j] += row[j];
    }
  }
  return absl::OkStatus();
}

}  // namespace vp::engine::tp
