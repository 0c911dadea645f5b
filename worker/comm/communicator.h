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

// The contiguous part [begin, begin + count) of a buffer of `total` elements that member `index`
// of `parts` owns in ReduceScatterSum and AllGather: balanced, the first total % parts members
// one element more, so no member's range is padded and the ranges tile [0, total) in order.
struct ShardRange {
  size_t begin = 0;
  size_t count = 0;
  size_t end() const { return begin + count; }
};
ShardRange RangeOf(size_t total, int parts, int index);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: every rank ends with op over all ranks' data[0..count).
  virtual absl::Status AllReduce(float* data, size_t count, ReduceOp op) = 0;
  // In place: every rank ends with root's data[0..count).
  virtual absl::Status Broadcast(float* data, size_t count, int root) = 0;
  // In place, over data[0..count) split by RangeOf(count, size(), ·): afterwards this rank's
  // range holds the sum over all ranks of that range; the rest of data is unspecified. The
  // reduction of ZeRO-1 (each rank then updates only its range).
  virtual absl::Status ReduceScatterSum(float* data, size_t count) = 0;
  // In place: every rank contributes its range of data[0..count) (RangeOf) and ends with every
  // rank's range. Undoes ReduceScatterSum's split (ZeRO-1's parameter gather).
  virtual absl::Status AllGather(float* data, size_t count) = 0;
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
