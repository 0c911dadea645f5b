// Vocabulary-parallel input and output layers against an unpartitioned reference computed
// plainly in double: p ranks as threads over real Gloo TCP on loopback.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/gloo_threads.h"
#include "worker/engine/memory.h"
#include "worker/engine/vocab/input_layer.h"
#include "worker/engine/vocab/output_layer.h"
#include "worker/engine/vocab/partition.h"

namespace vp::engine::vocab {
namespace {

using comm::GlooCommunicator;
using comm::testing::RunOnGlooRanks;

constexpr int kHidden = 16;
constexpr int kTokens = 12;       // n per microbatch
constexpr int kMicrobatches = 2;  // ∇W accumulates across them

// rel 1e-5 with an absolute floor of 1e-5 of the array's largest magnitude: float GEMMs over
// cancelling terms are accurate relative to the magnitudes summed, not to the result.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double maxabs = 0;
  for (double w : want) maxabs = std::max(maxabs, std::abs(w));
  const double floor = 1e-5 * std::max(maxabs, 1e-30);
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    if (std::abs(got[i] - want[i]) > 1e-5 * std::abs(want[i]) + floor && ++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// The unpartitioned model: one weight W (V, h) for the output layer, E (V, h) for the input.
struct Problem {
  int vocab;
  float d;                                   // loss gradient per token
  std::vector<float> w, e;                   // (V, h)
  std::vector<std::vector<float>> x;         // per microbatch (n, h)
  std::vector<std::vector<int32_t>> labels;  // per microbatch (n)
  std::vector<std::vector<int32_t>> tokens;  // per microbatch (n)
  std::vector<std::vector<float>> emb_grad;  // per microbatch (n, h): dL/d(embedding out)
};

Problem MakeProblem(int vocab, bool tied, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  Problem pr;
  pr.vocab = vocab;
  pr.d = 1.0f / (kTokens * kMicrobatches);
  pr.w.resize(static_cast<size_t>(vocab) * kHidden);
  for (float& v : pr.w) v = u(rng);
  if (tied) {
    pr.e = pr.w;
  } else {
    pr.e.resize(pr.w.size());
    for (float& v : pr.e) v = u(rng);
  }
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    std::vector<float> x(kTokens * kHidden), g(kTokens * kHidden);
    for (float& v : x) v = u(rng);
    for (float& v : g) v = 0.1f * u(rng);
    std::vector<int32_t> l(kTokens), t(kTokens);
    for (auto& v : l) v = tok(rng);
    for (auto& v : t) v = tok(rng);
    l[0] = vocab - 1;  // the last real row, next to the padding
    t[1] = vocab - 1;
    t[2] = t[3];  // a repeated token: its gradient rows add up
    pr.x.push_back(x);
    pr.labels.push_back(l);
    pr.tokens.push_back(t);
    pr.emb_grad.push_back(g);
  }
  return pr;
}

struct Reference {
  std::vector<std::vector<double>> loss;    // per microbatch (n)
  std::vector<std::vector<double>> grad_x;  // per microbatch (n, h)
  std::vector<double> grad_w, grad_e;       // (V, h), accumulated over microbatches
};

Reference ComputeReference(const Problem& pr) {
  const int V = pr.vocab, h = kHidden, n = kTokens;
  Reference ref;
  ref.grad_w.assign(static_cast<size_t>(V) * h, 0.0);
  ref.grad_e.assign(static_cast<size_t>(V) * h, 0.0);
  for (int mb = 0; mb < kMicrobatches; ++mb) {
    std::vector<double> loss(n), gx(static_cast<size_t>(n) * h, 0.0);
    for (int i = 0; i < n; ++i) {
      std::vector<double> z(V);
      for (int v = 0; v < V; ++v) {
        double acc = 0;
        for (int k = 0; k < h; ++k) acc += double(pr.x[mb][i * h + k]) * pr.w[v * h + k];
        z[v] = acc;
      }
      const double m = *std::max_element(z.begin(), z.end());
      double s = 0;
      for (double zv : z) s += std::exp(zv - m);
      const int label = pr.labels[mb][i];
      loss[i] = std::log(s) + m - z[label];
      for (int v = 0; v < V; ++v) {
        const double g = pr.d * (std::exp(z[v] - m) / s - (v == label ? 1.0 : 0.0));
        for (int k = 0; k < h; ++k) {
          gx[i * h + k] += g * pr.w[v * h + k];
          ref.grad_w[v * h + k] += g * pr.x[mb][i * h + k];
        }
      }
      for (int k = 0; k < h; ++k) {
        ref.grad_e[pr.tokens[mb][i] * h + k] += pr.emb_grad[mb][i * h + k];
      }
    }
    ref.loss.push_back(loss);
    ref.grad_x.push_back(gx);
  }
  return ref;
}

// This rank's rows of the model's flat buffers (padding rows zero). Tied: one weight and one
// gradient buffer serve both shards.
struct ShardBuffers {
  std::vector<float> out_w, out_g, in_w, in_g;  // in_*: untied only
  ShardBuffers(const Problem& pr, const VocabPartition& part, bool tied) {
    const size_t floats = static_cast<size_t>(part.rows) * kHidden;
    out_w.assign(floats, 0.0f);
    out_g.assign(floats, 0.0f);
    for (int64_t j = 0; j < part.valid_rows; ++j) {
      std::copy_n(&pr.w[(part.begin + j) * kHidden], kHidden, &out_w[j * kHidden]);
    }
    if (!tied) {
      in_w.assign(floats, 0.0f);
      in_g.assign(floats, 0.0f);
      for (int64_t j = 0; j < part.valid_rows; ++j) {
        std::copy_n(&pr.e[(part.begin + j) * kHidden], kHidden, &in_w[j * kHidden]);
      }
    }
  }
  float* input_weight() { return in_w.empty() ? out_w.data() : in_w.data(); }
  float* input_grad() { return in_g.empty() ? out_g.data() : in_g.data(); }
};

// The gathered weight gradients against the reference's. Tied: one buffer holds both, ∇W_out
// plus the scatter-add of the embedding gradient.
void ExpectWeightGradients(const Reference& ref, const std::vector<float>& grad_w,
                           const std::vector<float>& grad_e, bool tied) {
  if (tied) {
    std::vector<double> sum(ref.grad_w.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = ref.grad_w[i] + ref.grad_e[i];
    ExpectClose(grad_w, sum, "tied grad");
  } else {
    ExpectClose(grad_w, ref.grad_w, "grad_w");
    ExpectClose(grad_e, ref.grad_e, "grad_e");
  }
}

using Config = std::tuple<int /*p*/, int /*V*/, bool /*tied*/, OutputAlgorithm>;

class VocabLayersTest : public ::testing::TestWithParam<Config> {};

TEST_P(VocabLayersTest, MatchesUnpartitionedReference) {
  const auto [p, V, tied, algorithm] = GetParam();
  const int h = kHidden, n = kTokens;
  const Problem pr = MakeProblem(V, tied, 1234u + 17u * V + p);
  const Reference ref = ComputeReference(pr);

  // What the ranks produce, gathered by the main thread after they finish.
  std::mutex mu;
  std::vector<std::vector<std::vector<float>>> losses(p), grad_x(p), embedded(p);
  std::vector<float> grad_w(static_cast<size_t>(V) * h, -1.0f), grad_e(grad_w);
  bool padding_grads_zero = true;
  std::vector<int64_t> leaked_bytes(p, -1);

  RunOnGlooRanks(p, [&](GlooCommunicator& comm) {
    const int r = comm.rank();
    auto part = MakeVocabPartition(V, p, r);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(part->padded_vocab % (8 * p), 0);
    MemoryTracker tracker;
    ShardBuffers buf(pr, *part, tied);
    std::vector<float>& out_w = buf.out_w;
    std::vector<float>& out_g = buf.out_g;
    float* in_w = buf.input_weight();
    float* in_g = buf.input_grad();
    auto out = OutputLayerShard::Create(*part, h, algorithm, out_w.data(), out_g.data(), &tracker);
    auto in = InputLayerShard::Create(*part, h, in_w, in_g, &tracker);
    ASSERT_TRUE(out.ok() && in.ok());

    for (int mb = 0; mb < kMicrobatches; ++mb) {
      // IF + IF_REDUCE.
      auto ist = in->Forward(pr.tokens[mb].data(), n);
      ASSERT_TRUE(ist.ok()) << ist.status();
      ASSERT_TRUE(in->ForwardReduce(*ist, comm).ok());
      std::vector<float> emb(ist->output(), ist->output() + n * h);
      ist->ReleaseOutput();

      // S, C1, T (, C2).
      auto ost = out->S(pr.x[mb].data(), pr.labels[mb].data(), n, pr.d);
      ASSERT_TRUE(ost.ok()) << ost.status();
      EXPECT_EQ(ost->grad_input(), nullptr);
      ASSERT_TRUE(out->C1(*ost, comm).ok());
      std::vector<float> loss(ost->losses(), ost->losses() + n);
      ASSERT_TRUE(out->T(*ost, pr.x[mb].data()).ok());
      if (algorithm == OutputAlgorithm::kAlgorithm1) {
        EXPECT_EQ(ost->grad_input(), nullptr);  // partial until C2
        ASSERT_TRUE(out->C2(*ost, comm).ok());
      } else {
        EXPECT_EQ(out->C2(*ost, comm).code(), absl::StatusCode::kFailedPrecondition);
      }
      ASSERT_NE(ost->grad_input(), nullptr);
      std::vector<float> gx(ost->grad_input(), ost->grad_input() + n * h);
      ost->Release();

      // IB_BCAST from a varying root, then the local scatter-add.
      const int root = mb % p;
      ASSERT_TRUE(
          in->BackwardBroadcast(*ist, comm, root, r == root ? pr.emb_grad[mb].data() : nullptr)
              .ok());
      ASSERT_TRUE(in->Backward(*ist).ok());

      std::lock_guard<std::mutex> lock(mu);
      losses[r].push_back(loss);
      grad_x[r].push_back(gx);
      embedded[r].push_back(emb);
    }
    // Gather this shard's real rows; padding rows must still be exactly zero.
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t j = 0; j < part->rows; ++j) {
      for (int k = 0; k < h; ++k) {
        if (j < part->valid_rows) {
          grad_w[(part->begin + j) * h + k] = out_g[j * h + k];
          grad_e[(part->begin + j) * h + k] = in_g[j * h + k];
        } else if (out_g[j * h + k] != 0.0f || in_g[j * h + k] != 0.0f) {
          padding_grads_zero = false;
        }
      }
    }
    // Only T's reusable n×rows workspace is still held; after dropping it, nothing.
    EXPECT_EQ(tracker.current(MemoryCategory::kActivations),
              static_cast<int64_t>(sizeof(float)) * n * part->rows);
    out->ReleaseWorkspace();
    leaked_bytes[r] = tracker.current(MemoryCategory::kActivations);
  });

  EXPECT_TRUE(padding_grads_zero);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(leaked_bytes[r], 0) << "rank " << r;
    ASSERT_EQ(losses[r].size(), size_t{kMicrobatches}) << "rank " << r;
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      const std::string where = absl::StrCat(" rank ", r, " mb ", mb);
      ExpectClose(losses[r][mb], ref.loss[mb], "loss" + where);
      ExpectClose(grad_x[r][mb], ref.grad_x[mb], "grad_x" + where);
      std::vector<double> lookup(static_cast<size_t>(n) * h);
      for (int i = 0; i < n; ++i) {
        for (int k = 0; k < h; ++k) lookup[i * h + k] = pr.e[pr.tokens[mb][i] * h + k];
      }
      ExpectClose(embedded[r][mb], lookup, "embedding" + where);
    }
  }
  ExpectWeightGradients(ref, grad_w, grad_e, tied);
}

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) {
  const auto [p, V, tied, algorithm] = info.param;
  return absl::StrCat("p", p, "_V", V, tied ? "_tied" : "_untied",
                      algorithm == OutputAlgorithm::kAlgorithm1 ? "_alg1" : "_alg2");
}

// V=5: with p=4 the last shard and with p=8 five shards are all padding. V=48 is a multiple of
// 2p for every p here (no padding); V=37 is a multiple of none.
INSTANTIATE_TEST_SUITE_P(Shards, VocabLayersTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(5, 37, 48), ::testing::Bool(),
                                            ::testing::Values(OutputAlgorithm::kAlgorithm1,
                                                              OutputAlgorithm::kAlgorithm2)),
                         ConfigName);

// Tensor parallelism: p·t ranks (pp, tp) as threads, shard v = pp·t + tp of the vocabulary,
// each rank holding m = n/t of the token rows. Every rank joins two groups: its pipeline group
// (the p ranks with its tp: the barriers C1, C2, IF_REDUCE, IB_BCAST) and its tensor group (the t
// ranks with its pp: the exchanges inside S, T, IF and IB). Loss, ∇X and the embedding of a
// rank's own rows, and every weight gradient, equal the unpartitioned reference.
using TensorConfig = std::tuple<int /*p*/, int /*V*/, bool /*tied*/, OutputAlgorithm>;

class TensorVocabLayersTest : public ::testing::TestWithParam<TensorConfig> {};

TEST_P(TensorVocabLayersTest, MatchesUnpartitionedReference) {
  const auto [p, V, tied, algorithm] = GetParam();
  const int t = 2, h = kHidden, n = kTokens, m = n / t;
  const Problem pr = MakeProblem(V, tied, 4321u + 17u * V + p);
  const Reference ref = ComputeReference(pr);

  std::mutex mu;
  std::vector<std::vector<std::vector<float>>> losses(p * t), grad_x(p * t), embedded(p * t);
  std::vector<float> grad_w(static_cast<size_t>(V) * h, -1.0f), grad_e(grad_w);
  bool padding_grads_zero = true;
  std::vector<int64_t> leaked_bytes(p * t, -1);
  static std::atomic<int> run{0};
  const std::string prefix = absl::StrCat("tp-vocab", run.fetch_add(1));
  auto store = comm::MakeHashStore();

  RunOnGlooRanks(
      p * t,
      [&](GlooCommunicator& world) {
        const int v = world.rank(), pp = v / t, tp = v % t;
        // The two groups, connected on the world's store under their own prefixes.
        auto connect = [&](const std::string& name, int rank, int size) {
          return comm::testing::ConnectGroup(store, absl::StrCat(prefix, "/", name), rank, size,
                                             absl::Seconds(20));
        };
        auto pipe = connect(absl::StrCat("pipe", tp), pp, p);
        auto tensor = connect(absl::StrCat("tensor", pp), tp, t);
        ASSERT_TRUE(pipe.ok() && tensor.ok());
        comm::Communicator& pc = **pipe;
        const tp::TensorGroup group(tensor->get());

        auto part = MakeVocabPartition(V, p * t, v);
        ASSERT_TRUE(part.ok()) << part.status();
        MemoryTracker tracker;
        ShardBuffers buf(pr, *part, tied);
        std::vector<float>& out_w = buf.out_w;
        std::vector<float>& out_g = buf.out_g;
        float* in_w = buf.input_weight();
        float* in_g = buf.input_grad();
        auto out = OutputLayerShard::Create(*part, h, algorithm, out_w.data(), out_g.data(),
                                            &tracker, group);
        auto in = InputLayerShard::Create(*part, h, in_w, in_g, &tracker, group);
        ASSERT_TRUE(out.ok() && in.ok()) << out.status() << in.status();

        for (int mb = 0; mb < kMicrobatches; ++mb) {
          const float* my_x = pr.x[mb].data() + static_cast<size_t>(tp) * m * h;
          auto ist = in->Forward(pr.tokens[mb].data(), n);
          ASSERT_TRUE(ist.ok()) << ist.status();
          ASSERT_EQ(ist->n(), m);
          ASSERT_TRUE(in->ForwardReduce(*ist, pc).ok());
          std::vector<float> emb(ist->output(), ist->output() + m * h);
          ist->ReleaseOutput();

          auto ost = out->S(my_x, pr.labels[mb].data(), n, pr.d);
          ASSERT_TRUE(ost.ok()) << ost.status();
          ASSERT_EQ(ost->n(), m);
          ASSERT_TRUE(out->C1(*ost, pc).ok());
          std::vector<float> loss(ost->losses(), ost->losses() + m);
          ASSERT_TRUE(out->T(*ost, my_x).ok());
          if (algorithm == OutputAlgorithm::kAlgorithm1) {
            ASSERT_TRUE(out->C2(*ost, pc).ok());
          }
          ASSERT_NE(ost->grad_input(), nullptr);
          std::vector<float> gx(ost->grad_input(), ost->grad_input() + m * h);
          ost->Release();

          const int root = mb % p;
          const float* my_grad = pr.emb_grad[mb].data() + static_cast<size_t>(tp) * m * h;
          ASSERT_TRUE(in->BackwardBroadcast(*ist, pc, root, pp == root ? my_grad : nullptr).ok());
          ASSERT_TRUE(in->Backward(*ist).ok());

          std::lock_guard<std::mutex> lock(mu);
          losses[v].push_back(loss);
          grad_x[v].push_back(gx);
          embedded[v].push_back(emb);
        }
        std::lock_guard<std::mutex> lock(mu);
        for (int64_t j = 0; j < part->rows; ++j) {
          for (int k = 0; k < h; ++k) {
            if (j < part->valid_rows) {
              grad_w[(part->begin + j) * h + k] = out_g[j * h + k];
              grad_e[(part->begin + j) * h + k] = in_g[j * h + k];
            } else if (out_g[j * h + k] != 0.0f || in_g[j * h + k] != 0.0f) {
              padding_grads_zero = false;
            }
          }
        }
        out->ReleaseWorkspace();
        leaked_bytes[v] = tracker.current(MemoryCategory::kActivations);
      },
      absl::Seconds(20), store);

  EXPECT_TRUE(padding_grads_zero);
  for (int v = 0; v < p * t; ++v) {
    const int tp = v % t;
    EXPECT_EQ(leaked_bytes[v], 0) << "rank " << v;
    ASSERT_EQ(losses[v].size(), size_t{kMicrobatches}) << "rank " << v;
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      const std::string where = absl::StrCat(" rank ", v, " mb ", mb);
      const auto rows = [&](const std::vector<double>& all, int width) {
        return std::vector<double>(all.begin() + tp * m * width,
                                   all.begin() + (tp + 1) * m * width);
      };
      ExpectClose(losses[v][mb], rows(ref.loss[mb], 1), "loss" + where);
      ExpectClose(grad_x[v][mb], rows(ref.grad_x[mb], h), "grad_x" + where);
      std::vector<double> lookup(static_cast<size_t>(n) * h);
      for (int i = 0; i < n; ++i) {
        for (int k = 0; k < h; ++k) lookup[i * h + k] = pr.e[pr.tokens[mb][i] * h + k];
      }
      ExpectClose(embedded[v][mb], rows(lookup, h), "embedding" + where);
    }
  }
  ExpectWeightGradients(ref, grad_w, grad_e, tied);
}

std::string TensorConfigName(const ::testing::TestParamInfo<TensorConfig>& info) {
  const auto [p, V, tied, algorithm] = info.param;
  return absl::StrCat("t2_p", p, "_V", V, tied ? "_tied" : "_untied",
                      algorithm == OutputAlgorithm::kAlgorithm1 ? "_alg1" : "_alg2");
}

// V = 37 divides by no p·t here; V = 5 leaves whole shards (and at p·t = 8 whole tensor
// groups) of padding.
INSTANTIATE_TEST_SUITE_P(TensorShards, TensorVocabLayersTest,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(5, 37),
                                            ::testing::Bool(),
                                            ::testing::Values(OutputAlgorithm::kAlgorithm1,
                                                              OutputAlgorithm::kAlgorithm2)),
                         TensorConfigName);

TEST(TensorVocabShard, RefusesAShardThatIsNotItsTensorRank) {
  auto part = MakeVocabPartition(37, 4, 1);  // shard 1 = (pp 0, tp 1) of p·t = 2·2
  ASSERT_TRUE(part.ok());
  std::vector<float> w(part->rows * kHidden), g(w.size());
  RunOnGlooRanks(2, [&](GlooCommunicator& comm) {
    if (comm.rank() != 0) return;
    auto bad = OutputLayerShard::Create(*part, kHidden, OutputAlgorithm::kAlgorithm2, w.data(),
                                        g.data(), nullptr, tp::TensorGroup(&comm));
    EXPECT_EQ(bad.status().message(),
              "output layer: shard 1 of 4 is not tensor rank 0 of 2 (shard pp·t + tp of p·t: the "
              "world must be a multiple of t)");
  });
}

TEST(VocabPartition, PaddingRule) {
  EXPECT_EQ(PaddedVocab(50257, 4), 50272);
  EXPECT_EQ(PaddedVocab(64, 8), 64);
  EXPECT_EQ(PaddedVocab(5, 8), 64);
  auto last = MakeVocabPartition(50257, 4, 3);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->rows, 12568);
  EXPECT_EQ(last->begin, 37704);
  EXPECT_EQ(last->valid_rows, 50257 - 37704);
  EXPECT_TRUE(last->Owns(50256));
  EXPECT_FALSE(last->Owns(50257));  // padding is never a token
  auto empty = MakeVocabPartition(5, 8, 5);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->valid_rows, 0);
  EXPECT_EQ(MakeVocabPartition(0, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeVocabPartition(10, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeVocabPartition(10, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// An all-padding shard on its own: m' = -inf, s' = 0, P' = 0, and C1/T produce no NaN.
TEST(OutputLayerShard, AllPaddingShardContributesNothing) {
  auto part = MakeVocabPartition(5, 8, 7);
  ASSERT_TRUE(part.ok());
  ASSERT_EQ(part->valid_rows, 0);
  std::vector<float> w(part->rows * kHidden, 0.0f), g(w.size(), 0.0f);
  std::vector<float> x(kTokens * kHidden, 0.5f);
  std::vector<int32_t> labels(kTokens, 4);
  RunOnGlooRanks(2, [&](GlooCommunicator& comm) {
    // Rank 0 plays the all-padding shard; rank 1 a 1-row shard owning every label, which
    // the max/sum all-reduces must combine with -inf and 0 without a NaN.
    std::vector<float> w1(kHidden, 0.25f), g1(kHidden, 0.0f);
    VocabPartition one = *part;
    one.valid_rows = comm.rank() == 0 ? 0 : 1;
    one.rows = 1;
    one.begin = 4;
    auto s = OutputLayerShard::Create(
        comm.rank() == 0 ? *part : one, kHidden, OutputAlgorithm::kAlgorithm1,
        comm.rank() == 0 ? w.data() : w1.data(), comm.rank() == 0 ? g.data() : g1.data(), nullptr);
    ASSERT_TRUE(s.ok());
    auto st = s->S(x.data(), labels.data(), kTokens, 1.0f);
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE(s->C1(*st, comm).ok());
    for (int i = 0; i < kTokens; ++i) EXPECT_NEAR(st->losses()[i], 0.0f, 1e-6);  // one class
    ASSERT_TRUE(s->T(*st, x.data()).ok());
    ASSERT_TRUE(s->C2(*st, comm).ok());
    for (int i = 0; i < kTokens * kHidden; ++i) {
      ASSERT_TRUE(std::isfinite(st->grad_input()[i]));
      EXPECT_NEAR(st->grad_input()[i], 0.0f, 1e-6);  // softmax of one class is exactly 1
    }
  });
  for (float v : g) EXPECT_EQ(v, 0.0f);
}

TEST(OutputLayerShard, PassOrderAndArgumentsAreChecked) {
  auto part = MakeVocabPartition(10, 1, 0);
  ASSERT_TRUE(part.ok());
  std::vector<float> w(part->rows * kHidden, 0.1f), g(w.size()), x(2 * kHidden, 1.0f);
  MemoryTracker tracker;
  auto shard = OutputLayerShard::Create(*part, kHidden, OutputAlgorithm::kAlgorithm2, w.data(),
                                        g.data(), &tracker);
  ASSERT_TRUE(shard.ok());
  std::vector<int32_t> bad = {0, 10};
  EXPECT_EQ(shard->S(x.data(), bad.data(), 2, 1.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> labels = {0, 9};
  auto st = shard->S(x.data(), labels.data(), 2, 1.0f);
  ASSERT_TRUE(st.ok());
  EXPECT_GT(tracker.current(MemoryCategory::kActivations), 0);
  EXPECT_EQ(st->bytes(), tracker.current(MemoryCategory::kActivations));
  EXPECT_EQ(shard->T(*st, x.data()).code(), absl::StatusCode::kFailedPrecondition);  // no C1
  auto self = comm::MakeSelfCommunicator();
  ASSERT_TRUE(shard->C1(*st, *self).ok());
  EXPECT_EQ(shard->C1(*st, *self).code(), absl::StatusCode::kFailedPrecondition);  // twice
  ASSERT_TRUE(shard->T(*st, x.data()).ok());
  st->Release();
  // The second S reuses T's workspace: no new n×rows charge, so the peak does not grow.
  const int64_t peak = tracker.peak(MemoryCategory::kActivations);
  auto again = shard->S(x.data(), labels.data(), 2, 1.0f);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(tracker.peak(MemoryCategory::kActivations), peak);
  again->Release();
  shard->ReleaseWorkspace();
  EXPECT_EQ(tracker.current(MemoryCategory::kActivations), 0);
  EXPECT_EQ(
      OutputLayerShard::Create(*part, 0, OutputAlgorithm::kAlgorithm1, w.data(), g.data(), nullptr)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vp::engine::vocab
