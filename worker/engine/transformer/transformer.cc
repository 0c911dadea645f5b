#include "worker/engine/transformer/transformer.h"

#include <algorithm>
#include <chrono>
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

std::vector<TensorSpec> LayerTensorSpecs(const ModelConfig& cfg, int t) {
  const int64_t h = cfg.hidden;
  const int64_t f = cfg.ffn_hidden;
  const int64_t kv = cfg.kv_dim();
  const tp::LayerWidths w = tp::LocalLayerWidths(cfg, t);
  // How each tensor is cut over the tensor group: column-parallel products by their output
  // features, row-parallel ones by their input features, everything else replicated.
  constexpr tp::Split kReplicated{};
  const tp::Split kv_split = w.kv_replicated ? kReplicated : tp::Split{0};
  // Llama: nn.Linear weights [out, in]; q, k, v adjacent and gate, up adjacent (one GEMM each).
  std::vector<TensorSpec> specs = cfg.llama() ? std::vector<TensorSpec>{
      {"input_layernorm.weight", 0, {}, false, {h}, kReplicated},
      {"self_attn.q_proj.weight", 0, {}, true, {h, h}, {0}},
      {"self_attn.k_proj.weight", 0, {}, true, {kv, h}, kv_split},
      {"self_attn.v_proj.weight", 0, {}, true, {kv, h}, kv_split},
      {"self_attn.o_proj.weight", 0, {}, true, {h, h}, {1}},
      {"post_attention_layernorm.weight", 0, {}, false, {h}, kReplicated},
      {"mlp.gate_proj.weight", 0, {}, true, {f, h}, {0}},
      {"mlp.up_proj.weight", 0, {}, true, {f, h}, {0}},
      {"mlp.down_proj.weight", 0, {}, true, {h, f}, {1}},
  } : std::vector<TensorSpec>{
      // Hugging Face GPT-2 order; Conv1D weights are [in, out]. c_attn's columns are q|k|v,
      // each cut by heads.
      {"ln_1.weight", 0, {}, false, {h}, kReplicated},
      {"ln_1.bias", 0, {}, false, {h}, kReplicated},
      {"attn.c_attn.weight", 0, {}, true, {h, 3 * h}, {1, 3}},
      {"attn.c_attn.bias", 0, {}, false, {3 * h}, {0, 3}},
      {"attn.c_proj.weight", 0, {}, true, {h, h}, {0}},
      {"attn.c_proj.bias", 0, {}, false, {h}, kReplicated},
      {"ln_2.weight", 0, {}, false, {h}, kReplicated},
      {"ln_2.bias", 0, {}, false, {h}, kReplicated},
      {"mlp.c_fc.weight", 0, {}, true, {h, f}, {1}},
      {"mlp.c_fc.bias", 0, {}, false, {f}, {0}},
      {"mlp.c_proj.weight", 0, {}, true, {f, h}, {0}},
      {"mlp.c_proj.bias", 0, {}, false, {h}, kReplicated},
  };
  size_t offset = 0;
  for (TensorSpec& s : specs) {
    s.shape = tp::LocalShape(s.full_shape, s.split, t);
    s.offset = offset;
    offset += s.count();
  }
  return specs;
}

size_t LayerParamCount(const ModelConfig& cfg, int t) {
  const size_t h = cfg.hidden;
  const tp::LayerWidths w = tp::LocalLayerWidths(cfg, t);
  const size_t a = w.attn, f = w.ffn;
  if (cfg.llama()) return 2 * h + static_cast<size_t>(w.qkv()) * h + h * a + 3 * f * h;
  return 4 * h + h * 3 * a + 3 * a + a * h + h + h * f + f + f * h + h;
}

std::string LayerTensorName(int layer, std::string_view suffix) {
  return absl::StrCat("transformer.h.", layer, ".", std::string(suffix));
}

std::string LayerTensorName(const ModelConfig& cfg, int layer, std::string_view suffix) {
  if (!cfg.llama()) return LayerTensorName(layer, suffix);
  return absl::StrCat("model.layers.", layer, ".", std::string(suffix));
}

namespace {

// GPT-2 / Llama init of one whole tensor of layer `layer` (its full shape) into dst.
void InitWholeTensor(float* dst, const TensorSpec& s, size_t count, const ModelConfig& cfg,
                     int layer, uint64_t seed) {
  const std::string_view name = s.name;
  if (cfg.llama()) {
    if (s.full_shape.size() == 1) {
      InitConstant(dst, count, 1.0f);  // RMSNorm weights
    } else {
      InitNormal(dst, count, 0.02f, seed, TensorId(LayerTensorName(cfg, layer, name)), 0);
    }
    return;
  }
  // GPT-2: the projections that write into the residual stream are scaled so the stream's
  // variance does not grow with depth (2 such projections per layer).
  const float std_w = 0.02f;
  const float std_residual = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.layers));
  if (name == "ln_1.weight" || name == "ln_2.weight") {
    InitConstant(dst, count, 1.0f);
  } else if (s.full_shape.size() == 1) {
    InitConstant(dst, count, 0.0f);
  } else {
    const bool residual = name == "attn.c_proj.weight" || name == "mlp.c_proj.weight";
    InitNormal(dst, count, residual ? std_residual : std_w, seed,
               TensorId(LayerTensorName(layer, name)), 0);
  }
}

size_t ShapeCount(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (const int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

}  // namespace

void InitLayerParams(float* base, const ModelConfig& cfg, int layer, uint64_t seed, int r, int t) {
  for (const TensorSpec& s : LayerTensorSpecs(cfg, t)) {
    if (t == 1 || s.split.replicated()) {
      InitWholeTensor(base + s.offset, s, s.count(), cfg, layer, seed);
      continue;
    }
    // A rank's slice holds the whole tensor's values at those elements: draw the whole tensor
    // (counter-based, so the same numbers as on one rank) and keep the slice.
    std::vector<float> whole(ShapeCount(s.full_shape));
    InitWholeTensor(whole.data(), s, whole.size(), cfg, layer, seed);
    tp::SliceTensor(whole.data(), s.full_shape, s.split, r, t, base + s.offset);
  }
}

// ---------------------------------------------------------------------------------------------
// TransformerLayer.

namespace {

tp::ColumnParallelLinear QkvProduct(const ModelConfig& cfg, const tp::LayerWidths& w,
                                    const tp::SequenceParallel* sp, const LayerParams& p,
                                    const LayerParams& g, const LlamaLayerParams& lp,
                                    const LlamaLayerParams& lg) {
  if (cfg.llama()) {
    return {sp,
            {tp::WeightLayout::kOutIn, cfg.hidden, w.qkv(), lp.wqkv, nullptr, lg.wqkv, nullptr}};
  }
  return {sp,
          {tp::WeightLayout::kInOut, cfg.hidden, w.qkv(), p.attn_w, p.attn_b, g.attn_w, g.attn_b}};
}

tp::RowParallelLinear AttnOutProduct(const ModelConfig& cfg, const tp::LayerWidths& w,
                                     const tp::SequenceParallel* sp, const LayerParams& p,
                                     const LayerParams& g, const LlamaLayerParams& lp,
                                     const LlamaLayerParams& lg) {
  if (cfg.llama()) {
    return {sp, {tp::WeightLayout::kOutIn, w.attn, cfg.hidden, lp.wo, nullptr, lg.wo, nullptr}};
  }
  return {sp,
          {tp::WeightLayout::kInOut, w.attn, cfg.hidden, p.attn_proj_w, p.attn_proj_b,
           g.attn_proj_w, g.attn_proj_b}};
}

tp::ColumnParallelLinear MlpInProduct(const ModelConfig& cfg, const tp::LayerWidths& w,
                                      const tp::SequenceParallel* sp, const LayerParams& p,
                                      const LayerParams& g, const LlamaLayerParams& lp,
                                      const LlamaLayerParams& lg) {
  if (cfg.llama()) {  // gate|up: 2·f_r output columns
    return {sp,
            {tp::WeightLayout::kOutIn, cfg.hidden, 2 * w.ffn, lp.wgu, nullptr, lg.wgu, nullptr}};
  }
  return {sp, {tp::WeightLayout::kInOut, cfg.hidden, w.ffn, p.fc_w, p.fc_b, g.fc_w, g.fc_b}};
}

tp::RowParallelLinear MlpOutProduct(const ModelConfig& cfg, const tp::LayerWidths& w,
                                    const tp::SequenceParallel* sp, const LayerParams& p,
                                    const LayerParams& g, const LlamaLayerParams& lp,
                                    const LlamaLayerParams& lg) {
  if (cfg.llama()) {
    return {sp,
            {tp::WeightLayout::kOutIn, w.ffn, cfg.hidden, lp.wdown, nullptr, lg.wdown, nullptr}};
  }
  return {sp,
          {tp::WeightLayout::kInOut, w.ffn, cfg.hidden, p.proj_w, p.proj_b, g.proj_w, g.proj_b}};
}

// Copies rows [0, t) of column block [col, col+c) of src (b, t, ld) to rows [begin, begin+t) of
// the cache (b, s, c), or the reverse direction when to_cache is false.
void CopyRows(float* cache, float* chunk, int b, int t, int s, int c, int ld, int col, int begin,
              bool to_cache) {
  for (int i = 0; i < b; ++i) {
    for (int j = 0; j < t; ++j) {
      float* k = cache + (static_cast<long>(i) * s + begin + j) * c;
      float* x = chunk + (static_cast<long>(i) * t + j) * ld + col;
      if (to_cache) {
        std::memcpy(k, x, sizeof(float) * c);
      } else {
        std::memcpy(x, k, sizeof(float) * c);
      }
    }
  }
}

}  // namespace

TransformerLayer::TransformerLayer(const ModelConfig& cfg, int batch, float* params, float* grads,
                                   ActivationPool* pool, const tp::SequenceParallel* sp)
    : cfg_(cfg),
      batch_(batch),
      w_(tp::LocalLayerWidths(cfg, sp->group().size())),
      p_(BindLayerParams(params, cfg, sp->group().size())),
      g_(BindLayerParams(grads, cfg, sp->group().size())),
      lp_(BindLlamaLayerParams(params, cfg, sp->group().size())),
      lg_(BindLlamaLayerParams(grads, cfg, sp->group().size())),
      pool_(pool),
      sp_(sp),
      qkv_(QkvProduct(cfg, w_, sp, p_, g_, lp_, lg_)),
      attn_out_(AttnOutProduct(cfg, w_, sp, p_, g_, lp_, lg_)),
      mlp_in_(MlpInProduct(cfg, w_, sp, p_, g_, lp_, lg_)),
      mlp_out_(MlpOutProduct(cfg, w_, sp, p_, g_, lp_, lg_)) {}

// Letters (both blocks): b batch, t chunk length, s sequence length, n = b·t the chunk's token
// rows, m = n / t_p the rank's rows (the sequence-parallel share), h width, a the rank's
// attention width (its heads · head_dim), kv its key/value width, qd = a + 2kv its fused q|k|v
// row, f its MLP width.

absl::Status TransformerLayer::ForwardQkv(SeqChunk seq, const float* x, LayerKvState& kv,
                                          LayerActivations& acts) const {
  const int b = batch_, t = seq.len(), h = cfg_.hidden, s = cfg_.seq_len;
  const int a = w_.attn, kvd = w_.kv, qd = w_.qkv(), hd = w_.head_dim;
  const int n = b * t, m = sp_->LocalRows(n);
  if (kv.k.empty()) {
    kv.k = pool_->Acquire(static_cast<size_t>(b) * s * kvd);
    kv.v = pool_->Acquire(static_cast<size_t>(b) * s * kvd);
  }
  acts.ln1 = pool_->Acquire(static_cast<size_t>(m) * h);  // (m, h)
  acts.ln1_rstd = pool_->Acquire(m);                      // (m)
  if (cfg_.llama()) {
    cpu::RmsNormForward(acts.ln1.data(), acts.ln1_rstd.data(), x, lp_.attn_norm_w, m, h,
                        cfg_.rms_eps);
  } else {
    acts.ln1_mean = pool_->Acquire(m);
    cpu::LayerNormForward(acts.ln1.data(), acts.ln1_mean.data(), acts.ln1_rstd.data(), x, p_.ln1_w,
                          p_.ln1_b, m, h);
  }
  PooledBuffer qkv = pool_->Acquire(static_cast<size_t>(n) * qd);  // (b, t, qd)
  if (absl::Status st = qkv_.Forward(qkv.data(), acts.ln1.data(), n); !st.ok()) return st;
  if (cfg_.llama()) {
    // Rotate q and k at their absolute positions seq.begin + j: a chunk's keys enter the cache
    // already rotated, exactly as the whole sequence's would.
    cpu::RopeForward(qkv.data(), qd, b, t, w_.heads, hd, seq.begin, cfg_.rope_theta);
    cpu::RopeForward(qkv.data() + a, qd, b, t, w_.kv_heads, hd, seq.begin, cfg_.rope_theta);
  }
  // Append this chunk's keys and values to the cache so later chunks can attend to them, and
  // keep only the queries: the backward reads K and V from the cache.
  CopyRows(kv.k.data(), qkv.data(), b, t, s, kvd, qd, a, seq.begin, true);
  CopyRows(kv.v.data(), qkv.data(), b, t, s, kvd, qd, a + kvd, seq.begin, true);
  acts.q = pool_->Acquire(static_cast<size_t>(n) * a);  // (b, t, a) (Llama: rotated)
  CopyRows(acts.q.data(), qkv.data(), b, t, t, a, qd, 0, 0, true);
  return absl::OkStatus();
}

absl::Status TransformerLayer::ForwardKeysValues(SeqChunk seq, const float* x,
                                                 LayerKvState& kv) const {
  LayerActivations scratch;  // the chunk's norm output and queries, dropped on return
  return ForwardQkv(seq, x, kv, scratch);
}

void TransformerLayer::DropAttentionCore(LayerActivations& acts) const {
  if (cfg_.recompute != Recompute::kSelective) return;
  acts.atty.Reset();
  acts.lse.Reset();
}

absl::Status TransformerLayer::RecomputeAttention(LayerKvState& kv, LayerActivations& acts) const {
  if (!acts.atty.empty()) return absl::OkStatus();  // kept by F (recompute none or full)
  const SeqChunk seq = acts.seq;
  const int b = batch_, t = seq.len(), a = w_.attn;
  const cpu::AttentionShape shape{
      b, w_.heads, w_.head_dim, seq.begin, seq.end, cfg_.seq_len, cfg_.llama() ? w_.kv_heads : 0};
  acts.lse = pool_->Acquire(static_cast<size_t>(b) * w_.heads * t);
  acts.atty = pool_->Acquire(static_cast<size_t>(b) * t * a);
  cpu::AttentionForward(acts.atty.data(), acts.lse.data(), acts.q.data(), a, kv.k.data(),
                        kv.v.data(), shape);
  return absl::OkStatus();
}

absl::Status TransformerLayer::Forward(SeqChunk seq, const float* x, float* out, LayerKvState& kv,
                                       LayerActivations& acts) const {
  if (cfg_.llama()) return ForwardLlama(seq, x, out, kv, acts);
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
  const int a = w_.attn;
  const int n = b * t, m = sp_->LocalRows(n);
  const long mh = static_cast<long>(m) * h;
  acts.seq = seq;
  acts.batch = b;
  acts.inp = x;
  // Attention sub-block: res1 = x + c_proj(attn(c_attn(ln_1(x)))).
  if (absl::Status st = ForwardQkv(seq, x, kv, acts); !st.ok()) return st;
  const cpu::AttentionShape shape{b, w_.heads, w_.head_dim, seq.begin, seq.end, s};
  acts.lse = pool_->Acquire(static_cast<size_t>(b) * w_.heads * t);
  acts.atty = pool_->Acquire(static_cast<size_t>(n) * a);
  cpu::AttentionForward(acts.atty.data(), acts.lse.data(), acts.q.data(), a, kv.k.data(),
                        kv.v.data(), shape);
  acts.res1 = pool_->Acquire(mh);
  if (absl::Status st = attn_out_.Forward(acts.res1.data(), acts.atty.data(), n); !st.ok()) {
    return st;
  }
  cpu::ResidualForward(acts.res1.data(), acts.res1.data(), x, mh);
  DropAttentionCore(acts);
  // MLP sub-block: out = res1 + c_proj(gelu(c_fc(ln_2(res1)))).
  acts.ln2 = pool_->Acquire(mh);
  acts.ln2_mean = pool_->Acquire(m);
  acts.ln2_rstd = pool_->Acquire(m);
  cpu::LayerNormForward(acts.ln2.data(), acts.ln2_mean.data(), acts.ln2_rstd.data(),
                        acts.res1.data(), p_.ln2_w, p_.ln2_b, m, h);
  acts.fch = pool_->Acquire(static_cast<size_t>(n) * f);
  if (absl::Status st = mlp_in_.Forward(acts.fch.data(), acts.ln2.data(), n); !st.ok()) return st;
  acts.fch_gelu = pool_->Acquire(static_cast<size_t>(n) * f);
  cpu::GeluForward(acts.fch_gelu.data(), acts.fch.data(), static_cast<long>(n) * f);
  if (absl::Status st = mlp_out_.Forward(out, acts.fch_gelu.data(), n); !st.ok()) return st;
  cpu::ResidualForward(out, out, acts.res1.data(), mh);
  acts.forward_done = true;
  return absl::OkStatus();
}

absl::Status TransformerLayer::BackwardInput(const float* dout, float* dx, LayerKvState& kv,
                                             LayerActivations& acts) const {
  if (cfg_.llama()) return BackwardInputLlama(dout, dx, kv, acts);
  const SeqChunk seq = acts.seq;
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
  const int a = w_.attn, qd = w_.qkv();
  const int n = b * t, m = sp_->LocalRows(n);
  const long mh = static_cast<long>(m) * h;
  // MLP sub-block. The layer output gradient is both the skip-path gradient of res1 and the
  // output gradient of mlp.c_proj (stashed for W).
  acts.d_out = pool_->Acquire(mh);
  std::memcpy(acts.d_out.data(), dout, sizeof(float) * mh);
  acts.d_fch = pool_->Acquire(static_cast<size_t>(n) * f);
  if (absl::Status st = mlp_out_.BackwardInput(acts.d_fch.data(), dout, n); !st.ok()) return st;
  cpu::GeluBackward(acts.d_fch.data(), acts.fch.data(), acts.d_fch.data(),
                    static_cast<long>(n) * f);
  acts.fch.Reset();  // W needs only the GELU output
  acts.d_ln2 = pool_->Acquire(mh);
  if (absl::Status st = mlp_in_.BackwardInput(acts.d_ln2.data(), acts.d_fch.data(), n); !st.ok()) {
    return st;
  }
  acts.d_res1 = pool_->Acquire(mh);
  std::memcpy(acts.d_res1.data(), dout, sizeof(float) * mh);
  cpu::LayerNormBackwardInput(acts.d_res1.data(), acts.d_ln2.data(), acts.res1.data(), p_.ln2_w,
                              acts.ln2_mean.data(), acts.ln2_rstd.data(), m, h);
  // Attention sub-block.
  PooledBuffer d_atty = pool_->Acquire(static_cast<size_t>(n) * a);
  if (absl::Status st = attn_out_.BackwardInput(d_atty.data(), acts.d_res1.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = RecomputeAttention(kv, acts); !st.ok()) return st;
  if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
    kv.dk = pool_->Acquire(static_cast<size_t>(b) * s * a, /*zero=*/true);
    kv.dv = pool_->Acquire(static_cast<size_t>(b) * s * a, /*zero=*/true);
  }
  acts.d_qkv = pool_->Acquire(static_cast<size_t>(n) * qd);
  {
    const cpu::AttentionShape shape{b, w_.heads, w_.head_dim, seq.begin, seq.end, s};
    PooledBuffer scratch = pool_->Acquire(cpu::AttentionBackwardScratch(shape));
    cpu::AttentionBackward(acts.d_qkv.data(), qd, kv.dk.data(), kv.dv.data(), scratch.data(),
                           d_atty.data(), acts.atty.data(), acts.lse.data(), acts.q.data(), a,
                           kv.k.data(), kv.v.data(), shape);
  }
  // Later chunks (already run backward) and this chunk have now added everything they owe to
  // the keys/values at this chunk's positions; earlier chunks never see them. So the
  // accumulated dK/dV rows [begin, end) are final: take them as c_attn's output gradient.
  CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, a, qd, a, seq.begin, false);
  CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, a, qd, 2 * a, seq.begin, false);
  acts.lse.Reset();
  acts.q.Reset();
  acts.d_ln1 = pool_->Acquire(mh);
  if (absl::Status st = qkv_.BackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), n); !st.ok()) {
    return st;
  }
  std::memcpy(dx, acts.d_res1.data(), sizeof(float) * mh);
  cpu::LayerNormBackwardInput(dx, acts.d_ln1.data(), acts.inp, p_.ln1_w, acts.ln1_mean.data(),
                              acts.ln1_rstd.data(), m, h);
  if (seq.begin == 0) kv = LayerKvState();  // the microbatch's last backward
  acts.backward_input_done = true;
  return absl::OkStatus();
}

absl::Status TransformerLayer::BackwardWeight(LayerActivations& acts) const {
  if (cfg_.llama()) return BackwardWeightLlama(acts);
  const int n = batch_ * acts.seq.len(), m = sp_->LocalRows(n), h = cfg_.hidden;
  cpu::LayerNormBackwardWeight(g_.ln1_w, g_.ln1_b, acts.d_ln1.data(), acts.inp,
                               acts.ln1_mean.data(), acts.ln1_rstd.data(), m, h);
  if (absl::Status st = qkv_.BackwardWeight(acts.d_qkv.data(), acts.ln1.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = attn_out_.BackwardWeight(acts.d_res1.data(), acts.atty.data(), n);
      !st.ok()) {
    return st;
  }
  cpu::LayerNormBackwardWeight(g_.ln2_w, g_.ln2_b, acts.d_ln2.data(), acts.res1.data(),
                               acts.ln2_mean.data(), acts.ln2_rstd.data(), m, h);
  if (absl::Status st = mlp_in_.BackwardWeight(acts.d_fch.data(), acts.ln2.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = mlp_out_.BackwardWeight(acts.d_out.data(), acts.fch_gelu.data(), n);
      !st.ok()) {
    return st;
  }
  acts = LayerActivations();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The Llama block (same letters).

absl::Status TransformerLayer::ForwardLlama(SeqChunk seq, const float* x, float* out,
                                            LayerKvState& kv, LayerActivations& acts) const {
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
  const int a = w_.attn, hd = w_.head_dim;
  const int n = b * t, m = sp_->LocalRows(n);
  const long mh = static_cast<long>(m) * h;
  acts.seq = seq;
  acts.batch = b;
  acts.inp = x;
  // Attention: res1 = x + o_proj(attn(rope(q), rope(k), v)), q|k|v = rms(x)·Wqkvᵀ.
  if (absl::Status st = ForwardQkv(seq, x, kv, acts); !st.ok()) return st;
  const cpu::AttentionShape shape{b, w_.heads, hd, seq.begin, seq.end, s, w_.kv_heads};
  acts.lse = pool_->Acquire(static_cast<size_t>(b) * w_.heads * t);
  acts.atty = pool_->Acquire(static_cast<size_t>(n) * a);
  cpu::AttentionForward(acts.atty.data(), acts.lse.data(), acts.q.data(), a, kv.k.data(),
                        kv.v.data(), shape);
  acts.res1 = pool_->Acquire(mh);
  if (absl::Status st = attn_out_.Forward(acts.res1.data(), acts.atty.data(), n); !st.ok()) {
    return st;
  }
  cpu::ResidualForward(acts.res1.data(), acts.res1.data(), x, mh);
  DropAttentionCore(acts);
  // MLP: out = res1 + down(silu(gate) · up), gate|up = rms(res1)·Wguᵀ.
  acts.ln2 = pool_->Acquire(mh);
  acts.ln2_rstd = pool_->Acquire(m);
  cpu::RmsNormForward(acts.ln2.data(), acts.ln2_rstd.data(), acts.res1.data(), lp_.mlp_norm_w, m, h,
                      cfg_.rms_eps);
  acts.fch = pool_->Acquire(static_cast<size_t>(n) * 2 * f);  // (b, t, 2f)
  if (absl::Status st = mlp_in_.Forward(acts.fch.data(), acts.ln2.data(), n); !st.ok()) return st;
  acts.fch_gelu = pool_->Acquire(static_cast<size_t>(n) * f);  // (b, t, f)
  cpu::SwigluForward(acts.fch_gelu.data(), acts.fch.data(), n, f);
  if (absl::Status st = mlp_out_.Forward(out, acts.fch_gelu.data(), n); !st.ok()) return st;
  cpu::ResidualForward(out, out, acts.res1.data(), mh);
  acts.forward_done = true;
  return absl::OkStatus();
}

absl::Status TransformerLayer::BackwardInputLlama(const float* dout, float* dx, LayerKvState& kv,
                                                  LayerActivations& acts) const {
  const SeqChunk seq = acts.seq;
  const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
  const int a = w_.attn, kvd = w_.kv, qd = w_.qkv(), hd = w_.head_dim;
  const int n = b * t, m = sp_->LocalRows(n);
  const long mh = static_cast<long>(m) * h;
  // MLP. dout is both res1's skip-path gradient and down_proj's output gradient (kept for W).
  acts.d_out = pool_->Acquire(mh);
  std::memcpy(acts.d_out.data(), dout, sizeof(float) * mh);
  {
    PooledBuffer d_act = pool_->Acquire(static_cast<size_t>(n) * f);  // (b, t, f)
    if (absl::Status st = mlp_out_.BackwardInput(d_act.data(), dout, n); !st.ok()) return st;
    acts.d_fch = pool_->Acquire(static_cast<size_t>(n) * 2 * f);  // (b, t, 2f)
    cpu::SwigluBackward(acts.d_fch.data(), acts.fch.data(), d_act.data(), n, f);
  }
  acts.fch.Reset();  // W needs only the SwiGLU output
  acts.d_ln2 = pool_->Acquire(mh);
  if (absl::Status st = mlp_in_.BackwardInput(acts.d_ln2.data(), acts.d_fch.data(), n); !st.ok()) {
    return st;
  }
  acts.d_res1 = pool_->Acquire(mh);
  std::memcpy(acts.d_res1.data(), dout, sizeof(float) * mh);
  cpu::RmsNormBackwardInput(acts.d_res1.data(), acts.d_ln2.data(), acts.res1.data(), lp_.mlp_norm_w,
                            acts.ln2_rstd.data(), m, h);
  // Attention.
  PooledBuffer d_atty = pool_->Acquire(static_cast<size_t>(n) * a);
  if (absl::Status st = attn_out_.BackwardInput(d_atty.data(), acts.d_res1.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = RecomputeAttention(kv, acts); !st.ok()) return st;
  if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
    kv.dk = pool_->Acquire(static_cast<size_t>(b) * s * kvd, /*zero=*/true);
    kv.dv = pool_->Acquire(static_cast<size_t>(b) * s * kvd, /*zero=*/true);
  }
  acts.d_qkv = pool_->Acquire(static_cast<size_t>(n) * qd);  // (b, t, qd)
  {
    const cpu::AttentionShape shape{b, w_.heads, hd, seq.begin, seq.end, s, w_.kv_heads};
    PooledBuffer scratch = pool_->Acquire(cpu::AttentionBackwardScratch(shape));
    cpu::AttentionBackward(acts.d_qkv.data(), qd, kv.dk.data(), kv.dv.data(), scratch.data(),
                           d_atty.data(), acts.atty.data(), acts.lse.data(), acts.q.data(), a,
                           kv.k.data(), kv.v.data(), shape);
  }
  // As in the GPT-2 block, rows [begin, end) of the dK/dV accumulators are final now. (With
  // replicated key/value heads they hold only this rank's query heads' share: the k and v
  // weight gradients are summed over the group as replicated tensors, and the input gradient by
  // the q|k|v product's reduce-scatter.)
  CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, kvd, qd, a, seq.begin, false);
  CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, kvd, qd, a + kvd, seq.begin, false);
  // Those are gradients of the rotated q, k: rotate back to get the projections' gradients.
  cpu::RopeBackward(acts.d_qkv.data(), qd, b, t, w_.heads, hd, seq.begin, cfg_.rope_theta);
  cpu::RopeBackward(acts.d_qkv.data() + a, qd, b, t, w_.kv_heads, hd, seq.begin, cfg_.rope_theta);
  acts.lse.Reset();
  acts.q.Reset();
  acts.d_ln1 = pool_->Acquire(mh);
  if (absl::Status st = qkv_.BackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), n); !st.ok()) {
    return st;
  }
  std::memcpy(dx, acts.d_res1.data(), sizeof(float) * mh);
  cpu::RmsNormBackwardInput(dx, acts.d_ln1.data(), acts.inp, lp_.attn_norm_w, acts.ln1_rstd.data(),
                            m, h);
  if (seq.begin == 0) kv = LayerKvState();  // the microbatch's last backward
  acts.backward_input_done = true;
  return absl::OkStatus();
}

absl::Status TransformerLayer::BackwardWeightLlama(LayerActivations& acts) const {
  const int n = batch_ * acts.seq.len(), m = sp_->LocalRows(n), h = cfg_.hidden;
  cpu::RmsNormBackwardWeight(lg_.attn_norm_w, acts.d_ln1.data(), acts.inp, acts.ln1_rstd.data(), m,
                             h);
  if (absl::Status st = qkv_.BackwardWeight(acts.d_qkv.data(), acts.ln1.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = attn_out_.BackwardWeight(acts.d_res1.data(), acts.atty.data(), n);
      !st.ok()) {
    return st;
  }
  cpu::RmsNormBackwardWeight(lg_.mlp_norm_w, acts.d_ln2.data(), acts.res1.data(),
                             acts.ln2_rstd.data(), m, h);
  if (absl::Status st = mlp_in_.BackwardWeight(acts.d_fch.data(), acts.ln2.data(), n); !st.ok()) {
    return st;
  }
  if (absl::Status st = mlp_out_.BackwardWeight(acts.d_out.data(), acts.fch_gelu.data(), n);
      !st.ok()) {
    return st;
  }
  acts = LayerActivations();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// LayerStack.

absl::StatusOr<LayerStack> LayerStack::Create(const ModelConfig& cfg, int first_layer, int count,
                                              int microbatch_size, std::vector<int> seq_bounds,
                                              float* params, float* grads, MemoryTracker* tracker,
                                              tp::TensorGroup group) {
  if (absl::Status st = ValidateLayerStackArgs(cfg, first_layer, count, microbatch_size, params,
                                               grads, seq_bounds);
      !st.ok()) {
    return st;
  }
  const int t = group.size();
  if (absl::Status st = tp::ValidateTensorSplit(cfg, t); !st.ok()) return st;
  for (size_t q = 0; q + 1 < seq_bounds.size(); ++q) {
    if ((seq_bounds[q + 1] - seq_bounds[q]) % t != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence chunk ", q, " [", seq_bounds[q], ", ", seq_bounds[q + 1],
                       "): its length must be divisible by parallel.tensor (", t, ")"));
    }
  }
  LayerStack stack;
  stack.order_ = SlotOrder(static_cast<int>(seq_bounds.size()) - 1);
  stack.shape_ = {
      cfg, first_layer, count, microbatch_size, LayerParamCount(cfg, t), std::move(seq_bounds), t};
  stack.params_ = params;
  stack.grads_ = grads;
  stack.pool_ = std::make_unique<ActivationPool>(tracker);
  stack.sp_ = std::make_unique<tp::SequenceParallel>(group, stack.pool_.get());
  for (int i = 0; i < count; ++i) {
    stack.layers_.emplace_back(cfg, microbatch_size, params + i * stack.shape_.layer_params,
                               grads + i * stack.shape_.layer_params, stack.pool_.get(),
                               stack.sp_.get());
  }
  return stack;
}

std::vector<TensorSpec> LayerStack::TensorSpecs() const {
  std::vector<TensorSpec> out;
  const std::vector<TensorSpec> layer = LayerTensorSpecs(shape_.cfg, shape_.tensor);
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
    InitLayerParams(params_ + i * shape_.layer_params, shape_.cfg, shape_.first + i, seed,
                    sp_->group().rank(), shape_.tensor);
  }
}

absl::Status LayerStack::SumReplicatedGrads() {
  if (shape_.tensor == 1) return absl::OkStatus();
  const std::vector<TensorSpec> layer = LayerTensorSpecs(shape_.cfg, shape_.tensor);
  for (int i = 0; i < shape_.count; ++i) {
    float* block = grads_ + i * shape_.layer_params;
    for (const TensorSpec& s : layer) {
      if (!s.split.replicated()) continue;
      if (absl::Status st =
              sp_->group().comm()->AllReduce(block + s.offset, s.count(), comm::ReduceOp::kSum);
          !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LayerStack::Forward(SlotKey slot, const float* x, float* out) {
  if (absl::Status st = order_.CheckForward(slot); !st.ok()) return st;
  std::vector<LayerKvState>& kv = kv_[slot.microbatch];
  if (kv.empty()) kv.resize(shape_.count);
  const SeqChunk seq = seq_chunk(slot.seq);
  const size_t nh = LocalRowFloats(seq);
  const bool full = shape_.cfg.recompute == Recompute::kFull;
  // Full recomputation releases the K/V cache once no later chunk of the microbatch will read
  // it in a forward; the backward rebuilds it.
  const bool last_chunk = slot.seq + 1 == shape_.num_seq_chunks();
  Slot& st = slots_[slot];
  st.acts.resize(shape_.count);
  st.inputs.reserve(shape_.count);
  for (int i = 0; i < shape_.count; ++i) st.inputs.push_back(pool_->Acquire(nh));
  std::memcpy(st.inputs[0].data(), x, sizeof(float) * nh);
  for (int i = 0; i < shape_.count; ++i) {
    float* y = i + 1 < shape_.count ? st.inputs[i + 1].data() : out;
    if (absl::Status s = layers_[i].Forward(seq, st.inputs[i].data(), y, kv[i], st.acts[i]);
        !s.ok()) {
      return s;
    }
    if (full) {
      st.acts[i] = LayerActivations();  // only the layer's input (st.inputs[i]) is kept
      if (last_chunk) {
        kv[i].k.Reset();
        kv[i].v.Reset();
      }
    }
  }
  order_.ForwardDone(slot);
  return absl::OkStatus();
}

absl::Status LayerStack::RecomputeForward(SlotKey slot, int i) {
  Slot& st = slots_.at(slot);
  LayerKvState& kv = kv_.at(slot.microbatch)[i];
  if (kv.k.empty()) {
    // The microbatch's first B: the chunks before this one write their keys and values again
    // (this chunk's own come from its F below). They are all still held: B runs the chunks in
    // reverse order.
    for (int q = 0; q < slot.seq; ++q) {
      const Slot& earlier = slots_.at({slot.microbatch, q});
      if (absl::Status s = layers_[i].ForwardKeysValues(seq_chunk(q), earlier.inputs[i].data(), kv);
          !s.ok()) {
        return s;
      }
    }
  }
  // The layer's output again (equal to the next layer's kept input; not needed).
  PooledBuffer out = pool_->Acquire(LocalRowFloats(seq_chunk(slot.seq)));
  return layers_[i].Forward(seq_chunk(slot.seq), st.inputs[i].data(), out.data(), kv, st.acts[i]);
}

absl::Status LayerStack::BackwardPasses(SlotKey slot, const float* dout, float* dx, bool weights) {
  if (absl::Status st = order_.CheckBackwardInput(slot); !st.ok()) return st;
  Slot& st = slots_.at(slot);
  std::vector<LayerKvState>& kv = kv_.at(slot.microbatch);
  const size_t nh = LocalRowFloats(seq_chunk(slot.seq));
  const bool full = shape_.cfg.recompute == Recompute::kFull;
  // Ping-pong gradients between layers; the first layer writes straight into dx.
  PooledBuffer grad[2];
  if (shape_.count > 1) {
    grad[0] = pool_->Acquire(nh);
    grad[1] = pool_->Acquire(nh);
  }
  const float* g_in = dout;
  for (int i = shape_.count - 1; i >= 0; --i) {
    if (full) {
      if (absl::Status s = RecomputeForward(slot, i); !s.ok()) return s;
    }
    float* g_out = i == 0 ? dx : grad[i % 2].data();
    if (absl::Status s = layers_[i].BackwardInput(g_in, g_out, kv[i], st.acts[i]); !s.ok()) {
      return s;
    }
    if (weights) {
      if (absl::Status s = layers_[i].BackwardWeight(st.acts[i]); !s.ok()) return s;
    }
    g_in = g_out;
  }
  // The K/V caches were released by the layers at the microbatch's last B.
  if (order_.BackwardInputDone(slot)) kv_.erase(slot.microbatch);
  if (weights) {
    slots_.erase(slot);
    order_.BackwardWeightDone(slot);
  }
  return absl::OkStatus();
}

absl::Status LayerStack::BackwardInput(SlotKey slot, const float* dout, float* dx) {
  return BackwardPasses(slot, dout, dx, /*weights=*/false);
}

absl::Status LayerStack::BackwardWeight(SlotKey slot) {
  if (absl::Status st = order_.CheckBackwardWeight(slot); !st.ok()) return st;
  auto it = slots_.find(slot);
  for (int i = shape_.count - 1; i >= 0; --i) {
    if (absl::Status s = layers_[i].BackwardWeight(it->second.acts[i]); !s.ok()) return s;
  }
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
  // Full recomputation runs each layer's W right after its B, so that one layer's recomputed
  // activations are live at a time; otherwise B of every layer, then W of every layer. (The
  // layers' gradients are separate blocks: the order between layers changes no sum.)
  if (shape_.cfg.recompute == Recompute::kFull) {
    return BackwardPasses(slot, dout, dx, /*weights=*/true);
  }
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
    // The runtime holds the pass's output gradient and input gradient (n, h) while B runs. B
    // and W run split (what Backward does too, but under full recomputation, whose per-layer
    // B+W peaks no higher than a one-layer split B followed by its W).
    Buffer dout(&tracker, MemoryCategory::kActivations, nh);
    Buffer dx(&tracker, MemoryCategory::kActivations, nh);
    if (auto st = stack->BackwardInput({0, 0}, dout.data(), dx.data()); !st.ok()) return st;
    f.held_for_w = tracker.current(MemoryCategory::kActivations) -
                   2 * static_cast<int64_t>(nh * sizeof(float));
    if (auto st = stack->BackwardWeight({0, 0}); !st.ok()) return st;
  }
  f.backward_transient = tracker.peak(MemoryCategory::kActivations) - f.kept;
  return f;
}

double TimeAttentionCoreSeconds(const ModelConfig& cfg, int b) {
  const tp::LayerWidths w = tp::LocalLayerWidths(cfg, 1);
  const int s = cfg.seq_len;
  const size_t rows = static_cast<size_t>(b) * s;
  // The values do not change the time; small ones keep the exponentials finite.
  std::vector<float> q(rows * w.attn, 0.01f), k(rows * w.kv, 0.01f), v(rows * w.kv, 0.01f);
  std::vector<float> y(rows * w.attn), lse(static_cast<size_t>(b) * w.heads * s);
  const cpu::AttentionShape shape{b, w.heads, w.head_dim, 0, s, s, cfg.llama() ? w.kv_heads : 0};
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    cpu::AttentionForward(y.data(), lse.data(), q.data(), w.attn, k.data(), v.data(), shape);
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = i == 0 ? sec : std::min(best, sec);
  }
  return best;
}

}  // namespace vp::engine
