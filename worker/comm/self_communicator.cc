#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"

namespace vp::comm {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllReduce(float*, size_t, ReduceOp) override { return absl::OkStatus(); }
  absl::Status Broadcast(float*, size_t, int root) override {
    if (root != 0)
      return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " >= size 1"));
    return absl::OkStatus();
  }
  absl::Status ReduceScatterSum(float*, size_t) override { return absl::OkStatus(); }
  absl::Status AllGather(float*, size_t) override { return absl::OkStatus(); }
  absl::Status Send(const float*, size_t, int peer, uint64_t) override {
    return absl::FailedPreconditionError(
        absl::StrCat("send to rank ", peer, " on a 1-rank communicator"));
  }
  absl::Status Recv(float*, size_t, int peer, uint64_t) override {
    return absl::FailedPreconditionError(
        absl::StrCat("recv from rank ", peer, " on a 1-rank communicator"));
  }
  absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace

ShardRange RangeOf(size_t total, int parts, int index) {
  if (parts < 1 || index < 0 || index >= parts) return {};
  const size_t n = static_cast<size_t>(parts), i = static_cast<size_t>(index);
  const size_t base = total / n, extra = total % n;
  return {.begin = i * base + std::min(i, extra), .count = base + (i < extra ? 1 : 0)};
}

std::unique_ptr<Communicator> MakeSelfCommunicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace vp::comm
