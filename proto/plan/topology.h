// The ranks of a job and the groups they form: d data-parallel replicas of a p-stage pipeline
// (and, once tensor parallelism lands, t tensor ranks per stage), numbered in Megatron-LM's
// order — the tensor axis innermost, then data, then pipeline:
//
//   rank = tensor + t · (replica + d · stage)
//
// so the t ranks of one tensor group are neighbours (one host's GPUs), a stage's replicas
// follow each other, and adding the tensor axis later renumbers nothing for t = 1.
//
// Groups: a rank's pipeline group holds the ranks of its replica and tensor index, one per
// stage, in stage order (the plan's ranks); its data group holds the ranks of its stage and
// tensor index, one per replica, in replica order. Pure arithmetic, no I/O.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace vp::planner {

struct RankCoord {
  int stage = 0;    // pipeline position: the plan's rank
  int replica = 0;  // data-parallel index
  int tensor = 0;   // tensor-parallel index (0 until tensor parallelism)
  bool operator==(const RankCoord&) const = default;
};

class Topology {
 public:
  // InvalidArgument naming the axis for a size < 1 or a world above max_world.
  static absl::StatusOr<Topology> Create(int pipeline, int data, int tensor = 1,
                                         int max_world = 1 << 20);

  int pipeline() const { return p_; }
  int data() const { return d_; }
  int tensor() const { return t_; }
  int world() const { return p_ * d_ * t_; }

  // rank in [0, world()); coord's fields within their axes (unchecked: callers pass values
  // from the topology itself).
  RankCoord CoordOf(int rank) const;
  int RankOf(const RankCoord& coord) const;

  // The group members of `rank`, in the group's own order (its index in the group = its rank in
  // the group's communicator).
  std::vector<int> PipelineGroup(int rank) const;
  std::vector<int> DataGroup(int rank) const;
  std::vector<int> TensorGroup(int rank) const;
  // An id every member of the rank's group shares and no other group of that axis has, in
  // [0, world()): the `color` of a communicator split (ncclCommSplit) from a world communicator,
  // whose `key` is then the rank's index in the group (its stage, replica or tensor index).
  int PipelineGroupId(int rank) const;
  int DataGroupId(int rank) const;
  int TensorGroupId(int rank) const;

  // "replica R stage S" (and " tensor T" when t > 1): how logs and status name a rank.
  std::string Describe(int rank) const;

 private:
  Topology(int p, int d, int t) : p_(p), d_(d), t_(t) {}
  int p_, d_, t_;
};

}  // namespace vp::planner
