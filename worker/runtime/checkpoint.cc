#include "worker/runtime/checkpoint.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    if (!f) return absl::InternalError(absl::StrCat(path, ": write failed"));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": rename failed: ", ec.message()));
  return absl::OkStatus();
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
  const std::string dir = CheckpointDir(run_dir, step);
  std::error_code ec;
  fs::remove(fs::path(dir) / "DONE", ec);
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));

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
  if (auto st = WriteSafetensors((fs::path(dir) / "model.safetensors").string(), weights,
                                 {{"format", "pt"}, {"step", absl::StrCat(step)}});
      !st.ok()) {
    return st;
  }
  if (auto st = WriteSafetensors((fs::path(dir) / "optimizer.safetensors").string(), moments,
                                 {{"adamw_step", absl::StrCat(optimizer.step())}});
      !st.ok()) {
    return st;
  }
  if (auto st = WriteTextFileAtomically((fs::path(dir) / "config.json").string(),
                                        HfConfigJson(model.config()));
      !st.ok()) {
    return st;
  }
  return WriteTextFileAtomically((fs::path(dir) / "DONE").string(), absl::StrCat(step, "\n"));
}

absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& run_dir) {
  int64_t best = -1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) != 0 || !fs::exists(entry.path() / "DONE")) continue;
    char* end = nullptr;
    const long long v = std::strtoll(name.c_str() + 5, &end, 10);
    if (end != nullptr && *end == '\0' && v > best) best = v;
  }
  if (best < 0) return absl::NotFoundError(absl::StrCat(run_dir, ": no complete checkpoint"));
  return best;
}

absl::Status LoadCheckpoint(const std::string& step_dir, engine::RankModel& model,
                            engine::AdamW* optimizer) {
  if (!fs::exists(fs::path(step_dir) / "DONE")) {
    return absl::FailedPreconditionError(
        absl::StrCat(step_dir, ": no DONE marker; the checkpoint is incomplete"));
  }
  const std::string model_path = (fs::path(step_dir) / "model.safetensors").string();
  auto weights = ReadSafetensors(model_path);
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
    const std::string opt_path = (fs::path(step_dir) / "optimizer.safetensors").string();
    moments = ReadSafetensors(opt_path);
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
