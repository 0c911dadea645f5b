// A Communicator on device pointers that stages every call through host memory and forwards it
// to a host Communicator (Gloo, or the 1-rank self communicator). For CUDA ranks that cannot use
// NCCL: several emulated ranks on one GPU (NCCL refuses two ranks of a communicator on one
// device), or a GPU whose NCCL transport is unavailable. Slower than NCCL (two PCIe copies per
// call), byte-exact for Send/Recv/Broadcast, and the same arithmetic as the host backend for
// reductions.
//
// The caller's stream must be idle before a call (the same rule as NcclCommunicator); copies use
// cudaMemcpy, which returns when the data is in place. One thread at a time, like the inner
// communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"

namespace vp::comm {

class StagedCommunicator final : public Communicator {
 public:
  // inner: a host communicator this object uses exclusively (it must outlive this one).
  explicit StagedCommunicator(Communicator* inner) : inner_(inner) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  absl::Status AllReduce(float* data, size_t count, ReduceOp op) override;
  absl::Status Broadcast(float* data, size_t count, int root) override;
  absl::Status ReduceScatterSum(float* data, size_t count) override;
  absl::Status AllGather(float* data, size_t count) override;
  absl::Status Send(const float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Recv(float* data, size_t count, int peer, uint64_t tag) override;
  absl::Status Barrier() override { return inner_->Barrier(); }

 private:
  float* Host(size_t count);

  Communicator* inner_;
  std::vector<float> host_;  // grown to the largest call
};

}  // namespace vp::comm
