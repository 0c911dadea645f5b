#include "worker/launch/planner_inputs.h"

#include "worker/engine/transformer/transformer.h"
#include "worker/runtime/job_options.h"

namespace vp::launch {

absl::StatusOr<LayerActivationBytes> MeasureJobLayerActivations(
    const vocabpipe::v1::JobSpec& spec) {
  engine::ModelConfig shape = runtime::ModelConfigFromSpec(spec.model());
  shape.recompute = runtime::RecomputeFromSpec(spec.parallel());
  auto bytes = engine::MeasureLayerActivationBytes(shape, spec.parallel().microbatch_size());
  if (!bytes.ok()) return bytes.status();
  return LayerActivationBytes{.kept = bytes->kept,
                              .backward_transient = bytes->backward_transient,
                              .held_for_w = bytes->held_for_w};
}

}  // namespace vp::launch
