#include "proto/plan/topology.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace vp::planner {

absl::StatusOr<Topology> Topology::Create(int pipeline, int data, int tensor, int max_world) {
  if (pipeline < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.pipeline: must be >= 1 (got ", pipeline, ")"));
  }
  if (data < 1) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.data: must be >= 1 (got ", data, ")"));
  }
  if (tensor < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.tensor: must be >= 1 (got ", tensor, ")"));
  }
  const int64_t world = static_cast<int64_t>(pipeline) * data * tensor;
  if (world > max_world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel: data x pipeline x tensor must be <= ", max_world, " ranks (got ", world, ")"));
  }
  return Topology(pipeline, data, tensor);
}

RankCoord Topology::CoordOf(int rank) const {
  return {.stage = rank / (t_ * d_), .replica = (rank / t_) % d_, .tensor = rank % t_};
}

int Topology::RankOf(const RankCoord& c) const {
  return c.tensor + t_ * (c.replica + d_ * c.stage);
}

std::vector<int> Topology::PipelineGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> out;
  for (c.stage = 0; c.stage < p_; ++c.stage) out.push_back(RankOf(c));
  return out;
}

std::vector<int> Topology::DataGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> out;
  for (c.replica = 0; c.replica < d_; ++c.replica) out.push_back(RankOf(c));
  return out;
}

std::vector<int> Topology::TensorGroup(int rank) const {
  RankCoord c = CoordOf(rank);
  std::vector<int> out;
  for (c.tensor = 0; c.tensor < t_; ++c.tensor) out.push_back(RankOf(c));
  return out;
}

// Each id is the group's first member (the coordinate of its axis set to 0), so it is shared
// by exactly the group.
int Topology::PipelineGroupId(int rank) const {
  RankCoord c = CoordOf(rank);
  c.stage = 0;
  return RankOf(c);
}

int Topology::DataGroupId(int rank) const {
  RankCoord c = CoordOf(rank);
  c.replica = 0;
  return RankOf(c);
}

int Topology::TensorGroupId(int rank) const {
  RankCoord c = CoordOf(rank);
  c.tensor = 0;
  return RankOf(c);
}

std::string Topology::Describe(int rank) const {
  const RankCoord c = CoordOf(rank);
  std::string out = absl::StrCat("replica ", c.replica, " stage ", c.stage);
  if (t_ > 1) absl::StrAppend(&out, " tensor ", c.tensor);
  return out;
}

}  // namespace vp::planner
