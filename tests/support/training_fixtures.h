// Shared by the equivalence tests (CPU ranks vs the standalone trainer, CUDA ranks vs CPU
// ranks): the plan for a test case, a deterministic batch stream and the gathering of a rank's
// weights by tensor name.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "coordinator/planner/planner.h"
#include "gtest/gtest.h"
#include "tests/support/planner_fixtures.h"
#include "worker/engine/model/rank_model.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/trainer.h"

namespace vp::runtime::fixtures {

// The planner's input for `p` ranks and `k` sequence chunks with the model and batch shape of
// `o`. The costs are fixed small numbers: these tests compare results, not timing.
inline planner::PlannerInput PlannerInputFor(planner::Schedule schedule, planner::VocabMethod vocab,
                                             int p, int k, const TrainerOptions& o) {
  planner::PlannerInput in;
  in.pipeline = p;
  in.microbatches = o.microbatches;
  in.layers = o.model.layers;
  in.seq_chunks = k;
  in.schedule = schedule;
  in.vocab = vocab;
  in.costs = planner::fixtures::UnitCosts();
  in.model.hidden = o.model.hidden;
  in.model.heads = o.model.heads;
  in.model.seq_len = o.model.seq_len;
  in.model.vocab = o.model.vocab;
  in.model.ffn = o.model.ffn_hidden;
  in.model.microbatch_size = o.microbatch_size;
  in.model.tie_embeddings = o.model.tie_embeddings;
  in.model.llama = o.model.llama();
  in.model.kv_heads = o.model.llama() ? o.model.num_kv_heads() : 0;
  in.model.tensor_parallel = o.tensor.size;
  return in;
}

// The plan of PlannerInputFor(schedule, vocab, p, k, o).
inline absl::StatusOr<planner::Plan> PlanFor(planner::Schedule schedule, planner::VocabMethod vocab,
                                             int p, int k, const TrainerOptions& o) {
  return planner::BuildPlan(PlannerInputFor(schedule, vocab, p, k, o));
}

// A test name "<schedule>_<vocab>_p<p>_k<k><suffix>" with every character GoogleTest refuses
// in a name turned into '_'.
inline std::string CaseName(planner::Schedule schedule, planner::VocabMethod vocab, int p, int k,
                            const std::string& suffix) {
  std::string s = absl::StrCat(planner::ScheduleName(schedule), "_", planner::VocabName(vocab),
                               "_p", p, "_k", k, suffix);
  for (char& c : s) {
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

// Inputs and next-token targets from one fixed random token stream (seed 5), microbatch j of
// step `step` taking the j-th slice after the previous steps'.
inline BatchFn Batches(const TrainerOptions& o) {
  auto tokens = std::make_shared<std::vector<int32_t>>(2000);
  std::mt19937 rng(5);
  for (auto& t : *tokens) t = static_cast<int32_t>(rng() % o.model.vocab);
  const int b = o.microbatch_size, m = o.microbatches, s = o.model.seq_len;
  return [tokens, b, m, s](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < b; ++t) {
      const int64_t k = (step * m + j) * b + t;
      for (int i = 0; i < s; ++i) {
        inputs[t * s + i] = (*tokens)[(k * s + i) % tokens->size()];
        targets[t * s + i] = (*tokens)[(k * s + i + 1) % tokens->size()];
      }
    }
    return absl::OkStatus();
  };
}

// Weights by (HF name, global row): the unpadded logical tensor, assembled from shards.
using Weights = std::map<std::string, std::vector<float>>;

// Any flat buffer laid out like the model's parameters (the parameters, AdamW's m or v), each
// element multiplied by `scale`, by tensor name.
inline void GatherBuffer(const engine::RankModel& model, const float* flat, float scale,
                         Weights* out, std::mutex* mu) {
  std::lock_guard<std::mutex> l(*mu);
  const int h = model.config().hidden;
  for (const engine::ParamTensor& t : model.tensors()) {
    std::string name = t.name;
    // A tied output copy on another rank equals wte after every step; compare it as wte.
    if (model.config().tie_embeddings && name == "lm_head.weight") name = "tied_copy.wte";
    std::vector<float>& dst = (*out)[name];
    const float* src = flat + t.offset;
    size_t n = t.count(), at = 0;
    const engine::tp::TensorGroup& group = model.tensor_group();
    if (!t.vocab_shard && !t.split.replicated() && group.size() > 1) {
      // A tensor rank's slice: placed into the whole tensor.
      size_t whole = 1;
      for (const int64_t d : t.full_shape) whole *= static_cast<size_t>(d);
      dst.resize(whole);
      std::vector<float> scaled(src, src + n);
      for (float& v : scaled) v *= scale;
      engine::tp::PlaceSlice(scaled.data(), t.full_shape, t.split, group.rank(), group.size(),
                             dst.data());
      continue;
    }
    if (t.vocab_shard) {
      const size_t need = static_cast<size_t>(model.config().vocab) * h;
      if (dst.size() < need) dst.resize(need);
      n = static_cast<size_t>(t.valid_rows) * h;
      at = static_cast<size_t>(t.global_row_begin) * h;
    } else {
      dst.resize(n);
    }
    std::transform(src, src + n, dst.begin() + at, [scale](float v) { return v * scale; });
  }
}

inline void Gather(const engine::RankModel& model, Weights* out, std::mutex* mu) {
  GatherBuffer(model, model.params(), 1.0f, out, mu);
}

// Every tensor of `want` is in `got` with the same size and no element further than `tol` away.
inline void ExpectWeightsNear(const Weights& want, const Weights& got, double tol) {
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name << " missing";
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(it->second[i] - w[i])));
    }
    EXPECT_LE(worst, tol) << name;
  }
}

// A created rank (or its creation error) trained over steps [first, last) with `batches`,
// `on_step` called after each step: the first error as text, "" when every step ran — what a
// thread of a rank grid stores in its rank's error slot.
inline std::string TrainRank(const absl::StatusOr<std::unique_ptr<PipelineRank>>& rank,
                             int64_t first, int64_t last, const BatchFn& batches,
                             const std::function<void(const RankStepResult&)>& on_step) {
  if (!rank.ok()) return rank.status().ToString();
  for (int64_t step = first; step < last; ++step) {
    absl::StatusOr<RankStepResult> res = (*rank)->Step(step, batches);
    if (!res.ok()) return res.status().ToString();
    on_step(*res);
  }
  return "";
}

}  // namespace vp::runtime::fixtures
