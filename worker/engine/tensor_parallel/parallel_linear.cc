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
  absl::StatusOr<GatheredRows> x = sp_->Gather(x_local, n, p_.in);
  if (!x.ok()) return x.status();
  Product(p_.layout, y, x->data(), p_.w, p_.b, n, p_.in, p_.out);
  return absl::OkStatus();
}

absl::Status ColumnParallelLinear::BackwardInput(float* dx_local, const float* dy, int n) const {
  PooledBuffer holder;
  float* partial = sp_->PartialBuffer(holder, dx_local, n, p_.in);
  ProductBackwardInput(p_.layout, partial, dy, p_.w, n, p_.in, p_.out);
  return sp_->ScatterSum(partial, n, p_.in, dx_local);
}

absl::Status ColumnParallelLinear::BackwardWeight(const float* dy, const float* x_local,
                                                  int n) const {
  absl::StatusOr<GatheredRows> x = sp_->Gather(x_local, n, p_.in);
  if (!x.ok()) return x.status();
  ProductBackwardWeight(p_.layout, p_.dw, p_.db, dy, x->data(), n, p_.in, p_.out);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear.

absl::Status RowParallelLinear::Forward(float* y_local, const float* x, int n) const {
  if (sp_->group().size() == 1) {  // the plain layer: bias inside the product, as at t = 1
    Product(p_.layout, y_local, x, p_.w, p_.b, n, p_.in, p_.out);
    return absl::OkStatus();
  }
  PooledBuffer holder;
  float* partial = sp_->PartialBuffer(holder, y_local, n, p_.out);
  Product(p_.layout, partial, x, p_.w, nullptr, n, p_.in, p_.out);
  if (absl::Status s = sp_->ScatterSum(partial, n, p_.out, y_local); !s.ok()) return s;
  if (p_.b != nullptr) {  // the replicated bias, once per row after the sum
    const int m = sp_->LocalRows(n);
    for (int i = 0; i < m; ++i) {
      float* row = y_local + static_cast<size_t>(i) * p_.out;
      for (int j = 0; j < p_.out; ++j) row[j] += p_.b[j];
    }
  }
  return absl::OkStatus();
}

absl::Status RowParallelLinear::BackwardInput(float* dx, const float* dy_local, int n) const {
  absl::StatusOr<GatheredRows> dy = sp_->Gather(dy_local, n, p_.out);
  if (!dy.ok()) return dy.status();
  ProductBackwardInput(p_.layout, dx, dy->data(), p_.w, n, p_.in, p_.out);
  return absl::OkStatus();
}

absl::Status RowParallelLinear::BackwardWeight(const float* dy_local, const float* x, int n) const {
  if (sp_->group().size() == 1) {
    ProductBackwardWeight(p_.layout, p_.dw, p_.db, dy_local, x, n, p_.in, p_.out);
    return absl::OkStatus();
  }
  absl::StatusOr<GatheredRows> dy = sp_->Gather(dy_local, n, p_.out);
  if (!dy.ok()) return dy.status();
  ProductBackwardWeight(p_.layout, p_.dw, nullptr, dy->data(), x, n, p_.in, p_.out);
  if (p_.db != nullptr) {  // this rank's rows only; the group sum comes with the replicated tensors
    const int m = sp_->LocalRows(n);
    for (int i = 0; i < m; ++i) {
      const float* row = dy_local + static_cast<size_t>(i) * p_.out;
      for (int j = 0; j < p_.out; ++j) p_.db[j] += row[j];
    }
  }
  return absl::OkStatus();
}

}  // namespace vp::engine::tp
