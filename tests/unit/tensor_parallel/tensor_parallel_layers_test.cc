// Tensor-parallel transformer layers with sequence parallelism against the plain (t = 1) layer:
// t ranks as threads over real Gloo TCP on loopback, each holding its slices of two layers and
// its 1/t of every chunk's token rows. Forward outputs, input gradients and every parameter
// gradient (replicated ones after the group sum) equal the t = 1 stack's, for GPT-2 and Llama
// (key/value heads cut, and one key/value head replicated), whole sequences and Seq1F1B chunks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "tests/support/gloo_threads.h"
#include "tests/unit/engine/grad_check.h"
#include "worker/engine/init.h"
#include "worker/engine/tensor_parallel/split.h"
#include "worker/engine/transformer/transformer.h"

namespace vp::engine {
namespace {

using comm::GlooCommunicator;
using comm::testing::RunOnGlooRanks;
using testing::RandomVector;

constexpr int kLayers = 2;
constexpr int kBatch = 2;
constexpr int kMicrobatches = 2;

ModelConfig Gpt2Config() {
  ModelConfig cfg;
  cfg.layers = kLayers;
  cfg.hidden = 16;
  cfg.heads = 4;
  cfg.ffn_hidden = 24;
  cfg.seq_len = 8;
  cfg.vocab = 11;
  return cfg;
}

ModelConfig LlamaConfig(int kv_heads) {
  ModelConfig cfg = Gpt2Config();
  cfg.architecture = Architecture::kLlama;
  cfg.kv_heads = kv_heads;
  return cfg;
}

// Whole-model parameters far from the tiny init (norm weights around 1), layer-major.
std::vector<float> RandomWholeParams(const ModelConfig& cfg) {
  const size_t lp = LayerParamCount(cfg);
  std::vector<float> p = RandomVector(lp * kLayers, 7, 0.4f);
  for (int l = 0; l < kLayers; ++l) {
    for (const TensorSpec& s : LayerTensorSpecs(cfg)) {
      if (s.shape.size() != 1 || s.name.find("bias") != std::string::npos) continue;
      for (size_t i = 0; i < s.count(); ++i) p[l * lp + s.offset + i] += 1.0f;
    }
  }
  return p;
}

// Rank r's blocks (LayerParamCount(cfg, t) per layer) cut from the whole blocks.
std::vector<float> SliceStack(const ModelConfig& cfg, const std::vector<float>& whole, int r,
                              int t) {
  const std::vector<TensorSpec> full = LayerTensorSpecs(cfg, 1), local = LayerTensorSpecs(cfg, t);
  const size_t lp1 = LayerParamCount(cfg, 1), lpt = LayerParamCount(cfg, t);
  std::vector<float> out(lpt * kLayers);
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < full.size(); ++i) {
      tp::SliceTensor(whole.data() + l * lp1 + full[i].offset, full[i].full_shape, local[i].split,
                      r, t, out.data() + l * lpt + local[i].offset);
    }
  }
  return out;
}

// Relative error in the 2-norm, ‖a − b‖ / ‖b‖ ≤ 1e-5: the t ranks sum the same products in
// another order (partial sums over a rank's columns, then over ranks), and with weights this far
// from the init one layer amplifies float rounding enough that single small elements of a
// cancelling sum differ by ~1e-4 of their own size while whole tensors agree to
// within 2.2e-6 (the largest measured here).
void ExpectClose(const std::string& what, const float* a, const float* b, size_t n) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm) + 1e-12) << what;
  EXPECT_GT(norm, 0.0) << what << ": all zero, so the comparison says nothing";
}

struct StackResult {
  std::vector<float> out;    // per (microbatch, chunk) in run order: the rank's rows
  std::vector<float> dx;     // same layout
  std::vector<float> grads;  // the rank's gradient blocks (replicated ones summed)
};

// The token rows of chunk q of microbatch mb that rank r of t holds: (b·len/t, h).
std::vector<float> LocalRows(const std::vector<float>& whole_chunk, int r, int t) {
  const size_t m = whole_chunk.size() / t;
  return {whole_chunk.begin() + r * m, whole_chunk.begin() + (r + 1) * m};
}

// Runs kMicrobatches through a two-layer stack on one rank of t: F of every chunk in order,
// then B of each microbatch's chunks in reverse order, then every W.
StackResult RunStack(const ModelConfig& cfg, const std::vector<int>& bounds,
                     std::vector<float> params, int r, int t, tp::TensorGroup group) {
  std::vector<float> grads(params.size(), 0.0f);
  MemoryTracker tracker;
  auto stack = LayerStack::Create(cfg, 0, kLayers, kBatch, bounds, params.data(), grads.data(),
                                  &tracker, group);
  EXPECT_TRUE(stack.ok()) << stack.status();
  if (!stack.ok()) return {};
  StackResult res;
  const int k = static_cast<int>(bounds.size()) - 1;
  std::vector<std::vector<float>> outs(kMicrobatches * k), dxs(kMicrobatches * k);
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    for (int q = 0; q < k; ++q) {
      const size_t rows = static_cast<size_t>(kBatch) * (bounds[q + 1] - bounds[q]);
      const std::vector<float> x =
          LocalRows(RandomVector(rows * cfg.hidden, 100 + 10 * mb + q), r, t);
      std::vector<float>& y = outs[mb * k + q];
      y.resize(x.size());
      EXPECT_TRUE(stack->Forward({mb, q}, x.data(), y.data()).ok());
    }
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    for (int q = k - 1; q >= 0; --q) {
      const size_t rows = static_cast<size_t>(kBatch) * (bounds[q + 1] - bounds[q]);
      const std::vector<float> dy =
          LocalRows(RandomVector(rows * cfg.hidden, 200 + 10 * mb + q), r, t);
      std::vector<float>& dx = dxs[mb * k + q];
      dx.resize(dy.size());
      EXPECT_TRUE(stack->BackwardInput({mb, q}, dy.data(), dx.data()).ok());
    }
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    for (int q = k - 1; q >= 0; --q) EXPECT_TRUE(stack->BackwardWeight({mb, q}).ok());
  }
  EXPECT_TRUE(stack->SumReplicatedGrads().ok());
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  for (const auto& o : outs) res.out.insert(res.out.end(), o.begin(), o.end());
  for (const auto& d : dxs) res.dx.insert(res.dx.end(), d.begin(), d.end());
  res.grads = std::move(grads);
  return res;
}

struct Case {
  const char* name;
  ModelConfig cfg;
  int t;
  std::vector<int> bounds;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class TensorParallelLayers : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelLayers, EqualTheWholeLayer) {
  const Case& c = GetParam();
  const std::vector<float> whole = RandomWholeParams(c.cfg);
  const StackResult ref = RunStack(c.cfg, c.bounds, whole, 0, 1, {});
  std::vector<StackResult> ranks(c.t);
  RunOnGlooRanks(c.t, [&](GlooCommunicator& comm) {
    const int r = comm.rank();
    ranks[r] =
        RunStack(c.cfg, c.bounds, SliceStack(c.cfg, whole, r, c.t), r, c.t, tp::TensorGroup(&comm));
  });
  const int k = static_cast<int>(c.bounds.size()) - 1;
  for (int r = 0; r < c.t; ++r) {
    SCOPED_TRACE(::testing::Message() << "tensor rank " << r);
    // Outputs and input gradients: the rank's rows of every chunk.
    size_t ref_at = 0, at = 0;
    for (int i = 0; i < kMicrobatches * k; ++i) {
      const int q = i % k;
      const size_t chunk =
          static_cast<size_t>(kBatch) * (c.bounds[q + 1] - c.bounds[q]) * c.cfg.hidden;
      const size_t m = chunk / c.t;
      ASSERT_LE(at + m, ranks[r].out.size());
      ExpectClose("out", ranks[r].out.data() + at, ref.out.data() + ref_at + r * m, m);
      ExpectClose("dx", ranks[r].dx.data() + at, ref.dx.data() + ref_at + r * m, m);
      ref_at += chunk;
      at += m;
    }
    // Every parameter gradient: the rank's slice of the whole gradient.
    const std::vector<float> expected = SliceStack(c.cfg, ref.grads, r, c.t);
    ASSERT_EQ(expected.size(), ranks[r].grads.size());
    const std::vector<TensorSpec> specs = LayerTensorSpecs(c.cfg, c.t);
    const size_t lpt = LayerParamCount(c.cfg, c.t);
    for (int l = 0; l < kLayers; ++l) {
      for (const TensorSpec& s : specs) {
        const size_t o = l * lpt + s.offset;
        ExpectClose(s.name, ranks[r].grads.data() + o, expected.data() + o, s.count());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layers, TensorParallelLayers,
    ::testing::Values(Case{"gpt2_t2", Gpt2Config(), 2, {0, 8}},
                      Case{"gpt2_t4", Gpt2Config(), 4, {0, 8}},
                      Case{"gpt2_t2_seq1f1b_k2", Gpt2Config(), 2, {0, 6, 8}},
                      Case{"llama_t2_kv2", LlamaConfig(2), 2, {0, 8}},
                      Case{"llama_t4_kv4", LlamaConfig(4), 4, {0, 8}},
                      Case{"llama_t2_kv1_replicated", LlamaConfig(1), 2, {0, 8}},
                      Case{"llama_t4_kv1_replicated_seq1f1b_k2", LlamaConfig(1), 4, {0, 4, 8}}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(TensorSplit, SliceAndPlaceAreInverse) {
  // GPT-2's c_attn weight [h = 2, q|k|v = 3·4]: rank 1 of 2 holds columns 2..3 of each block.
  const std::vector<int64_t> shape = {2, 12};
  std::vector<float> whole(24);
  for (int i = 0; i < 24; ++i) whole[i] = static_cast<float>(i);
  const tp::Split split{1, 3};
  EXPECT_EQ(tp::LocalShape(shape, split, 2), (std::vector<int64_t>{2, 6}));
  std::vector<float> local(12);
  tp::SliceTensor(whole.data(), shape, split, 1, 2, local.data());
  EXPECT_EQ(local, (std::vector<float>{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23}));
  std::vector<float> back(24, -1.0f);
  for (int r = 0; r < 2; ++r) {
    tp::SliceTensor(whole.data(), shape, split, r, 2, local.data());
    tp::PlaceSlice(local.data(), shape, split, r, 2, back.data());
  }
  EXPECT_EQ(back, whole);
}

TEST(TensorSplit, RankInitHoldsTheWholeInitsValues) {
  for (const ModelConfig& cfg : {Gpt2Config(), LlamaConfig(2), LlamaConfig(1)}) {
    std::vector<float> whole(LayerParamCount(cfg));
    InitLayerParams(whole.data(), cfg, 1, 42);
    for (int r = 0; r < 2; ++r) {
      std::vector<float> mine(LayerParamCount(cfg, 2));
      InitLayerParams(mine.data(), cfg, 1, 42, r, 2);
      std::vector<float> expected(mine.size());
      const std::vector<TensorSpec> full = LayerTensorSpecs(cfg, 1),
                                    local = LayerTensorSpecs(cfg, 2);
      for (size_t i = 0; i < full.size(); ++i) {
        tp::SliceTensor(whole.data() + full[i].offset, full[i].full_shape, local[i].split, r, 2,
                        expected.data() + local[i].offset);
      }
      EXPECT_EQ(mine, expected) << (cfg.llama() ? "llama" : "gpt2") << " rank " << r;
    }
  }
}

TEST(TensorSplit, RefusesSplitsThatDoNotDivide) {
  ModelConfig cfg = Gpt2Config();
  EXPECT_EQ(tp::ValidateTensorSplit(cfg, 3).message(),
            "model.heads: must be divisible by parallel.tensor (4 % 3 != 0)");
  cfg.ffn_hidden = 26;
  EXPECT_EQ(tp::ValidateTensorSplit(cfg, 4).message(),
            "model.ffn_hidden: must be divisible by parallel.tensor (26 % 4 != 0)");
  EXPECT_EQ(tp::ValidateTensorSplit(LlamaConfig(2), 4).message(),
            "model.kv_heads: must be divisible by parallel.tensor or be 1 (replicated on every "
            "tensor rank) (2 % 4 != 0)");
  EXPECT_TRUE(tp::ValidateTensorSplit(LlamaConfig(1), 4).ok());
  // A chunk whose length t does not divide.
  const ModelConfig g = Gpt2Config();
  std::vector<float> p(LayerParamCount(g, 2)), d(p.size());
  auto stack = LayerStack::Create(g, 0, 1, 1, {0, 3, 8}, p.data(), d.data(), nullptr,
                                  tp::TensorGroup());  // t = 1: any chunk
  EXPECT_TRUE(stack.ok());
  RunOnGlooRanks(2, [&](GlooCommunicator& comm) {
    std::vector<float> p2(LayerParamCount(g, 2)), d2(p2.size());
    auto bad = LayerStack::Create(g, 0, 1, 1, {0, 3, 8}, p2.data(), d2.data(), nullptr,
                                  tp::TensorGroup(&comm));
    EXPECT_EQ(bad.status().message(),
              "sequence chunk 0 [0, 3): its length must be divisible by parallel.tensor (2)");
  });
}

}  // namespace
}  // namespace vp::engine
