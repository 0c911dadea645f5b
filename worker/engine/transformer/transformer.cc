#include "worker/engine/transformer/transformer.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/init.h"
#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::engine {

// ---------------------------------------------------------------------------------------------
// Parameter layout.

size_t TensorSpec::count() const {
  size_t n = 1;
  for (const int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::vector<TensorSpec> LayerTensorSpecs(const ModelConfig& cfg) {
  const int64_t h = cfg.hidden;
  const int64_t f = cfg.ffn_hidden;
  const int64_t kv = cfg.kv_dim();
  // Llama: nn.Linear weights [out, in]; q, k, v adjacent and gate, up adjacent (one GEMM each).
  std::vector<TensorSpec> specs = cfg.llama() ? std::vector<TensorSpec>{
      {"input_layernorm.weight", 0, {h}, false},
      {"self_attn.q_proj.weight", 0, {h, h}, true},
      {"self_attn.k_proj.weight", 0, {kv, h}, true},
      {"self_attn.v_proj.weight", 0, {kv, h}, true},
      {"self_attn.o_proj.weight", 0, {h, h}, true},
      {"post_attention_layernorm.weight", 0, {h}, false},
      {"mlp.gate_proj.weight", 0, {f, h}, true},
      {"mlp.up_proj.weight", 0, {f, h}, true},
      {"mlp.down_proj.weight", 0, {h, f}, true},
  } : std::vector<TensorSpec>{
      // Hugging Face GPT-2 order; Conv1D weights are [in, out].
      {"ln_1.weight", 0, {h}, false},
      {"ln_1.bias", 0, {h}, false},
      {"attn.c_attn.weight", 0, {h, 3 * h}, true},
      {"attn.c_attn.bias", 0, {3 * h}, false},
      {"attn.c_proj.weight", 0, {h, h}, true},
      {"attn.c_proj.bias", 0, {h}, false},
      {"ln_2.weight", 0, {h}, false},
      {"ln_2.bias", 0, {h}, false},
      {"mlp.c_fc.weight", 0, {h, f}, true},
      {"mlp.c_fc.bias", 0, {f}, false},
      {"mlp.c_proj.weight", 0, {f, h}, true},
      {"mlp.c_proj.bias", 0, {h}, false},
  };
  size_t offset = 0;
  for (TensorSpec& s : specs) {
    s.offset = offset;
    offset += s.count();
  }
  return specs;
}

size_t LayerParamCount(const ModelConfig& cfg) {
  const size_t h = cfg.hidden;
  const size_t f = cfg.ffn_hidden;
  if (cfg.llama()) {
    const size_t kv = cfg.kv_dim();
    return 2 * h + (h + 2 * kv) * h + h * h + 3 * f * h;
  }
  return 4 * h + h * 3 * h + 3 * h + h * h + h + h * f + f + f * h + h;
}

std::string LayerTensorName(int layer, std::string_view suffix) {
  return absl::StrCat("transformer.h.", layer, ".", std::string(suffix));
}

std::string LayerTensorName(const ModelConfig& cfg, int layer, std::string_view suffix) {
  if (!cfg.llama()) return LayerTensorName(layer, suffix);
  return absl::StrCat("model.layers.", layer, ".", std::string(suffix));
}

void InitLayerParams(float* base, const ModelConfig& cfg, int layer, uint64_t seed) {
  if (cfg.llama()) {
    for (const TensorSpec& s : LayerTensorSpecs(cfg)) {
      if (s.shape.size() == 1) {
        InitConstant(base + s.offset, s.count(), 1.0f);  // RMSNorm weights
      } else {
        InitNormal(base + s.offset, s.count(), 0.02f, seed,
                   TensorId(LayerTensorName(cfg, layer, s.name)), 0);
      }
    }
    return;
  }
  const float std_w = 0.02f;
  // GPT-2: the projections that write into the residual stream are scaled so the stream's
  // variance does not grow with depth (2 such projections per layer).
  const float std_residual = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  for (const TensorSpec& s : LayerTensorSpecs(cfg)) {
    float* dst = base + s.offset;
    const std::string_view name = s.name;
    if (name == "ln_1.weight" || name == "ln_2.weight") {
      InitConstant(dst, s.count(), 1.0f);
    } else if (s.shape.size() == 1) {
      InitConstant(dst, s.count(), 0.0f);
    } else {
      const bool residual = name == "attn.c_proj.weight" || name == "mlp.c_proj.weight";
      InitNormal(dst, s.count(), residual ? std_residual : std_w, seed,
                 TensorId(LayerTensorName(layer, name)), 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// TransformerLayer.

TransformerLayer::TransformerLayer(const ModelConfig& cfg, int batch, float* params, float* grads,
                                   ActivationPool* pool)
    : cfg_(cfg),
      batch_(batch),
      p_(BindLayerParams(params, cfg)),
      g_(BindLayerParams(grads, cfg)),
      lp_(BindLlamaLayerParams(params, cfg)),
      lg_(BindLlamaLayerParams(grads, cfg)),
      pool_(pool) {}

namespace {

// Copies rows [0, t) of column block [col, col+h) of src (b, t, ld) to rows [begin, begin+t) of
// dst (b, s, h), or the reverse direction when to_cache is false.
void CopyRows(float* cache, float* chunk, int b, int t, int s, int h, int ld, int col, int begin,
              bool to_cache) {
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < t; ++j) {
      float* c = cache + (static_cast<long>(i) * s + begin + j) * h;
      float* x = chunk + (static_cast<long>(i) * t + j) * ld + col;
      if (to_cache) {
        std::memcpy(c, x, sizeof(float) * h);
      } else {
        std::memcpy(x, c, sizeof(float) * h);
      }
    }
  }
}

}  // namespace

void TransformerLayer::Forward(SeqChunk seq, const float* x, float* out, LayerKvState& kv,
                               LayerActivations& acts) const {
  if (cfg_.llama()) return ForwardLlama(seq, x, out, kv, acts);
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden, s = cfg_.seq_len;
  const int n = b * t;
  const long nh = static_cast<long>(n) * h;
  acts.seq = seq;
  acts.batch = b;
  acts.inp = x;
  if (kv.k.empty()) {
    kv.k = pool_->Acquire(static_cast<size_t>(b) * s * h);
    kv.v = pool_->Acquire(static_cast<size_t>(b) * s * h);
  }
  // Attention sub-block: res1 = x + c_proj(attn(c_attn(ln_1(x)))).
  acts.ln1 = pool_->Acquire(nh);
  acts.ln1_mean = pool_->Acquire(n);
  acts.ln1_rstd = pool_->Acquire(n);
  cpu::LayerNormForward(acts.ln1.data(), acts.ln1_mean.data(), acts.ln1_rstd.data(), x, p_.ln1_w,
                        p_.ln1_b, n, h);
  {
    PooledBuffer qkv = pool_->Acquire(3 * nh);  // (b, t, 3h)
    cpu::LinearForward(qkv.data(), acts.ln1.data(), p_.attn_w, p_.attn_b, n, h, 3 * h);
    // Append this chunk's keys and values to the cache so later chunks can attend to them, and
    // keep only the queries: the backward reads K and V from the cache.
    CopyRows(kv.k.data(), qkv.data(), b, t, s, h, 3 * h, h, seq.begin, true);
    CopyRows(kv.v.data(), qkv.data(), b, t, s, h, 3 * h, 2 * h, seq.begin, true);
    acts.q = pool_->Acquire(nh);
    CopyRows(acts.q.data(), qkv.data(), b, t, t, h, 3 * h, 0, 0, true);
  }
  const cpu::AttentionShape shape{b, cfg_.heads, cfg_.head_dim(), seq.begin, seq.end, s};
  acts.lse = pool_->Acquire(static_cast<size_t>(b) * cfg_.heads * t);
  acts.atty = pool_->Acquire(nh);
  cpu::AttentionForward(acts.atty.data(), acts.lse.data(), acts.q.data(), h, kv.k.data(),
                        kv.v.data(), shape);
  acts.res1 = pool_->Acquire(nh);
  cpu::LinearForward(acts.res1.data(), acts.atty.data(), p_.attn_proj_w, p_.attn_proj_b, n, h, h);
  cpu::ResidualForward(acts.res1.data(), acts.res1.data(), x, nh);
  // MLP sub-block: out = res1 + c_proj(gelu(c_fc(ln_2(res1)))).
  acts.ln2 = pool_->Acquire(nh);
  acts.ln2_mean = pool_->Acquire(n);
  acts.ln2_rstd = pool_->Acquire(n);
  cpu::LayerNormForward(acts.ln2.data(), acts.ln2_mean.data(), acts.ln2_rstd.data(),
                        acts.res1.data(), p_.ln2_w, p_.ln2_b, n, h);
  acts.fch = pool_->Acquire(static_cast<size_t>(n) * f);
  cpu::LinearForward(acts.fch.data(), acts.ln2.data(), p_.fc_w, p_.fc_b, n, h, f);
  acts.fch_gelu = pool_->Acquire(static_cast<size_t>(n) * f);
  cpu::GeluForward(acts.fch_gelu.data(), acts.fch.data(), static_cast<long>(n) * f);
  cpu::LinearForward(out, acts.fch_gelu.data(), p_.proj_w, p_.proj_b, n, f, h);
  cpu::ResidualForward(out, out, acts.res1.data(), nh);
  acts.forward_done = true;
}

void TransformerLayer::BackwardInput(const float* dout, float* dx, LayerKvState& kv,
                                     LayerActivations& acts) const {
  if (cfg_.llama()) return BackwardInputLlama(dout, dx, kv, acts);
  const SeqChunk seq = acts.seq;
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden, s = cfg_.seq_len;
  const int n = b * t;
  const long nh = static_cast<long>(n) * h;
  // MLP sub-block. The layer output gradient is both the skip-path gradient of res1 and the
  // output gradient of mlp.c_proj (stashed for W).
  acts.d_out = pool_->Acquire(nh);
  std::memcpy(acts.d_out.data(), dout, sizeof(float) * nh);
  acts.d_fch = pool_->Acquire(static_cast<size_t>(n) * f);
  cpu::LinearBackwardInput(acts.d_fch.data(), dout, p_.proj_w, n, f, h);
  cpu::GeluBackward(acts.d_fch.data(), acts.fch.data(), acts.d_fch.data(),
                    static_cast<long>(n) * f);
  acts.fch.Reset();  // W needs only the GELU output
  acts.d_ln2 = pool_->Acquire(nh);
  cpu::LinearBackwardInput(acts.d_ln2.data(), acts.d_fch.data(), p_.fc_w, n, h, f);
  acts.d_res1 = pool_->Acquire(nh);
  std::memcpy(acts.d_res1.data(), dout, sizeof(float) * nh);
  cpu::LayerNormBackwardInput(acts.d_res1.data(), acts.d_ln2.data(), acts.res1.data(), p_.ln2_w,
                              acts.ln2_mean.data(), acts.ln2_rstd.data(), n, h);
  // Attention sub-block.
  PooledBuffer d_atty = pool_->Acquire(nh);
  cpu::LinearBackwardInput(d_atty.data(), acts.d_res1.data(), p_.attn_proj_w, n, h, h);
  if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
    kv.dk = pool_->Acquire(static_cast<size_t>(b) * s * h, /*zero=*/true);
    kv.dv = pool_->Acquire(static_cast<size_t>(b) * s * h, /*zero=*/true);
  }
  acts.d_qkv = pool_->Acquire(3 * nh);
  {
    const cpu::AttentionShape shape{b, cfg_.heads, cfg_.head_dim(), seq.begin, seq.end, s};
    PooledBuffer scratch = pool_->Acquire(cpu::AttentionBackwardScratch(shape));
    cpu::AttentionBackward(acts.d_qkv.data(), 3 * h, kv.dk.data(), kv.dv.data(), scratch.data(),
                           d_atty.data(), acts.atty.data(), acts.lse.data(), acts.q.data(), h,
                           kv.k.data(), kv.v.data(), shape);
  }
  // Later chunks (already run backward) and this chunk have now added everything they owe to
  // the keys/values at this chunk's positions; earlier chunks never see them. So the
  // accumulated dK/dV rows [begin, end) are final: take them as c_attn's output gradient.
  CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, h, 3 * h, h, seq.begin, false);
  CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, h, 3 * h, 2 * h, seq.begin, false);
  acts.lse.Reset();
  acts.q.Reset();
  acts.d_ln1 = pool_->Acquire(nh);
  cpu::LinearBackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), p_.attn_w, n, h, 3 * h);
  std::memcpy(dx, acts.d_res1.data(), sizeof(float) * nh);
  cpu::LayerNormBackwardInput(dx, acts.d_ln1.data(), acts.inp, p_.ln1_w, acts.ln1_mean.data(),
                              acts.ln1_rstd.data(), n, h);
  if (seq.begin == 0) kv = LayerKvState();  // the microbatch's last backward
  acts.backward_input_done = true;
}

void TransformerLayer::BackwardWeight(LayerActivations& acts) const {
  if (cfg_.llama()) return BackwardWeightLlama(acts);
  const int n = batch_ * acts.seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden;
  cpu::LayerNormBackwardWeight(g_.ln1_w, g_.ln1_b, acts.d_ln1.data(), acts.inp,
                               acts.ln1_mean.data(), acts.ln1_rstd.data(), n, h);
  cpu::LinearBackwardWeight(g_.attn_w, g_.attn_b, acts.d_qkv.data(), acts.ln1.data(), n, h, 3 * h);
  cpu::LinearBackwardWeight(g_.attn_proj_w, g_.attn_proj_b, acts.d_res1.data(), acts.atty.data(), n,
                            h, h);
  cpu::LayerNormBackwardWeight(g_.ln2_w, g_.ln2_b, acts.d_ln2.data(), acts.res1.data(),
                               acts.ln2_mean.data(), acts.ln2_rstd.data(), n, h);
  cpu::LinearBackwardWeight(g_.fc_w, g_.fc_b, acts.d_fch.data(), acts.ln2.data(), n, h, f);
  cpu::LinearBackwardWeight(g_.proj_w, g_.proj_b, acts.d_out.data(), acts.fch_gelu.data(), n, f, h);
  acts = LayerActivations();
}

// ---------------------------------------------------------------------------------------------
// The Llama block. Letters: b batch, t chunk length, s sequence length, h width, kv =
// kv_heads·head_dim, qd = h + 2kv (the fused q|k|v row), f MLP width.

void TransformerLayer::ForwardLlama(SeqChunk seq, const float* x, float* out, LayerKvState& kv,
                                    LayerActivations& acts) const {
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden, s = cfg_.seq_len;
  const int kvd = cfg_.kv_dim(), qd = h + 2 * kvd, hd = cfg_.head_dim();
  const int n = b * t;
  const long nh = static_cast<long>(n) * h;
  acts.seq = seq;
  acts.batch = b;
  acts.inp = x;
  if (kv.k.empty()) {
    kv.k = pool_->Acquire(static_cast<size_t>(b) * s * kvd);
    kv.v = pool_->Acquire(static_cast<size_t>(b) * s * kvd);
  }
  // Attention: res1 = x + o_proj(attn(rope(q), rope(k), v)), q|k|v = rms(x)·Wqkvᵀ.
  acts.ln1 = pool_->Acquire(nh);      // (b, t, h)
  acts.ln1_rstd = pool_->Acquire(n);  // (b, t)
  cpu::RmsNormForward(acts.ln1.data(), acts.ln1_rstd.data(), x, lp_.attn_norm_w, n, h,
                      cfg_.rms_eps);
  {
    PooledBuffer qkv = pool_->Acquire(static_cast<size_t>(n) * qd);  // (b, t, qd)
    cpu::LinearTForward(qkv.data(), acts.ln1.data(), lp_.wqkv, n, h, qd);
    // Rotate q and k at their absolute positions seq.begin + j: a chunk's keys enter the cache
    // already rotated, exactly as the whole sequence's would.
    cpu::RopeForward(qkv.data(), qd, b, t, cfg_.heads, hd, seq.begin, cfg_.rope_theta);
    cpu::RopeForward(qkv.data() + h, qd, b, t, cfg_.num_kv_heads(), hd, seq.begin, cfg_.rope_theta);
    CopyRows(kv.k.data(), qkv.data(), b, t, s, kvd, qd, h, seq.begin, true);
    CopyRows(kv.v.data(), qkv.data(), b, t, s, kvd, qd, h + kvd, seq.begin, true);
    acts.q = pool_->Acquire(nh);  // (b, t, h) the rotated queries
    CopyRows(acts.q.data(), qkv.data(), b, t, t, h, qd, 0, 0, true);
  }
  const cpu::AttentionShape shape{b, cfg_.heads, hd, seq.begin, seq.end, s, cfg_.num_kv_heads()};
  acts.lse = pool_->Acquire(static_cast<size_t>(b) * cfg_.heads * t);
  acts.atty = pool_->Acquire(nh);
  cpu::AttentionForward(acts.atty.data(), acts.lse.data(), acts.q.data(), h, kv.k.data(),
                        kv.v.data(), shape);
  acts.res1 = pool_->Acquire(nh);
  cpu::LinearTForward(acts.res1.data(), acts.atty.data(), lp_.wo, n, h, h);
  cpu::ResidualForward(acts.res1.data(), acts.res1.data(), x, nh);
  // MLP: out = res1 + down(silu(gate) · up), gate|up = rms(res1)·Wguᵀ.
  acts.ln2 = pool_->Acquire(nh);
  acts.ln2_rstd = pool_->Acquire(n);
  cpu::RmsNormForward(acts.ln2.data(), acts.ln2_rstd.data(), acts.res1.data(), lp_.mlp_norm_w, n, h,
                      cfg_.rms_eps);
  acts.fch = pool_->Acquire(static_cast<size_t>(n) * 2 * f);  // (b, t, 2f)
  cpu::LinearTForward(acts.fch.data(), acts.ln2.data(), lp_.wgu, n, h, 2 * f);
  acts.fch_gelu = pool_->Acquire(static_cast<size_t>(n) * f);  // (b, t, f)
  cpu::SwigluForward(acts.fch_gelu.data(), acts.fch.data(), n, f);
  cpu::LinearTForward(out, acts.fch_gelu.data(), lp_.wdown, n, f, h);
  cpu::ResidualForward(out, out, acts.res1.data(), nh);
  acts.forward_done = true;
}

void TransformerLayer::BackwardInputLlama(const float* dout, float* dx, LayerKvState& kv,
                                          LayerActivations& acts) const {
  const SeqChunk seq = acts.seq;
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden, s = cfg_.seq_len;
  const int kvd = cfg_.kv_dim(), qd = h + 2 * kvd, hd = cfg_.head_dim();
  const int n = b * t;
  const long nh = static_cast<long>(n) * h;
  // MLP. dout is both res1's skip-path gradient and down_proj's output gradient (kept for W).
  acts.d_out = pool_->Acquire(nh);
  std::memcpy(acts.d_out.data(), dout, sizeof(float) * nh);
  {
    PooledBuffer d_act = pool_->Acquire(static_cast<size_t>(n) * f);  // (b, t, f)
    cpu::LinearTBackwardInput(d_act.data(), dout, lp_.wdown, n, f, h);
    acts.d_fch = pool_->Acquire(static_cast<size_t>(n) * 2 * f);  // (b, t, 2f)
    cpu::SwigluBackward(acts.d_fch.data(), acts.fch.data(), d_act.data(), n, f);
  }
  acts.fch.Reset();  // W needs only the SwiGLU output
  acts.d_ln2 = pool_->Acquire(nh);
  cpu::LinearTBackwardInput(acts.d_ln2.data(), acts.d_fch.data(), lp_.wgu, n, h, 2 * f);
  acts.d_res1 = pool_->Acquire(nh);
  std::memcpy(acts.d_res1.data(), dout, sizeof(float) * nh);
  cpu::RmsNormBackwardInput(acts.d_res1.data(), acts.d_ln2.data(), acts.res1.data(), lp_.mlp_norm_w,
                            acts.ln2_rstd.data(), n, h);
  // Attention.
  PooledBuffer d_atty = pool_->Acquire(nh);
  cpu::LinearTBackwardInput(d_atty.data(), acts.d_res1.data(), lp_.wo, n, h, h);
  if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
    kv.dk = pool_->Acquire(static_cast<size_t>(b) * s * kvd, /*zero=*/true);
    kv.dv = pool_->Acquire(static_cast<size_t>(b) * s * kvd, /*zero=*/true);
  }
  acts.d_qkv = pool_->Acquire(static_cast<size_t>(n) * qd);  // (b, t, qd)
  {
    const cpu::AttentionShape shape{b, cfg_.heads, hd, seq.begin, seq.end, s, cfg_.num_kv_heads()};
    PooledBuffer scratch = pool_->Acquire(cpu::AttentionBackwardScratch(shape));
    cpu::AttentionBackward(acts.d_qkv.data(), qd, kv.dk.data(), kv.dv.data(), scratch.data(),
                           d_atty.data(), acts.atty.data(), acts.lse.data(), acts.q.data(), h,
                           kv.k.data(), kv.v.data(), shape);
  }
  // As in the GPT-2 block, rows [begin, end) of the dK/dV accumulators are final now.
  CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, kvd, qd, h, seq.begin, false);
  CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, kvd, qd, h + kvd, seq.begin, false);
  // Those are gradients of the rotated q, k: rotate back to get the projections' gradients.
  cpu::RopeBackward(acts.d_qkv.data(), qd, b, t, cfg_.heads, hd, seq.begin, cfg_.rope_theta);
  cpu::RopeBackward(acts.d_qkv.data() + h, qd, b, t, cfg_.num_kv_heads(), hd, seq.begin,
                    cfg_.rope_theta);
  acts.lse.Reset();
  acts.q.Reset();
  acts.d_ln1 = pool_->Acquire(nh);
  cpu::LinearTBackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), lp_.wqkv, n, h, qd);
  std::memcpy(dx, acts.d_res1.data(), sizeof(float) * nh);
  cpu::RmsNormBackwardInput(dx, acts.d_ln1.data(), acts.inp, lp_.attn_norm_w, acts.ln1_rstd.data(),
                            n, h);
  if (seq.begin == 0) kv = LayerKvState();  // the microbatch's last backward
  acts.backward_input_done = true;
}

void TransformerLayer::BackwardWeightLlama(LayerActivations& acts) const {
  const int n = batch_ * acts.seq.len(), h = cfg_.hidden, f = cfg_.ffn_hidden;
  const int qd = h + 2 * cfg_.kv_dim();
  cpu::RmsNormBackwardWeight(lg_.attn_norm_w, acts.d_ln1.data(), acts.inp, acts.ln1_rstd.data(), n,
                             h);
  cpu::LinearTBackwardWeight(lg_.wqkv, acts.d_qkv.data(), acts.ln1.data(), n, h, qd);
  cpu::LinearTBackwardWeight(lg_.wo, acts.d_res1.data(), acts.atty.data(), n, h, h);
  cpu::RmsNormBackwardWeight(lg_.mlp_norm_w, acts.d_ln2.data(), acts.res1.data(),
                             acts.ln2_rstd.data(), n, h);
  cpu::LinearTBackwardWeight(lg_.wgu, acts.d_fch.data(), acts.ln2.data(), n, h, 2 * f);
  cpu::LinearTBackwardWeight(lg_.wdown, acts.d_out.data(), acts.fch_gelu.data(), n, f, h);
  acts = LayerActivations();
}

// ---------------------------------------------------------------------------------------------
// LayerStack.

absl::StatusOr<LayerStack> LayerStack::Create(const ModelConfig& cfg, int first_layer, int count,
                                              int microbatch_size, std::vector<int> seq_bounds,
                                              float* params, float* grads, MemoryTracker* tracker) {
  if (absl::Status st = ValidateLayerStackArgs(cfg, first_layer, count, microbatch_size, params,
                                               grads, seq_bounds);
      !st.ok()) {
    return st;
  }
  LayerStack stack;
  stack.order_ = SlotOrder(static_cast<int>(seq_bounds.size()) - 1);
  stack.shape_ = {
      cfg, first_layer, count, microbatch_size, LayerParamCount(cfg), std::move(seq_bounds)};
  stack.params_ = params;
  stack.grads_ = grads;
  stack.pool_ = std::make_unique<ActivationPool>(tracker);
  for (int i = 0; i < count; ++i) {
    stack.layers_.emplace_back(cfg, microbatch_size, params + i * stack.shape_.layer_params,
                               grads + i * stack.shape_.layer_params, stack.pool_.get());
  }
  return stack;
}

std::vector<TensorSpec> LayerStack::TensorSpecs() const {
  std::vector<TensorSpec> out;
  const std::vector<TensorSpec> layer = LayerTensorSpecs(shape_.cfg);
  for (int i = 0; i < shape_.count; ++i) {
    for (const TensorSpec& s : layer) {
      TensorSpec t = s;
      t.name = LayerTensorName(shape_.cfg, shape_.first + i, s.name);
      t.offset += static_cast<size_t>(i) * shape_.layer_params;
      out.push_back(std::move(t));
    }
  }
  return out;
}

void LayerStack::InitParams(uint64_t seed) {
  for (int i = 0; i < shape_.count; ++i) {
    InitLayerParams(params_ + i * shape_.layer_params, shape_.cfg, shape_.first + i, seed);
  }
}

absl::Status LayerStack::Forward(SlotKey slot, const float* x, float* out) {
  if (absl::Status st = order_.CheckForward(slot); !st.ok()) return st;
  std::vector<LayerKvState>& kv = kv_[slot.microbatch];
  if (kv.empty()) kv.resize(shape_.count);
  const SeqChunk seq = seq_chunk(slot.seq);
  const size_t nh = static_cast<size_t>(shape_.batch) * seq.len() * shape_.cfg.hidden;
  Slot& st = slots_[slot];
  st.acts.resize(shape_.count);
  st.inputs.reserve(shape_.count);
  for (int i = 0; i < shape_.count; ++i) st.inputs.push_back(pool_->Acquire(nh));
  std::memcpy(st.inputs[0].data(), x, sizeof(float) * nh);
  for (int i = 0; i < shape_.count; ++i) {
    float* y = i + 1 < shape_.count ? st.inputs[i + 1].data() : out;
    layers_[i].Forward(seq, st.inputs[i].data(), y, kv[i], st.acts[i]);
  }
  order_.ForwardDone(slot);
  return absl::OkStatus();
}

absl::Status LayerStack::BackwardInput(SlotKey slot, const float* dout, float* dx) {
  if (absl::Status st = order_.CheckBackwardInput(slot); !st.ok()) return st;
  Slot& st = slots_.at(slot);
  std::vector<LayerKvState>& kv = kv_.at(slot.microbatch);
  const SeqChunk seq = seq_chunk(slot.seq);
  const size_t nh = static_cast<size_t>(shape_.batch) * seq.len() * shape_.cfg.hidden;
  // Ping-pong gradients between layers; the first layer writes straight into dx.
  PooledBuffer grad[2];
  if (shape_.count > 1) {
    grad[0] = pool_->Acquire(nh);
    grad[1] = pool_->Acquire(nh);
  }
  const float* g_in = dout;
  for (int i = shape_.count - 1; i >= 0; --i) {
    float* g_out = i == 0 ? dx : grad[i % 2].data();
    layers_[i].BackwardInput(g_in, g_out, kv[i], st.acts[i]);
    g_in = g_out;
  }
  // The K/V caches were released by the layers at the microbatch's last B.
  if (order_.BackwardInputDone(slot)) kv_.erase(slot.microbatch);
  return absl::OkStatus();
}

absl::Status LayerStack::BackwardWeight(SlotKey slot) {
  if (absl::Status st = order_.CheckBackwardWeight(slot); !st.ok()) return st;
  auto it = slots_.find(slot);
  for (int i = shape_.count - 1; i >= 0; --i) layers_[i].BackwardWeight(it->second.acts[i]);
  slots_.erase(it);
  order_.BackwardWeightDone(slot);
  return absl::OkStatus();
}

void LayerStack::DiscardMicrobatch(int microbatch) {
  std::erase_if(slots_, [microbatch](const auto& e) { return e.first.microbatch == microbatch; });
  kv_.erase(microbatch);
  order_.Discard(microbatch);
}

absl::Status LayerStack::Backward(SlotKey slot, const float* dout, float* dx) {
  if (absl::Status s = BackwardInput(slot, dout, dx); !s.ok()) return s;
  return BackwardWeight(slot);
}

absl::StatusOr<LayerActivationFootprint> MeasureLayerActivationBytes(const ModelConfig& cfg,
                                                                     int b) {
  MemoryTracker tracker;
  const size_t n = LayerParamCount(cfg);
  Buffer params(nullptr, MemoryCategory::kParameters, n);
  Buffer grads(nullptr, MemoryCategory::kGradients, n);
  auto stack =
      LayerStack::Create(cfg, 0, 1, b, {0, cfg.seq_len}, params.data(), grads.data(), &tracker);
  if (!stack.ok()) return stack.status();
  stack->InitParams(0);
  const size_t nh = static_cast<size_t>(b) * cfg.seq_len * cfg.hidden;
  Buffer x(nullptr, MemoryCategory::kActivations, nh);
  Buffer out(nullptr, MemoryCategory::kActivations, nh);
  if (auto st = stack->Forward({0, 0}, x.data(), out.data()); !st.ok()) return st;
  LayerActivationFootprint f;
  f.kept = tracker.current(MemoryCategory::kActivations);
  tracker.ResetPeaks();
  {
    // The runtime holds the pass's output gradient and input gradient (n, h) while B runs.
    Buffer dout(&tracker, MemoryCategory::kActivations, nh);
    Buffer dx(&tracker, MemoryCategory::kActivations, nh);
    if (auto st = stack->Backward({0, 0}, dout.data(), dx.data()); !st.ok()) return st;
  }
  f.backward_transient = tracker.peak(MemoryCategory::kActivations) - f.kept;
  return f;
}

}  // namespace vp::engine
