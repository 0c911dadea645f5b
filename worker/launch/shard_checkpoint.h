// Checkpoints of pipeline runs: every rank saves its own shard (the resume state), and the
// shards of a step are merged into the Hugging Face layout a standalone run writes
// (worker/runtime/checkpoint.h), so users load a pipeline run exactly like a standalone one.
//
// Shard files (<dir>/step_<N>/rank_<R>/):
//   model.safetensors      the rank's tensors under their GPT-2 names; vocabulary shards
//                          without padding rows. Metadata: rank, world, step, and for each
//                          vocabulary shard "vocab_shard.<name>" = "<global_row_begin> <rows>".
//   optimizer.safetensors  exp_avg.<name>, exp_avg_sq.<name>; metadata adamw_step.
//   DONE                   the step, after both files.
//   MANIFEST.json          written last (docs/formats.md): run id, step, rank, world size and
//                          the size and SHA-256 of every other file. A shard counts only when
//                          its manifest verifies; every file, then the directory, is fsynced
//                          before the manifest goes in by rename.
// Merge: vocabulary shards are concatenated by global row (they must tile [0, V) exactly);
// other tensors are taken from the rank that holds them. With tied embeddings lm_head.weight
// is wte (a rank's separate output copy, kept in sync by the runtime, is not read).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/runtime/checkpoint.h"

namespace vp::launch {

// Writes rank `rank`'s shard of step `step` (MANIFEST.json last); run_id names the run in the
// manifest. optimizer_ranges = 0: the optimizer state goes to optimizer.safetensors from
// `optimizer`; d > 0 (ZeRO-1): the d replicas of the stage wrote it already, each its range
// (SaveOptimizerRange), and the manifest lists those files (`optimizer` is not read).
absl::Status SaveRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           const engine::RankModel& model, engine::AdamW& optimizer,
                           const std::string& run_id, int optimizer_ranges = 0);

// ZeRO-1 saves, one stage's d replicas together (the caller orders them: replica 0 runs
// PrepareShardSave, a barrier, every replica SaveOptimizerRange, a barrier, replica 0
// SaveRankShard with optimizer_ranges = d):
//   PrepareShardSave    the shard no longer counts (its manifest and DONE removed), its folder
//                       exists;
//   SaveOptimizerRange  optimizer-R-of-D.safetensors: for each tensor, the part of its AdamW
//                       moments inside this replica's range of the stage's flat buffer, as a
//                       1-D entry exp_avg.<name> / exp_avg_sq.<name> whose first element is
//                       the metadata "piece.<entry>" (an element index of the saved tensor).
// No replica ever holds more than its own range; a resume at any (d', p') re-slices the pieces
// by tensor name (LoadRankShard, LoadFromShards).
std::string OptimizerRangeFile(int replica, int replicas);
absl::Status PrepareShardSave(const std::string& run_dir, int64_t step, int rank);
absl::Status SaveOptimizerRange(const std::string& run_dir, int64_t step, int rank,
                                const engine::RankModel& model, engine::AdamW& shard, int replica,
                                int replicas);

// Checks rank `rank`'s shard of step `step` against its manifest: present, of this step, rank
// and world size, every file of the listed size and SHA-256. Returns the manifest's run id;
// DataLoss (naming the file) for a mismatch, FailedPrecondition for a missing manifest.
absl::StatusOr<std::string> VerifyRankShard(const std::string& run_dir, int64_t step, int rank,
                                            int world);

// Loads rank `rank`'s shard of step `step` into a model built from the same plan (and the
// optimizer state when optimizer is non-null). Verifies the manifest, then checks every tensor
// (present, shape, global rows, finite) before copying anything.
absl::Status LoadRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           engine::RankModel& model, engine::AdamW* optimizer);

// The number of ranks (pipeline stages) that saved step `step`: rank 0's manifest's world.
absl::StatusOr<int> SavedWorld(const std::string& run_dir, int64_t step);
// Both from one read of rank 0's manifest: the world, and the tensor-parallel ranks per stage
// ("tensor"; 1 when absent). Under tensor parallelism shard rank_<stage·t + tp> is stage
// `stage`'s tensor rank tp, and the world is p·t.
struct SavedRanks {
  int world = 0;
  int tensor = 1;
};
absl::StatusOr<SavedRanks> SavedRanksOf(const std::string& run_dir, int64_t step);

// Loads this rank's tensors (and, when optimizer is non-null, its AdamW moments and step) from
// step `step` saved by `saved_world` ranks under another plan — another p, or another
// vocabulary method: every tensor by name from the shard that holds it, a vocabulary shard's
// rows from the saved shards that cover them (their global rows are in the metadata), the tied
// output copy from wte when the saved plan kept only that. Every saved shard is verified, every
// piece checked (shape, finite) before anything is copied; DataLoss names what is missing.
absl::Status LoadFromShards(const std::string& run_dir, int64_t step, int saved_world,
                            engine::RankModel& model, engine::AdamW* optimizer);

struct VerifiedStep {
  int64_t step = -1;
  int world = 0;  // the ranks that saved it (SavedWorld): the plan's p, or another plan's
  // One line per newer step that was skipped: which rank's shard failed and why.
  std::vector<std::string> warnings;
};
// The highest step whose shards of all its ranks verify (and name one run): `world` (the plan's
// p), or the world rank 0's manifest records for a step saved under another plan. Newer steps that
// fail (a corrupt file, a partial save) are skipped and listed in `warnings`. When no step
// verifies: DataLoss (naming the newest corrupt file) if some candidate step has shards that
// do not match their manifests, so a resume never silently starts over on top of lost training;
// NotFound (a fresh start is safe) when there is no candidate or every candidate is a save that
// never finished (no manifest).
// max_step >= 0: only steps up to it count.
absl::StatusOr<VerifiedStep> LatestVerifiedStep(const std::string& run_dir, int world,
                                                int64_t max_step = -1);
// LatestVerifiedStep's step.
absl::StatusOr<int64_t> LatestShardedStep(const std::string& run_dir, int world);

// checkpoint.keep_last: keeps the `keep_last` newest verified steps at or below `step` (and
// anything newer) and removes every older step_<N> folder. keep_last <= 0 keeps everything.
absl::Status PruneCheckpoints(const std::string& run_dir, int64_t step, int world, int keep_last);

// Merges step `step`'s shards into <dir>/step_<N>/{model.safetensors, config.json, DONE}, or,
// when the tensors take more than max_shard_bytes (checkpoint.max_shard_bytes), into Hugging
// Face's sharded form: model-0000k-of-0000n.safetensors files of at most max_shard_bytes of
// tensor data each (a larger tensor alone in its file) plus model.safetensors.index.json. The
// merge streams: the output headers come from the shards' headers, and every tensor's bytes
// (vocabulary rows concatenated across ranks) are copied from the rank files in chunks of
// kMergeChunkBytes, so its resident memory is bounded whatever the model's size. The single
// file is byte-identical to what the in-memory merge wrote before.
inline constexpr size_t kMergeChunkBytes = 32 << 20;
absl::Status MergeShards(const std::string& run_dir, int64_t step, int world,
                         const engine::ModelConfig& config,
                         int64_t max_shard_bytes = runtime::kDefaultMaxShardBytes);

}  // namespace vp::launch
