// The GPT-2 transformer block, x + attn(ln_1(x)) followed by + mlp(ln_2(·)), with its backward
// split into the B pass (input gradient) and the W pass (parameter gradients), and run per
// (microbatch, sequence chunk) so Seq1F1B can pipeline chunks of one sequence.
//
// Parameters live in one flat float buffer per rank (llm.c style); a layer is a contiguous block
// of LayerParamCount floats whose tensors follow Hugging Face GPT-2's order and names, so a
// checkpoint exports each tensor with a memcpy. The gradient buffer has the same layout.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/activation_pool.h"
#include "worker/engine/config.h"
#include "worker/engine/memory.h"

namespace vp::engine {

// ---------------------------------------------------------------------------------------------
// Parameter layout.

// One tensor of a layer: its Hugging Face name suffix (after "transformer.h.<i>."), offset in
// floats from the start of the layer's block, shape, and whether AdamW's weight decay applies
// (2-D weights yes; biases and LayerNorm no).
struct TensorSpec {
  std::string name;
  size_t offset = 0;
  std::vector<int64_t> shape;
  bool weight_decay = false;

  size_t count() const;
};

// Named pointers into one layer's block (of parameters or of gradients).
struct LayerParams {
  float* ln1_w = nullptr;        // ln_1.weight        (h)
  float* ln1_b = nullptr;        // ln_1.bias          (h)
  float* attn_w = nullptr;       // attn.c_attn.weight (h, 3h)
  float* attn_b = nullptr;       // attn.c_attn.bias   (3h)
  float* attn_proj_w = nullptr;  // attn.c_proj.weight (h, h)
  float* attn_proj_b = nullptr;  // attn.c_proj.bias   (h)
  float* ln2_w = nullptr;        // ln_2.weight        (h)
  float* ln2_b = nullptr;        // ln_2.bias          (h)
  float* fc_w = nullptr;         // mlp.c_fc.weight    (h, f)
  float* fc_b = nullptr;         // mlp.c_fc.bias      (f)
  float* proj_w = nullptr;       // mlp.c_proj.weight  (f, h)
  float* proj_b = nullptr;       // mlp.c_proj.bias    (h)
};

// Floats per layer: 4h (two LayerNorms) + h·3h + 3h + h·h + h + h·f + f + f·h + h.
size_t LayerParamCount(const ModelConfig& cfg);
// The layer's tensors in Hugging Face order, offsets relative to the layer's block.
std::vector<TensorSpec> LayerTensorSpecs(const ModelConfig& cfg);
// "transformer.h.<layer>.<suffix>".
std::string LayerTensorName(int layer, std::string_view suffix);
// Binds the named pointers to the block starting at `base` (params or grads).
LayerParams BindLayerParams(float* base, const ModelConfig& cfg);

// GPT-2 init of layer `layer` (its global index, which names its tensors): weights
// N(0, 0.02) drawn with InitNormal(tensor_id = TensorId(full HF name)), the residual output
// projections (attn.c_proj, mlp.c_proj weights) with std 0.02/sqrt(2·layers), biases 0,
// LayerNorm weights 1.
void InitLayerParams(float* base, const ModelConfig& cfg, int layer, uint64_t seed);

// ---------------------------------------------------------------------------------------------
// Per-call state.

// A contiguous range [begin, end) of sequence positions (a Seq1F1B chunk; [0, s) when whole).
struct SeqChunk {
  int begin = 0;
  int end = 0;
  int len() const { return end - begin; }
};

// Per (layer, microbatch) state spanning the sequence chunks: the key/value cache filled by
// the forwards of chunks 0, 1, ... in order, and the key/value gradient accumulator filled by
// the backwards of chunks k-1, ..., 0. Released by the backward of the chunk starting at 0.
struct LayerKvState {
  PooledBuffer k;   // (b, s, h)
  PooledBuffer v;   // (b, s, h)
  PooledBuffer dk;  // (b, s, h)
  PooledBuffer dv;  // (b, s, h)
};

// Activations of one layer for one (microbatch, chunk), owned by the caller, on loan from an
// ActivationPool (charged to kActivations while live). Forward fills the first group; BackwardInput
// frees what only it needed and stashes the output gradients the W pass needs; BackwardWeight
// consumes and frees the rest.
struct LayerActivations {
  SeqChunk chunk;
  int batch = 0;
  const float* inp = nullptr;  // (b, t, h) the layer input; caller keeps it alive until W
  // Forward.
  PooledBuffer ln1, ln1_mean, ln1_rstd;  // (b,t,h), (b,t), (b,t)
  PooledBuffer qkv;                      // (b, t, 3h)      freed by B
  PooledBuffer att;                      // (b, nh, t, end) freed by B
  PooledBuffer atty;                     // (b, t, h)  attention output before c_proj
  PooledBuffer res1;                     // (b, t, h)  x + attn
  PooledBuffer ln2, ln2_mean, ln2_rstd;  // (b,t,h), (b,t), (b,t)
  PooledBuffer fch;                      // (b, t, f)  c_fc output, pre-GELU; freed by B
  PooledBuffer fch_gelu;                 // (b, t, f)
  // B-pass stash for W.
  PooledBuffer d_out;   // (b, t, h)  gradient of the layer output (mlp.c_proj's output)
  PooledBuffer d_fch;   // (b, t, f)  gradient of c_fc's output
  PooledBuffer d_ln2;   // (b, t, h)  gradient of ln_2's output
  PooledBuffer d_res1;  // (b, t, h)  gradient of res1 (= attn.c_proj's output gradient)
  PooledBuffer d_qkv;   // (b, t, 3h) gradient of c_attn's output (dK, dV fully accumulated)
  PooledBuffer d_ln1;   // (b, t, h)  gradient of ln_1's output
  bool forward_done = false;
  bool backward_input_done = false;
};

// One transformer layer bound to its parameters and gradient block. The caller orders calls:
// forwards of a microbatch's chunks in position order, backwards in reverse order, and W of a
// chunk after its B. LayerStack checks that order; this class assumes it.
class TransformerLayer {
 public:
  // params/grads: blocks of LayerParamCount(cfg) floats. Activations come from `pool`, which
  // must outlive the layer's activations and K/V state.
  TransformerLayer(const ModelConfig& cfg, int batch, float* params, float* grads,
                   ActivationPool* pool);

  // F: out = layer(x) for chunk positions; appends the chunk's K/V to kv.
  void Forward(SeqChunk chunk,
               const float* x,  // (b, chunk.len, h), kept alive by the caller until W
               float* out,      // (b, chunk.len, h)
               LayerKvState& kv, LayerActivations& acts) const;
  // B: dx = dL/dx for the chunk (overwritten); adds this chunk's dK/dV of positions
  // [0, chunk.end) into kv and uses the accumulated values for the chunk's own positions.
  void BackwardInput(const float* dout,  // (b, t, h)
                     float* dx,          // (b, t, h)
                     LayerKvState& kv, LayerActivations& acts) const;
  // W: accumulates every parameter gradient of the chunk into the gradient block, then frees
  // the activations.
  void BackwardWeight(LayerActivations& acts) const;

 private:
  ModelConfig cfg_;
  int batch_;
  LayerParams p_;
  LayerParams g_;
  ActivationPool* pool_;
};

// ---------------------------------------------------------------------------------------------
// A pipeline stage's layers [first, first+count), driven per (microbatch, sequence chunk) slot.

struct SlotKey {
  int microbatch = 0;
  int chunk = 0;
  auto operator<=>(const SlotKey&) const = default;
};

// chunk_bounds = {0, e_1, ..., s}: k+1 strictly increasing positions ending at seq_len.
absl::Status ValidateChunkBounds(const std::vector<int>& chunk_bounds, int seq_len);
// k chunks with (nearly) equal numbers of positions.
std::vector<int> EqualChunkBounds(int seq_len, int k);

class LayerStack {
 public:
  // params/grads: count·LayerParamCount(cfg) floats, layer-major, owned by the caller.
  static absl::StatusOr<LayerStack> Create(const ModelConfig& cfg, int first_layer, int count,
                                           int microbatch_size, std::vector<int> chunk_bounds,
                                           float* params, float* grads, MemoryTracker* tracker);

  size_t param_count() const { return static_cast<size_t>(count_) * layer_params_; }
  int first_layer() const { return first_; }
  int count() const { return count_; }
  int num_chunks() const { return static_cast<int>(bounds_.size()) - 1; }
  SeqChunk chunk(int q) const { return {bounds_[q], bounds_[q + 1]}; }
  // Slots forwarded and not yet released by W.
  int live_slots() const { return static_cast<int>(slots_.size()); }
  // The stack's activation pool (live bytes are charged to the tracker's kActivations).
  ActivationPool& pool() { return *pool_; }

  // Tensors of the whole stack with full HF names, offsets relative to `params`.
  std::vector<TensorSpec> TensorSpecs() const;
  // GPT-2 init of every layer of the stack (global indices name the tensors).
  void InitParams(uint64_t seed);

  // F of a slot: x and out are (b, chunk_len, h). Chunks of a microbatch go in order 0..k-1.
  absl::Status Forward(SlotKey slot, const float* x, float* out);
  // B of a slot: dout, dx (b, chunk_len, h). Needs all k chunks forwarded; chunks in reverse.
  absl::Status BackwardInput(SlotKey slot, const float* dout, float* dx);
  // W of a slot, after its B: accumulates parameter gradients, frees the slot.
  absl::Status BackwardWeight(SlotKey slot);
  // B followed by W (schedules that do not split the backward).
  absl::Status Backward(SlotKey slot, const float* dout, float* dx);

 private:
  struct Slot {
    std::vector<PooledBuffer> inputs;  // inputs[i]: the input of layer i (b, t, h)
    std::vector<LayerActivations> acts;
  };
  struct MicrobatchState {
    int next_forward = 0;          // next chunk to forward
    int next_backward = 0;         // next chunk to run B on (counts down from k-1)
    std::vector<LayerKvState> kv;  // per layer
  };

  LayerStack() = default;

  ModelConfig cfg_;
  int first_ = 0;
  int count_ = 0;
  int batch_ = 0;
  size_t layer_params_ = 0;
  std::vector<int> bounds_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  // Declared before the slots so that it is destroyed after every buffer it lent.
  std::unique_ptr<ActivationPool> pool_;
  std::vector<TransformerLayer> layers_;
  std::map<SlotKey, Slot> slots_;
  std::map<int, MicrobatchState> microbatches_;
};

// The activation footprint of one layer for one microbatch of b whole sequences, measured by
// running a forward and a backward through a one-layer stack and reading the tracker (the
// planner's memory model takes these numbers as its input).
struct LayerActivationFootprint {
  int64_t kept = 0;                // held from the layer's F until its backward
  int64_t backward_transient = 0;  // extra held while its backward runs (dK/dV, the B stash,
                                   // the pass's input and output gradients)
};
absl::StatusOr<LayerActivationFootprint> MeasureLayerActivationBytes(const ModelConfig& cfg, int b);

}  // namespace vp::engine
