#include "worker/runtime/checkpoint.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/safefs/dir.h"
#include "worker/runtime/safetensors.h"

namespace vp::runtime {
namespace fs = std::filesystem;

namespace {

// A tensor as exported: name, global shape (unpadded), and the local data it comes from.
struct Export {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset;  // floats into the rank's flat buffer
};

std::vector<Export> ExportTable(const engine::RankModel& model) {
  std::vector<Export> out;
  for (const engine::ParamTensor& t : model.tensors()) {
    std::vector<int64_t> shape = t.shape;
    if (t.vocab_shard) shape[0] = t.valid_rows;  // drop padding rows
    out.push_back({t.name, shape, t.offset});
  }
  // Tied embeddings: HF GPT-2 checkpoints still name lm_head.weight; it is wte's data.
  if (model.config().tie_embeddings && model.Find("lm_head.weight") == nullptr) {
    const engine::ParamTensor* wte = model.Find(engine::EmbeddingTensorName(model.config()));
    out.push_back({"lm_head.weight", {wte->valid_rows, wte->shape[1]}, wte->offset});
  }
  return out;
}

}  // namespace

absl::Status WriteTextFileAtomically(const std::string& path, const std::string& text) {
  const fs::path p(path);
  auto dir = safefs::Dir::Open(p.has_parent_path() ? p.parent_path().string() : ".");
  if (!dir.ok()) return dir.status();
  return dir->WriteFileAtomically(p.filename().string(), text);
}

std::string CheckpointDir(const std::string& run_dir, int64_t step) {
  return (fs::path(run_dir) / absl::StrCat("step_", step)).string();
}

std::string Gpt2ConfigJson(const engine::ModelConfig& cfg) {
  nlohmann::json j = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", cfg.vocab},
      {"n_positions", cfg.seq_len},
      {"n_ctx", cfg.seq_len},
      {"n_embd", cfg.hidden},
      {"n_layer", cfg.layers},
      {"n_head", cfg.heads},
      {"n_inner", cfg.ffn_hidden},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", 1e-5},
      {"initializer_range", 0.02},
      {"resid_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"attn_pdrop", 0.0},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", cfg.tie_embeddings},
      {"torch_dtype", "float32"},
  };
  return j.dump(2) + "\n";
}

std::string LlamaConfigJson(const engine::ModelConfig& cfg) {
  nlohmann::json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", cfg.vocab},
      {"hidden_size", cfg.hidden},
      {"intermediate_size", cfg.ffn_hidden},
      {"num_hidden_layers", cfg.layers},
      {"num_attention_heads", cfg.heads},
      {"num_key_value_heads", cfg.num_kv_heads()},
      {"head_dim", cfg.head_dim()},
      {"max_position_embeddings", cfg.seq_len},
      {"hidden_act", "silu"},
      {"rms_norm_eps", cfg.rms_eps},
      {"rope_theta", cfg.rope_theta},
      {"rope_scaling", nullptr},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"initializer_range", 0.02},
      {"tie_word_embeddings", cfg.tie_embeddings},
      {"torch_dtype", "float32"},
  };
  return j.dump(2) + "\n";
}

std::string HfConfigJson(const engine::ModelConfig& cfg) {
  return cfg.llama() ? LlamaConfigJson(cfg) : Gpt2ConfigJson(cfg);
}

absl::Status SaveCheckpoint(const std::string& run_dir, int64_t step,
                            const engine::RankModel& model, engine::AdamW& optimizer) {
  // The run folder (made when missing) and its step folder by handle: a link planted in
  // either is refused.
  auto run = safefs::Dir::Create(run_dir);
  if (!run.ok()) return run.status();
  auto dir = run->Sub(absl::StrCat("step_", step), /*create=*/true);
  if (!dir.ok()) return dir.status();
  if (auto st = dir->Remove("DONE"); !st.ok()) return st;

  std::vector<TensorView> weights, moments;
  const std::vector<Export> table = ExportTable(model);
  for (const Export& e : table) {
    weights.push_back({e.name, e.shape, model.params() + e.offset});
  }
  for (const engine::ParamTensor& t : model.tensors()) {
    std::vector<int64_t> shape = t.shape;
    if (t.vocab_shard) shape[0] = t.valid_rows;
    moments.push_back({"exp_avg." + t.name, shape, optimizer.m().data() + t.offset});
    moments.push_back({"exp_avg_sq." + t.name, shape, optimizer.v().data() + t.offset});
  }
  if (auto st = WriteSafetensorsAt(*dir, "model.safetensors", weights,
                                   {{"format", "pt"}, {"step", absl::StrCat(step)}});
      !st.ok()) {
    return st;
  }
  if (auto st = WriteSafetensorsAt(*dir, "optimizer.safetensors", moments,
                                   {{"adamw_step", absl::StrCat(optimizer.step())}});
      !st.ok()) {
    return st;
  }
  if (auto st = dir->WriteFileAtomically("config.json", HfConfigJson(model.config())); !st.ok()) {
    return st;
  }
  return dir->WriteFileAtomically("DONE", absl::StrCat(step, "\n"));
}

namespace {

// The config.json keys an HF folder must agree on with the model, with the spec field each
// comes from.
struct ConfigKey {
  const char* key;
  const char* field;
  int64_t want;
};

// A tensor the model needs from the folder: where it lands and what global shape it has.
struct Wanted {
  const engine::ParamTensor* dst;
  std::string name;            // HF name in the file
  std::vector<int64_t> shape;  // global shape
  bool positions = false;      // GPT-2 wpe: at least seq_len rows, the first ones taken
};

}  // namespace

absl::Status InitFromHfDir(const std::string& dir, engine::RankModel& model) {
  const engine::ModelConfig& cfg = model.config();
  // The folder and its files by handle, never through a link (a file of another user's run,
  // or one outside the storage root, is not read by linking it here).
  auto folder = safefs::Dir::Open(dir);
  if (!folder.ok()) {
    return absl::Status(folder.status().code(),
                        absl::StrCat("model.init_from: ", folder.status().message()));
  }
  const std::string config_path = folder->PathOf("config.json");
  auto config_text = folder->ReadFile("config.json", 1 << 20);
  if (!config_text.ok()) {
    if (!absl::IsNotFound(config_text.status())) {
      return absl::Status(config_text.status().code(),
                          absl::StrCat("model.init_from: ", config_text.status().message()));
    }
    return absl::NotFoundError(
        absl::StrCat("model.init_from: ", config_path,
                     ": cannot open (need a Hugging Face "
                     "model folder with config.json and model.safetensors)"));
  }
  nlohmann::json j = nlohmann::json::parse(*config_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.init_from: ", config_path, ": not a JSON object"));
  }
  const char* type = cfg.llama() ? "llama" : "gpt2";
  if (!j.contains("model_type") || !j["model_type"].is_string() || j["model_type"] != type) {
    return absl::InvalidArgumentError(absl::StrCat("model.init_from: ", config_path,
                                                   ": model_type must be \"", type,
                                                   "\" to match model.architecture"));
  }
  std::vector<ConfigKey> keys;
  if (cfg.llama()) {
    keys = {{"hidden_size", "model.hidden", cfg.hidden},
            {"num_hidden_layers", "model.layers", cfg.layers},
            {"num_attention_heads", "model.heads", cfg.heads},
            {"num_key_value_heads", "model.kv_heads", cfg.num_kv_heads()},
            {"intermediate_size", "model.ffn_hidden", cfg.ffn_hidden},
            {"vocab_size", "model.vocab_size", cfg.vocab}};
  } else {
    keys = {{"n_embd", "model.hidden", cfg.hidden},
            {"n_layer", "model.layers", cfg.layers},
            {"n_head", "model.heads", cfg.heads},
            {"n_inner", "model.ffn_hidden", cfg.ffn_hidden},
            {"vocab_size", "model.vocab_size", cfg.vocab}};
  }
  for (const ConfigKey& k : keys) {
    int64_t got = 0;
    if (j.contains(k.key) && j[k.key].is_number_integer()) {
      got = j[k.key].get<int64_t>();
    } else if (std::string_view(k.key) == "num_key_value_heads" && !j.contains(k.key)) {
      got = cfg.heads;  // HF's default: multi-head
    } else if (std::string_view(k.key) == "n_inner" && (!j.contains(k.key) || j[k.key].is_null())) {
      got = 4 * static_cast<int64_t>(cfg.hidden);  // HF GPT-2's default
    } else {
      return absl::InvalidArgumentError(absl::StrCat("model.init_from: ", config_path, ": ", k.key,
                                                     " missing or not an integer"));
    }
    if (got != k.want) {
      return absl::InvalidArgumentError(absl::StrCat("model.init_from: ", config_path, ": ", k.key,
                                                     " is ", got, " but ", k.field, " is ",
                                                     k.want));
    }
  }
  const bool file_tied = j.value("tie_word_embeddings", !cfg.llama());

  const std::string path = folder->PathOf("model.safetensors");
  auto file = ReadSafetensorsAt(*folder, "model.safetensors");
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("model.init_from: ", file.status().message()));
  }
  // HF's own GPT-2 files name tensors without the "transformer." prefix.
  auto in_file = [&](const std::string& name) -> std::string {
    if (file->tensors.contains(name)) return name;
    const std::string prefix = "transformer.";
    if (name.rfind(prefix, 0) == 0 && file->tensors.contains(name.substr(prefix.size()))) {
      return name.substr(prefix.size());
    }
    return name;
  };
  const int64_t h = cfg.hidden;
  const std::string embedding = engine::EmbeddingTensorName(cfg);
  std::vector<Wanted> wanted;
  for (const engine::ParamTensor& t : model.tensors()) {
    Wanted w{&t, t.name, t.shape};
    if (t.vocab_shard) w.shape = {cfg.vocab, h};
    if (t.name == "lm_head.weight" &&
        (cfg.tie_embeddings || (file_tied && !file->tensors.contains("lm_head.weight")))) {
      w.name = embedding;  // the output layer is (or starts as) the embedding
    }
    w.positions = t.name == "transformer.wpe.weight";
    w.name = in_file(w.name);
    wanted.push_back(std::move(w));
  }
  // Every tensor of the file must belong to the model (buffers HF stores are skipped).
  size_t known = 0, buffers = 0;
  for (const auto& [name, tensor] : file->tensors) {
    const std::string_view n = name;
    if (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") ||
        n.ends_with("rotary_emb.inv_freq")) {
      ++buffers;
    }
  }
  {
    std::vector<std::string> names = {embedding, engine::FinalNormTensorName(cfg)};
    if (!cfg.llama())
      names.insert(names.end(), {"transformer.wpe.weight", "transformer.ln_f.bias"});
    if (file->tensors.contains("lm_head.weight")) names.push_back("lm_head.weight");
    for (int l = 0; l < cfg.layers; ++l) {
      for (const engine::TensorSpec& sp : engine::LayerTensorSpecs(cfg)) {
        names.push_back(engine::LayerTensorName(cfg, l, sp.name));
      }
    }
    for (const std::string& n : names) {
      if (file->tensors.contains(in_file(n))) ++known;
    }
  }
  if (known + buffers != file->tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.init_from: ", path, ": ", file->tensors.size() - known - buffers,
        " tensor(s) are not part of a ", cfg.llama() ? "LlamaForCausalLM" : "GPT2LMHeadModel",
        " with model.layers ", cfg.layers, " (names must be Hugging Face's)"));
  }
  // Check everything, then copy.
  std::vector<std::pair<const Wanted*, const Tensor*>> copies;
  for (const Wanted& w : wanted) {
    if (w.positions) {
      auto it = file->tensors.find(w.name);
      if (it == file->tensors.end() || it->second.shape.size() != 2 || it->second.shape[1] != h ||
          it->second.shape[0] < cfg.seq_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.init_from: ", path, ": tensor ", w.name,
            " must be present with shape [>= ", cfg.seq_len, " (model.seq_len), ", h, "]"));
      }
      copies.emplace_back(&w, &it->second);
      continue;
    }
    auto t = CheckedTensor(path, *file, w.name, w.shape);
    if (!t.ok()) {
      return absl::Status(t.status().code(),
                          absl::StrCat("model.init_from: ", t.status().message()));
    }
    copies.emplace_back(&w, *t);
  }
  for (const auto& [w, t] : copies) {
    const engine::ParamTensor& d = *w->dst;
    const size_t begin = d.vocab_shard ? static_cast<size_t>(d.global_row_begin) * h : 0;
    const size_t count =
        d.vocab_shard ? static_cast<size_t>(d.valid_rows) * h : d.count();  // wpe: first s rows
    std::memcpy(model.params() + d.offset, t->data.data() + begin, count * sizeof(float));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& run_dir) {
  int64_t best = -1;
  auto run = safefs::Dir::Open(run_dir);
  if (!run.ok()) {
    if (!absl::IsNotFound(run.status())) return run.status();
    return absl::NotFoundError(absl::StrCat(run_dir, ": no complete checkpoint"));
  }
  auto names = run->List();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    // A step folder counts by its own entries only: links are not followed to find DONE.
    if (name.rfind("step_", 0) != 0 || run->KindOf(name) != safefs::Kind::kDirectory) continue;
    auto step = run->Sub(name);
    if (!step.ok() || step->KindOf("DONE") != safefs::Kind::kFile) continue;
    char* end = nullptr;
    const long long v = std::strtoll(name.c_str() + 5, &end, 10);
    if (end != nullptr && *end == '\0' && v > best) best = v;
  }
  if (best < 0) return absl::NotFoundError(absl::StrCat(run_dir, ": no complete checkpoint"));
  return best;
}

absl::Status LoadCheckpoint(const std::string& step_dir, engine::RankModel& model,
                            engine::AdamW* optimizer) {
  auto dir = safefs::Dir::Open(step_dir);
  if (!dir.ok()) {
    if (!absl::IsNotFound(dir.status())) return dir.status();
    return absl::FailedPreconditionError(
        absl::StrCat(step_dir, ": no DONE marker; the checkpoint is incomplete"));
  }
  switch (dir->KindOf("DONE")) {
    case safefs::Kind::kFile:
      break;
    case safefs::Kind::kLink:
      return absl::PermissionDeniedError(
          absl::StrCat(dir->PathOf("DONE"),
                       " is a symbolic link: files of a run folder are never "
                       "opened through a link"));
    default:
      return absl::FailedPreconditionError(
          absl::StrCat(step_dir, ": no DONE marker; the checkpoint is incomplete"));
  }
  const std::string model_path = dir->PathOf("model.safetensors");
  auto weights = ReadSafetensorsAt(*dir, "model.safetensors");
  if (!weights.ok()) return weights.status();
  // Validate everything first, copy afterwards: a bad checkpoint leaves the model untouched.
  std::vector<std::pair<const Tensor*, size_t>> copies;
  for (const Export& e : ExportTable(model)) {
    auto t = CheckedTensor(model_path, *weights, e.name, e.shape);
    if (!t.ok()) return t.status();
    copies.emplace_back(*t, e.offset);
  }
  std::vector<std::pair<const Tensor*, float*>> moment_copies;
  absl::StatusOr<SafetensorsFile> moments;
  int64_t adamw_step = 0;
  if (optimizer != nullptr) {
    const std::string opt_path = dir->PathOf("optimizer.safetensors");
    moments = ReadSafetensorsAt(*dir, "optimizer.safetensors");
    if (!moments.ok()) return moments.status();
    auto it = moments->metadata.find("adamw_step");
    if (it == moments->metadata.end() || !absl::SimpleAtoi(it->second, &adamw_step) ||
        adamw_step < 0) {
      return absl::DataLossError(absl::StrCat(opt_path, ": metadata adamw_step missing or bad"));
    }
    for (const engine::ParamTensor& p : model.tensors()) {
      std::vector<int64_t> shape = p.shape;
      if (p.vocab_shard) shape[0] = p.valid_rows;
      auto m = CheckedTensor(opt_path, *moments, "exp_avg." + p.name, shape);
      if (!m.ok()) return m.status();
      auto v = CheckedTensor(opt_path, *moments, "exp_avg_sq." + p.name, shape);
      if (!v.ok()) return v.status();
      moment_copies.emplace_back(*m, optimizer->m().data() + p.offset);
      moment_copies.emplace_back(*v, optimizer->v().data() + p.offset);
    }
  }
  for (auto& [t, offset] : copies) {
    std::memcpy(model.params() + offset, t->data.data(), t->data.size() * sizeof(float));
  }
  for (auto& [t, dst] : moment_copies) {
    std::memcpy(dst, t->data.data(), t->data.size() * sizeof(float));
  }
  if (optimizer != nullptr) optimizer->set_step(adamw_step);
  return absl::OkStatus();
}

}  // namespace vp::runtime
