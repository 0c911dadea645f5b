#include "worker/engine/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace vp::engine {

absl::StatusOr<AdamW> AdamW::Create(MemoryTracker* tracker, size_t count, const AdamWConfig& config,
                                    std::vector<DecayRange> ranges) {
  return CreateShard(tracker, count, config, std::move(ranges), 0, count);
}

absl::StatusOr<AdamW> AdamW::CreateShard(MemoryTracker* tracker, size_t count,
                                         const AdamWConfig& config, std::vector<DecayRange> ranges,
                                         size_t shard_begin, size_t shard_count) {
  if (shard_begin > count || shard_count > count - shard_begin) {
    return absl::InvalidArgumentError(absl::StrCat("adamw: shard [", shard_begin, ", ",
                                                   shard_begin + shard_count,
                                                   ") exceeds the buffer of ", count));
  }
  if (!(config.beta1 >= 0.0f && config.beta1 < 1.0f) ||
      !(config.beta2 >= 0.0f && config.beta2 < 1.0f)) {
    return absl::InvalidArgumentError("adamw: beta1 and beta2 must lie in [0, 1)");
  }
  if (!(config.eps > 0.0f) || !(config.weight_decay >= 0.0f)) {
    return absl::InvalidArgumentError("adamw: eps must be > 0 and weight_decay >= 0");
  }
  AdamW opt;
  opt.config_ = config;
  opt.count_ = shard_count;
  opt.begin_ = shard_begin;
  opt.buffer_count_ = count;
  opt.decay_.assign(shard_count, 0);
  const size_t shard_end = shard_begin + shard_count;
  for (const DecayRange& r : ranges) {
    if (r.offset > count || r.count > count - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "adamw: range [", r.offset, ", ", r.offset + r.count, ") exceeds the buffer of ", count));
    }
    // The part of the range inside the shard.
    const size_t lo = std::max(r.offset, shard_begin), hi = std::min(r.offset + r.count, shard_end);
    if (r.weight_decay && lo < hi) {
      std::fill(opt.decay_.begin() + (lo - shard_begin), opt.decay_.begin() + (hi - shard_begin),
                uint8_t{1});
    }
  }
  opt.m_ = Buffer(tracker, MemoryCategory::kOptimizer, shard_count);
  opt.v_ = Buffer(tracker, MemoryCategory::kOptimizer, shard_count);
  return opt;
}

void AdamW::Step(float* params, const float* grads, float lr, float grad_scale) {
  ++step_;
  const float b1 = config_.beta1, b2 = config_.beta2;
  // Bias corrections in double: β^t underflows gracefully and stays exact for small t.
  const double bc1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step_));
  const float step_size = static_cast<float>(lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = 1.0f - lr * config_.weight_decay;
  float* m = m_.data();
  float* v = v_.data();
  params += begin_;
  grads += begin_;
  for (size_t i = 0; i < count_; ++i) {
    const float g = grads[i] * grad_scale;
    float p = params[i];
    if (decay_[i]) p *= decay;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + config_.eps;
    params[i] = p - step_size * m[i] / denom;
  }
}

double SquaredNorm(const float* grads, size_t count) {
  double s = 0.0;
  for (size_t i = 0; i < count; ++i) s += static_cast<double>(grads[i]) * grads[i];
  return s;
}

float ClipScale(double squared_norm, float max_norm) {
  if (max_norm <= 0.0f) return 1.0f;
  const double scale = max_norm / (std::sqrt(squared_norm) + 1e-6);
  return static_cast<float>(std::min(1.0, scale));
}

float LrSchedule::At(int64_t step) const {
  if (step < warmup_steps) {
    return lr * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  }
  if (!cosine) return lr;
  const int64_t decay_steps = static_cast<int64_t>(total_steps) - warmup_steps;
  double r = decay_steps > 0 ? static_cast<double>(step - warmup_steps) / decay_steps : 1.0;
  r = std::clamp(r, 0.0, 1.0);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * r));
  return static_cast<float>(min_lr + coeff * (static_cast<double>(lr) - min_lr));
}

}  // namespace vp::engine
