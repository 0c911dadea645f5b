#include "worker/engine/transformer/slot_order.h"

#include "absl/strings/str_cat.h"

namespace vp::engine {

absl::Status ValidateSeqBounds(const std::vector<int>& seq_bounds, int seq_len) {
  if (seq_bounds.size() < 2) {
    return absl::InvalidArgumentError("seq_bounds: needs at least 2 entries {0, ..., seq_len}");
  }
  if (seq_bounds.front() != 0 || seq_bounds.back() != seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_bounds: must start at 0 and end at seq_len ", seq_len));
  }
  for (size_t i = 1; i < seq_bounds.size(); ++i) {
    if (seq_bounds[i] <= seq_bounds[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq_bounds: must be strictly increasing (entry ", i, ")"));
    }
  }
  return absl::OkStatus();
}

std::vector<int> EqualSeqBounds(int seq_len, int k) {
  std::vector<int> bounds(k + 1);
  for (int q = 0; q <= k; ++q) bounds[q] = static_cast<int>(static_cast<long>(seq_len) * q / k);
  return bounds;
}

absl::Status ValidateLayerStackArgs(const ModelConfig& cfg, int first_layer, int count,
                                    int microbatch_size, const void* params, const void* grads,
                                    const std::vector<int>& seq_bounds) {
  if (cfg.hidden <= 0 || cfg.heads <= 0 || cfg.hidden % cfg.heads != 0) {
    return absl::InvalidArgumentError("model: hidden and heads must be > 0, hidden % heads == 0");
  }
  if (cfg.ffn_hidden <= 0 || cfg.seq_len <= 0 || cfg.layers <= 0) {
    return absl::InvalidArgumentError("model: ffn_hidden, seq_len and layers must be > 0");
  }
  if (cfg.llama()) {
    if (cfg.kv_heads < 0 || cfg.kv_heads > cfg.heads || cfg.heads % cfg.num_kv_heads() != 0) {
      return absl::InvalidArgumentError(absl::StrCat("model.kv_heads: must divide heads (",
                                                     cfg.heads, " % ", cfg.kv_heads, " != 0)"));
    }
    if (cfg.head_dim() % 2 != 0 || !(cfg.rms_eps > 0) || !(cfg.rope_theta >= 1)) {
      return absl::InvalidArgumentError(
          "model: llama needs an even head dimension, rms_eps > 0 and rope_theta >= 1");
    }
  }
  if (count <= 0 || first_layer < 0 || first_layer + count > cfg.layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", first_layer, ", ",
                                                   first_layer + count, ") must lie in [0, ",
                                                   cfg.layers, ") and be non-empty"));
  }
  if (microbatch_size <= 0) {
    return absl::InvalidArgumentError("microbatch_size: must be > 0");
  }
  if (params == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("params/grads: must not be null");
  }
  return ValidateSeqBounds(seq_bounds, cfg.seq_len);
}

namespace {
std::string Pass(const char* pass, SlotKey slot) {
  return absl::StrCat(pass, "(mb ", slot.microbatch, ", seq ", slot.seq, ")");
}
}  // namespace

absl::Status SlotOrder::CheckForward(SlotKey slot) const {
  if (slot.seq < 0 || slot.seq >= k_) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot.seq: ", slot.seq, " not in [0, ", k_, ")"));
  }
  if (slots_.contains(slot)) {
    return absl::FailedPreconditionError(absl::StrCat(Pass("F", slot), ": slot already forwarded"));
  }
  const auto it = microbatches_.find(slot.microbatch);
  const int next = it == microbatches_.end() ? 0 : it->second.next_forward;
  if (next != slot.seq) {
    return absl::FailedPreconditionError(absl::StrCat(
        Pass("F", slot), ": sequence chunks must be forwarded in order; expected seq ", next));
  }
  return absl::OkStatus();
}

void SlotOrder::Discard(int microbatch) {
  std::erase_if(slots_, [microbatch](const auto& e) { return e.first.microbatch == microbatch; });
  microbatches_.erase(microbatch);
}

void SlotOrder::ForwardDone(SlotKey slot) {
  slots_[slot] = false;
  Microbatch& mb = microbatches_[slot.microbatch];
  if (++mb.next_forward == k_) mb.next_backward = k_ - 1;
}

absl::Status SlotOrder::CheckBackwardInput(SlotKey slot) const {
  const auto it = slots_.find(slot);
  if (it == slots_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(Pass("B", slot), ": slot was not forwarded"));
  }
  if (it->second) {
    return absl::FailedPreconditionError(absl::StrCat(Pass("B", slot), ": backward already ran"));
  }
  const Microbatch& mb = microbatches_.at(slot.microbatch);
  if (mb.next_forward != k_ || mb.next_backward != slot.seq) {
    return absl::FailedPreconditionError(absl::StrCat(
        Pass("B", slot),
        ": needs all sequence chunks forwarded and then runs them in reverse order; expected seq ",
        mb.next_forward != k_ ? k_ - 1 : mb.next_backward));
  }
  return absl::OkStatus();
}

bool SlotOrder::BackwardInputDone(SlotKey slot) {
  slots_.at(slot) = true;
  if (slot.seq == 0) {
    microbatches_.erase(slot.microbatch);
    return true;
  }
  --microbatches_.at(slot.microbatch).next_backward;
  return false;
}

absl::Status SlotOrder::CheckBackwardWeight(SlotKey slot) const {
  const auto it = slots_.find(slot);
  if (it == slots_.end() || !it->second) {
    return absl::FailedPreconditionError(
        absl::StrCat(Pass("W", slot), ": needs B of the slot first"));
  }
  return absl::OkStatus();
}

void SlotOrder::BackwardWeightDone(SlotKey slot) { slots_.erase(slot); }

}  // namespace vp::engine
