// The rules every layer stack keeps, on the CPU (LayerStack, transformer.h) or a CUDA device
// (DeviceLayerStack, cuda/transformer.h): one definition of the arguments a stack accepts and
// of the order of its passes over (microbatch, sequence chunk) slots, with the same messages.
//
// Letters: k sequence chunks of a microbatch (Seq1F1B; k = 1 for whole sequences), q one of them.
// Order of the passes of one microbatch:
//   F  of q = 0, 1, ..., k−1 in order, each slot once (each chunk's attention reads the K/V
//      cache that the earlier chunks filled);
//   B  only once all k are forwarded, then q = k−1, ..., 0 (each chunk adds its dK/dV for the
//      keys before it, so later chunks must go first), once per slot;
//   W  of a slot any time after its B (the zero-bubble schedules defer it).
#pragma once

#include <map>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/config.h"

namespace vp::engine {

// One (microbatch, sequence chunk) pair: what a stack's pass runs on. `seq` is a sequence chunk,
// never a model chunk (a model chunk is a whole stack).
struct SlotKey {
  int microbatch = 0;
  int seq = 0;
  auto operator<=>(const SlotKey&) const = default;
};

// seq_bounds = {0, e_1, ..., s}: k+1 strictly increasing positions ending at seq_len.
absl::Status ValidateSeqBounds(const std::vector<int>& seq_bounds, int seq_len);
// k sequence chunks with (nearly) equal numbers of positions.
std::vector<int> EqualSeqBounds(int seq_len, int k);

// The arguments every stack's Create checks before it touches memory: the model's sizes, the
// layer range [first_layer, first_layer + count), the microbatch size, non-null parameter and
// gradient blocks and the sequence chunk bounds.
absl::Status ValidateLayerStackArgs(const ModelConfig& cfg, int first_layer, int count,
                                    int microbatch_size, const void* params, const void* grads,
                                    const std::vector<int>& seq_bounds);

// The pass order of one stack. It holds no tensors: a stack calls Check* before a pass (a
// rejected pass touches nothing) and the matching *Done once the pass succeeded.
class SlotOrder {
 public:
  explicit SlotOrder(int num_seq_chunks) : k_(num_seq_chunks) {}

  int num_seq_chunks() const { return k_; }
  // Slots forwarded and not yet released by W.
  int live_slots() const { return static_cast<int>(slots_.size()); }

  absl::Status CheckForward(SlotKey slot) const;
  void ForwardDone(SlotKey slot);
  absl::Status CheckBackwardInput(SlotKey slot) const;
  // True when this was the microbatch's last B (q = 0): its K/V state may be released.
  bool BackwardInputDone(SlotKey slot);
  absl::Status CheckBackwardWeight(SlotKey slot) const;
  void BackwardWeightDone(SlotKey slot);
  // Forgets every slot of a microbatch (forward-only evaluation: no B or W will follow).
  void Discard(int microbatch);

 private:
  struct Microbatch {
    int next_forward = 0;   // next sequence chunk to forward
    int next_backward = 0;  // next sequence chunk to run B on (counts down from k−1)
  };
  int k_;
  std::map<SlotKey, bool> slots_;  // forwarded slot → its B has run
  std::map<int, Microbatch> microbatches_;
};

}  // namespace vp::engine
