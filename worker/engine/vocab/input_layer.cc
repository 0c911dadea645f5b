#include "worker/engine/vocab/input_layer.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace vp::engine::vocab {

absl::StatusOr<InputLayerShard> InputLayerShard::Create(const VocabPartition& partition, int hidden,
                                                        const float* weight, float* weight_grad,
                                                        MemoryTracker* tracker,
                                                        tp::TensorGroup tensor) {
  if (absl::Status st = ValidateShardArgs("input layer", partition, hidden, weight, weight_grad);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = ValidateTensorShard("input layer", partition, tensor); !st.ok()) return st;
  return InputLayerShard(partition, hidden, weight, weight_grad, tracker, tensor);
}

absl::StatusOr<InputLayerState> InputLayerShard::Forward(const int32_t* tokens, int n) const {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("input layer IF: n ", n, " < 1"));
  if (tokens == nullptr) return absl::InvalidArgumentError("input layer IF: tokens is null");
  const int h = hidden_, t = sp_.group().size();
  if (n % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("input layer IF: n ", n, " tokens do not split over ", t, " tensor ranks"));
  }
  InputLayerState st;
  st.n_ = n / t;
  st.n_all_ = n;
  st.local_token_.resize(n);
  st.output_ = Buffer(tracker_, MemoryCategory::kActivations, static_cast<size_t>(n) * h);
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= partition_.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("input layer IF: tokens[", i,
                                                     "] = ", tokens[i],
                                                     " outside [0, V = ", partition_.vocab, ")"));
    }
    const int32_t local =
        partition_.Owns(tokens[i]) ? static_cast<int32_t>(tokens[i] - partition_.begin) : -1;
    st.local_token_[i] = local;
    // Rows of tokens owned elsewhere stay zero (the buffer starts zeroed), so the sum
    // all-reduce adds exactly one non-zero row per token.
    if (local >= 0) {
      std::memcpy(st.output_.data() + static_cast<size_t>(i) * h,
                  weight_ + static_cast<size_t>(local) * h, h * sizeof(float));
    }
  }
  if (t > 1) {
    // The group's t shards summed, each rank keeping its own m rows.
    Buffer mine(tracker_, MemoryCategory::kActivations, static_cast<size_t>(st.n_) * h);
    if (absl::Status s = sp_.ScatterSum(st.output_.data(), n, h, mine.data()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("input layer IF group sum: ", s.message()));
    }
    st.output_ = std::move(mine);
  }
  return st;
}

absl::Status InputLayerShard::ForwardReduce(InputLayerState& st, comm::Communicator& comm) const {
  if (st.output_.empty()) {
    return absl::FailedPreconditionError("input layer IF_REDUCE: no forward output in state");
  }
  if (absl::Status s = comm.AllReduce(st.output_.data(), st.output_.size(), comm::ReduceOp::kSum);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("input layer IF_REDUCE: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status InputLayerShard::BackwardBroadcast(InputLayerState& st, comm::Communicator& comm,
                                                int root, const float* root_grad) const {
  if (st.n_ < 1) return absl::FailedPreconditionError("input layer IB_BCAST: empty state");
  if (root < 0 || root >= comm.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input layer IB_BCAST: root ", root, " outside [0, ", comm.size(), ")"));
  }
  const size_t count = static_cast<size_t>(st.n_) * hidden_;
  st.output_grad_ = Buffer(tracker_, MemoryCategory::kActivations, count);
  if (comm.rank() == root) {
    if (root_grad == nullptr) {
      return absl::InvalidArgumentError("input layer IB_BCAST: root_grad is null on the root");
    }
    std::memcpy(st.output_grad_.data(), root_grad, count * sizeof(float));
  }
  if (absl::Status s = comm.Broadcast(st.output_grad_.data(), count, root); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("input layer IB_BCAST: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status InputLayerShard::Backward(InputLayerState& st) const {
  if (st.output_grad_.empty()) {
    return absl::FailedPreconditionError("input layer IB: no broadcast gradient in state");
  }
  const int h = hidden_;
  const float* g = st.output_grad_.data();  // (n, h)
  Buffer gathered;
  if (sp_.group().size() > 1) {  // the group's rows of the gradient
    gathered = Buffer(tracker_, MemoryCategory::kActivations, static_cast<size_t>(st.n_all_) * h);
    if (absl::Status s = sp_.GatherInto(g, st.n_all_, h, gathered.data()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("input layer IB gather: ", s.message()));
    }
    g = gathered.data();
  }
  // Scatter-add: a token repeated in the microbatch adds its gradient once per occurrence.
  for (int i = 0; i < st.n_all_; ++i) {
    const int32_t local = st.local_token_[i];
    if (local < 0) continue;
    float* dst = weight_grad_ + static_cast<size_t>(local) * h;
    const float* src = g + static_cast<size_t>(i) * h;
    for (int k = 0; k < h; ++k) dst[k] += src[k];
  }
  st.output_grad_ = Buffer();
  return absl::OkStatus();
}

}  // namespace vp::engine::vocab
