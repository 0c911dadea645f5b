// AdamW with torch.optim.AdamW semantics, gradient-norm clipping, and the learning-rate
// schedule. The optimizer works on a rank's flat parameter buffer; which ranges get weight
// decay comes from the tensor specs (2-D weights yes, biases and LayerNorm no).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/memory.h"

namespace vp::engine {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
};

// A contiguous range of the flat buffer and whether weight decay applies to it.
struct DecayRange {
  size_t offset = 0;
  size_t count = 0;
  bool weight_decay = false;
};

class AdamW {
 public:
  // count: length of the flat parameter/gradient buffers. ranges: the parts of [0, count) that
  // get weight decay are those in a range with weight_decay = true; anything not covered by a
  // range is updated without decay. m and v are Buffers charged to kOptimizer.
  static absl::StatusOr<AdamW> Create(MemoryTracker* tracker, size_t count,
                                      const AdamWConfig& config, std::vector<DecayRange> ranges);
  // ZeRO stage 1: the state of [shard_begin, shard_begin + shard_count) of the flat buffer only
  // (m and v hold shard_count elements); Step updates that range and leaves the rest alone.
  static absl::StatusOr<AdamW> CreateShard(MemoryTracker* tracker, size_t count,
                                           const AdamWConfig& config,
                                           std::vector<DecayRange> ranges, size_t shard_begin,
                                           size_t shard_count);

  // One step t = step() + 1, for every element i:
  //   g = grad_scale · grads[i]                       (grad_scale: clipping / loss scaling)
  //   p ← p · (1 − lr · weight_decay)                 (decayed ranges only)
  //   m ← β1 m + (1 − β1) g;   v ← β2 v + (1 − β2) g²
  //   p ← p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps)
  // (A shard updates elements [shard_begin(), shard_begin() + count()) of the buffers.)
  void Step(float* params,       // (the whole flat buffer)
            const float* grads,  // (the whole flat buffer)
            float lr, float grad_scale = 1.0f);

  int64_t step() const { return step_; }
  size_t count() const { return count_; }        // elements of state: the shard's, or the buffer's
  size_t shard_begin() const { return begin_; }  // 0 for a whole-buffer state
  // The whole flat buffer's length (count() unless sharded).
  size_t buffer_count() const { return buffer_count_; }
  bool sharded() const { return count_ != buffer_count_; }
  const AdamWConfig& config() const { return config_; }
  // State, for checkpointing.
  Buffer& m() { return m_; }
  Buffer& v() { return v_; }
  void set_step(int64_t step) { step_ = step; }

 private:
  AdamW() = default;

  AdamWConfig config_;
  size_t count_ = 0;
  size_t begin_ = 0;
  size_t buffer_count_ = 0;
  std::vector<uint8_t> decay_;  // per element: 1 where weight decay applies
  Buffer m_;
  Buffer v_;
  int64_t step_ = 0;
};

// Σ g² in double (the caller may all-reduce it across ranks before ClipScale).
double SquaredNorm(const float* grads, size_t count);

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (sqrt(squared_norm) + 1e-6)).
// max_norm <= 0 disables clipping (returns 1).
float ClipScale(double squared_norm, float max_norm);

// Learning rate at 0-based step `step`:
//   warm-up (step < warmup_steps):  lr · (step + 1) / warmup_steps
//   constant schedule afterwards:   lr
//   cosine schedule afterwards:     r = (step − warmup) / (total_steps − warmup), clamped to
//                                   [0, 1];  min_lr + 0.5 · (1 + cos(π r)) · (lr − min_lr)
struct LrSchedule {
  float lr = 0.0f;
  float min_lr = 0.0f;
  int warmup_steps = 0;
  int total_steps = 0;
  bool cosine = false;

  float At(int64_t step) const;
};

}  // namespace vp::engine
