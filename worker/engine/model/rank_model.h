// The parameters one pipeline rank holds, as one flat buffer with a named tensor table
// (llm.c's single parameter buffer, with names instead of magic offsets), and the shards and
// layer stacks bound to it.
//
// A rank holds: its vocabulary shards (rows [begin, begin+rows) of wte and, when untied, of
// lm_head), the position embedding wpe if it runs the first layer group, its model chunks'
// layers, and the final LayerNorm ln_f if it runs the last layer group. A 1-rank model holds
// everything. Tensor names are Hugging Face GPT-2's or LlamaForCausalLM's (model.embed_tokens,
// model.layers.<i>.*, model.norm, lm_head; no position table); initialisation is slice-independent
// (init.h), so the tensors of a p-rank model are slices of the 1-rank model's.
//
// Tensor parallelism (docs/tensor-parallel.md): a rank of a tensor group of t holds its slices
// of every layer (tensor_parallel/split.h), vocabulary shard pp·t + tp of p·t, and whole copies
// of wpe and the final norm, whose gradients (like the layers' replicated tensors') the group
// sums once a step (SumReplicatedGrads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/config.h"
#include "worker/engine/memory.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/transformer/transformer.h"
#include "worker/engine/vocab/input_layer.h"
#include "worker/engine/vocab/output_layer.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine {

// What one rank holds. chunks[c] = {first_layer, count}: model chunk c runs layers
// [first_layer, first_layer + count). count may be 0 (a rank with only vocabulary work).
struct RankLayout {
  int rank = 0;
  int world = 1;
  struct Chunk {
    int first_layer = 0;
    int count = 0;
  };
  std::vector<Chunk> chunks;
  bool holds_first_group = true;  // owns wpe; adds position embeddings after IF
  bool holds_last_group = true;   // owns ln_f; produces X for the output layer
  // Vocabulary layers. Sharded (vocab-parallel methods): every rank holds rows
  // [rank·Vp/world, (rank+1)·Vp/world) of wte and lm_head. Not sharded (baseline, redis): the
  // whole input layer sits on the rank of the first layer group and the whole output layer on
  // the rank of the last one; with tied embeddings on different ranks each keeps a copy
  // (identical init; the runtime all-reduces their gradients).
  bool vocab_sharded = true;
  bool holds_input_layer = true;   // used when !vocab_sharded
  bool holds_output_layer = true;  // used when !vocab_sharded

  // The layout of a 1-rank model: every layer in one chunk.
  static RankLayout Standalone(const ModelConfig& cfg);
};

// One named tensor of the rank's flat buffer.
struct ParamTensor {
  std::string name;            // Hugging Face GPT-2 name, e.g. "transformer.h.0.ln_1.weight"
  size_t offset = 0;           // floats from the start of the flat buffer
  std::vector<int64_t> shape;  // local shape (vocabulary shards: {rows incl. padding, h})
  bool weight_decay = false;   // AdamW decoupled decay applies (>= 2-D weights)
  // Vocabulary shards only: global row of local row 0 and the number of real (non-padding)
  // rows; other tensors: 0 and shape[0].
  int64_t global_row_begin = 0;
  int64_t valid_rows = 0;
  bool vocab_shard = false;
  // Tensor parallelism: how the tensor is cut over the tensor group and its whole shape (a
  // layer tensor's slice, tensor_parallel/split.h); replicated and shape when not cut.
  tp::Split split;
  std::vector<int64_t> full_shape;

  size_t count() const;
};

class RankModel {
 public:
  // microbatch_size and seq_bounds (sequence chunk boundaries {0, ..., seq_len}) size the
  // layer stacks' activation slots. tracker may be null. tensor: the tensor group of this
  // stage (default: none); its communicator must outlive the model. Tensor parallelism needs a
  // sharded vocabulary.
  static absl::StatusOr<std::unique_ptr<RankModel>> Create(
      const ModelConfig& cfg, const RankLayout& layout, int microbatch_size,
      std::vector<int> seq_bounds, vocab::OutputAlgorithm algorithm, MemoryTracker* tracker,
      tp::TensorGroup tensor = {});

  // GPT-2 initialisation of every tensor this rank holds (padding rows stay zero).
  void Init(uint64_t seed);
  void ZeroGrads() { grads_.Zero(); }

  const ModelConfig& config() const { return cfg_; }
  const RankLayout& layout() const { return layout_; }
  const vocab::VocabPartition& partition() const { return partition_; }

  float* params() { return params_.data(); }  // (param_count)
  float* grads() { return grads_.data(); }    // (param_count)
  const float* params() const { return params_.data(); }
  size_t param_count() const { return params_.size(); }
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  // The tensor named `name`, or null.
  const ParamTensor* Find(const std::string& name) const;
  // The ranges AdamW decays, from the tensor table.
  std::vector<DecayRange> DecayRanges() const;
  const tp::TensorGroup& tensor_group() const { return tensor_; }
  // Tensor parallelism: the replicated tensors' gradients (the layers' norms and row-parallel
  // biases, wpe, the final norm) summed over the tensor group. Nothing at t = 1.
  absl::Status SumReplicatedGrads();
  // The same for any gradient block laid out like this model's (a device copy: `grads` in the
  // memory `tensor` takes), over `tensor`.
  absl::Status SumReplicatedGrads(comm::Communicator& tensor, float* grads) const;
  // The flat ranges of the replicated tensors (empty at t = 1): the gradient norm counts them
  // once per tensor group.
  std::vector<DecayRange> ReplicatedRanges() const;

  bool has_input_layer() const { return input_ != nullptr; }
  bool has_output_layer() const { return output_ != nullptr; }
  vocab::InputLayerShard& input_layer() { return *input_; }
  vocab::OutputLayerShard& output_layer() { return *output_; }
  // Tied embeddings whose input and output copies live on different ranks (not sharded): the
  // output copy's tensor (named lm_head.weight here), whose gradient the runtime sums with the
  // input copy's. Null otherwise.
  const ParamTensor* tied_output_copy() const;
  int num_chunks() const { return static_cast<int>(stacks_.size()); }
  LayerStack& stack(int chunk) { return *stacks_[chunk]; }
  // Where model chunk `chunk`'s layers sit in the flat buffers: [offset, offset + count), the
  // span a GRAD_SYNC(c) sums over the replicas.
  struct ParamSpan {
    size_t offset = 0;
    size_t count = 0;
  };
  ParamSpan ChunkParams(int chunk) const { return chunk_params_[chunk]; }

  // First layer group only, GPT-2 only: wpe (seq_len, h) and its gradient.
  const float* wpe() const { return params_.data() + wpe_offset_; }
  float* wpe_grad() { return grads_.data() + wpe_offset_; }
  // Last layer group only: ln_f weight/bias (h) and gradients. Llama: model.norm.weight (the
  // final RMSNorm's), and no bias (lnf_bias must not be used).
  const float* lnf_weight() const { return params_.data() + lnf_offset_; }
  const float* lnf_bias() const { return params_.data() + lnf_offset_ + cfg_.hidden; }
  float* lnf_weight_grad() { return grads_.data() + lnf_offset_; }
  float* lnf_bias_grad() { return grads_.data() + lnf_offset_ + cfg_.hidden; }

 private:
  struct PassKey {
    explicit PassKey() = default;
  };

 public:
  explicit RankModel(PassKey) {}  // use Create

 private:
  ModelConfig cfg_;
  RankLayout layout_;
  tp::TensorGroup tensor_;
  vocab::VocabPartition partition_;
  std::vector<ParamTensor> tensors_;
  Buffer params_;
  Buffer grads_;
  size_t wte_offset_ = 0;
  size_t lm_head_offset_ = 0;  // == wte_offset_ when tied
  size_t wpe_offset_ = 0;
  size_t lnf_offset_ = 0;
  std::unique_ptr<vocab::InputLayerShard> input_;
  std::unique_ptr<vocab::OutputLayerShard> output_;
  std::vector<std::unique_ptr<LayerStack>> stacks_;
  std::vector<ParamSpan> chunk_params_;  // per model chunk
};

}  // namespace vp::engine
