#include "worker/runtime/job_options.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"

namespace vp::runtime {

engine::ModelConfig ModelConfigFromSpec(const vocabpipe::v1::ModelSpec& m) {
  return {.layers = m.layers(),
          .hidden = m.hidden(),
          .heads = m.heads(),
          .vocab = m.vocab_size(),
          .seq_len = m.seq_len(),
          .ffn_hidden = m.ffn_hidden(),
          .tie_embeddings = m.tie_embeddings(),
          .architecture = m.architecture() == "llama" ? engine::Architecture::kLlama
                                                      : engine::Architecture::kGpt2,
          .kv_heads = m.kv_heads(),
          .rms_eps = static_cast<float>(m.has_rms_eps() ? m.rms_eps() : 1e-5),
          .rope_theta = static_cast<float>(m.has_rope_theta() ? m.rope_theta() : 10000.0)};
}

engine::Recompute RecomputeFromSpec(const vocabpipe::v1::ParallelSpec& p) {
  if (p.recompute() == "full") return engine::Recompute::kFull;
  if (p.recompute() == "selective") return engine::Recompute::kSelective;
  return engine::Recompute::kNone;
}

absl::StatusOr<TrainerOptions> TrainerOptionsFromSpec(const vocabpipe::v1::JobSpec& spec,
                                                      const planner::Plan* plan) {
  if (plan == nullptr && spec.parallel().pipeline() != 1) {
    return absl::UnimplementedError(absl::StrCat(
        "parallel.pipeline: ", spec.parallel().pipeline(),
        " ranks need the multi-process pipeline runtime, which this build does not have yet; "
        "use pipeline: 1 or `vocabpipe plan` to inspect the pipeline plan"));
  }
  if (plan == nullptr && spec.parallel().data() > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "parallel.data: ", spec.parallel().data(),
        " replicas need the multi-process runtime (`vocabpipe run`), not the in-process trainer"));
  }
  if (plan == nullptr && spec.device() != "cpu") {
    return absl::UnimplementedError(
        absl::StrCat("device: ", spec.device(), ": not available on this path; use cpu"));
  }
  TrainerOptions o;
  const auto& m = spec.model();
  o.model = ModelConfigFromSpec(m);
  o.model.recompute = RecomputeFromSpec(spec.parallel());
  o.microbatch_size = spec.parallel().microbatch_size();
  o.microbatches = spec.parallel().microbatches();
  const bool algorithm1 =
      plan == nullptr ? spec.parallel().vocab() == "vocab1" : plan->barrier == 2;
  o.algorithm = algorithm1 ? engine::vocab::OutputAlgorithm::kAlgorithm1
                           : engine::vocab::OutputAlgorithm::kAlgorithm2;
  const auto& t = spec.train();
  o.adamw = {.beta1 = static_cast<float>(t.beta1()),
             .beta2 = static_cast<float>(t.beta2()),
             .eps = static_cast<float>(t.eps()),
             .weight_decay = static_cast<float>(t.weight_decay())};
  o.lr = {.lr = static_cast<float>(t.lr()),
          .min_lr = static_cast<float>(t.min_lr()),
          .warmup_steps = t.warmup_steps(),
          .total_steps = t.steps(),
          .cosine = t.lr_schedule() == "cosine"};
  o.grad_clip = static_cast<float>(t.grad_clip());
  o.seed = t.seed();
  // The replica index is the rank's (the worker sets it from its job rank).
  o.data = {.replicas = std::max(1, spec.parallel().data()),
            .replica = 0,
            .zero = spec.parallel().zero() == 1};
  if (plan != nullptr) {
    if (plan->microbatches != o.microbatches) {
      return absl::InvalidArgumentError(absl::StrCat("plan microbatches ", plan->microbatches,
                                                     " differ from parallel.microbatches ",
                                                     o.microbatches));
    }
    if (plan->layers != o.model.layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan layers ", plan->layers, " differ from model.layers ", o.model.layers));
    }
  }
  return o;
}

int WorkerThreads(const vocabpipe::v1::JobSpec& spec) {
  if (spec.train().threads() > 0) return spec.train().threads();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int ranks = std::max(1, spec.parallel().pipeline()) * std::max(1, spec.parallel().data());
  return std::max(1, cores / ranks);
}

}  // namespace vp::runtime
