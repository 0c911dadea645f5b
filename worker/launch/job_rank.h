// One rank of a job on the device its spec names, with the communicators it runs over:
//   cpu:          Gloo, one communicator per group (pipeline, data, tensor); the executor runs
//                 a pipeline's transfers and barriers on one thread
//   cuda, cuda:N: one rank in all: the self communicator (a lone rank never communicates);
//                 NCCL when every rank of the job has a GPU of its own — one world
//                 communicator bootstrapped through the store, and the pipeline's, the data
//                 group's and the tensor group's split from it (ncclCommSplit,
//                 planner::Topology's group ids); the pipeline's is one communicator, or with VOCABPIPE_NCCL_SPLIT_COMM=1 one for
//                 stage-to-stage transfers and one for the vocabulary barriers on a
//                 high-priority stream (and the data reduction then overlaps the backward);
//                 otherwise (several ranks on one GPU, which NCCL refuses) Gloo per group with
//                 device buffers staged through host memory (comm::StagedCommunicator).
// The ranks agree on the transport through the rendezvous store: each publishes its host and
// the PCI bus id of its device, and all read every rank's before choosing.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/plan/plan.h"
#include "proto/plan/topology.h"
#include "vocabpipe/v1/job.pb.h"
#include "worker/comm/communicator.h"
#include "worker/launch/worker.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/trainer.h"

namespace vp::launch {

struct JobRank {
  std::vector<std::unique_ptr<comm::Communicator>> comms;  // outlive the rank (declared first)
  std::unique_ptr<runtime::PipelineRank> rank;
  planner::RankCoord coord;            // this rank's stage (the plan's rank) and replica
  comm::Communicator* data = nullptr;  // the replicas of this stage (one of comms); null for d = 1
  comm::Communicator* tensor = nullptr;  // the tensor ranks of this stage (one of comms); null for t = 1
  std::string transport;               // "gloo", "nccl" or "gloo-staged"
  int cuda_device = -1;                // the CUDA device used, -1 on cpu

  ~JobRank() { rank.reset(); }  // the executor's threads use the communicators
};

// The CUDA device rank `rank` of a job on `spec_device` ("cuda" or "cuda:N") uses among
// `device_count` devices: `requested_device` when >= 0, else N of "cuda:N", else
// rank % device_count. InvalidArgument for an index out of range, FailedPrecondition "no CUDA
// device" when device_count is 0. Pure: the rule RankCudaDevice and the local control plane's
// daemons share.
absl::StatusOr<int> PickCudaDevice(const std::string& spec_device, int rank, int requested_device,
                                   int device_count);
// CUDA devices visible to this process (0 in a build without CUDA).
int CudaDeviceCount();

// The CUDA device a rank uses: options.cuda_device when >= 0, else N of "cuda:N", else
// rank % (devices on this host). InvalidArgument for an out-of-range index; FailedPrecondition
// "no CUDA device" when there is none; Unimplemented in a build without CUDA.
absl::StatusOr<int> RankCudaDevice(const vocabpipe::v1::JobSpec& spec, int rank,
                                   int requested_device);

// Connects this rank to the others (bounded by options.timeout) and builds its PipelineRank.
// options.rank is the job rank (planner::Topology: replica + d · stage); the rank joins its
// replica's pipeline as `stage` and, for d > 1, its stage's data group as `replica`.
absl::StatusOr<std::unique_ptr<JobRank>> ConnectJobRank(
    const vocabpipe::v1::JobSpec& spec, const planner::Plan& plan,
    const runtime::TrainerOptions& trainer, const WorkerOptions& options,
    std::shared_ptr<gloo::rendezvous::Store> store);

// A one-rank job's rank in this process over `self` (a 1-rank communicator; its identity
// collectives take device pointers too): the pass profiler's rank, on the spec's device.
absl::StatusOr<std::unique_ptr<runtime::PipelineRank>> CreateLocalRank(
    const vocabpipe::v1::JobSpec& spec, const planner::Plan& plan,
    const runtime::TrainerOptions& trainer, comm::Communicator* self, int cuda_device);

// Dense peak FLOP/s one rank of this job can reach, for MFU: the CUDA device's bf16 (or fp32:
// half of it is not a datasheet number, so fp32 jobs report against the bf16 peak as well)
// tensor-core peak from engine::cuda::PeakBf16Tflops; 0 when the device is unknown. Not for cpu.
double CudaPeakFlops(int device);
// The memory of CUDA device `device` in bytes; 0 when unknown or without CUDA.
int64_t CudaMemoryBytes(int device);

}  // namespace vp::launch
