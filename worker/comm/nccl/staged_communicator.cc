#include "worker/comm/nccl/staged_communicator.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace vp::comm {
namespace {

absl::Status Copy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, const char* op) {
  if (count == 0) return absl::OkStatus();
  cudaError_t e = cudaMemcpy(dst, src, count * sizeof(float), kind);
  // A copy from pageable memory may return before the DMA lands; kernels on non-blocking
  // streams do not wait for the legacy stream, so wait here.
  if (e == cudaSuccess && kind == cudaMemcpyHostToDevice) {
    e = cudaStreamSynchronize(cudaStreamLegacy);
  }
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("staged ", op, ": cudaMemcpy ",
                                            kind == cudaMemcpyDeviceToHost ? "D2H" : "H2D", ": ",
                                            cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace

float* StagedCommunicator::Host(size_t count) {
  if (host_.size() < count) host_.resize(count);
  return host_.data();
}

absl::Status StagedCommunicator::AllReduce(float* data, size_t count, ReduceOp op) {
  float* h = Host(count);
  if (auto st = Copy(h, data, count, cudaMemcpyDeviceToHost, "all-reduce"); !st.ok()) return st;
  if (auto st = inner_->AllReduce(h, count, op); !st.ok()) return st;
  return Copy(data, h, count, cudaMemcpyHostToDevice, "all-reduce");
}

absl::Status StagedCommunicator::Broadcast(float* data, size_t count, int root) {
  float* h = Host(count);
  if (rank() == root) {
    if (auto st = Copy(h, data, count, cudaMemcpyDeviceToHost, "broadcast"); !st.ok()) return st;
  }
  if (auto st = inner_->Broadcast(h, count, root); !st.ok()) return st;
  if (rank() == root) return absl::OkStatus();
  return Copy(data, h, count, cudaMemcpyHostToDevice, "broadcast");
}

absl::Status StagedCommunicator::ReduceScatterSum(float* data, size_t count) {
  float* h = Host(count);
  if (auto st = Copy(h, data, count, cudaMemcpyDeviceToHost, "reduce-scatter"); !st.ok()) {
    return st;
  }
  if (auto st = inner_->ReduceScatterSum(h, count); !st.ok()) return st;
  const ShardRange mine = RangeOf(count, size(), rank());
  return Copy(data + mine.begin, h + mine.begin, mine.count, cudaMemcpyHostToDevice,
              "reduce-scatter");
}

absl::Status StagedCommunicator::AllGather(float* data, size_t count) {
  float* h = Host(count);
  const ShardRange mine = RangeOf(count, size(), rank());
  if (auto st =
          Copy(h + mine.begin, data + mine.begin, mine.count, cudaMemcpyDeviceToHost, "all-gather");
      !st.ok()) {
    return st;
  }
  if (auto st = inner_->AllGather(h, count); !st.ok()) return st;
  return Copy(data, h, count, cudaMemcpyHostToDevice, "all-gather");
}

absl::Status StagedCommunicator::Send(const float* data, size_t count, int peer, uint64_t tag) {
  float* h = Host(count);
  if (auto st = Copy(h, data, count, cudaMemcpyDeviceToHost, "send"); !st.ok()) return st;
  return inner_->Send(h, count, peer, tag);
}

absl::Status StagedCommunicator::Recv(float* data, size_t count, int peer, uint64_t tag) {
  float* h = Host(count);
  if (auto st = inner_->Recv(h, count, peer, tag); !st.ok()) return st;
  return Copy(data, h, count, cudaMemcpyHostToDevice, "recv");
}

}  // namespace vp::comm
