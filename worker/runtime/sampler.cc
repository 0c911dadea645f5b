#include "worker/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "proto/safefs/dir.h"
#include "worker/comm/communicator.h"
#include "worker/data/tokenizer.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/runtime/checkpoint.h"

namespace vp::runtime {
namespace fs = std::filesystem;

using engine::Buffer;
using engine::MemoryCategory;

namespace {

// Sequence chunk bounds with one position per chunk: {0, 1, ..., s}.
std::vector<int> PerPositionBounds(int s) {
  std::vector<int> bounds(static_cast<size_t>(s) + 1);
  std::iota(bounds.begin(), bounds.end(), 0);
  return bounds;
}

// Read by handle without following a link, like the weights LoadCheckpoint reads after it.
absl::StatusOr<nlohmann::json> ReadConfig(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "config.json").string();
  auto dir = safefs::Dir::Open(step_dir);
  absl::StatusOr<std::string> text =
      dir.ok() ? dir->ReadFile("config.json", 1 << 20) : absl::StatusOr<std::string>(dir.status());
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    }
    return text.status();
  }
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

// GPT-2 config.json keys (checkpoint.h writes them) → the engine's config.
absl::StatusOr<engine::ModelConfig> Gpt2Config(const nlohmann::json& j, const std::string& path) {
  engine::ModelConfig cfg;
  for (const auto& [key, field] :
       {std::pair{"n_layer", &cfg.layers}, std::pair{"n_embd", &cfg.hidden},
        std::pair{"n_head", &cfg.heads}, std::pair{"vocab_size", &cfg.vocab},
        std::pair{"n_positions", &cfg.seq_len}, std::pair{"n_inner", &cfg.ffn_hidden}}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < 1 ||
        it->get<int64_t>() > (1 << 24)) {
      return absl::DataLossError(
          absl::StrCat(path, ": ", key, " missing or not an integer in [1, ", 1 << 24, "]"));
    }
    *field = it->get<int>();
  }
  if (cfg.hidden % cfg.heads != 0) {
    return absl::DataLossError(absl::StrCat(path, ": n_embd must be a multiple of n_head"));
  }
  cfg.tie_embeddings = j.value("tie_word_embeddings", false);
  return cfg;
}

// Llama config.json keys (LlamaConfigJson writes them; Hugging Face's defaults where a key may
// be absent) → the engine's config.
absl::StatusOr<engine::ModelConfig> LlamaConfig(const nlohmann::json& j, const std::string& path) {
  engine::ModelConfig cfg;
  cfg.architecture = engine::Architecture::kLlama;
  cfg.kv_heads = 0;
  for (const auto& [key, field] :
       {std::pair{"num_hidden_layers", &cfg.layers}, std::pair{"hidden_size", &cfg.hidden},
        std::pair{"num_attention_heads", &cfg.heads},
        std::pair{"num_key_value_heads", &cfg.kv_heads}, std::pair{"vocab_size", &cfg.vocab},
        std::pair{"max_position_embeddings", &cfg.seq_len},
        std::pair{"intermediate_size", &cfg.ffn_hidden}}) {
    auto it = j.find(key);
    if (it == j.end() && std::string_view(key) == "num_key_value_heads") continue;  // = heads
    if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < 1 ||
        it->get<int64_t>() > (1 << 24)) {
      return absl::DataLossError(
          absl::StrCat(path, ": ", key, " missing or not an integer in [1, ", 1 << 24, "]"));
    }
    *field = it->get<int>();
  }
  if (cfg.hidden % cfg.heads != 0 || cfg.heads % cfg.num_kv_heads() != 0) {
    return absl::DataLossError(
        absl::StrCat(path,
                     ": hidden_size must be a multiple of num_attention_heads, and that of "
                     "num_key_value_heads"));
  }
  if (auto it = j.find("head_dim");
      it != j.end() && !it->is_null() &&
      (!it->is_number_integer() || it->get<int64_t>() != cfg.head_dim())) {
    return absl::DataLossError(
        absl::StrCat(path, ": head_dim must equal hidden_size / num_attention_heads"));
  }
  for (const auto& [key, field] :
       {std::pair{"rms_norm_eps", &cfg.rms_eps}, std::pair{"rope_theta", &cfg.rope_theta}}) {
    auto it = j.find(key);
    if (it == j.end()) continue;  // the defaults: 1e-5 (HF: 1e-6) and 10000
    if (!it->is_number() || !(it->get<double>() > 0) || !std::isfinite(it->get<double>())) {
      return absl::DataLossError(absl::StrCat(path, ": ", key, " must be a positive number"));
    }
    *field = static_cast<float>(it->get<double>());
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return absl::DataLossError(
        absl::StrCat(path, ": rope_scaling is not supported (must be null)"));
  }
  cfg.tie_embeddings = j.value("tie_word_embeddings", false);
  return cfg;
}

}  // namespace

// ---- GPT-2 and Llama on the CPU engine ----

absl::StatusOr<std::unique_ptr<EngineDecoder>> EngineDecoder::Create(
    const engine::RankModel& model) {
  const engine::ModelConfig& cfg = model.config();
  if (model.layout().world != 1 || model.num_chunks() != 1) {
    return absl::InvalidArgumentError("sampling needs the whole model on one rank");
  }
  auto d = std::make_unique<EngineDecoder>(PassKey{});
  d->cfg_ = cfg;
  d->tracker_ = std::make_unique<engine::MemoryTracker>();
  auto m = engine::RankModel::Create(
      cfg, engine::RankLayout::Standalone(cfg), /*b=*/1, PerPositionBounds(cfg.seq_len),
      engine::vocab::OutputAlgorithm::kAlgorithm2, d->tracker_.get());
  if (!m.ok()) return m.status();
  d->model_ = std::move(*m);
  if (auto st = d->CopyWeights(model); !st.ok()) return st;
  return d;
}

absl::StatusOr<std::unique_ptr<EngineDecoder>> EngineDecoder::Load(const std::string& step_dir) {
  auto j = ReadConfig(step_dir);
  if (!j.ok()) return j.status();
  const std::string path = (fs::path(step_dir) / "config.json").string();
  const std::string type = j->value("model_type", std::string());
  if (type != "gpt2" && type != "llama") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model_type is not gpt2 or llama"));
  }
  auto cfg = type == "gpt2" ? Gpt2Config(*j, path) : LlamaConfig(*j, path);
  if (!cfg.ok()) return cfg.status();
  auto d = std::make_unique<EngineDecoder>(PassKey{});
  d->cfg_ = *cfg;
  d->tracker_ = std::make_unique<engine::MemoryTracker>();
  auto m = engine::RankModel::Create(
      *cfg, engine::RankLayout::Standalone(*cfg), /*b=*/1, PerPositionBounds(cfg->seq_len),
      engine::vocab::OutputAlgorithm::kAlgorithm2, d->tracker_.get());
  if (!m.ok()) return m.status();
  d->model_ = std::move(*m);
  if (auto st = LoadCheckpoint(step_dir, *d->model_, nullptr); !st.ok()) return st;
  return d;
}

absl::Status EngineDecoder::CopyWeights(const engine::RankModel& model) {
  const engine::ModelConfig& c = model.config();
  if (c.layers != cfg_.layers || c.hidden != cfg_.hidden || c.heads != cfg_.heads ||
      c.vocab != cfg_.vocab || c.seq_len != cfg_.seq_len || c.ffn_hidden != cfg_.ffn_hidden ||
      c.tie_embeddings != cfg_.tie_embeddings || c.architecture != cfg_.architecture ||
      c.num_kv_heads() != cfg_.num_kv_heads() || c.rms_eps != cfg_.rms_eps ||
      c.rope_theta != cfg_.rope_theta || model.param_count() != model_->param_count()) {
    return absl::InvalidArgumentError("sampler: the model's shape differs from the decoder's");
  }
  std::copy_n(model.params(), model.param_count(), model_->params());
  Reset();
  return absl::OkStatus();
}

void EngineDecoder::Reset() {
  model_->stack(0).DiscardMicrobatch(0);
  pos_ = 0;
}

void EngineDecoder::Logits(const float* x, float* logits) const {
  const int h = cfg_.hidden;
  std::vector<float> y(static_cast<size_t>(h));  // ln_f(x) (h); Llama: norm(x), an RMSNorm
  float mean = 0, rstd = 0;
  if (cfg_.llama()) {
    engine::cpu::RmsNormForward(y.data(), &rstd, x, model_->lnf_weight(), 1, h, cfg_.rms_eps);
  } else {
    engine::cpu::LayerNormForward(y.data(), &mean, &rstd, x, model_->lnf_weight(),
                                  model_->lnf_bias(), 1, h);
  }
  // The output projection: lm_head (tied: the token embedding), rows (V incl. padding, h).
  const engine::ParamTensor* w = model_->Find("lm_head.weight");
  if (w == nullptr) w = model_->Find(engine::EmbeddingTensorName(cfg_));
  const float* wp = model_->params() + w->offset;
  for (int v = 0; v < cfg_.vocab; ++v) {
    const float* row = wp + static_cast<size_t>(v) * h;
    float acc = 0;
    for (int i = 0; i < h; ++i) acc += row[i] * y[i];
    logits[v] = acc;
  }
}

absl::Status EngineDecoder::Append(std::span<const int32_t> tokens, float* logits) {
  if (tokens.empty()) return absl::InvalidArgumentError("sampler: no tokens to append");
  if (pos_ + static_cast<int64_t>(tokens.size()) > cfg_.seq_len) {
    return absl::OutOfRangeError(absl::StrCat(
        "sampler: ", pos_ + tokens.size(), " tokens exceed the model's context of ", cfg_.seq_len,
        " positions (", cfg_.llama() ? "max_position_embeddings" : "n_positions", ")"));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= cfg_.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampler: token ", t, " is outside the vocabulary [0, ", cfg_.vocab, ")"));
    }
  }
  const int h = cfg_.hidden;
  auto comm = comm::MakeSelfCommunicator();
  Buffer out(tracker_.get(), MemoryCategory::kActivations, static_cast<size_t>(h));  // (1, 1, h)
  for (int32_t t : tokens) {
    // One position: embedding lookup + position embedding (GPT-2; Llama's layers rotate q and k
    // at the chunk's absolute position instead), then chunk `pos_` of the stack, which attends
    // to the keys and values the earlier chunks left in the cache.
    auto in = model_->input_layer().Forward(&t, 1);
    if (!in.ok()) return in.status();
    if (auto st = model_->input_layer().ForwardReduce(*in, *comm); !st.ok()) return st;
    float* x = in->mutable_output();  // (1, 1, h)
    if (!cfg_.llama()) engine::cpu::PositionEmbeddingForward(x, model_->wpe(), 1, 1, h, pos_);
    if (auto st = model_->stack(0).Forward({0, pos_}, x, out.data()); !st.ok()) return st;
    ++pos_;
  }
  Logits(out.data(), logits);
  return absl::OkStatus();
}

absl::Status EngineDecoder::FullForward(std::span<const int32_t> tokens, float* logits) {
  const int n = static_cast<int>(tokens.size()), h = cfg_.hidden;
  if (n < 1 || n > cfg_.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampler: full forward of ", n, " tokens; the context is ", cfg_.seq_len));
  }
  // A model whose first sequence chunk is exactly the n tokens: one causal forward, no cache.
  std::vector<int> bounds = {0, n};
  if (n < cfg_.seq_len) bounds.push_back(cfg_.seq_len);
  engine::MemoryTracker tracker;
  auto m = engine::RankModel::Create(cfg_, engine::RankLayout::Standalone(cfg_), 1, bounds,
                                     engine::vocab::OutputAlgorithm::kAlgorithm2, &tracker);
  if (!m.ok()) return m.status();
  std::copy_n(model_->params(), model_->param_count(), (*m)->params());
  auto comm = comm::MakeSelfCommunicator();
  auto in = (*m)->input_layer().Forward(tokens.data(), n);
  if (!in.ok()) return in.status();
  if (auto st = (*m)->input_layer().ForwardReduce(*in, *comm); !st.ok()) return st;
  float* x = in->mutable_output();  // (1, n, h)
  if (!cfg_.llama()) engine::cpu::PositionEmbeddingForward(x, (*m)->wpe(), 1, n, h, 0);
  std::vector<float> out(static_cast<size_t>(n) * h);  // (1, n, h)
  if (auto st = (*m)->stack(0).Forward({0, 0}, x, out.data()); !st.ok()) return st;
  (*m)->stack(0).DiscardMicrobatch(0);
  Logits(out.data() + static_cast<size_t>(n - 1) * h, logits);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Decoder>> LoadDecoder(const std::string& step_dir) {
  auto j = ReadConfig(step_dir);
  if (!j.ok()) return j.status();
  const std::string type = j->value("model_type", std::string());
  if (type == "gpt2" || type == "llama") {
    auto d = EngineDecoder::Load(step_dir);
    if (!d.ok()) return d.status();
    return std::unique_ptr<Decoder>(std::move(*d));
  }
  return absl::UnimplementedError(absl::StrCat((fs::path(step_dir) / "config.json").string(),
                                               ": model_type \"", type.substr(0, 32),
                                               "\" has no decoder (gpt2 and llama have)"));
}

// ---- sampling ----

absl::Status ValidateSampleOptions(const SampleOptions& o) {
  if (o.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-tokens: must be >= 1 (got ", o.max_tokens, ")"));
  }
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError("--temperature: must be a finite number >= 0");
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--top-k: must be >= 0 (got ", o.top_k, ")"));
  }
  return absl::OkStatus();
}

int32_t PickToken(std::span<const float> logits, const SampleOptions& o, std::mt19937_64& rng) {
  const int V = static_cast<int>(logits.size());
  if (o.temperature == 0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // The candidates: ids by descending logit (ties: lower id first), the first top_k of them.
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const int k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  // softmax(logits / T) over the candidates, in double; the draw is one uniform in [0, 1),
  // made from 53 random bits so that the same seed gives the same tokens everywhere.
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[ids[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += p[i] = std::exp((logits[ids[i]] - top) / o.temperature);
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
  double acc = 0;
  for (int i = 0; i < k; ++i) {
    acc += p[i];
    if (u < acc) return ids[i];
  }
  return ids[k - 1];
}

absl::StatusOr<std::vector<int32_t>> Generate(Decoder& decoder, std::span<const int32_t> prompt,
                                              const SampleOptions& options) {
  if (auto st = ValidateSampleOptions(options); !st.ok()) return st;
  if (prompt.empty()) return absl::InvalidArgumentError("sampler: the prompt has no tokens");
  // The last new token is never fed back: prompt + N − 1 positions are forwarded.
  if (static_cast<int64_t>(prompt.size()) + options.max_tokens - 1 > decoder.context()) {
    return absl::OutOfRangeError(
        absl::StrCat("--max-tokens: ", prompt.size(), " prompt tokens + ", options.max_tokens,
                     " new ones exceed the model's context of ", decoder.context(), " positions"));
  }
  decoder.Reset();
  std::mt19937_64 rng(options.seed);
  std::vector<float> logits(static_cast<size_t>(decoder.vocab_size()));
  if (auto st = decoder.Append(prompt, logits.data()); !st.ok()) return st;
  std::vector<int32_t> out;
  for (int i = 0; i < options.max_tokens; ++i) {
    const int32_t next = PickToken(logits, options, rng);
    out.push_back(next);
    if (i + 1 == options.max_tokens) break;
    if (auto st = decoder.Append({&next, 1}, logits.data()); !st.ok()) return st;
  }
  return out;
}

absl::StatusOr<TextSample> SampleText(Decoder& decoder, const std::string& tokenizer_path,
                                      const std::string& prompt, const SampleOptions& options) {
  auto tok = data::Tokenizer::Load(tokenizer_path);
  if (!tok.ok()) return tok.status();
  if (tok->vocab_size() != decoder.vocab_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(tokenizer_path, ": the tokenizer has ", tok->vocab_size(),
                     " tokens but the model's vocab_size is ", decoder.vocab_size()));
  }
  TextSample s;
  if (prompt.empty()) {
    s.prompt_tokens = {static_cast<int32_t>(tok->eot_id())};
  } else {
    if (const int64_t bad = data::FirstInvalidUtf8(prompt); bad >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt: not UTF-8 text: invalid byte sequence at byte offset ", bad));
    }
    auto ids = tok->Encode(prompt);
    if (!ids.ok())
      return absl::Status(ids.status().code(), absl::StrCat("--prompt: ", ids.status().message()));
    s.prompt_tokens.assign(ids->begin(), ids->end());
    // A document starts with EOT in the training data (llm.c's convention).
    s.prompt_tokens.insert(s.prompt_tokens.begin(), static_cast<int32_t>(tok->eot_id()));
  }
  auto gen = Generate(decoder, s.prompt_tokens, options);
  if (!gen.ok()) return gen.status();
  s.tokens = std::move(*gen);
  std::vector<uint32_t> ids(s.tokens.begin(), s.tokens.end());
  auto text = tok->Decode(ids);
  if (!text.ok()) return text.status();
  s.text = std::move(*text);
  return s;
}

}  // namespace vp::runtime
