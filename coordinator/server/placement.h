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
//
// Tensor parallelism (t > 1, docs/tensor-parallel.md): a tensor group's t ranks exchange
// activations inside every pass, so each group is t workers of one host, consecutive in device
// order. The free workers (rule 1's order) are cut host by host into such groups, and rule 3
// then places whole groups as it places single workers above (a pipeline of p groups on one
// host where it fits). A host's workers beyond its last whole group are left free. Hints do not
// decide the ranks when t > 1. Too few whole groups: no placement, and `unmet` says what is
// needed and what each host has.
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
// it; empty when there are fewer candidates than ranks, or (t > 1) fewer whole tensor groups on
// single hosts than the job needs — then `unmet` (if not null) names the need and the hosts.
std::vector<int> PlaceRanks(const std::vector<PlacementCandidate>& candidates,
                            const planner::Topology& topology, std::string* unmet = nullptr);

// The device index in a worker's device string: "cuda:3" → 3; -1 for "cpu" or no index.
int DeviceIndex(const std::string& device);

}  // namespace vp::server
