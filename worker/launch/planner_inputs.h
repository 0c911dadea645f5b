// What the planner needs from the engine for a job: the measured activation bytes of one
// transformer layer for one microbatch at the job's shapes, the input of the planner's memory
// model. The `--direct` launcher and the daemon's profiling both pass it on.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::launch {

// Bytes of one layer's activations for one microbatch: kept from F until B, and the extra
// working set B needs while it runs (planner::LayerActivationBytes is the planner's copy).
struct LayerActivationBytes {
  int64_t kept = 0;
  int64_t backward_transient = 0;
  int64_t held_for_w = 0;  // held from a split B until its W
};

absl::StatusOr<LayerActivationBytes> MeasureJobLayerActivations(const vocabpipe::v1::JobSpec& spec);

}  // namespace vp::launch
