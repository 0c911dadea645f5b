// How a transformer layer is divided over a tensor group of t ranks (Megatron's tensor
// parallelism, docs/tensor-parallel.md): which tensors are cut along which dimension, the widths
// one tensor rank computes with, and the copies between a whole tensor and one rank's slice
// (initialisation, checkpoints and tests use them; the passes never do).
//
// Letters: t the tensor group's size, r a rank in it, h model width, a = heads·head_dim the
// attention width, kv the key/value width, f the MLP width; a suffix _r is one rank's share.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/config.h"

namespace vp::engine::tp {

// How one tensor is divided over the group. dim < 0: replicated (every rank holds all of it, and
// its gradient, computed from the rank's own tokens, is summed over the group). Otherwise the
// tensor's dimension `dim` is cut into t equal slices, separately inside each of `parts` fused
// blocks along it: GPT-2's c_attn weight is [h, q|k|v], parts = 3, and rank r holds columns
// r of q, r of k and r of v, i.e. its own heads of all three.
struct Split {
  int dim = -1;
  int parts = 1;

  bool replicated() const { return dim < 0; }
};

// The shape rank r of t holds: shape with dimension `split.dim` divided by t (the same for
// every rank). Requires that dimension divisible by parts·t.
std::vector<int64_t> LocalShape(const std::vector<int64_t>& full_shape, Split split, int t);

// Copies rank r's slice of `full` (full_shape, row-major) to `local` (LocalShape, row-major).
void SliceTensor(const float* full, const std::vector<int64_t>& full_shape, Split split, int r,
                 int t, float* local);
// The inverse: writes `local` into rank r's slice of `full` (the rest of full is untouched).
void PlaceSlice(const float* local, const std::vector<int64_t>& full_shape, Split split, int r,
                int t, float* full);

// The widths one tensor rank's layer computes with. Query heads are always cut; key/value heads
// are cut when t divides their count and replicated when the model has a single one (Llama with
// kv_heads = 1; its k and v projections are then whole on every rank and their gradients summed
// over the group).
struct LayerWidths {
  int heads = 0;     // query heads of this rank: heads / t
  int kv_heads = 0;  // key/value heads of this rank: kv_heads / t, or 1 when replicated
  int head_dim = 0;
  int attn = 0;  // heads · head_dim: the query width and the attention output width (a_r)
  int kv = 0;    // kv_heads · head_dim: the width of K and of V (kv_r)
  int ffn = 0;   // f / t
  bool kv_replicated = false;

  int qkv() const { return attn + 2 * kv; }  // the fused q|k|v row of this rank
};

// Checks that cfg splits over t ranks (heads, ffn_hidden divisible by t; Llama kv_heads
// divisible by t or 1), naming the field and the rule.
absl::Status ValidateTensorSplit(const ModelConfig& cfg, int t);
// The widths of one rank of t (t = 1: the whole layer). Call ValidateTensorSplit first.
LayerWidths LocalLayerWidths(const ModelConfig& cfg, int t);

}  // namespace vp::engine::tp
