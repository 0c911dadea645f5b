#include "worker/engine/transformer/transformer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "tests/unit/engine/grad_check.h"
#include "worker/engine/init.h"

namespace vp::engine {
namespace {

using ::vp::engine::testing::ExpectAllNear;
using ::vp::engine::testing::ExpectGradientMatches;
using ::vp::engine::testing::RandomVector;
using ::vp::engine::testing::WeightedSum;

ModelConfig SmallConfig(int layers = 2) {
  ModelConfig cfg;
  cfg.layers = layers;
  cfg.hidden = 8;
  cfg.heads = 2;
  cfg.ffn_hidden = 20;  // not 4h: the layout must not assume it
  cfg.seq_len = 7;
  cfg.vocab = 11;
  return cfg;
}

// Parameters far from GPT-2's tiny init, so every path (attention softmax, GELU curvature,
// LayerNorm scale) carries a visible gradient.
std::vector<float> RandomParams(const ModelConfig& cfg, int layers, uint32_t seed) {
  std::vector<float> p = RandomVector(LayerParamCount(cfg) * layers, seed, 0.4f);
  for (int l = 0; l < layers; ++l) {
    LayerParams lp = BindLayerParams(p.data() + l * LayerParamCount(cfg), cfg);
    for (int j = 0; j < cfg.hidden; ++j) {
      lp.ln1_w[j] += 1.0f;
      lp.ln2_w[j] += 1.0f;
    }
  }
  return p;
}

TEST(LayerLayout, FollowsHuggingFaceOrderAndShapes) {
  const ModelConfig cfg = SmallConfig();
  const std::vector<TensorSpec> specs = LayerTensorSpecs(cfg);
  const std::vector<std::string> names = {
      "ln_1.weight",        "ln_1.bias",        "attn.c_attn.weight", "attn.c_attn.bias",
      "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight",        "ln_2.bias",
      "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};
  ASSERT_EQ(specs.size(), names.size());
  size_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(specs[i].name, names[i]);
    EXPECT_EQ(specs[i].offset, offset);
    EXPECT_EQ(specs[i].weight_decay, specs[i].shape.size() == 2) << names[i];
    offset += specs[i].count();
  }
  EXPECT_EQ(offset, LayerParamCount(cfg));
  EXPECT_EQ(specs[2].shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(specs[8].shape, (std::vector<int64_t>{8, 20}));
  EXPECT_EQ(specs[10].shape, (std::vector<int64_t>{20, 8}));
  std::vector<float> block(LayerParamCount(cfg));
  const LayerParams p = BindLayerParams(block.data(), cfg);
  EXPECT_EQ(p.attn_proj_w, block.data() + specs[4].offset);
  EXPECT_EQ(p.proj_b, block.data() + specs[11].offset);
  EXPECT_EQ(LayerTensorName(3, "attn.c_proj.weight"), "transformer.h.3.attn.c_proj.weight");
}

TEST(LayerInit, Gpt2InitIsDeterministicPerNamedTensor) {
  ModelConfig cfg = SmallConfig(4);
  cfg.hidden = 64;
  cfg.heads = 4;
  cfg.ffn_hidden = 256;
  const size_t n = LayerParamCount(cfg);
  std::vector<float> a(n), b(n), c(n);
  InitLayerParams(a.data(), cfg, 3, 42);
  InitLayerParams(b.data(), cfg, 3, 42);
  InitLayerParams(c.data(), cfg, 2, 42);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);  // layer index names the tensors
  const LayerParams p = BindLayerParams(a.data(), cfg);
  for (int j = 0; j < cfg.hidden; ++j) {
    EXPECT_EQ(p.ln1_w[j], 1.0f);
    EXPECT_EQ(p.ln2_b[j], 0.0f);
    EXPECT_EQ(p.proj_b[j], 0.0f);
  }
  // Element 0 of c_proj is the named tensor's first normal sample, scaled by 0.02/sqrt(2L).
  float expect;
  InitNormal(&expect, 1, 0.02f / std::sqrt(8.0f), 42,
             TensorId("transformer.h.3.attn.c_proj.weight"), 0);
  EXPECT_EQ(p.attn_proj_w[0], expect);
  auto stddev = [](const float* x, size_t count) {
    double s = 0;
    for (size_t i = 0; i < count; ++i) s += double(x[i]) * x[i];
    return std::sqrt(s / count);
  };
  EXPECT_NEAR(stddev(p.fc_w, 64 * 256), 0.02, 0.001);
  EXPECT_NEAR(stddev(p.proj_w, 64 * 256), 0.02 / std::sqrt(8.0), 0.0005);
}

// Runs one layer on the whole sequence; returns Σ dy·out.
double LayerLoss(const ModelConfig& cfg, int batch, std::vector<float>& params,
                 const std::vector<float>& x, const std::vector<float>& dy) {
  std::vector<float> grads(params.size()), out(x.size());
  ActivationPool pool(nullptr);
  const tp::SequenceParallel sp({}, &pool);
  TransformerLayer layer(cfg, batch, params.data(), grads.data(), &pool, &sp);
  LayerKvState kv;
  LayerActivations acts;
  EXPECT_TRUE(layer.Forward({0, cfg.seq_len}, x.data(), out.data(), kv, acts).ok());
  return WeightedSum(out.data(), dy);
}

// One layer (batch 2, the whole sequence as one chunk) with `params` on inputs and output
// gradients drawn from seeds x_seed and x_seed + 1: the backward's dx and every weight
// gradient against central differences of LayerLoss, and the layer's K/V and activations all
// released afterwards.
void ExpectLayerGradientsMatchFiniteDifferences(const ModelConfig& cfg, std::vector<float> params,
                                                uint32_t x_seed) {
  const int batch = 2;
  const size_t nh = static_cast<size_t>(batch) * cfg.seq_len * cfg.hidden;
  std::vector<float> x = RandomVector(nh, x_seed);
  const std::vector<float> dy = RandomVector(nh, x_seed + 1);
  std::vector<float> grads(params.size(), 0.0f), out(nh), dx(nh);
  MemoryTracker tracker;
  ActivationPool pool(&tracker);
  {
    const tp::SequenceParallel sp({}, &pool);
    TransformerLayer layer(cfg, batch, params.data(), grads.data(), &pool, &sp);
    LayerKvState kv;
    LayerActivations acts;
    ASSERT_TRUE(layer.Forward({0, cfg.seq_len}, x.data(), out.data(), kv, acts).ok());
    ASSERT_TRUE(layer.BackwardInput(dy.data(), dx.data(), kv, acts).ok());
    EXPECT_TRUE(kv.k.empty());  // released by the backward of the chunk at position 0
    ASSERT_TRUE(layer.BackwardWeight(acts).ok());
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  }
  auto loss = [&] { return LayerLoss(cfg, batch, params, x, dy); };
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss);
  for (const TensorSpec& s : LayerTensorSpecs(cfg)) {
    std::vector<float> analytic(grads.begin() + s.offset, grads.begin() + s.offset + s.count());
    ExpectGradientMatches(s.name, params.data() + s.offset, s.count(), analytic, loss);
  }
}

TEST(TransformerLayer, BackwardInputAndWeightMatchFiniteDifferences) {
  const ModelConfig cfg = SmallConfig(1);
  ExpectLayerGradientsMatchFiniteDifferences(cfg, RandomParams(cfg, 1, 1), 2);
}

struct StackRun {
  std::vector<float> out;  // per microbatch, (b, s, h) each, concatenated
  std::vector<float> dx;
  std::vector<float> grads;
};

// Two microbatches through a 2-layer stack with the given chunk bounds, in a Seq1F1B-like
// order: all forwards of mb 0, the forwards of mb 1 interleaved with the backwards of mb 0
// (reverse chunk order, W deferred), then the rest.
StackRun RunStack(const ModelConfig& cfg, const std::vector<float>& params, int batch,
                  const std::vector<int>& bounds, MemoryTracker* tracker) {
  const int mbs = 2;
  const size_t row = cfg.hidden;
  const size_t per_mb = static_cast<size_t>(batch) * cfg.seq_len * row;
  const std::vector<float> x = RandomVector(mbs * per_mb, 100);
  const std::vector<float> dy = RandomVector(mbs * per_mb, 101);
  std::vector<float> p = params;
  StackRun r{std::vector<float>(mbs * per_mb), std::vector<float>(mbs * per_mb),
             std::vector<float>(params.size(), 0.0f)};
  auto stack =
      LayerStack::Create(cfg, 0, cfg.layers, batch, bounds, p.data(), r.grads.data(), tracker);
  EXPECT_TRUE(stack.ok()) << stack.status();
  const int k = stack->num_seq_chunks();
  // Gathers/scatters a chunk (b, len, h) out of a whole sequence tensor (b, s, h).
  auto gather = [&](const std::vector<float>& src, int mb, SeqChunk c) {
    std::vector<float> o(static_cast<size_t>(batch) * c.len() * row);
    for (int b = 0; b < batch; ++b)
      for (int t = 0; t < c.len(); ++t)
        for (size_t j = 0; j < row; ++j)
          o[(b * c.len() + t) * row + j] =
              src[mb * per_mb + (b * cfg.seq_len + c.begin + t) * row + j];
    return o;
  };
  auto scatter = [&](std::vector<float>& dst, int mb, SeqChunk c, const std::vector<float>& v) {
    for (int b = 0; b < batch; ++b)
      for (int t = 0; t < c.len(); ++t)
        for (size_t j = 0; j < row; ++j)
          dst[mb * per_mb + (b * cfg.seq_len + c.begin + t) * row + j] =
              v[(b * c.len() + t) * row + j];
  };
  auto forward = [&](int mb, int q) {
    const SeqChunk c = stack->seq_chunk(q);
    std::vector<float> in = gather(x, mb, c), o(in.size());
    ASSERT_TRUE(stack->Forward({mb, q}, in.data(), o.data()).ok());
    scatter(r.out, mb, c, o);
  };
  auto backward_input = [&](int mb, int q) {
    const SeqChunk c = stack->seq_chunk(q);
    std::vector<float> g = gather(dy, mb, c), d(g.size());
    ASSERT_TRUE(stack->BackwardInput({mb, q}, g.data(), d.data()).ok());
    scatter(r.dx, mb, c, d);
  };
  for (int q = 0; q < k; ++q) forward(0, q);
  for (int q = k - 1; q >= 0; --q) {
    forward(1, k - 1 - q);
    backward_input(0, q);
  }
  for (int q = k - 1; q >= 0; --q) EXPECT_TRUE(stack->BackwardWeight({0, q}).ok());
  for (int q = k - 1; q >= 0; --q) {
    backward_input(1, q);
    EXPECT_TRUE(stack->BackwardWeight({1, q}).ok());
  }
  EXPECT_EQ(stack->live_slots(), 0);
  return r;
}

TEST(LayerStack, ChunkedSequenceEqualsWholeSequence) {
  const ModelConfig cfg = SmallConfig(2);
  const std::vector<float> params = RandomParams(cfg, 2, 7);
  MemoryTracker tracker;
  const StackRun whole = RunStack(cfg, params, 2, {0, 7}, &tracker);
  for (const std::vector<int>& bounds : std::vector<std::vector<int>>{
           {0, 4, 7}, {0, 2, 4, 7}, {0, 1, 6, 7}, {0, 5, 6, 7}, EqualSeqBounds(7, 3)}) {
    SCOPED_TRACE(::testing::Message() << "chunks ending at " << bounds[1] << "," << bounds[2]);
    const StackRun chunked = RunStack(cfg, params, 2, bounds, &tracker);
    ExpectAllNear("out", chunked.out.data(), whole.out.data(), whole.out.size(), 5e-5, 1e-4);
    ExpectAllNear("dx", chunked.dx.data(), whole.dx.data(), whole.dx.size(), 5e-5, 1e-4);
    ExpectAllNear("grads", chunked.grads.data(), whole.grads.data(), whole.grads.size(), 5e-5,
                  1e-4);
  }
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);  // K/V caches and slots freed
  EXPECT_GT(tracker.peak(MemoryCategory::kActivations), 0);
}

TEST(LayerStack, MatchesLayersRunOneByOneAndAccumulatesOverMicrobatches) {
  const ModelConfig cfg = SmallConfig(2);
  const std::vector<float> params = RandomParams(cfg, 2, 9);
  const StackRun stack = RunStack(cfg, params, 2, {0, 7}, nullptr);
  // Reference: each microbatch through layer 0 then layer 1 with fused B+W.
  const size_t per_mb = 2ul * cfg.seq_len * cfg.hidden, lp = LayerParamCount(cfg);
  const std::vector<float> x = RandomVector(2 * per_mb, 100);
  const std::vector<float> dy = RandomVector(2 * per_mb, 101);
  std::vector<float> p = params, grads(params.size(), 0.0f);
  ActivationPool pool(nullptr);
  const tp::SequenceParallel sp({}, &pool);
  TransformerLayer l0(cfg, 2, p.data(), grads.data(), &pool, &sp);
  TransformerLayer l1(cfg, 2, p.data() + lp, grads.data() + lp, &pool, &sp);
  for (int mb = 0; mb < 2; ++mb) {
    LayerKvState kv0, kv1;
    LayerActivations a0, a1;
    std::vector<float> h(per_mb), out(per_mb), dh(per_mb), dx(per_mb);
    ASSERT_TRUE(l0.Forward({0, cfg.seq_len}, x.data() + mb * per_mb, h.data(), kv0, a0).ok());
    ASSERT_TRUE(l1.Forward({0, cfg.seq_len}, h.data(), out.data(), kv1, a1).ok());
    ASSERT_TRUE(l1.BackwardInput(dy.data() + mb * per_mb, dh.data(), kv1, a1).ok());
    ASSERT_TRUE(l1.BackwardWeight(a1).ok());
    ASSERT_TRUE(l0.BackwardInput(dh.data(), dx.data(), kv0, a0).ok());
    ASSERT_TRUE(l0.BackwardWeight(a0).ok());
    ExpectAllNear("out", out.data(), stack.out.data() + mb * per_mb, per_mb, 1e-6, 1e-6);
    ExpectAllNear("dx", dx.data(), stack.dx.data() + mb * per_mb, per_mb, 1e-6, 1e-6);
  }
  ExpectAllNear("grads", grads.data(), stack.grads.data(), grads.size(), 1e-6, 1e-6);
}

TEST(LayerStack, RejectsOutOfOrderPasses) {
  const ModelConfig cfg = SmallConfig(2);
  std::vector<float> p = RandomParams(cfg, 2, 3), g(p.size());
  EXPECT_FALSE(LayerStack::Create(cfg, 1, 2, 1, {0, 7}, p.data(), g.data(), nullptr).ok());
  EXPECT_FALSE(LayerStack::Create(cfg, 0, 2, 1, {0, 3, 3, 7}, p.data(), g.data(), nullptr).ok());
  EXPECT_FALSE(LayerStack::Create(cfg, 0, 2, 1, {0, 6}, p.data(), g.data(), nullptr).ok());
  auto stack = LayerStack::Create(cfg, 0, 2, 1, {0, 3, 7}, p.data(), g.data(), nullptr);
  ASSERT_TRUE(stack.ok()) << stack.status();
  std::vector<float> x(4 * 8, 0.1f), y(4 * 8), d(4 * 8);
  EXPECT_FALSE(stack->Forward({0, 1}, x.data(), y.data()).ok());  // chunk 1 before chunk 0
  ASSERT_TRUE(stack->Forward({0, 0}, x.data(), y.data()).ok());
  EXPECT_FALSE(stack->Forward({0, 0}, x.data(), y.data()).ok());        // twice
  EXPECT_FALSE(stack->BackwardInput({0, 0}, x.data(), d.data()).ok());  // chunk 1 not forwarded
  EXPECT_FALSE(stack->BackwardWeight({0, 0}).ok());                     // W before B
  ASSERT_TRUE(stack->Forward({0, 1}, x.data(), y.data()).ok());
  EXPECT_FALSE(stack->BackwardInput({0, 0}, x.data(), d.data()).ok());  // must start at chunk 1
  EXPECT_TRUE(stack->BackwardInput({0, 1}, x.data(), d.data()).ok());
  EXPECT_FALSE(stack->BackwardInput({0, 1}, x.data(), d.data()).ok());  // twice
  EXPECT_TRUE(stack->Backward({0, 0}, y.data(), d.data()).ok());
  EXPECT_TRUE(stack->BackwardWeight({0, 1}).ok());
  EXPECT_EQ(stack->live_slots(), 0);
}

TEST(LayerStack, InitAndTensorSpecsUseGlobalLayerNames) {
  const ModelConfig cfg = SmallConfig(4);
  const size_t lp = LayerParamCount(cfg);
  std::vector<float> full(4 * lp), part(2 * lp), g(4 * lp);
  auto whole = LayerStack::Create(cfg, 0, 4, 1, {0, 7}, full.data(), g.data(), nullptr);
  auto stage = LayerStack::Create(cfg, 2, 2, 1, {0, 7}, part.data(), g.data(), nullptr);
  ASSERT_TRUE(whole.ok() && stage.ok());
  whole->InitParams(5);
  stage->InitParams(5);
  // A pipeline stage holding layers 2..3 has exactly the 1-rank model's values there.
  EXPECT_TRUE(std::equal(part.begin(), part.end(), full.begin() + 2 * lp));
  const std::vector<TensorSpec> specs = stage->TensorSpecs();
  ASSERT_EQ(specs.size(), 24u);
  EXPECT_EQ(specs[0].name, "transformer.h.2.ln_1.weight");
  EXPECT_EQ(specs[12].name, "transformer.h.3.ln_1.weight");
  EXPECT_EQ(specs[12].offset, lp);
  EXPECT_EQ(stage->param_count(), 2 * lp);
}

}  // namespace
}  // namespace vp::engine

// ---------------------------------------------------------------------------------------------
// Llama layers (RMSNorm, RoPE, grouped-query attention, SwiGLU).

namespace vp::engine {
namespace {

ModelConfig LlamaConfig(int layers, int kv_heads) {
  ModelConfig cfg;
  cfg.layers = layers;
  cfg.hidden = 16;
  cfg.heads = 4;  // head_dim 4: two rotary pairs per head
  cfg.ffn_hidden = 12;
  cfg.seq_len = 7;
  cfg.vocab = 11;
  cfg.architecture = Architecture::kLlama;
  cfg.kv_heads = kv_heads;
  cfg.rope_theta = 100.0f;  // a small base so every rotary pair turns visibly over 7 positions
  return cfg;
}

// Scale 0.2 at h = 16 keeps the attention scores about as large as GPT-2's test at h = 8 and 0.4
// (saturated softmaxes make central differences inaccurate).
std::vector<float> LlamaRandomParams(const ModelConfig& cfg, int layers, uint32_t seed) {
  std::vector<float> p = RandomVector(LayerParamCount(cfg) * layers, seed, 0.2f);
  for (int l = 0; l < layers; ++l) {
    LlamaLayerParams lp = BindLlamaLayerParams(p.data() + l * LayerParamCount(cfg), cfg);
    for (int j = 0; j < cfg.hidden; ++j) {
      lp.attn_norm_w[j] += 1.0f;
      lp.mlp_norm_w[j] += 1.0f;
    }
  }
  return p;
}

TEST(LlamaLayerLayout, FollowsLlamaForCausalLMNamesAndShapes) {
  const ModelConfig cfg = LlamaConfig(2, 2);  // kv = 2 heads · 4 = 8
  const std::vector<TensorSpec> specs = LayerTensorSpecs(cfg);
  const std::vector<std::string> names = {
      "input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
      "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
      "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight"};
  ASSERT_EQ(specs.size(), names.size());
  size_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(specs[i].name, names[i]);
    EXPECT_EQ(specs[i].offset, offset);
    EXPECT_EQ(specs[i].weight_decay, specs[i].shape.size() == 2) << names[i];
    offset += specs[i].count();
  }
  EXPECT_EQ(offset, LayerParamCount(cfg));
  EXPECT_EQ(LayerParamCount(cfg), 2u * 16 + (16 + 16) * 16 + 16 * 16 + 3u * 12 * 16);
  EXPECT_EQ(specs[2].shape, (std::vector<int64_t>{8, 16}));   // k_proj [kv, h]
  EXPECT_EQ(specs[6].shape, (std::vector<int64_t>{12, 16}));  // gate_proj [f, h]
  EXPECT_EQ(specs[8].shape, (std::vector<int64_t>{16, 12}));  // down_proj [h, f]
  EXPECT_EQ(LayerTensorName(cfg, 3, "mlp.up_proj.weight"), "model.layers.3.mlp.up_proj.weight");
  std::vector<float> block(LayerParamCount(cfg));
  const LlamaLayerParams p = BindLlamaLayerParams(block.data(), cfg);
  EXPECT_EQ(p.wqkv, block.data() + specs[1].offset);
  EXPECT_EQ(p.wdown, block.data() + specs[8].offset);
  // Init: RMSNorm weights 1, every matrix N(0, 0.02) named by its full HF name.
  InitLayerParams(block.data(), cfg, 3, 42);
  EXPECT_EQ(p.attn_norm_w[0], 1.0f);
  float expect;
  InitNormal(&expect, 1, 0.02f, 42, TensorId("model.layers.3.self_attn.o_proj.weight"), 0);
  EXPECT_EQ(p.wo[0], expect);
}

class LlamaLayerTest : public ::testing::TestWithParam<int> {};  // kv_heads

TEST_P(LlamaLayerTest, BackwardInputAndWeightMatchFiniteDifferences) {
  const ModelConfig cfg = LlamaConfig(1, GetParam());
  ExpectLayerGradientsMatchFiniteDifferences(cfg, LlamaRandomParams(cfg, 1, 11), 12);
}

TEST_P(LlamaLayerTest, ChunkedSequenceEqualsWholeSequence) {
  // RoPE positions must be absolute: a chunk starting at position 4 rotates its q and k as the
  // whole sequence does, and its keys enter the cache rotated.
  const ModelConfig cfg = LlamaConfig(2, GetParam());
  const std::vector<float> params = LlamaRandomParams(cfg, 2, 17);
  MemoryTracker tracker;
  const StackRun whole = RunStack(cfg, params, 2, {0, 7}, &tracker);
  for (const std::vector<int>& bounds :
       std::vector<std::vector<int>>{{0, 4, 7}, {0, 1, 6, 7}, EqualSeqBounds(7, 3)}) {
    const StackRun chunked = RunStack(cfg, params, 2, bounds, &tracker);
    ExpectAllNear("out", chunked.out.data(), whole.out.data(), whole.out.size(), 5e-5, 1e-4);
    ExpectAllNear("dx", chunked.dx.data(), whole.dx.data(), whole.dx.size(), 5e-5, 1e-4);
    ExpectAllNear("grads", chunked.grads.data(), whole.grads.data(), whole.grads.size(), 5e-5,
                  1e-4);
  }
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
}

// MHA (4 key/value heads), GQA (2) and MQA (1).
INSTANTIATE_TEST_SUITE_P(KvHeads, LlamaLayerTest, ::testing::Values(4, 2, 1));

}  // namespace
}  // namespace vp::engine
