// The collectives and point-to-point transfers a rank needs, independent of the transport
// (Gloo over TCP on CPU, NCCL on GPU). The vocabulary barriers (C0/C1/C2, the input-layer
// reduce and broadcast) and the pipeline's activation/gradient transfers are written against
// this interface only.
//
// One Communicator is used by one thread at a time (Gloo contexts are not thread-safe); a
// runtime that overlaps collectives with compute opens one communicator per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace vp::comm {

enum class ReduceOp { kSum, kMax };

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: every rank ends with op over all ranks' data[0..count).
  virtual absl::Status AllReduce(float* data, size_t count, ReduceOp op) = 0;
  // In place: every rank ends with root's data[0..count).
  virtual absl::Status Broadcast(float* data, size_t count, int root) = 0;
  // Point to point. A Send to `peer` with `tag` matches the Recv on `peer` with the same tag;
  // both block until the transfer completes (or fails / times out).
  virtual absl::Status Send(const float* data, size_t count, int peer, uint64_t tag) = 0;
  virtual absl::Status Recv(float* data, size_t count, int peer, uint64_t tag) = 0;
  virtual absl::Status Barrier() = 0;
};

// A communicator of one rank (size 1): collectives are the identity, point to point is an
// error. Standalone (pipeline = 1) training runs the same vocabulary code through it.
std::unique_ptr<Communicator> MakeSelfCommunicator();

}  // namespace vp::comm
