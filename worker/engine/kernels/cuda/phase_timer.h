// Where a pass's device time goes, for cuda_bench's breakdown: the passes mark the start of each
// phase of their work on their stream (MarkPhase), and an active PhaseTimer records a CUDA event
// at each mark; the time between two consecutive marks on that stream is charged to the first
// mark's phase. No synchronisation is added: events are recorded asynchronously and read once,
// after the stream is idle (Collect).
//
// Finish (device.h) marks kIdle before it synchronises, so the time from a pass's end to the
// next pass's first kernel (host work, stream synchronisation, the allocator, collectives on
// other streams) is kIdle; work the bench enqueues itself is marked kOther.
//
// With no active timer MarkPhase is one relaxed atomic load: the marks stay in the training
// path at no cost. One timer at a time per process, bound to one stream; marks on other streams
// (the communication stream, other ranks' threads) are ignored.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace vp::engine::cuda {

enum class Phase : int {
  kGemmQkv,      // the attention input projection (GPT-2 c_attn; Llama wq|wk|wv)
  kGemmProj,     // the attention output projection (c_proj; Llama wo)
  kGemmFc1,      // the MLP's first linear (c_fc; Llama gate|up)
  kGemmFc2,      // the MLP's second linear (mlp.c_proj; Llama down)
  kAttention,    // flash attention forward/backward (and the backward's delta kernel)
  kNorm,         // LayerNorm / RMSNorm forward and backward
  kElementwise,  // GELU/SwiGLU, bias add and bias gradient, residual adds, RoPE
  kCopy,         // device-to-device copies (K/V cache rows, stashed gradients)
  kOutGemm,      // the output layer's GEMMs (logits, A = P'·W, ∇W, ∇X')
  kOutSoftmax,   // the output layer's softmax passes over the (n × rows) logits
  kOptimizer,    // the step's gradient zeroing, gradient norm and AdamW
  kOther,        // anything else the caller marks (embeddings, conversions, ...)
  kHost,         // marked right after a step's last launch where the host's work before the next
                 // mark (allocations, bookkeeping) could leave the stream waiting: that wait,
                 // which would otherwise be charged to the step, shows here
  kIdle,         // marked by Finish: the stream waits for the host until the next mark
  kCount
};
constexpr int kPhaseCount = static_cast<int>(Phase::kCount);

// Short fixed names for the breakdown tables ("gemm.qkv", "attention", ...).
const char* PhaseName(Phase phase);

// Starts `phase` on `stream` (see the file comment). Cheap and a no-op without an active timer.
void MarkPhase(cudaStream_t stream, Phase phase);

class PhaseTimer {
 public:
  struct Breakdown {
    std::array<double, kPhaseCount> ms{};  // device milliseconds charged to each phase
    std::array<int, kPhaseCount> marks{};  // how often each phase was entered (kIdle: syncs)
    double total_ms() const {
      double t = 0;
      for (double x : ms) t += x;
      return t;
    }
    double busy_ms() const { return total_ms() - ms[static_cast<int>(Phase::kIdle)]; }
  };

  // Activates a timer on `stream` with room for `capacity` marks (events are created here, not
  // in the timed path). Fails if another timer is active.
  static absl::StatusOr<std::unique_ptr<PhaseTimer>> Start(cudaStream_t stream,
                                                           int capacity = 16384);
  ~PhaseTimer();  // deactivates; events destroyed
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // Records a closing kIdle mark, waits for it, and returns the milliseconds per phase since
  // Start or the last Collect (the first mark opens the window); then starts afresh (the timer
  // stays active).
  absl::StatusOr<Breakdown> Collect();

  // Marks dropped in the window the last Collect covered because the capacity was reached (the
  // phases then undercount; raise the capacity).
  int dropped() const { return last_dropped_; }

  // Called by MarkPhase for the active timer's stream.
  void Record(Phase phase);

 private:
  PhaseTimer(cudaStream_t stream, std::vector<cudaEvent_t> events);
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;  // a pool; events_[i] marks phases_[i]'s start
  std::vector<Phase> phases_;
  int used_ = 0, dropped_ = 0, last_dropped_ = 0;
};

}  // namespace vp::engine::cuda
