// A pipeline rank on a CUDA device: the plan executor (rank_executor.h) over CudaStageEngine.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "worker/comm/communicator.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime {

enum class DevicePrecision { kBf16, kFp32 };

struct CudaRankOptions {
  int device = 0;  // CUDA device index on this host
  DevicePrecision precision = DevicePrecision::kBf16;
  // The transport has no tags (NCCL): each pair's transfers must match in plan order
  // (CheckP2POrderMatches). False for a tagged transport (a host-staged Gloo communicator).
  bool untagged_p2p = true;
};

// p2p: stage-to-stage transfers; coll: the vocabulary barriers and the optimizer's all-reduces.
// Both take device pointers (NCCL, or comm::StagedCommunicator); they may be the same object.
absl::StatusOr<std::unique_ptr<PipelineRank>> CreateCudaPipelineRank(
    const planner::Plan& plan, int rank, const TrainerOptions& options, const CudaRankOptions& cuda,
    comm::Communicator* p2p, comm::Communicator* coll, comm::Communicator* data = nullptr);

}  // namespace vp::runtime
