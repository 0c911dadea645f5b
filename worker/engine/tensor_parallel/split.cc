#include "worker/engine/tensor_parallel/split.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace vp::engine::tp {

std::vector<int64_t> LocalShape(const std::vector<int64_t>& full_shape, Split split, int t) {
  std::vector<int64_t> shape = full_shape;
  if (!split.replicated()) shape[split.dim] /= t;
  return shape;
}

namespace {

// Views the tensor as [outer, parts, t, slice, inner] around the split dimension and copies
// rank r's [outer, parts, slice, inner] between it and the local tensor.
void CopySlice(float* full, float* local, const std::vector<int64_t>& full_shape, Split split,
               int r, int t, bool to_local) {
  int64_t count = 1;
  for (const int64_t d : full_shape) count *= d;
  if (split.replicated()) {
    if (to_local) {
      std::memcpy(local, full, sizeof(float) * count);
    } else {
      std::memcpy(full, local, sizeof(float) * count);
    }
    return;
  }
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < split.dim; ++i) outer *= full_shape[i];
  for (size_t i = split.dim + 1; i < full_shape.size(); ++i) inner *= full_shape[i];
  const int64_t part = full_shape[split.dim] / split.parts;  // one fused block along dim
  const int64_t slice = part / t;                            // this rank's share of a block
  const int64_t run = slice * inner;                         // contiguous floats per copy
  for (int64_t o = 0; o < outer; ++o) {
    for (int p = 0; p < split.parts; ++p) {
      float* f = full + (o * full_shape[split.dim] + p * part + r * slice) * inner;
      float* l = local + (o * split.parts + p) * run;
      if (to_local) {
        std::memcpy(l, f, sizeof(float) * run);
      } else {
        std::memcpy(f, l, sizeof(float) * run);
      }
    }
  }
}

}  // namespace

void SliceTensor(const float* full, const std::vector<int64_t>& full_shape, Split split, int r,
                 int t, float* local) {
  CopySlice(const_cast<float*>(full), local, full_shape, split, r, t, /*to_local=*/true);
}

void PlaceSlice(const float* local, const std::vector<int64_t>& full_shape, Split split, int r,
                int t, float* full) {
  CopySlice(full, const_cast<float*>(local), full_shape, split, r, t, /*to_local=*/false);
}

absl::Status ValidateTensorSplit(const ModelConfig& cfg, int t) {
  if (t < 1)
    return absl::InvalidArgumentError(absl::StrCat("parallel.tensor: must be >= 1 (got ", t, ")"));
  if (t == 1) return absl::OkStatus();
  const auto divisible = [t](const char* field, int value) -> absl::Status {
    if (value % t == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be divisible by parallel.tensor (", value, " % ", t, " != 0)"));
  };
  if (absl::Status s = divisible("model.heads", cfg.heads); !s.ok()) return s;
  if (absl::Status s = divisible("model.ffn_hidden", cfg.ffn_hidden); !s.ok()) return s;
  const int kv = cfg.num_kv_heads();
  if (cfg.llama() && kv > 1 && kv % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.kv_heads: must be divisible by parallel.tensor or be 1 (replicated "
                     "on every tensor rank) (",
                     kv, " % ", t, " != 0)"));
  }
  return absl::OkStatus();
}

LayerWidths LocalLayerWidths(const ModelConfig& cfg, int t) {
  LayerWidths w;
  w.head_dim = cfg.head_dim();
  w.heads = cfg.heads / t;
  w.kv_replicated = t > 1 && cfg.num_kv_heads() == 1;
  w.kv_heads = w.kv_replicated ? 1 : cfg.num_kv_heads() / t;
  w.attn = w.heads * w.head_dim;
  w.kv = w.kv_heads * w.head_dim;
  w.ffn = cfg.ffn_hidden / t;
  return w;
}

}  // namespace vp::engine::tp
