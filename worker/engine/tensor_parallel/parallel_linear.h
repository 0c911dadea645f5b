// The pieces of a tensor-parallel layer and every collective they need, on the CPU (Megatron
// keeps the same pieces in its tensor_parallel layers): the layer files call these and stay the
// t = 1 math; at t = 1 each piece is the plain linear layer and exchanges nothing.
//
// Sequence parallelism (Megatron's, docs/tensor-parallel.md): between the matrix products a
// rank holds 1/t of the chunk's tokens. A chunk's n = b·len token rows, flattened batch-major as
// everywhere in the engine, are cut into t equal blocks of m = n/t rows, rank r holding rows
// [r·m, (r+1)·m) (with b = 1, Megatron's split along the sequence). So
//
//   column-parallel   all-gather the input rows (m → n), then the rank's output columns
//                     Y_r (n, out_r) = X · W_r  (+ b_r): no reduction, the bias is cut too;
//   row-parallel      the rank's input columns give a partial product P_r (n, out) = X_r · W_r,
//                     reduce-scattered into the rank's own rows (n → m), then + b (replicated).
//
// The backward mirrors it: the gradient of an all-gather is a reduce-scatter and the reverse.
// W passes gather again what they need (the norm outputs, the row-parallel output gradients)
// instead of keeping whole copies from F or B, so a rank keeps 1/t of every activation
// (the planner prices the extra all-gathers).
//
// Letters: n token rows of the chunk, m = n/t this rank's rows, in/out the GEMM widths (out_r,
// in_r this rank's slice), t the group size.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/activation_pool.h"

namespace vp::engine::tp {

// The ranks that share a layer's matrices: the communicator of the tensor group (rank() is the
// tensor rank), or none for t = 1. The layer's passes are its only users, on the compute thread.
class TensorGroup {
 public:
  TensorGroup() = default;
  explicit TensorGroup(comm::Communicator* comm) : comm_(comm) {}

  int size() const { return comm_ == nullptr ? 1 : comm_->size(); }
  int rank() const { return comm_ == nullptr ? 0 : comm_->rank(); }
  comm::Communicator* comm() const { return comm_; }

 private:
  comm::Communicator* comm_ = nullptr;
};

// n rows of width c, whole on this rank: a view of the caller's rows at t = 1, a gathered copy
// (borrowed from the pool) otherwise.
class GatheredRows {
 public:
  GatheredRows() = default;
  explicit GatheredRows(const float* view) : data_(view) {}
  explicit GatheredRows(PooledBuffer owned) : owned_(std::move(owned)), data_(owned_.data()) {}

  const float* data() const { return data_; }

 private:
  PooledBuffer owned_;
  const float* data_ = nullptr;
};

// The token-row exchanges of sequence parallelism.
class SequenceParallel {
 public:
  SequenceParallel(TensorGroup group, ActivationPool* pool) : group_(group), pool_(pool) {}

  const TensorGroup& group() const { return group_; }
  // This rank's rows of a chunk of n token rows (n must be divisible by t).
  int LocalRows(int n) const { return n / group_.size(); }

  // All-gather: every rank's m rows (n, c) in rank order.
  absl::StatusOr<GatheredRows> Gather(const float* local,  // (m, c)
                                      int n, int c) const;
  // The same into the caller's buffer (no pool needed; at t = 1 a copy).
  absl::Status GatherInto(const float* local,  // (m, c)
                          int n, int c,
                          float* full) const;  // (n, c)
  // Reduce-scatter: `partial` (n, c) summed over the group, this rank's m rows written to
  // `local`. partial is clobbered. At t = 1 the caller passes local == partial.
  absl::Status ScatterSum(float* partial,  // (n, c)
                          int n, int c,
                          float* local) const;  // (m, c)
  // A buffer for a row-parallel product that ScatterSum then reduces: (n, c) from the pool at
  // t > 1; at t = 1 the product is already the rank's rows, so `local` itself (not owned).
  float* PartialBuffer(PooledBuffer& holder, float* local, int n, int c) const;

 private:
  TensorGroup group_;
  ActivationPool* pool_;
};

// Weight layouts: Hugging Face GPT-2's Conv1D [in, out] (cpu::Linear*) or torch nn.Linear's
// [out, in] (Llama; cpu::LinearT*, no bias).
enum class WeightLayout { kInOut, kOutIn };

// One product's weights and their gradients: this rank's W_r (in × out in `layout`), its bias
// (null for none) and the gradient blocks they accumulate into. in and out are the widths the
// rank computes with (one of them its slice).
struct LinearWeights {
  WeightLayout layout = WeightLayout::kInOut;
  int in = 0, out = 0;
  const float* w = nullptr;
  const float* b = nullptr;
  float* dw = nullptr;
  float* db = nullptr;
};

// Y (n, out_r) = gather(X) (n, in) · W_r (in, out_r) + b_r. Bias pointers may be null.
class ColumnParallelLinear {
 public:
  // p.in = in, p.out = out_r.
  ColumnParallelLinear(const SequenceParallel* sp, LinearWeights p) : sp_(sp), p_(p) {}

  absl::Status Forward(float* y,              // (n, out_r)
                       const float* x_local,  // (m, in)
                       int n) const;
  // B: dX_local (m, in) = reduce-scatter(dY · W_rᵀ) (overwrites).
  absl::Status BackwardInput(float* dx_local,  // (m, in)
                             const float* dy,  // (n, out_r)
                             int n) const;
  // W: dW_r += gather(X)ᵀ · dY, db_r += Σ_rows dY (all n rows: the bias slice is the rank's own).
  absl::Status BackwardWeight(const float* dy,       // (n, out_r)
                              const float* x_local,  // (m, in)
                              int n) const;

 private:
  const SequenceParallel* sp_;
  LinearWeights p_;
};

// Y_local (m, out) = reduce-scatter(X_r (n, in_r) · W_r (in_r, out)) + b. The bias is whole on
// every rank (replicated): its gradient from the rank's own rows is summed over the group later.
class RowParallelLinear {
 public:
  // p.in = in_r, p.out = out.
  RowParallelLinear(const SequenceParallel* sp, LinearWeights p) : sp_(sp), p_(p) {}

  absl::Status Forward(float* y_local,  // (m, out)
                       const float* x,  // (n, in_r)
                       int n) const;
  // B: dX (n, in_r) = gather(dY_local) · W_rᵀ (overwrites).
  absl::Status BackwardInput(float* dx,              // (n, in_r)
                             const float* dy_local,  // (m, out)
                             int n) const;
  // W: dW_r += Xᵀ · gather(dY_local), db += Σ_rows dY_local (this rank's rows: a partial sum).
  absl::Status BackwardWeight(const float* dy_local,  // (m, out)
                              const float* x,         // (n, in_r)
                              int n) const;

 private:
  const SequenceParallel* sp_;
  LinearWeights p_;
};

}  // namespace vp::engine::tp
