// Checkpoints under ZeRO-1 (parallel.zero: 1): each replica of a stage holds the AdamW state of
// its range of the stage's flat buffer only (comm::RangeOf), but a shard on disk holds the whole
// stage's state, in the format every other run writes — so a run saved at one data-parallel
// degree resumes at any other, and at zero: 0.
//
// Saving gathers the ranges onto replica 0, which writes the shard; loading reads the whole
// state on every replica and keeps its range. Both hold the whole state for the duration of the
// save or load only (a transient of the unsharded size, in host memory).
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/optimizer.h"

namespace vp::launch {

// A whole-buffer AdamW with the shard's configuration and step, m and v zero: the state a
// shard file is read into (outside any memory tracker: a transient).
absl::StatusOr<std::unique_ptr<engine::AdamW>> WholeOptimizerLike(const engine::AdamW& shard);

// Collective over `data` (the stage's replicas; rank r holds comm::RangeOf(n, d, r)): replica 0
// returns the whole state (every range in place), the others send their range and return null.
absl::StatusOr<std::unique_ptr<engine::AdamW>> GatherOptimizerState(engine::AdamW& shard,
                                                                    comm::Communicator& data);

// shard's m and v = whole's over the shard's range, and whole's step.
absl::Status TakeOptimizerRange(engine::AdamW& whole, engine::AdamW& shard);

}  // namespace vp::launch
