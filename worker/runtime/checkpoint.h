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
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"

namespace vp::runtime {

// Writes a small text file atomically: to a temporary name unique to this process, then renamed
// over `path`, so readers never see a partial file and concurrent writers never share a
// temporary (worker daemons of one job write the same run files at once).
absl::Status WriteTextFileAtomically(const std::string& path, const std::string& text);

// The folder of step N: <run_dir>/step_<N>.
std::string CheckpointDir(const std::string& run_dir, int64_t step);

// Starts `model` (any rank's slice) from a Hugging Face model folder: config.json must be the
// model's architecture (GPT2LMHeadModel / LlamaForCausalLM) with the same sizes, and
// model.safetensors must hold every tensor of the model under its HF name with the global
// shape (vocabulary tensors [V, h]; GPT-2's wpe may have more positions than seq_len, the first
// seq_len are taken). Tied embeddings read the embedding (lm_head may be absent). Errors name
// the file, the key or tensor and the rule; nothing is copied unless everything checks out.
absl::Status InitFromHfDir(const std::string& dir, engine::RankModel& model);

// The GPT-2 config.json text for a model.
std::string Gpt2ConfigJson(const engine::ModelConfig& cfg);
// Hugging Face LlamaForCausalLM's config.json for a llama model.
std::string LlamaConfigJson(const engine::ModelConfig& cfg);
// The config.json of the model's architecture (one of the two above).
std::string HfConfigJson(const engine::ModelConfig& cfg);

// Saves model, config and optimizer state of a rank that holds the whole model.
absl::Status SaveCheckpoint(const std::string& run_dir, int64_t step,
                            const engine::RankModel& model, engine::AdamW& optimizer);

// The highest step with a DONE marker under run_dir, or NotFound.
absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& run_dir);

// Loads a checkpoint folder into a model of the same shape (and, if optimizer is non-null, the
// optimizer state). Every tensor is checked: present, same shape, finite; errors name the file
// and the tensor. Nothing is modified unless the whole checkpoint is valid.
absl::Status LoadCheckpoint(const std::string& step_dir, engine::RankModel& model,
                            engine::AdamW* optimizer);

}  // namespace vp::runtime
