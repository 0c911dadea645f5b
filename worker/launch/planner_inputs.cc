#include "worker/launch/planner_inputs.h"

#include "worker/engine/transformer/transformer.h"

namespace vp::launch {

absl::StatusOr<LayerActivationBytes> MeasureJobLayerActivations(
    const vocabpipe::v1::JobSpec& spec) {
  const engine::ModelConfig shape{.layers = spec.model().layers(),
                                  .hidden = spec.model().hidden(),
                                  .heads = spec.model().heads(),
                                  .vocab = spec.model().vocab_size(),
                                  .seq_len = spec.model().seq_len(),
                                  .ffn_hidden = spec.model().ffn_hidden(),
                                  .tie_embeddings = spec.model().tie_embeddings()};
  auto bytes = engine::MeasureLayerActivationBytes(shape, spec.parallel().microbatch_size());
  if (!bytes.ok()) return bytes.status();
  return LayerActivationBytes{.kept = bytes->kept,
                                       .backward_transient = bytes->backward_transient};
}

}  // namespace vp::launch
