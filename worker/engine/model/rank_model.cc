#include "worker/engine/model/rank_model.h"

#include "absl/strings/str_cat.h"
#include "worker/engine/init.h"

namespace vp::engine {

namespace {
constexpr float kInitStd = 0.02f;  // GPT-2's initializer_range
}  // namespace

RankLayout RankLayout::Standalone(const ModelConfig& cfg) {
  RankLayout layout;
  layout.chunks = {{0, cfg.layers}};
  return layout;
}

size_t ParamTensor::count() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

absl::StatusOr<std::unique_ptr<RankModel>> RankModel::Create(
    const ModelConfig& cfg, const RankLayout& layout, int microbatch_size,
    std::vector<int> seq_bounds, vocab::OutputAlgorithm algorithm, MemoryTracker* tracker,
    tp::TensorGroup tensor) {
  if (cfg.layers < 1 || cfg.hidden < 1 || cfg.heads < 1 || cfg.hidden % cfg.heads != 0 ||
      cfg.vocab < 2 || cfg.seq_len < 1 || cfg.ffn_hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("model config: invalid shape (layers ",
                                                   cfg.layers, ", hidden ", cfg.hidden, ", heads ",
                                                   cfg.heads, ", vocab ", cfg.vocab, ", seq_len ",
                                                   cfg.seq_len, ", ffn ", cfg.ffn_hidden, ")"));
  }
  for (const RankLayout::Chunk& c : layout.chunks) {
    if (c.first_layer < 0 || c.count < 0 || c.first_layer + c.count > cfg.layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank layout: chunk [", c.first_layer, ", ", c.first_layer + c.count,
                       ") outside the model's ", cfg.layers, " layers"));
    }
  }
  const int tensor_size = tensor.size();
  if (tensor_size > 1 && !layout.vocab_sharded) {
    return absl::InvalidArgumentError(
        "parallel.vocab: tensor parallelism needs a vocabulary-parallel method (vocab1, vocab2)");
  }
  const bool has_input = layout.vocab_sharded || layout.holds_input_layer;
  const bool has_output = layout.vocab_sharded || layout.holds_output_layer;
  // Shard pp·t + tp of p·t under tensor parallelism.
  auto partition = layout.vocab_sharded
                       ? vocab::MakeVocabPartition(cfg.vocab, layout.world * tensor_size,
                                                   layout.rank * tensor_size + tensor.rank())
                       : vocab::MakeVocabPartition(cfg.vocab, 1, 0);
  if (!partition.ok()) return partition.status();

  auto m = std::make_unique<RankModel>(PassKey{});
  m->cfg_ = cfg;
  m->layout_ = layout;
  m->tensor_ = tensor;
  m->partition_ = *partition;
  const int64_t h = cfg.hidden;
  const int64_t rows = partition->rows;
  size_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool decay, bool vocab_shard) {
    ParamTensor t;
    t.name = std::move(name);
    t.offset = offset;
    t.shape = std::move(shape);
    t.weight_decay = decay;
    t.vocab_shard = vocab_shard;
    t.global_row_begin = vocab_shard ? partition->begin : 0;
    t.valid_rows = vocab_shard ? partition->valid_rows : t.shape[0];
    t.full_shape = t.shape;
    offset += t.count();
    m->tensors_.push_back(std::move(t));
    return m->tensors_.back().offset;
  };
  if (has_input) m->wte_offset_ = add(EmbeddingTensorName(cfg), {rows, h}, true, true);
  if (layout.holds_first_group && !cfg.llama()) {  // Llama has rotary positions, no table
    m->wpe_offset_ = add("transformer.wpe.weight", {cfg.seq_len, h}, true, false);
  }
  std::vector<size_t> stack_offsets;
  for (const RankLayout::Chunk& c : layout.chunks) {
    stack_offsets.push_back(offset);
    for (int l = c.first_layer; l < c.first_layer + c.count; ++l) {
      const size_t layer_base = offset;
      for (const TensorSpec& spec : LayerTensorSpecs(cfg, tensor_size)) {
        ParamTensor p;
        p.name = LayerTensorName(cfg, l, spec.name);
        p.offset = layer_base + spec.offset;
        p.shape = spec.shape;
        p.weight_decay = spec.weight_decay;
        p.valid_rows = spec.shape[0];
        p.split = spec.split;
        p.full_shape = spec.full_shape;
        m->tensors_.push_back(std::move(p));
      }
      offset = layer_base + LayerParamCount(cfg, tensor_size);
    }
    m->chunk_params_.push_back({stack_offsets.back(), offset - stack_offsets.back()});
  }
  if (layout.holds_last_group) {
    m->lnf_offset_ = add(FinalNormTensorName(cfg), {h}, false, false);
    if (!cfg.llama()) add("transformer.ln_f.bias", {h}, false, false);  // RMSNorm has none
  }
  if (has_output) {
    m->lm_head_offset_ = cfg.tie_embeddings && has_input
                             ? m->wte_offset_
                             : add("lm_head.weight", {rows, h}, true, true);
  }

  m->params_ = Buffer(tracker, MemoryCategory::kParameters, offset);
  m->grads_ = Buffer(tracker, MemoryCategory::kGradients, offset);

  auto input =
      vocab::InputLayerShard::Create(*partition, cfg.hidden, m->params_.data() + m->wte_offset_,
                                     m->grads_.data() + m->wte_offset_, tracker, tensor);
  if (!input.ok()) return input.status();
  m->input_ = std::make_unique<vocab::InputLayerShard>(std::move(*input));
  auto output = vocab::OutputLayerShard::Create(
      *partition, cfg.hidden, algorithm, m->params_.data() + m->lm_head_offset_,
      m->grads_.data() + m->lm_head_offset_, tracker, tensor);
  if (!output.ok()) return output.status();
  m->output_ = std::make_unique<vocab::OutputLayerShard>(std::move(*output));

  for (size_t c = 0; c < layout.chunks.size(); ++c) {
    auto stack = LayerStack::Create(
        cfg, layout.chunks[c].first_layer, layout.chunks[c].count, microbatch_size, seq_bounds,
        m->params_.data() + stack_offsets[c], m->grads_.data() + stack_offsets[c], tracker, tensor);
    if (!stack.ok()) return stack.status();
    m->stacks_.push_back(std::make_unique<LayerStack>(std::move(*stack)));
  }
  return m;
}

void RankModel::Init(uint64_t seed) {
  params_.Zero();
  const int64_t h = cfg_.hidden;
  for (const ParamTensor& t : tensors_) {
    if (!t.vocab_shard) continue;
    // Real rows only: element (row, col) of the global tensor is sample row·h + col, so the
    // shard draws exactly the 1-rank model's values; padding rows stay zero.
    // A tied output copy on another rank starts equal to wte.
    const std::string& id_name =
        cfg_.tie_embeddings ? std::string(EmbeddingTensorName(cfg_)) : t.name;
    InitNormal(params_.data() + t.offset, static_cast<size_t>(t.valid_rows * h), kInitStd, seed,
               TensorId(id_name), static_cast<uint64_t>(t.global_row_begin * h));
  }
  if (layout_.holds_first_group && !cfg_.llama()) {
    InitNormal(params_.data() + wpe_offset_, static_cast<size_t>(cfg_.seq_len) * h, kInitStd, seed,
               TensorId("transformer.wpe.weight"), 0);
  }
  for (auto& stack : stacks_) stack->InitParams(seed);
  if (layout_.holds_last_group) {
    InitConstant(params_.data() + lnf_offset_, h, 1.0f);
    if (!cfg_.llama()) InitConstant(params_.data() + lnf_offset_ + h, h, 0.0f);
  }
}

const ParamTensor* RankModel::tied_output_copy() const {
  if (!cfg_.tie_embeddings || output_ == nullptr) return nullptr;
  return Find("lm_head.weight");
}

const ParamTensor* RankModel::Find(const std::string& name) const {
  for (const ParamTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::vector<DecayRange> RankModel::ReplicatedRanges() const {
  std::vector<DecayRange> ranges;
  if (tensor_.size() == 1) return ranges;
  for (const ParamTensor& t : tensors_) {
    if (!t.vocab_shard && t.split.replicated()) ranges.push_back({t.offset, t.count(), false});
  }
  return ranges;
}

absl::Status RankModel::SumReplicatedGrads() {
  if (tensor_.size() == 1) return absl::OkStatus();
  return SumReplicatedGrads(*tensor_.comm(), grads_.data());
}

absl::Status RankModel::SumReplicatedGrads(comm::Communicator& tensor, float* grads) const {
  for (const DecayRange& r : ReplicatedRanges()) {
    if (absl::Status st = tensor.AllReduce(grads + r.offset, r.count, comm::ReduceOp::kSum);
        !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("tensor group sum of replicated gradients: ", st.message()));
    }
  }
  return absl::OkStatus();
}

std::vector<DecayRange> RankModel::DecayRanges() const {
  std::vector<DecayRange> ranges;
  for (const ParamTensor& t : tensors_) ranges.push_back({t.offset, t.count(), t.weight_decay});
  return ranges;
}

}  // namespace vp::engine
