#include "worker/launch/shard_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "worker/launch/run_dir.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/safetensors.h"

namespace vp::launch {
namespace fs = std::filesystem;

namespace {

constexpr char kShardKey[] = "vocab_shard.";

// The saved shape of a tensor: vocabulary shards lose their padding rows.
std::vector<int64_t> SavedShape(const engine::ParamTensor& t) {
  std::vector<int64_t> shape = t.shape;
  if (t.vocab_shard) shape[0] = t.valid_rows;
  return shape;
}

struct ShardRows {
  int64_t begin = 0, rows = 0;
};

absl::StatusOr<ShardRows> ParseShardRows(const std::string& file, const std::string& name,
                                         const std::string& value) {
  std::vector<std::string> parts = absl::StrSplit(value, ' ', absl::SkipEmpty());
  ShardRows r;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.begin) ||
      !absl::SimpleAtoi(parts[1], &r.rows) || r.begin < 0 || r.rows < 0) {
    return absl::DataLossError(absl::StrCat(file, ": metadata ", kShardKey, name, " = \"", value,
                                            "\" is not \"<global_row_begin> <rows>\""));
  }
  return r;
}

}  // namespace

absl::Status SaveRankShard(const std::string& run_dir, int64_t step, int rank, int world,
                           const engine::RankModel& model, engine::AdamW& optimizer) {
  const std::string dir = ShardDir(run_dir, step, rank);
  std::error_code ec;
  fs::remove(fs::path(dir) / "DONE", ec);
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  std::vector<runtime::TensorView> weights, moments;
  std::map<std::string, std::string> meta = {{"format", "vocabpipe-shard"},
                                             {"rank", absl::StrCat(rank)},
                                             {"world", absl::StrCat(world)},
                                             {"step", absl::StrCat(step)}};
  for (const engine::ParamTensor& t : model.tensors()) {
    const std::vector<int64_t> shape = SavedShape(t);
    weights.push_back({t.name, shape, model.params() + t.offset});
    moments.push_back({"exp_avg." + t.name, shape, optimizer.m().data() + t.offset});
    moments.push_back({"exp_avg_sq." + t.name, shape, optimizer.v().data() + t.offset});
    if (t.vocab_shard) {
      meta[kShardKey + t.name] = absl::StrCat(t.global_row_begin, " ", t.valid_rows);
    }
  }
  if (auto st =
          runtime::WriteSafetensors((fs::path(dir) / "model.safetensors").string(), weights, meta);
      !st.ok()) {
    return st;
  }
  if (auto st =
          runtime::WriteSafetensors((fs::path(dir) / "optimizer.safetensors").string(), moments,
                                    {{"adamw_step", absl::StrCat(optimizer.step())}});
      !st.ok()) {
    return st;
  }
  return runtime::WriteTextFileAtomically((fs::path(dir) / "DONE").string(),
                                          absl::StrCat(step, "\n"));
}

absl::Status LoadRankShard(const std::string& run_dir, int64_t step, int rank,
                           engine::RankModel& model, engine::AdamW* optimizer) {
  const std::string dir = ShardDir(run_dir, step, rank);
  if (!fs::exists(fs::path(dir) / "DONE")) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": no DONE marker; the shard is incomplete"));
  }
  const std::string model_path = (fs::path(dir) / "model.safetensors").string();
  auto weights = runtime::ReadSafetensors(model_path);
  if (!weights.ok()) return weights.status();
  std::vector<std::pair<const runtime::Tensor*, float*>> copies;
  for (const engine::ParamTensor& t : model.tensors()) {
    auto w = runtime::CheckedTensor(model_path, *weights, t.name, SavedShape(t));
    if (!w.ok()) return w.status();
    if (t.vocab_shard) {
      auto it = weights->metadata.find(kShardKey + t.name);
      if (it == weights->metadata.end()) {
        return absl::DataLossError(
            absl::StrCat(model_path, ": metadata ", kShardKey, t.name, " is missing"));
      }
      auto rows = ParseShardRows(model_path, t.name, it->second);
      if (!rows.ok()) return rows.status();
      if (rows->begin != t.global_row_begin) {
        return absl::InvalidArgumentError(
            absl::StrCat(model_path, ": tensor ", t.name, " starts at global row ", rows->begin,
                         ", this rank's shard at ", t.global_row_begin,
                         " (the checkpoint was written under another plan)"));
      }
    }
    copies.emplace_back(*w, model.params() + t.offset);
  }
  absl::StatusOr<runtime::SafetensorsFile> moments;
  int64_t adamw_step = 0;
  if (optimizer != nullptr) {
    const std::string opt_path = (fs::path(dir) / "optimizer.safetensors").string();
    moments = runtime::ReadSafetensors(opt_path);
    if (!moments.ok()) return moments.status();
    auto it = moments->metadata.find("adamw_step");
    if (it == moments->metadata.end() || !absl::SimpleAtoi(it->second, &adamw_step) ||
        adamw_step < 0) {
      return absl::DataLossError(absl::StrCat(opt_path, ": metadata adamw_step missing or bad"));
    }
    for (const engine::ParamTensor& t : model.tensors()) {
      auto m = runtime::CheckedTensor(opt_path, *moments, "exp_avg." + t.name, SavedShape(t));
      if (!m.ok()) return m.status();
      auto v = runtime::CheckedTensor(opt_path, *moments, "exp_avg_sq." + t.name, SavedShape(t));
      if (!v.ok()) return v.status();
      copies.emplace_back(*m, optimizer->m().data() + t.offset);
      copies.emplace_back(*v, optimizer->v().data() + t.offset);
    }
  }
  for (auto& [t, dst] : copies) {
    std::memcpy(dst, t->data.data(), t->data.size() * sizeof(float));
  }
  if (optimizer != nullptr) optimizer->set_step(adamw_step);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> LatestShardedStep(const std::string& run_dir, int world) {
  int64_t best = -1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t v = 0;
    if (name.rfind("step_", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &v) || v <= best) {
      continue;
    }
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      complete = fs::exists(fs::path(ShardDir(run_dir, v, r)) / "DONE");
    }
    if (complete) best = v;
  }
  if (best < 0) {
    return absl::NotFoundError(
        absl::StrCat(run_dir, ": no step with complete shards of all ", world, " ranks"));
  }
  return best;
}

absl::Status MergeShards(const std::string& run_dir, int64_t step, int world,
                         const engine::ModelConfig& config) {
  struct Piece {
    int64_t begin = 0;
    const runtime::Tensor* tensor = nullptr;
  };
  std::vector<runtime::SafetensorsFile> files(world);
  std::map<std::string, std::vector<Piece>> sharded;    // name -> pieces
  std::map<std::string, const runtime::Tensor*> whole;  // name -> tensor
  std::vector<std::string> order;                       // first-seen order
  for (int r = 0; r < world; ++r) {
    const std::string dir = ShardDir(run_dir, step, r);
    if (!fs::exists(fs::path(dir) / "DONE")) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": no DONE marker; rank ", r, " has not saved step ", step));
    }
    const std::string path = (fs::path(dir) / "model.safetensors").string();
    auto f = runtime::ReadSafetensors(path);
    if (!f.ok()) return f.status();
    files[r] = std::move(*f);
    for (const auto& [name, tensor] : files[r].tensors) {
      // With tied embeddings the output copy of a non-sharded plan is wte's twin: skip it.
      if (config.tie_embeddings && name == "lm_head.weight") continue;
      if (!sharded.contains(name) && !whole.contains(name)) order.push_back(name);
      auto meta = files[r].metadata.find(kShardKey + name);
      if (meta != files[r].metadata.end()) {
        auto rows = ParseShardRows(path, name, meta->second);
        if (!rows.ok()) return rows.status();
        if (tensor.shape.size() != 2 || tensor.shape[0] != rows->rows) {
          return absl::DataLossError(absl::StrCat(
              path, ": tensor ", name, " does not have the metadata's ", rows->rows, " rows"));
        }
        sharded[name].push_back({rows->begin, &tensor});
      } else {
        whole.emplace(name, &tensor);  // duplicates (tied copies) keep the first
      }
    }
  }
  std::map<std::string, runtime::Tensor> merged;
  for (auto& [name, pieces] : sharded) {
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    const int64_t cols = pieces.front().tensor->shape[1];
    runtime::Tensor out;
    int64_t next = 0;
    for (const Piece& p : pieces) {
      if (p.begin != next || p.tensor->shape[1] != cols) {
        return absl::DataLossError(absl::StrCat(
            runtime::CheckpointDir(run_dir, step), ": vocabulary shards of ", name,
            " do not tile the rows: expected global row ", next, ", a shard starts at ", p.begin));
      }
      out.data.insert(out.data.end(), p.tensor->data.begin(), p.tensor->data.end());
      next += p.tensor->shape[0];
    }
    if (next != config.vocab) {
      return absl::DataLossError(absl::StrCat(runtime::CheckpointDir(run_dir, step), ": shards of ",
                                              name, " cover ", next, " rows, the vocabulary has ",
                                              config.vocab));
    }
    out.shape = {next, cols};
    merged.emplace(name, std::move(out));
  }
  std::vector<runtime::TensorView> views;
  for (const std::string& name : order) {
    auto m = merged.find(name);
    const runtime::Tensor* t = m != merged.end() ? &m->second : whole.at(name);
    views.push_back({name, t->shape, t->data.data()});
  }
  if (config.tie_embeddings) {
    const std::string wte_name = engine::EmbeddingTensorName(config);
    auto wte = merged.find(wte_name);
    if (wte == merged.end()) {
      return absl::DataLossError(
          absl::StrCat(runtime::CheckpointDir(run_dir, step), ": no rank holds ", wte_name));
    }
    views.push_back({"lm_head.weight", wte->second.shape, wte->second.data.data()});
  }
  const std::string out_dir = runtime::CheckpointDir(run_dir, step);
  std::error_code ec;
  fs::remove(fs::path(out_dir) / "DONE", ec);
  if (auto st = runtime::WriteSafetensors((fs::path(out_dir) / "model.safetensors").string(), views,
                                          {{"format", "pt"}, {"step", absl::StrCat(step)}});
      !st.ok()) {
    return st;
  }
  if (auto st = runtime::WriteTextFileAtomically((fs::path(out_dir) / "config.json").string(),
                                                 runtime::HfConfigJson(config));
      !st.ok()) {
    return st;
  }
  return runtime::WriteTextFileAtomically((fs::path(out_dir) / "DONE").string(),
                                          absl::StrCat(step, "\n"));
}

}  // namespace vp::launch
