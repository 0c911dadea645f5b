#include "worker/engine/kernels/cuda/phase_timer.h"

#include <atomic>
#include <utility>

#include "absl/status/status.h"
#include "worker/engine/kernels/cuda/check.h"

namespace vp::engine::cuda {
namespace {

std::atomic<PhaseTimer*> g_active{nullptr};
std::atomic<cudaStream_t> g_stream{nullptr};

}  // namespace

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kGemmQkv:
      return "gemm.qkv";
    case Phase::kGemmProj:
      return "gemm.proj";
    case Phase::kGemmFc1:
      return "gemm.fc1";
    case Phase::kGemmFc2:
      return "gemm.fc2";
    case Phase::kAttention:
      return "attention";
    case Phase::kNorm:
      return "norm";
    case Phase::kElementwise:
      return "eltwise";
    case Phase::kCopy:
      return "copy";
    case Phase::kOutGemm:
      return "out.gemm";
    case Phase::kOutSoftmax:
      return "out.softmax";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kOther:
      return "other";
    case Phase::kHost:
      return "host";
    case Phase::kIdle:
      return "idle";
    case Phase::kCount:
      break;
  }
  return "?";
}

void MarkPhase(cudaStream_t stream, Phase phase) {
  PhaseTimer* t = g_active.load(std::memory_order_relaxed);
  if (t == nullptr || g_stream.load(std::memory_order_relaxed) != stream) return;
  t->Record(phase);
}

void PhaseTimer::Record(Phase phase) {
  if (used_ >= static_cast<int>(events_.size())) {
    ++dropped_;
    return;
  }
  // An error here (a sticky device error) shows up at the pass's own next check.
  if (cudaEventRecord(events_[used_], stream_) != cudaSuccess) return;
  phases_[used_++] = phase;
}

PhaseTimer::PhaseTimer(cudaStream_t stream, std::vector<cudaEvent_t> events)
    : stream_(stream), events_(std::move(events)), phases_(events_.size(), Phase::kIdle) {}

absl::StatusOr<std::unique_ptr<PhaseTimer>> PhaseTimer::Start(cudaStream_t stream, int capacity) {
  if (capacity < 2) return absl::InvalidArgumentError("PhaseTimer: capacity < 2");
  std::vector<cudaEvent_t> events;
  events.reserve(capacity);
  for (int i = 0; i < capacity; ++i) {
    cudaEvent_t e = nullptr;
    if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
      for (cudaEvent_t made : events) cudaEventDestroy(made);
      VP_CUDA_RETURN_IF_ERROR(err);
    }
    events.push_back(e);
  }
  std::unique_ptr<PhaseTimer> timer(new PhaseTimer(stream, std::move(events)));
  PhaseTimer* expected = nullptr;
  if (!g_active.compare_exchange_strong(expected, timer.get())) {
    return absl::FailedPreconditionError("PhaseTimer: another timer is active");
  }
  g_stream.store(stream);
  return timer;
}

PhaseTimer::~PhaseTimer() {
  PhaseTimer* self = this;
  if (g_active.compare_exchange_strong(self, nullptr)) g_stream.store(nullptr);
  cudaStreamSynchronize(stream_);  // no event may be pending when destroyed
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

absl::StatusOr<PhaseTimer::Breakdown> PhaseTimer::Collect() {
  Breakdown out;
  // The closing mark ends the last phase; it needs a free slot even when the pool is full.
  if (used_ == static_cast<int>(events_.size())) --used_, ++dropped_;
  Record(Phase::kIdle);
  if (used_ > 0) VP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[used_ - 1]));
  for (int i = 0; i + 1 < used_; ++i) {
    float t = 0;
    VP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, events_[i], events_[i + 1]));
    out.ms[static_cast<int>(phases_[i])] += t;
    ++out.marks[static_cast<int>(phases_[i])];
  }
  used_ = 0;
  last_dropped_ = dropped_;
  dropped_ = 0;
  return out;
}

}  // namespace vp::engine::cuda
