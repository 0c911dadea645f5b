// The model's shape, as the engine sees it (filled from vocabpipe.v1.ModelSpec by the runtime;
// the engine does not depend on protobuf).
#pragma once

namespace vp::engine {

// The decoder family. GPT-2: LayerNorm with bias, learned positions (wpe), GELU MLP, biases,
// multi-head attention. Llama: RMSNorm, rotary positions (RoPE), SwiGLU MLP, grouped-query
// attention, no biases, no position table (docs/engine.md, "Llama layer").
enum class Architecture { kGpt2, kLlama };

// Activation recomputation (parallel.recompute, docs/recompute.md): how much of a layer's forward
// its backward runs again instead of keeping. The arithmetic is the same in every mode, so losses
// and gradients are bit-identical to kNone. kSelective drops the attention core's output and
// log-sum-exp after F and recomputes them from the kept queries and K/V cache before B;
// kFull keeps only each layer's input per (microbatch, chunk) and runs the layer's forward again
// before its B (the K/V cache too, once the microbatch's last chunk has gone forward).
enum class Recompute { kNone, kSelective, kFull };

struct ModelConfig {
  int layers = 0;
  int hidden = 0;      // h
  int heads = 0;       // h % heads == 0
  int vocab = 0;       // V, the real vocabulary size
  int seq_len = 0;     // s; also the number of learned positions (GPT-2 n_positions)
  int ffn_hidden = 0;  // 4h for GPT-2
  bool tie_embeddings = false;
  Architecture architecture = Architecture::kGpt2;
  int kv_heads = 0;             // llama: key/value heads, divides heads; 0 = heads
  float rms_eps = 1e-5f;        // llama: RMSNorm epsilon
  float rope_theta = 10000.0f;  // llama: rotary base
  // How the layers run, not what they compute (see Recompute).
  Recompute recompute = Recompute::kNone;

  bool llama() const { return architecture == Architecture::kLlama; }
  int head_dim() const { return hidden / heads; }
  int num_kv_heads() const { return llama() && kv_heads > 0 ? kv_heads : heads; }
  int kv_dim() const { return num_kv_heads() * head_dim(); }  // width of K and of V
};

// Hugging Face names of the tensors outside the layers (GPT2LMHeadModel / LlamaForCausalLM).
inline const char* EmbeddingTensorName(const ModelConfig& c) {
  return c.llama() ? "model.embed_tokens.weight" : "transformer.wte.weight";
}
inline const char* FinalNormTensorName(const ModelConfig& c) {
  return c.llama() ? "model.norm.weight" : "transformer.ln_f.weight";
}

}  // namespace vp::engine
