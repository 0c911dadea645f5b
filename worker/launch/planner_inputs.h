// What the planner needs from the engine for a job: the measured activation bytes of one
// transformer layer for one microbatch at the job's shapes, the input of the planner's memory
// model. The `--direct` launcher and the daemon's profiling both pass it on.
#pragma once

#include "absl/status/statusor.h"
#include "coordinator/planner/spec_input.h"
#include "vocabpipe/v1/job.pb.h"

namespace vp::launch {

absl::StatusOr<planner::LayerActivationBytes> MeasureJobLayerActivations(
    const vocabpipe::v1::JobSpec& spec);

}  // namespace vp::launch
