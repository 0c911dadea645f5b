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
  // The data-parallel gradient reduction (GRAD_SYNC) on its own thread, overlapping the
  // backward while the pipeline's transfers run on another; false: at OPT, after them. NCCL
  // communicators of one device driven from two threads at once may deadlock (their kernels
  // wait on each other's SMs in different orders on different ranks), so the launcher sets it
  // for NCCL only where the split communicators are opted into (VOCABPIPE_NCCL_SPLIT_COMM=1).
  bool overlap_data_sync = true;
};

// p2p: stage-to-stage transfers; coll: the vocabulary barriers and the optimizer's all-reduces.
// Both take device pointers (NCCL, or comm::StagedCommunicator); they may be the same object.
// data: this stage's replicas (d > 1; device pointers too): the gradient reduction and, with
// options.data.zero, ZeRO-1's reduce-scatter and parameter gather. tensor: this stage's tensor
// group (options.tensor.size > 1; device pointers): the collectives inside the passes.
absl::StatusOr<std::unique_ptr<PipelineRank>> CreateCudaPipelineRank(
    const planner::Plan& plan, int rank, const TrainerOptions& options, const CudaRankOptions& cuda,
    comm::Communicator* p2p, comm::Communicator* coll, comm::Communicator* data = nullptr,
    comm::Communicator* tensor = nullptr);

}  // namespace vp::runtime
