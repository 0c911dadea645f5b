// Which free worker runs which rank of a job: d replicas of a p-stage pipeline (Topology).
//
// The vocabulary barriers (C1, C2 per microbatch) and the stage-to-stage transfers run inside a
// pipeline, many times a step; the replicas meet once a step (their gradient sum, which the
// plan overlaps with the backward). So a pipeline's ranks go on one host where they fit, in
// device order there (cuda:0, cuda:1, ... — NVLink neighbours on most boards), and the replicas
// spread over hosts. Rules, in order:
//   1. The workers taken are the first world() free ones by rank hint (the platform's index:
//      a StatefulSet ordinal, SLURM_PROCID), then registration — the same set as before
//      locality, so adding a worker never reshuffles who is chosen.
//   2. If every one of them carries a hint, the hints decide: rank r goes to the r-th by hint
//      (the operator laid the ranks out).
//   3. Otherwise they are grouped by host (the host with the most of them first; a tie by
//      which comes first in rule 1's order), within a host by device index, then rule 1's
//      order. Each host gives as many whole pipelines as it holds; the rest fill the remaining
//      pipelines in that order (those pipelines span hosts: nothing better fits). Pipeline j
//      is replica j, its k-th worker stage k.
// Pure: no I/O, unit-tested (placement_test).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/plan/topology.h"

namespace vp::server {

struct PlacementCandidate {
  std::string hostname;
  int device = -1;         // CUDA device index on its host, -1 for a CPU worker
  int64_t rank_hint = -1;  // -1: none
  int64_t registered = 0;  // registration order (the worker id's number)
};

// For each rank r in [0, topology.world()), the index in `candidates` of the worker that runs
// it; empty when there are fewer candidates than ranks.
std::vector<int> PlaceRanks(const std::vector<PlacementCandidate>& candidates,
                            const planner::Topology& topology);

// The device index in a worker's device string: "cuda:3" → 3; -1 for "cpu" or no index.
int DeviceIndex(const std::string& device);

}  // namespace vp::server
