// Checkpoints of a standalone run, in the layout users load with Hugging Face tools:
//
//   <run_dir>/step_<N>/model.safetensors     GPT-2 tensor names and layouts, unpadded vocabulary
//   <run_dir>/step_<N>/config.json           GPT-2 config keys
//   <run_dir>/step_<N>/optimizer.safetensors AdamW exp_avg.<name> / exp_avg_sq.<name>, step
//   <run_dir>/step_<N>/DONE                  written last: a step folder without it is partial
//
// Files are written to temporaries and renamed; DONE is the commit point, so a crash mid-save
// never leaves a checkpoint that looks complete.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/runtime/safetensors.h"

namespace vp::runtime {

// Writes a small text file atomically: to a temporary name unique to this process, then renamed
// over `path`, so readers never see a partial file and concurrent writers never share a
// temporary (worker daemons of one job write the same run files at once).
absl::Status WriteTextFileAtomically(const std::string& path, const std::string& text);

// The folder of step N: <run_dir>/step_<N>.
std::string CheckpointDir(const std::string& run_dir, int64_t step);

// Hugging Face's sharded form of a model folder: model-0000k-of-0000n.safetensors (k from 1)
// plus model.safetensors.index.json = {"metadata": {"total_size": N}, "weight_map": {tensor:
// file}}. A merged export above checkpoint.max_shard_bytes takes this form (docs/formats.md).
inline constexpr char kHfSingleFile[] = "model.safetensors";
inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";
inline constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;  // as Hugging Face's default
std::string HfShardFileName(int k, int n);
// Whether `name` has the form of a shard file name (model-<5 digits>-of-<5 digits>.safetensors).
bool IsHfShardFileName(const std::string& name);

// Hugging Face's split of tensors (their byte sizes, in file order) under max_shard_bytes: one
// group when all of them fit; else a group is closed when the next tensor would take it past
// the limit (a tensor larger than the limit gets a group of its own).
std::vector<std::vector<size_t>> HfShardGroups(const std::vector<uint64_t>& bytes,
                                               int64_t max_shard_bytes);
// The file names of `groups` groups: model.safetensors for one, else HfShardFileName(k, n).
std::string HfWeightsFileName(size_t group, size_t groups);
// Completes an export whose weight files (`files`, from HfWeightsFileName) are written: for
// the sharded form writes model.safetensors.index.json ({"metadata": {"total_size"},
// "weight_map"}, fsynced); either way removes the other form's files left by an earlier export
// of the folder, so that a loader finds exactly this one.
absl::Status FinishHfWeights(const safefs::Dir& dir, const std::vector<std::string>& files,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

// The weights of a Hugging Face model folder, in either form: model.safetensors.index.json and
// the files it names when the index is there, else model.safetensors. Only headers are read;
// tensors are read in pieces from the open files. The index is external input: it must be a
// JSON object whose weight_map maps every tensor to a shard file name of this folder (a single
// path component ending in .safetensors), and each tensor must be in the file it is mapped to.
// Errors name the folder's file and the rule, never the file's text.
class HfWeights {
 public:
  static absl::StatusOr<HfWeights> Open(const safefs::Dir& dir);

  bool contains(const std::string& name) const { return where_.contains(name); }
  size_t size() const { return where_.size(); }
  std::vector<std::string> names() const;
  // The file holding `name` (null when absent) and its entry.
  const SafetensorsReader* FileOf(const std::string& name) const;
  // Where errors about the weights point: the single file, or the index.
  const std::string& path() const { return path_; }

 private:
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, const SafetensorsReader*> where_;
  std::string path_;
};

// Starts `model` (any rank's slice) from a Hugging Face model folder: config.json must be the
// model's architecture (GPT2LMHeadModel / LlamaForCausalLM) with the same sizes, and the
// weights (model.safetensors, or the sharded form: HfWeights) must hold every tensor of the
// model under its HF name with the global
// shape (vocabulary tensors [V, h]; GPT-2's wpe may have more positions than seq_len, the first
// seq_len are taken). Tied embeddings read the embedding (lm_head may be absent). Errors name
// the file, the key or tensor and the rule; nothing is copied unless everything checks out.
// Only this rank's part is read (its tensors, its vocabulary rows), by pread straight into
// the model after a check pass in bounded pieces: no copy of the file is held.
absl::Status InitFromHfDir(const std::string& dir, engine::RankModel& model);

// The GPT-2 config.json text for a model.
std::string Gpt2ConfigJson(const engine::ModelConfig& cfg);
// Hugging Face LlamaForCausalLM's config.json for a llama model.
std::string LlamaConfigJson(const engine::ModelConfig& cfg);
// The config.json of the model's architecture (one of the two above).
std::string HfConfigJson(const engine::ModelConfig& cfg);

// Saves model, config and optimizer state of a rank that holds the whole model; the model in
// the sharded form when its tensors take more than max_shard_bytes (checkpoint.max_shard_bytes).
absl::Status SaveCheckpoint(const std::string& run_dir, int64_t step,
                            const engine::RankModel& model, engine::AdamW& optimizer,
                            int64_t max_shard_bytes = kDefaultMaxShardBytes);

// The highest step with a DONE marker under run_dir, or NotFound.
absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& run_dir);

// Loads a checkpoint folder into a model of the same shape (and, if optimizer is non-null, the
// optimizer state). Every tensor is checked: present, same shape, finite; errors name the file
// and the tensor. Nothing is modified unless the whole checkpoint is valid.
absl::Status LoadCheckpoint(const std::string& step_dir, engine::RankModel& model,
                            engine::AdamW* optimizer);

}  // namespace vp::runtime
