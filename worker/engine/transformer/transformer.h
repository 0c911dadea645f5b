// The transformer block (GPT-2's, x + attn(ln_1(x)) followed by + mlp(ln_2(·)), or Llama's with
// RMSNorm, RoPE, grouped-query attention and SwiGLU), with its backward
// split into the B pass (input gradient) and the W pass (parameter gradients), and run per
// (microbatch, sequence chunk) so Seq1F1B can pipeline chunks of one sequence.
//
// Parameters live in one flat float buffer per rank (llm.c style); a layer is a contiguous block
// of LayerParamCount floats whose tensors follow Hugging Face GPT-2's order and names, so a
// checkpoint exports each tensor with a memcpy. The gradient buffer has the same layout.
//
// Tensor parallelism (docs/tensor-parallel.md): over a tensor group of t ranks each rank's block
// holds its slices (tensor_parallel/split.h: heads, MLP columns) in the same order, and the passes
// run on 1/t of the chunk's token rows between the matrix products (sequence parallelism); the
// column- and row-parallel products and their collectives are tensor_parallel/parallel_linear.h.
// t = 1 is the plain layer.
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
#include "worker/engine/tensor_parallel/parallel_linear.h"
#include "worker/engine/tensor_parallel/split.h"
#include "worker/engine/transformer/slot_order.h"

namespace vp::engine {

// ---------------------------------------------------------------------------------------------
// Parameter layout.

// One tensor of a layer: its Hugging Face name suffix (after "transformer.h.<i>."), offset in
// floats from the start of the layer's block, shape, and whether AdamW's weight decay applies
// (2-D weights yes; biases and LayerNorm no). Under tensor parallelism `shape` is the rank's
// slice of `full_shape`, cut as `split` says (replicated tensors: the same).
struct TensorSpec {
  std::string name;
  size_t offset = 0;
  std::vector<int64_t> shape;
  bool weight_decay = false;
  std::vector<int64_t> full_shape;
  tp::Split split;

  size_t count() const;
};

// Named pointers into one layer's block of E: parameters or gradients, float on the CPU; the
// device stack (cuda/transformer.h) binds its T parameters and fp32 gradients with the same
// struct, so both backends read one layout.
template <typename E>
struct LayerTensors {
  E* ln1_w = nullptr;        // ln_1.weight        (h)
  E* ln1_b = nullptr;        // ln_1.bias          (h)
  E* attn_w = nullptr;       // attn.c_attn.weight (h, 3h)
  E* attn_b = nullptr;       // attn.c_attn.bias   (3h)
  E* attn_proj_w = nullptr;  // attn.c_proj.weight (h, h)
  E* attn_proj_b = nullptr;  // attn.c_proj.bias   (h)
  E* ln2_w = nullptr;        // ln_2.weight        (h)
  E* ln2_b = nullptr;        // ln_2.bias          (h)
  E* fc_w = nullptr;         // mlp.c_fc.weight    (h, f)
  E* fc_b = nullptr;         // mlp.c_fc.bias      (f)
  E* proj_w = nullptr;       // mlp.c_proj.weight  (f, h)
  E* proj_b = nullptr;       // mlp.c_proj.bias    (h)
};
using LayerParams = LayerTensors<float>;

// A Llama layer's tensors, weights in nn.Linear layout [out, in] (LlamaForCausalLM's), kv =
// kv_heads·head_dim. q, k, v are adjacent so one GEMM computes all three into a (n, h+2kv) row;
// gate and up are adjacent so one GEMM gives the (n, 2f) SwiGLU input.
// E is float on the CPU; the device stack binds its T parameters and fp32 gradients with it.
template <typename E>
struct LlamaLayerTensors {
  E* attn_norm_w = nullptr;  // input_layernorm.weight           (h)
  E* wqkv = nullptr;         // self_attn.{q,k,v}_proj.weight    (h + 2kv, h)
  E* wo = nullptr;           // self_attn.o_proj.weight          (h, h)
  E* mlp_norm_w = nullptr;   // post_attention_layernorm.weight  (h)
  E* wgu = nullptr;          // mlp.{gate,up}_proj.weight        (2f, h)
  E* wdown = nullptr;        // mlp.down_proj.weight             (h, f)
};
using LlamaLayerParams = LlamaLayerTensors<float>;

// Floats per layer (one tensor rank's of t). GPT-2 at t = 1: 4h (two LayerNorms) + h·3h + 3h +
// h·h + h + h·f + f + f·h + h. Llama: 2h (two RMSNorms) + (h + 2kv)·h + h·h + 3·f·h.
size_t LayerParamCount(const ModelConfig& cfg, int t = 1);
// The layer's tensors in Hugging Face order, offsets relative to the layer's block; shapes are
// one tensor rank's of t.
std::vector<TensorSpec> LayerTensorSpecs(const ModelConfig& cfg, int t = 1);
// "transformer.h.<layer>.<suffix>" (GPT-2 names; see the overload for either architecture).
std::string LayerTensorName(int layer, std::string_view suffix);
// GPT-2 "transformer.h.<layer>.<suffix>", Llama "model.layers.<layer>.<suffix>".
std::string LayerTensorName(const ModelConfig& cfg, int layer, std::string_view suffix);
// Binds a Llama layer's pointers to the block at `base` (params or grads); empty for GPT-2.
template <typename E>
LlamaLayerTensors<E> BindLlamaLayerTensors(E* base, const ModelConfig& cfg, int t = 1) {
  if (!cfg.llama()) return {};
  const std::vector<TensorSpec> specs = LayerTensorSpecs(cfg, t);
  // Spec order: norm, q, k, v, o, norm, gate, up, down.
  return {.attn_norm_w = base + specs[0].offset,
          .wqkv = base + specs[1].offset,
          .wo = base + specs[4].offset,
          .mlp_norm_w = base + specs[5].offset,
          .wgu = base + specs[6].offset,
          .wdown = base + specs[8].offset};
}
inline LlamaLayerParams BindLlamaLayerParams(float* base, const ModelConfig& cfg, int t = 1) {
  return BindLlamaLayerTensors(base, cfg, t);
}
// Binds the named pointers to the block starting at `base` (params or grads), at the offsets
// of LayerTensorSpecs. GPT-2 only (a Llama block binds with BindLlamaLayerParams).
template <typename E>
LayerTensors<E> BindLayerTensors(E* base, const ModelConfig& cfg, int t = 1) {
  if (cfg.llama()) return {};
  const std::vector<TensorSpec> specs = LayerTensorSpecs(cfg, t);
  E* LayerTensors<E>::*const fields[] = {
      &LayerTensors<E>::ln1_w,  &LayerTensors<E>::ln1_b,       &LayerTensors<E>::attn_w,
      &LayerTensors<E>::attn_b, &LayerTensors<E>::attn_proj_w, &LayerTensors<E>::attn_proj_b,
      &LayerTensors<E>::ln2_w,  &LayerTensors<E>::ln2_b,       &LayerTensors<E>::fc_w,
      &LayerTensors<E>::fc_b,   &LayerTensors<E>::proj_w,      &LayerTensors<E>::proj_b,
  };
  LayerTensors<E> p;
  for (size_t i = 0; i < specs.size(); ++i) p.*fields[i] = base + specs[i].offset;
  return p;
}
inline LayerParams BindLayerParams(float* base, const ModelConfig& cfg, int t = 1) {
  return BindLayerTensors(base, cfg, t);
}

// GPT-2 init of layer `layer` (its global index, which names its tensors): weights
// N(0, 0.02) drawn with InitNormal(tensor_id = TensorId(full HF name)), the residual output
// projections (attn.c_proj, mlp.c_proj weights) with std 0.02/sqrt(2·layers), biases 0,
// LayerNorm weights 1. Llama (Hugging Face's LlamaPreTrainedModel): every weight N(0, 0.02),
// RMSNorm weights 1. Tensor rank r of t gets its slices of those values (element i of a named
// tensor has one value whichever rank holds it).
void InitLayerParams(float* base, const ModelConfig& cfg, int layer, uint64_t seed, int r = 0,
                     int t = 1);

// ---------------------------------------------------------------------------------------------
// Per-call state.

// A contiguous range [begin, end) of sequence positions (a Seq1F1B chunk; [0, s) when whole).
struct SeqChunk {
  int begin = 0;
  int end = 0;
  int len() const { return end - begin; }
};

// Where a layer stack sits and what it runs on, the same for the CPU stack and its CUDA twin:
// layers [first, first+count) of the model, microbatches of `batch` sequences split at
// `bounds` = {0, e_1, ..., s} into sequence chunks.
struct LayerStackShape {
  ModelConfig cfg;
  int first = 0;
  int count = 0;
  int batch = 0;
  size_t layer_params = 0;  // LayerParamCount(cfg, tensor)
  std::vector<int> bounds;
  int tensor = 1;  // t: the layers are one rank's slices of a tensor group of t

  int num_seq_chunks() const { return static_cast<int>(bounds.size()) - 1; }
  SeqChunk seq_chunk(int q) const { return {bounds[q], bounds[q + 1]}; }
};

// Per (layer, microbatch) state spanning the sequence chunks: the key/value cache filled by
// the forwards of chunks 0, 1, ... in order, and the key/value gradient accumulator filled by
// the backwards of chunks k-1, ..., 0. Released by the backward of the chunk starting at 0.
// K rows are stored after RoPE (Llama), so later chunks read them rotated.
struct LayerKvState {
  PooledBuffer k;   // (b, s, kv)  kv = h for GPT-2, kv_heads·head_dim for Llama
  PooledBuffer v;   // (b, s, kv)
  PooledBuffer dk;  // (b, s, kv)
  PooledBuffer dv;  // (b, s, kv)
};

// Activations of one layer for one (microbatch, chunk), owned by the caller, on loan from an
// ActivationPool (charged to kActivations while live). Shapes are t = 1's; under tensor
// parallelism (b, t) rows of width h are the rank's m = b·t/t_p token rows, and widths 3h, h of
// the attention and f of the MLP are the rank's slices. Forward fills the first group;
// BackwardInput frees what only it needed and stashes the output gradients the W pass needs;
// BackwardWeight consumes and frees the rest.
struct LayerActivations {
  SeqChunk seq;
  int batch = 0;
  const float* inp = nullptr;  // (b, t, h) the layer input; caller keeps it alive until W
  // Forward. Llama uses the same slots: ln1/ln2 hold the RMSNorm outputs (no mean), q holds
  // the rotated queries (the rotated keys go to the cache), fch is the SwiGLU input (b, t, 2f) and
  // fch_gelu its output (b, t, f); d_fch and d_qkv follow those widths.
  PooledBuffer ln1, ln1_mean, ln1_rstd;  // (b,t,h), (b,t), (b,t)
  PooledBuffer q;                        // (b, t, h) queries (K, V are in the cache); freed by B
  PooledBuffer lse;                      // (b, nh, t) softmax log-sum-exp; freed by B
  PooledBuffer atty;                     // (b, t, h)  attention output before c_proj (and
                                         //            what B recomputes the softmax with)
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
// chunk after its B. LayerStack checks that order; this class assumes it. Under tensor
// parallelism every rank of the group makes the same calls in the same order (each pass
// exchanges token rows with the group); m below is the rank's b·len/t rows.
class TransformerLayer {
 public:
  // params/grads: blocks of LayerParamCount(cfg, t) floats, t = sp->group().size().
  // Activations come from `pool`, which must outlive the layer's activations and K/V state; sp
  // must outlive the layer.
  TransformerLayer(const ModelConfig& cfg, int batch, float* params, float* grads,
                   ActivationPool* pool, const tp::SequenceParallel* sp);

  // F: out = layer(x) for chunk positions; appends the chunk's K/V to kv.
  absl::Status Forward(SeqChunk seq,
                       const float* x,  // (m, h), kept alive by the caller until W
                       float* out,      // (m, h)
                       LayerKvState& kv, LayerActivations& acts) const;
  // B: dx = dL/dx for the chunk (overwritten); adds this chunk's dK/dV of positions
  // [0, seq.end) into kv and uses the accumulated values for the chunk's own positions.
  absl::Status BackwardInput(const float* dout,  // (m, h)
                             float* dx,          // (m, h)
                             LayerKvState& kv, LayerActivations& acts) const;
  // W: accumulates every parameter gradient of the chunk into the gradient block, then frees
  // the activations. Replicated tensors get this rank's rows' share (LayerStack sums them).
  absl::Status BackwardWeight(LayerActivations& acts) const;
  // Full recomputation: writes the chunk's keys and values into kv (allocating the cache if it
  // was released) by running F's first part again, the same arithmetic as Forward's.
  absl::Status ForwardKeysValues(SeqChunk seq,
                                 const float* x,  // (m, h) the layer input
                                 LayerKvState& kv) const;

 private:
  // F's first part: ln1 (and its statistics), the q|k|v product (rotated for Llama), the chunk's
  // K and V appended to the cache (allocated on the microbatch's first chunk), the queries kept.
  absl::Status ForwardQkv(SeqChunk seq, const float* x, LayerKvState& kv,
                          LayerActivations& acts) const;
  // Selective recomputation: after F, frees the attention core's output and log-sum-exp ...
  void DropAttentionCore(LayerActivations& acts) const;
  // ... and before B computes them again from the kept queries and the K/V cache (a no-op when F
  // kept them).
  absl::Status RecomputeAttention(LayerKvState& kv, LayerActivations& acts) const;
  // The Llama block (cfg_.llama()): x + o_proj(attn(rope(qkv(rms(x))))) then
  // + down(swiglu(gate_up(rms(·)))).
  absl::Status ForwardLlama(SeqChunk seq, const float* x, float* out, LayerKvState& kv,
                            LayerActivations& acts) const;
  absl::Status BackwardInputLlama(const float* dout, float* dx, LayerKvState& kv,
                                  LayerActivations& acts) const;
  absl::Status BackwardWeightLlama(LayerActivations& acts) const;

  ModelConfig cfg_;
  int batch_;
  tp::LayerWidths w_;  // this tensor rank's widths
  LayerParams p_;
  LayerParams g_;
  LlamaLayerParams lp_;
  LlamaLayerParams lg_;
  ActivationPool* pool_;
  const tp::SequenceParallel* sp_;
  // The products: GPT-2 c_attn / Llama q|k|v and c_fc / gate|up column-parallel, attn.c_proj /
  // o_proj and mlp.c_proj / down row-parallel.
  tp::ColumnParallelLinear qkv_;
  tp::RowParallelLinear attn_out_;
  tp::ColumnParallelLinear mlp_in_;
  tp::RowParallelLinear mlp_out_;
};

// ---------------------------------------------------------------------------------------------
// A pipeline stage's layers [first, first+count), driven per (microbatch, sequence chunk) slot.

class LayerStack {
 public:
  // params/grads: count·LayerParamCount(cfg, t) floats, layer-major, owned by the caller.
  // group: the tensor group the layers are split over (default: none, t = 1); its communicator
  // must outlive the stack. Every sequence chunk's length must be divisible by t.
  static absl::StatusOr<LayerStack> Create(const ModelConfig& cfg, int first_layer, int count,
                                           int microbatch_size, std::vector<int> seq_bounds,
                                           float* params, float* grads, MemoryTracker* tracker,
                                           tp::TensorGroup group = {});

  size_t param_count() const { return static_cast<size_t>(shape_.count) * shape_.layer_params; }
  const tp::TensorGroup& tensor_group() const { return sp_->group(); }
  int first_layer() const { return shape_.first; }
  int count() const { return shape_.count; }
  int num_seq_chunks() const { return shape_.num_seq_chunks(); }
  SeqChunk seq_chunk(int q) const { return shape_.seq_chunk(q); }
  // Slots forwarded and not yet released by W.
  int live_slots() const { return order_.live_slots(); }
  // The stack's activation pool (live bytes are charged to the tracker's kActivations).
  ActivationPool& pool() { return *pool_; }

  // Tensors of the whole stack with full HF names, offsets relative to `params`.
  std::vector<TensorSpec> TensorSpecs() const;
  // GPT-2 init of every layer of the stack (global indices name the tensors); a tensor rank
  // gets its slices.
  void InitParams(uint64_t seed);
  // Tensor parallelism: sums the gradients of the replicated tensors (norms, row-parallel
  // biases, Llama's k and v when kv_heads = 1) over the tensor group, each rank having
  // accumulated its own token rows' share. Once per step, before the data-parallel reduction
  // and the optimizer; nothing at t = 1.
  absl::Status SumReplicatedGrads();

  // The passes keep the order of slot_order.h (F in sequence order, B in reverse, W after B).
  // F of a slot: x and out are (m, h), the rank's m = b·len/t token rows of the chunk (len its
  // length; all b·len rows at t = 1).
  absl::Status Forward(SlotKey slot, const float* x, float* out);
  // B of a slot: dout, dx (b, len, h).
  absl::Status BackwardInput(SlotKey slot, const float* dout, float* dx);
  // W of a slot, after its B: accumulates parameter gradients, frees the slot.
  absl::Status BackwardWeight(SlotKey slot);
  // B followed by W (schedules that do not split the backward).
  absl::Status Backward(SlotKey slot, const float* dout, float* dx);
  // Forward-only evaluation: frees every forwarded slot of `microbatch` and its K/V state
  // without running B or W (no gradient is touched).
  void DiscardMicrobatch(int microbatch);

 private:
  struct Slot {
    std::vector<PooledBuffer> inputs;  // inputs[i]: the input of layer i (b, t, h)
    std::vector<LayerActivations> acts;
  };
  LayerStack() : order_(1) {}
  // Full recomputation: layer i's F of the slot again, before its B (and the K/V of the
  // microbatch's earlier chunks first when the cache was released).
  absl::Status RecomputeForward(SlotKey slot, int i);
  // B of every layer of the slot, last layer first; with `weights` each layer's W right after
  // its B and the slot released.
  absl::Status BackwardPasses(SlotKey slot, const float* dout, float* dx, bool weights);
  // Floats of the rank's rows of one activation of chunk `seq`: (b·len/t, h).
  size_t LocalRowFloats(SeqChunk seq) const {
    return static_cast<size_t>(shape_.batch) * seq.len() / shape_.tensor * shape_.cfg.hidden;
  }

  LayerStackShape shape_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  // Declared before the slots so that it is destroyed after every buffer it lent.
  std::unique_ptr<ActivationPool> pool_;
  std::unique_ptr<tp::SequenceParallel> sp_;  // heap-held: the layers point at it
  std::vector<TransformerLayer> layers_;
  SlotOrder order_;
  std::map<SlotKey, Slot> slots_;
  std::map<int, std::vector<LayerKvState>> kv_;  // per microbatch in flight, per layer
};

// The activation footprint of one layer for one microbatch of b whole sequences, measured by
// running a forward and a backward through a one-layer stack and reading the tracker (the
// planner's memory model takes these numbers as its input). cfg.recompute decides what F keeps.
struct LayerActivationFootprint {
  int64_t kept = 0;                // held from the layer's F until its backward
  int64_t backward_transient = 0;  // extra held while its backward runs (dK/dV, the B stash,
                                   // the pass's input and output gradients; under full
                                   // recomputation the recomputed forward too)
  int64_t held_for_w = 0;          // held from its B until its W when the backward is split
                                   // (what W reads: the B stash and forward activations)
};
absl::StatusOr<LayerActivationFootprint> MeasureLayerActivationBytes(const ModelConfig& cfg, int b);

// Seconds of one layer's attention core (softmax(QKᵀ)V with its log-sum-exp) over one
// microbatch of b whole sequences on this CPU, the fastest of three: what selective
// recomputation adds to a layer's B. Profiling reports it (the planner's Costs::recompute).
double TimeAttentionCoreSeconds(const ModelConfig& cfg, int b);

}  // namespace vp::engine
