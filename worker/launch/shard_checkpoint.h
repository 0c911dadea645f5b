// Checkpoints of pipeline runs: every rank saves its own shard (the resume state), and the
// shards of a step are merged into the Hugging Face layout a standalone run writes
// (worker/runtime/checkpoint.h), so users load a pipeline run exactly like a standalone one.
//
// Shard files (<dir>/step_<N>/rank_<R>/):
//   model.safetensors      the rank's tensors under their GPT-2 names; vocabulary shards
//                          without padding rows. Metadata: rank, world, step, and for each
//                          vocabulary shard "vocab_shard.<name>" = "<global_row_begin> <rows>".
//   optimizer.safetensors  exp_avg.<name>, exp_avg_sq.<name>; metadata adamw_step.
//   DONE                   written last.
// Merge: vocabulary shards are concatenated by global row (they must tile [0, V) exactly);
// other tensors are taken from the rank that holds them. With tied embeddings lm_head.weight
// is wte (a rank's separate output copy, kept in sync by the runtime, is not read).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"

namespace vp::launch {

// Writes rank `rank`'s shard of step `step` (DONE last).
absl::Status SaveRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           const engine::RankModel& model, engine::AdamW& optimizer);

// Loads rank `rank`'s shard of step `step` into a model built from the same plan (and the
// optimizer state when optimizer is non-null). Checks every tensor (present, shape, global
// rows, finite) before copying anything.
absl::Status LoadRankShard(const std::string& run_dir, int64_t step, int rank,
                           engine::RankModel& model, engine::AdamW* optimizer);

// The highest step whose shards of all `world` ranks are complete, or NotFound.
absl::StatusOr<int64_t> LatestShardedStep(const std::string& run_dir, int world);

// Merges step `step`'s shards into <dir>/step_<N>/{model.safetensors, config.json, DONE}.
absl::Status MergeShards(const std::string& run_dir, int64_t step, int world,
                         const engine::ModelConfig& config);

}  // namespace vp::launch
