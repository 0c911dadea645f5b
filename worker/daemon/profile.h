// Pass profiling for the coordinator's planner: times F, B, W, S, T, IF, IB (and the optimizer
// step) at a job's real shapes on this worker, in the planner's units (planner::Costs):
// F, B, W = one pipeline stage's layers (L/p) over one whole microbatch; S, T = one rank's
// vocabulary shard (V/p rows) for one microbatch; IF, IB = the input layer on that shard.
//
// How: a one-rank plan of a model cut to one stage's layers and one shard's vocabulary
// (ceil(L/p) layers, ceil(V/p) tokens, same h, heads, s, b), scheduled with split backward
// (zbh1: B and W are separate passes) and a vocabulary-parallel output layer (vocab1: S and T
// passes), runs two steps on synthetic tokens through the real runtime (runtime::PipelineRank
// on the 1-rank communicator); the second step's busy seconds per pass kind, divided by the
// number of such passes and scaled from ceil(L/p) to L/p layers, are the costs. For p > 1,
// two Gloo ranks of this process on loopback time an all-reduce (the vocabulary collective
// cost) and a send/recv (the P2P cost) of b·s·h floats.
#pragma once

#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"
#include "vocabpipe/v1/service.pb.h"

namespace vp::daemon {

// cuda_device: a GPU daemon's device (cuda jobs are timed on it); -1 otherwise.
absl::StatusOr<vocabpipe::v1::PassCosts> ProfilePasses(const vocabpipe::v1::JobSpec& spec,
                                                       int cuda_device = -1);

}  // namespace vp::daemon
