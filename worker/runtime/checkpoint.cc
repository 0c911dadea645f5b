#include "worker/runtime/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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

std::string HfShardFileName(int k, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", k, n);
  return buf;
}

bool IsHfShardFileName(const std::string& name) {
  // model-NNNNN-of-NNNNN.safetensors
  if (name.size() != 32 || name.rfind("model-", 0) != 0 || name.substr(11, 4) != "-of-" ||
      name.substr(20) != ".safetensors") {
    return false;
  }
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19}) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  return true;
}

std::vector<std::vector<size_t>> HfShardGroups(const std::vector<uint64_t>& bytes,
                                               int64_t max_shard_bytes) {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  const uint64_t limit = static_cast<uint64_t>(std::max<int64_t>(max_shard_bytes, 1));
  std::vector<std::vector<size_t>> groups;
  uint64_t in_group = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (groups.empty() || (total > limit && in_group > 0 && in_group + bytes[i] > limit)) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(i);
    in_group += bytes[i];
  }
  return groups;
}

std::string HfWeightsFileName(size_t group, size_t groups) {
  if (groups <= 1) return kHfSingleFile;
  return HfShardFileName(static_cast<int>(group) + 1, static_cast<int>(groups));
}

absl::Status FinishHfWeights(const safefs::Dir& dir, const std::vector<std::string>& files,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  const bool single = files.size() == 1 && files[0] == kHfSingleFile;
  auto names = dir.List();
  if (!names.ok()) return names.status();
  for (const std::string& n : *names) {
    const bool stale =
        (single && n == kHfIndexFile) || (!single && n == kHfSingleFile) ||
        (IsHfShardFileName(n) && std::find(files.begin(), files.end(), n) == files.end());
    if (stale) {
      if (auto st = dir.Remove(n); !st.ok()) return st;
    }
  }
  if (single) return absl::OkStatus();
  const nlohmann::json index = {{"metadata", {{"total_size", total_size}}},
                                {"weight_map", weight_map}};
  return dir.WriteFileAtomically(kHfIndexFile, index.dump(2) + "\n", /*sync=*/true);
}

absl::StatusOr<HfWeights> HfWeights::Open(const safefs::Dir& dir) {
  HfWeights w;
  const safefs::Kind index_kind = dir.KindOf(kHfIndexFile);
  if (index_kind == safefs::Kind::kMissing) {
    auto file = SafetensorsReader::OpenAt(dir, kHfSingleFile);
    if (!file.ok()) return file.status();
    w.path_ = file->path();
    w.files_.push_back(std::make_unique<SafetensorsReader>(std::move(*file)));
    for (const auto& [name, e] : w.files_.back()->tensors()) w.where_[name] = w.files_.back().get();
    return w;
  }
  w.path_ = dir.PathOf(kHfIndexFile);
  auto text = dir.ReadFile(kHfIndexFile, 64 << 20);
  if (!text.ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(w.path_, ": ", why));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    return bad("weight_map must be an object {tensor name: file name}");
  }
  std::map<std::string, const SafetensorsReader*> opened;
  int index = -1;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    ++index;
    // Entries are named by their place: the index's own text is never echoed.
    const std::string where = absl::StrCat("weight_map entry #", index);
    if (!file.is_string()) return bad(absl::StrCat(where, ": the file must be a string"));
    const std::string name = file.get<std::string>();
    if (name.empty() || name.size() > 255 || name.find('/') != std::string::npos || name == "." ||
        name == ".." || !std::string_view(name).ends_with(".safetensors") ||
        name == kHfSingleFile) {
      return bad(absl::StrCat(where,
                              ": the file must be a shard file name of this folder (one path "
                              "component ending in .safetensors, not model.safetensors)"));
    }
    auto it = opened.find(name);
    if (it == opened.end()) {
      auto r = SafetensorsReader::OpenAt(dir, name);
      if (!r.ok()) {
        if (absl::IsPermissionDenied(r.status())) return r.status();  // a link: named as such
        if (absl::IsNotFound(r.status())) {
          return bad(absl::StrCat(where, ": names a file missing from ", dir.path()));
        }
        return r.status();
      }
      w.files_.push_back(std::make_unique<SafetensorsReader>(std::move(*r)));
      it = opened.emplace(name, w.files_.back().get()).first;
    }
    if (it->second->Find(tensor) == nullptr) {
      return bad(absl::StrCat(where, ": the tensor is not in the file it is mapped to"));
    }
    w.where_[tensor] = it->second;
  }
  return w;
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, f] : where_) out.push_back(name);
  return out;
}

const SafetensorsReader* HfWeights::FileOf(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : it->second;
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
                            const engine::RankModel& model, engine::AdamW& optimizer,
                            int64_t max_shard_bytes) {
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
  {
    std::vector<uint64_t> bytes;
    uint64_t total = 0;
    for (const TensorView& w : weights) {
      bytes.push_back(TensorLayout{w.name, w.shape}.bytes());
      total += bytes.back();
    }
    const auto groups = HfShardGroups(bytes, max_shard_bytes);
    std::vector<std::string> files;
    std::map<std::string, std::string> weight_map;
    for (size_t g = 0; g < groups.size(); ++g) {
      files.push_back(HfWeightsFileName(g, groups.size()));
      std::vector<TensorView> part;
      for (size_t i : groups[g]) {
        part.push_back(weights[i]);
        weight_map[weights[i].name] = files.back();
      }
      if (auto st = WriteSafetensorsAt(*dir, files.back(), part,
                                       {{"format", "pt"}, {"step", absl::StrCat(step)}});
          !st.ok()) {
        return st;
      }
    }
    if (auto st = FinishHfWeights(*dir, files, weight_map, total); !st.ok()) return st;
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

  auto file = HfWeights::Open(*folder);
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("model.init_from: ", file.status().message()));
  }
  const std::string& path = file->path();
  // HF's own GPT-2 files name tensors without the "transformer." prefix.
  auto in_file = [&](const std::string& name) -> std::string {
    if (file->contains(name)) return name;
    const std::string prefix = "transformer.";
    if (name.rfind(prefix, 0) == 0 && file->contains(name.substr(prefix.size()))) {
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
    // A tensor-parallel slice is read whole and cut (the file holds the whole model).
    if (!t.vocab_shard && t.split.dim >= 0 && model.tensor_group().size() > 1) {
      w.shape = t.full_shape;
    }
    if (t.name == "lm_head.weight" &&
        (cfg.tie_embeddings || (file_tied && !file->contains("lm_head.weight")))) {
      w.name = embedding;  // the output layer is (or starts as) the embedding
    }
    w.positions = t.name == "transformer.wpe.weight";
    w.name = in_file(w.name);
    wanted.push_back(std::move(w));
  }
  // Every tensor of the file must belong to the model (buffers HF stores are skipped).
  size_t known = 0, buffers = 0;
  for (const std::string& name : file->names()) {
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
    if (file->contains("lm_head.weight")) names.push_back("lm_head.weight");
    for (int l = 0; l < cfg.layers; ++l) {
      for (const engine::TensorSpec& sp : engine::LayerTensorSpecs(cfg)) {
        names.push_back(engine::LayerTensorName(cfg, l, sp.name));
      }
    }
    for (const std::string& n : names) {
      if (file->contains(in_file(n))) ++known;
    }
  }
  if (known + buffers != file->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.init_from: ", path, ": ", file->size() - known - buffers,
        " tensor(s) are not part of a ", cfg.llama() ? "LlamaForCausalLM" : "GPT2LMHeadModel",
        " with model.layers ", cfg.layers, " (names must be Hugging Face's)"));
  }
  // Check everything (shapes, then the values of the slice this rank takes, read in bounded
  // pieces), then copy: each rank reads only its own rows, straight into its parameters.
  struct Copy {
    const Wanted* w;
    const SafetensorsReader* file;
    const TensorEntry* entry;
    uint64_t first, count;  // floats of the tensor
  };
  std::vector<Copy> copies;
  for (const Wanted& w : wanted) {
    const SafetensorsReader* f = file->FileOf(w.name);
    const TensorEntry* e = nullptr;
    if (w.positions) {
      e = f == nullptr ? nullptr : f->Find(w.name);
      if (e == nullptr || e->shape.size() != 2 || e->shape[1] != h || e->shape[0] < cfg.seq_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.init_from: ", path, ": tensor ", w.name,
            " must be present with shape [>= ", cfg.seq_len, " (model.seq_len), ", h, "]"));
      }
    } else {
      if (f == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("model.init_from: ", path, ": tensor ", w.name, " is missing"));
      }
      auto checked = CheckedEntry(*f, w.name, w.shape);
      if (!checked.ok()) {
        return absl::Status(checked.status().code(),
                            absl::StrCat("model.init_from: ", checked.status().message()));
      }
      e = *checked;
    }
    const engine::ParamTensor& d = *w.dst;
    const uint64_t first = d.vocab_shard ? static_cast<uint64_t>(d.global_row_begin) * h : 0;
    uint64_t count =
        d.vocab_shard ? static_cast<uint64_t>(d.valid_rows) * h : d.count();  // wpe: first s rows
    if (w.shape != d.shape && !d.vocab_shard && !w.positions) {  // a slice: the whole tensor
      count = static_cast<uint64_t>(e->numel());
    }
    if (auto st = f->CheckFinite(w.name, *e, first, count); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("model.init_from: ", st.message()));
    }
    copies.push_back({&w, f, e, first, count});
  }
  const engine::tp::TensorGroup& group = model.tensor_group();
  for (const Copy& c : copies) {
    const engine::ParamTensor& d = *c.w->dst;
    if (c.count != d.count() && !d.vocab_shard && !c.w->positions) {
      // This tensor rank's slice of the whole tensor.
      std::vector<float> whole(c.count);
      if (auto st = c.file->Read(*c.entry, c.first, c.count, whole.data()); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("model.init_from: ", st.message()));
      }
      engine::tp::SliceTensor(whole.data(), d.full_shape, d.split, group.rank(), group.size(),
                              model.params() + d.offset);
      continue;
    }
    if (auto st = c.file->Read(*c.entry, c.first, c.count, model.params() + d.offset); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("model.init_from: ", st.message()));
    }
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
  // The model in either form (one model.safetensors, or shards and their index), read in
  // pieces: validated first (shapes, then values in bounded chunks), copied afterwards, so a bad
  // checkpoint leaves the model untouched and no second copy of the model is ever resident.
  auto weights = HfWeights::Open(*dir);
  if (!weights.ok()) return weights.status();
  struct Copy {
    const SafetensorsReader* file;
    const TensorEntry* entry;
    float* dst;
  };
  std::vector<Copy> copies;
  auto check = [&](const SafetensorsReader* f, const std::string& name,
                   const std::vector<int64_t>& shape, float* dst) -> absl::Status {
    if (f == nullptr) {
      return absl::NotFoundError(absl::StrCat(weights->path(), ": tensor ", name, " is missing"));
    }
    auto e = CheckedEntry(*f, name, shape);
    if (!e.ok()) return e.status();
    if (auto st = f->CheckFinite(name, **e, 0, static_cast<uint64_t>((*e)->numel())); !st.ok()) {
      return st;
    }
    copies.push_back({f, *e, dst});
    return absl::OkStatus();
  };
  for (const Export& e : ExportTable(model)) {
    if (auto st = check(weights->FileOf(e.name), e.name, e.shape, model.params() + e.offset);
        !st.ok()) {
      return st;
    }
  }
  absl::StatusOr<SafetensorsReader> moments = absl::UnknownError("unread");
  int64_t adamw_step = 0;
  if (optimizer != nullptr) {
    const std::string opt_path = dir->PathOf("optimizer.safetensors");
    moments = SafetensorsReader::OpenAt(*dir, "optimizer.safetensors");
    if (!moments.ok()) return moments.status();
    auto it = moments->metadata().find("adamw_step");
    if (it == moments->metadata().end() || !absl::SimpleAtoi(it->second, &adamw_step) ||
        adamw_step < 0) {
      return absl::DataLossError(absl::StrCat(opt_path, ": metadata adamw_step missing or bad"));
    }
    for (const engine::ParamTensor& p : model.tensors()) {
      std::vector<int64_t> shape = p.shape;
      if (p.vocab_shard) shape[0] = p.valid_rows;
      if (auto st = check(&*moments, "exp_avg." + p.name, shape, optimizer->m().data() + p.offset);
          !st.ok()) {
        return st;
      }
      if (auto st =
              check(&*moments, "exp_avg_sq." + p.name, shape, optimizer->v().data() + p.offset);
          !st.ok()) {
        return st;
      }
    }
  }
  for (const Copy& c : copies) {
    if (auto st = c.file->Read(*c.entry, 0, static_cast<uint64_t>(c.entry->numel()), c.dst);
        !st.ok()) {
      return st;
    }
  }
  if (optimizer != nullptr) optimizer->set_step(adamw_step);
  return absl::OkStatus();
}

}  // namespace vp::runtime
