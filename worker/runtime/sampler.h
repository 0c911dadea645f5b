// Text generation from a checkpoint: a decoder that appends tokens to a key/value cache and
// returns the next-token logits, and the sampling loop on top of it (temperature, top-k, a
// seeded generator), as llm.c samples during training.
//
// A model architecture plugs in as a Decoder (its forward over new tokens with a cache); the
// loop, the tokenizer and the checkpoint lookup are shared. EngineDecoder serves GPT-2 and Llama:
// the CPU engine's layer stack, created with one sequence chunk per position, so that forwarding
// chunk q is exactly "one new token at position q attending to the cached keys and values of
// 0..q−1" (the Seq1F1B key/value cache, transformer.h), without a second attention kernel. For
// Llama the layers rotate q and k at the chunk's absolute position q and cache the rotated keys
// of the kv_heads key/value heads (grouped-query attention), so the cache needs nothing extra.
//
// Letters: V vocabulary size, h hidden size, s the model's context (GPT-2's n_positions, Llama's
// max_position_embeddings), P prompt tokens, N new tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/memory.h"
#include "worker/engine/model/rank_model.h"

namespace vp::runtime {

// One model's incremental forward.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual int vocab_size() const = 0;  // V
  virtual int context() const = 0;     // s: positions the model has
  virtual int position() const = 0;    // tokens in the cache
  // Empties the cache.
  virtual void Reset() = 0;
  // Appends tokens (each < V) at positions position() .. position() + n − 1 and writes the
  // logits (V) that follow the last of them. OutOfRange past the context.
  virtual absl::Status Append(std::span<const int32_t> tokens, float* logits) = 0;
};

// GPT-2 or Llama on the CPU engine, with its own copy of the weights.
class EngineDecoder final : public Decoder {
 public:
  // A decoder for `model`'s weights (a whole model: one rank, every layer).
  static absl::StatusOr<std::unique_ptr<EngineDecoder>> Create(const engine::RankModel& model);
  // Loads a checkpoint folder (config.json with model_type gpt2 or llama, model.safetensors).
  static absl::StatusOr<std::unique_ptr<EngineDecoder>> Load(const std::string& step_dir);

  int vocab_size() const override { return cfg_.vocab; }
  int context() const override { return cfg_.seq_len; }
  int position() const override { return pos_; }
  void Reset() override;
  absl::Status Append(std::span<const int32_t> tokens, float* logits) override;

  // Copies the weights of a model of the same shape (training prints samples of its model).
  absl::Status CopyWeights(const engine::RankModel& model);

  // The reference the cache is tested against: the logits (V) after tokens[0..n) computed from
  // scratch, all n positions in one causal forward, no cache.
  absl::Status FullForward(std::span<const int32_t> tokens, float* logits);

 private:
  struct PassKey {
    explicit PassKey() = default;
  };

 public:
  explicit EngineDecoder(PassKey) {}

 private:
  // The final LayerNorm and the output projection of one position's stack output x (h).
  void Logits(const float* x, float* logits) const;

  engine::ModelConfig cfg_;
  std::unique_ptr<engine::MemoryTracker> tracker_;
  std::unique_ptr<engine::RankModel> model_;  // one sequence chunk per position
  int pos_ = 0;
};

// The decoder for a checkpoint folder, by config.json's model_type. Errors name the file.
absl::StatusOr<std::unique_ptr<Decoder>> LoadDecoder(const std::string& step_dir);

struct SampleOptions {
  int max_tokens = 64;       // N
  float temperature = 1.0f;  // 0: greedy (argmax)
  int top_k = 0;             // 0: the whole vocabulary
  uint64_t seed = 1337;
};

// Checks the options: max_tokens >= 1, temperature >= 0 and finite, top_k >= 0. The error
// names the flag (--max-tokens, --temperature, --top-k).
absl::Status ValidateSampleOptions(const SampleOptions& options);

// Picks the next token from logits (V): argmax at temperature 0 (the lowest id on ties), else a
// draw from softmax(logits / T) over the top_k largest (all when 0).
int32_t PickToken(std::span<const float> logits, const SampleOptions& options,
                  std::mt19937_64& rng);

// Appends the prompt (>= 1 token) and then N picked tokens, each fed back; returns the N new
// tokens. Resets the decoder first. prompt + N must fit the context (OutOfRange naming
// --max-tokens otherwise).
absl::StatusOr<std::vector<int32_t>> Generate(Decoder& decoder, std::span<const int32_t> prompt,
                                              const SampleOptions& options);

// Text in, text out: encodes the prompt with the checkpoint's tokenizer.model (an empty prompt
// starts from the end-of-text token, as llm.c's samples do), generates and decodes.
struct TextSample {
  std::vector<int32_t> prompt_tokens, tokens;
  std::string text;  // the decoded new tokens
};
absl::StatusOr<TextSample> SampleText(Decoder& decoder, const std::string& tokenizer_path,
                                      const std::string& prompt, const SampleOptions& options);

}  // namespace vp::runtime
