#include "worker/engine/kernels/cpu/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/support/quadratic_attention.h"
#include "tests/unit/engine/grad_check.h"

namespace vp::engine::cpu {
namespace {

using ::vp::engine::testing::ExpectAllNear;
using ::vp::engine::testing::ExpectGradientMatches;
using ::vp::engine::testing::RandomVector;
using ::vp::engine::testing::WeightedSum;

TEST(LayerNorm, ForwardNormalisesRows) {
  const int n = 3, c = 16;
  std::vector<float> x = RandomVector(n * c, 1, 2.0f, 0.5f);
  std::vector<float> w(c, 1.0f), b(c, 0.0f), y(n * c), mean(n), rstd(n);
  LayerNormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
  for (int i = 0; i < n; ++i) {
    double m = 0, v = 0;
    for (int j = 0; j < c; ++j) m += y[i * c + j];
    for (int j = 0; j < c; ++j) v += y[i * c + j] * y[i * c + j];
    EXPECT_NEAR(m / c, 0.0, 1e-6);
    EXPECT_NEAR(v / c, 1.0, 1e-4);  // eps 1e-5 shrinks the variance very slightly
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const int n = 4, c = 12;
  std::vector<float> x = RandomVector(n * c, 2, 1.5f, 0.3f);
  std::vector<float> w = RandomVector(c, 3, 0.5f, 1.0f);
  std::vector<float> b = RandomVector(c, 4, 0.5f);
  const std::vector<float> dy = RandomVector(n * c, 5);
  std::vector<float> y(n * c), mean(n), rstd(n);
  auto loss = [&] {
    LayerNormForward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
    return WeightedSum(y.data(), dy);
  };
  loss();
  // Input part accumulates onto what is there: start from 1 and subtract it again.
  std::vector<float> dx(n * c, 1.0f);
  LayerNormBackwardInput(dx.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), n, c);
  for (float& v : dx) v -= 1.0f;
  std::vector<float> dw(c, 0.0f), db(c, 0.0f);
  LayerNormBackwardWeight(dw.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(), n,
                          c);
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss);
  ExpectGradientMatches("dweight", w.data(), w.size(), dw, loss);
  ExpectGradientMatches("dbias", b.data(), b.size(), db, loss);
}

TEST(Linear, ForwardMatchesNaiveProduct) {
  const int n = 5, in = 7, out = 3;
  const std::vector<float> x = RandomVector(n * in, 6), w = RandomVector(in * out, 7),
                           b = RandomVector(out, 8);
  std::vector<float> y(n * out), y_nobias(n * out);
  LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
  LinearForward(y_nobias.data(), x.data(), w.data(), nullptr, n, in, out);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < out; ++j) {
      double s = 0;
      for (int k = 0; k < in; ++k) s += x[i * in + k] * w[k * out + j];  // W is [in, out]
      EXPECT_NEAR(y_nobias[i * out + j], s, 1e-5);
      EXPECT_NEAR(y[i * out + j], s + b[j], 1e-5);
    }
  }
}

TEST(Linear, BackwardMatchesFiniteDifferencesAndAccumulates) {
  const int n = 6, in = 5, out = 4;
  std::vector<float> x = RandomVector(n * in, 9), w = RandomVector(in * out, 10),
                     b = RandomVector(out, 11);
  const std::vector<float> dy = RandomVector(n * out, 12);
  std::vector<float> y(n * out);
  auto loss = [&] {
    LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out);
    return WeightedSum(y.data(), dy);
  };
  std::vector<float> dx(n * in, 7.0f);  // overwritten
  LinearBackwardInput(dx.data(), dy.data(), w.data(), n, in, out);
  std::vector<float> dw(in * out, 0.0f), db(out, 0.0f);
  LinearBackwardWeight(dw.data(), db.data(), dy.data(), x.data(), n, in, out);
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss);
  ExpectGradientMatches("dweight", w.data(), w.size(), dw, loss);
  ExpectGradientMatches("dbias", b.data(), b.size(), db, loss);
  // A second W pass (another microbatch) adds the same amount again.
  std::vector<float> dw2 = dw, db2 = db;
  LinearBackwardWeight(dw2.data(), db2.data(), dy.data(), x.data(), n, in, out);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw[i], 1e-5);
  for (size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db2[i], 2 * db[i], 1e-5);
}

TEST(Gelu, ForwardMatchesFormulaAndBackwardMatchesFiniteDifferences) {
  const int n = 64;
  std::vector<float> x = RandomVector(n, 13, 2.0f);
  const std::vector<float> dy = RandomVector(n, 14);
  std::vector<float> y(n);
  GeluForward(y.data(), x.data(), n);
  for (int i = 0; i < n; ++i) {
    const double v = x[i];
    const double ref = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(y[i], ref, 1e-6);
  }
  auto loss = [&] {
    GeluForward(y.data(), x.data(), n);
    return WeightedSum(y.data(), dy);
  };
  std::vector<float> dx = dy;  // in place on the output gradient
  GeluBackward(dx.data(), x.data(), dx.data(), n);
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss, 1e-3f, 1e-3, 1e-2);
}

TEST(Residual, ForwardAddsAndBackwardAccumulatesIntoBoth) {
  const std::vector<float> a = {1, 2, 3}, b = {10, 20, 30}, dy = {0.5f, -1, 2};
  std::vector<float> y(3);
  ResidualForward(y.data(), a.data(), b.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{11, 22, 33}));
  std::vector<float> da = {1, 1, 1}, db = {0, 0, 0};
  ResidualBackward(da.data(), db.data(), dy.data(), 3);
  EXPECT_EQ(da, (std::vector<float>{1.5f, 0, 3}));
  EXPECT_EQ(db, dy);
}

TEST(PositionEmbedding, ChunkUsesOffsetPositionsAndBackwardAccumulates) {
  const int batch = 2, t = 3, c = 4, max_pos = 8, start = 5;
  const std::vector<float> wpe = RandomVector(max_pos * c, 15);
  std::vector<float> x = RandomVector(batch * t * c, 16);
  const std::vector<float> x0 = x;
  PositionEmbeddingForward(x.data(), wpe.data(), batch, t, c, start);
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < t; ++i)
      for (int j = 0; j < c; ++j) {
        const int k = (b * t + i) * c + j;
        EXPECT_FLOAT_EQ(x[k], x0[k] + wpe[(start + i) * c + j]);
      }
  const std::vector<float> dx = RandomVector(batch * t * c, 17);
  std::vector<float> dwpe(max_pos * c, 1.0f);
  PositionEmbeddingBackward(dwpe.data(), dx.data(), batch, t, c, start);
  for (int p = 0; p < max_pos; ++p)
    for (int j = 0; j < c; ++j) {
      float expect = 1.0f;
      if (p >= start && p < start + t)
        for (int b = 0; b < batch; ++b) expect += dx[(b * t + (p - start)) * c + j];
      EXPECT_FLOAT_EQ(dwpe[p * c + j], expect) << p << "," << j;
    }
}

// Attention of a query chunk [q_begin, q_end) with q inside a wider (qkv-like) row.
struct AttentionCase {
  AttentionShape shape;
  int ldq;
};

class AttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionTest, ForwardMatchesNaiveCausalAttention) {
  const AttentionShape sh = GetParam().shape;
  const int ldq = GetParam().ldq, w = sh.width(), kw = sh.kv_width(), tq = sh.q_len();
  const int group = sh.heads / sh.num_kv_heads();
  const std::vector<float> q = RandomVector(sh.batch * tq * ldq, 20);
  const std::vector<float> k = RandomVector(sh.batch * sh.kv_rows * kw, 21);
  const std::vector<float> v = RandomVector(sh.batch * sh.kv_rows * kw, 22);
  std::vector<float> out(sh.batch * tq * w), lse(sh.batch * sh.heads * tq);
  AttentionForward(out.data(), lse.data(), q.data(), ldq, k.data(), v.data(), sh);
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.head_dim));
  for (int b = 0; b < sh.batch; ++b)
    for (int h = 0; h < sh.heads; ++h)
      for (int i = 0; i < tq; ++i) {
        const int pos = sh.q_begin + i;
        std::vector<double> p(pos + 1);
        double maxv = -1e300, sum = 0;
        for (int j = 0; j <= pos; ++j) {
          double s = 0;
          for (int d = 0; d < sh.head_dim; ++d)
            s += q[(b * tq + i) * ldq + h * sh.head_dim + d] *
                 k[(b * sh.kv_rows + j) * kw + (h / group) * sh.head_dim + d];
          p[j] = s * scale;
          maxv = std::max(maxv, p[j]);
        }
        for (double& e : p) sum += (e = std::exp(e - maxv));
        EXPECT_NEAR(lse[(b * sh.heads + h) * tq + i], maxv + std::log(sum), 1e-5);
        for (int d = 0; d < sh.head_dim; ++d) {
          double o = 0;
          for (int j = 0; j <= pos; ++j)
            o += p[j] / sum * v[(b * sh.kv_rows + j) * kw + (h / group) * sh.head_dim + d];
          EXPECT_NEAR(out[(b * tq + i) * w + h * sh.head_dim + d], o, 1e-5);
        }
      }
}

TEST_P(AttentionTest, BackwardMatchesFiniteDifferences) {
  const AttentionShape sh = GetParam().shape;
  const int ldq = GetParam().ldq, w = sh.width(), kw = sh.kv_width(), tq = sh.q_len();
  std::vector<float> q = RandomVector(sh.batch * tq * ldq, 30);
  std::vector<float> k = RandomVector(sh.batch * sh.kv_rows * kw, 31);
  std::vector<float> v = RandomVector(sh.batch * sh.kv_rows * kw, 32);
  const std::vector<float> dy = RandomVector(sh.batch * tq * w, 33);
  std::vector<float> out(sh.batch * tq * w), lse(sh.batch * sh.heads * tq);
  auto loss = [&] {
    AttentionForward(out.data(), lse.data(), q.data(), ldq, k.data(), v.data(), sh);
    return WeightedSum(out.data(), dy);
  };
  loss();
  std::vector<float> dq(q.size(), 0.0f), scratch(AttentionBackwardScratch(sh));
  // dk/dv accumulate: start from 2 and take it off again.
  std::vector<float> dk(k.size(), 2.0f), dv(v.size(), 2.0f);
  AttentionBackward(dq.data(), ldq, dk.data(), dv.data(), scratch.data(), dy.data(), out.data(),
                    lse.data(), q.data(), ldq, k.data(), v.data(), sh);
  for (float& x : dk) x -= 2.0f;
  for (float& x : dv) x -= 2.0f;
  // Columns of q outside the heads (the k/v part of a qkv row) are not attention inputs: the
  // loss does not depend on them, so their numeric gradient is 0, and dq must leave them at 0.
  ExpectGradientMatches("dq", q.data(), q.size(), dq, loss);
  ExpectGradientMatches("dk", k.data(), k.size(), dk, loss);  // rows >= q_end: exactly 0
  ExpectGradientMatches("dv", v.data(), v.size(), dv, loss);
}

INSTANTIATE_TEST_SUITE_P(
    Chunks, AttentionTest,
    ::testing::Values(AttentionCase{{2, 2, 3, 0, 5, 5}, 6},   // whole sequence, packed q
                      AttentionCase{{2, 2, 3, 2, 5, 7}, 18},  // middle chunk inside a qkv row
                      AttentionCase{{1, 3, 2, 4, 5, 5}, 6},   // one-token last chunk
                      // Grouped-query attention: 4 query heads on 2 key/value heads (and on 1,
                      // multi-query), whole and as a middle chunk inside a q|k|v row.
                      AttentionCase{{2, 4, 2, 0, 5, 5, 2}, 8},
                      AttentionCase{{2, 4, 2, 2, 5, 7, 2}, 16},
                      AttentionCase{{1, 4, 2, 1, 4, 4, 1}, 12}));

// The tiled kernels against the quadratic implementation they replaced (tests/support), at
// shapes that cross several query tiles (64) and key tiles (256), with chunks that start and
// end inside a tile: the output, dQ and the accumulated dK, dV agree to 1e-5 of each tensor's
// largest magnitude (the online softmax sums in another order).
void ExpectCloseRelative(const char* what, const std::vector<float>& got,
                         const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  double peak = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    peak = std::max(peak, std::fabs(double(want[i])));
    worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
  }
  EXPECT_LE(worst, 1e-5 * peak) << what << ": max |diff| " << worst << ", max |want| " << peak;
}

class AttentionReferenceTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionReferenceTest, TiledMatchesQuadratic) {
  const AttentionShape sh = GetParam().shape;
  const int ldq = GetParam().ldq, w = sh.width(), kw = sh.kv_width(), tq = sh.q_len();
  const size_t nq = size_t(sh.batch) * tq, nkv = size_t(sh.batch) * sh.kv_rows;
  // Scores of a few units, as a trained model has: softmax rows far from uniform.
  const std::vector<float> q = RandomVector(nq * ldq, 70, 3.0f);
  const std::vector<float> k = RandomVector(nkv * kw, 71, 3.0f);
  const std::vector<float> v = RandomVector(nkv * kw, 72);
  const std::vector<float> dy = RandomVector(nq * w, 73);
  std::vector<float> out(nq * w), lse(size_t(sh.batch) * sh.heads * tq);
  std::vector<float> ref_out(nq * w), att(size_t(sh.batch) * sh.heads * tq * sh.q_end);
  AttentionForward(out.data(), lse.data(), q.data(), ldq, k.data(), v.data(), sh);
  testing::QuadraticAttentionForward(ref_out.data(), att.data(), q.data(), ldq, k.data(), v.data(),
                                     sh);
  ExpectCloseRelative("out", out, ref_out);
  // dk, dv accumulate onto what a later chunk left there.
  const std::vector<float> dk0 = RandomVector(nkv * kw, 74), dv0 = RandomVector(nkv * kw, 75);
  std::vector<float> dq(nq * ldq, 0.0f), dk = dk0, dv = dv0, scratch(AttentionBackwardScratch(sh));
  std::vector<float> ref_dq(nq * ldq, 0.0f), ref_dk = dk0, ref_dv = dv0;
  AttentionBackward(dq.data(), ldq, dk.data(), dv.data(), scratch.data(), dy.data(), out.data(),
                    lse.data(), q.data(), ldq, k.data(), v.data(), sh);
  testing::QuadraticAttentionBackward(ref_dq.data(), ref_dk.data(), ref_dv.data(), dy.data(),
                                      att.data(), q.data(), ldq, k.data(), v.data(), sh);
  for (size_t i = 0; i < dk.size(); ++i) {  // compare the gradients, not the starting values
    dk[i] -= dk0[i], ref_dk[i] -= dk0[i];
    dv[i] -= dv0[i], ref_dv[i] -= dv0[i];
  }
  ExpectCloseRelative("dq", dq, ref_dq);
  ExpectCloseRelative("dk", dk, ref_dk);
  ExpectCloseRelative("dv", dv, ref_dv);
}

INSTANTIATE_TEST_SUITE_P(
    Tiles, AttentionReferenceTest,
    ::testing::Values(
        // GPT-2-like: whole sequence of 600 (3 key tiles, 10 query tiles), q packed.
        AttentionCase{{1, 2, 16, 0, 600, 600}, 32},
        // Seq1F1B middle chunk [200, 530) inside a q|k|v row, cache longer than q_end.
        AttentionCase{{2, 2, 16, 200, 530, 640}, 96},
        // Last chunk of one query deep into the sequence (the KV cache of sampling).
        AttentionCase{{1, 2, 16, 599, 600, 600}, 32},
        // Llama GQA: 4 query heads on 2 and on 1 key/value heads, whole and chunked.
        AttentionCase{{1, 4, 16, 0, 520, 520, 2}, 128},
        AttentionCase{{2, 4, 16, 300, 450, 512, 1}, 96}));

// ---------------------------------------------------------------------------------------------
// Llama ops.

TEST(LinearT, MatchesNaiveProductAndFiniteDifferences) {
  const int n = 4, in = 6, out = 5;
  std::vector<float> x = RandomVector(n * in, 40), w = RandomVector(out * in, 41);
  const std::vector<float> dy = RandomVector(n * out, 42);
  std::vector<float> y(n * out);
  LinearTForward(y.data(), x.data(), w.data(), n, in, out);
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) {
      double e = 0;
      for (int j = 0; j < in; ++j) e += double(x[i * in + j]) * w[o * in + j];  // w is [out, in]
      EXPECT_NEAR(y[i * out + o], e, 1e-5);
    }
  auto loss = [&] {
    LinearTForward(y.data(), x.data(), w.data(), n, in, out);
    return WeightedSum(y.data(), dy);
  };
  std::vector<float> dx(n * in), dw(out * in, 0.5f);
  LinearTBackwardInput(dx.data(), dy.data(), w.data(), n, in, out);
  LinearTBackwardWeight(dw.data(), dy.data(), x.data(), n, in, out);  // accumulates onto 0.5
  for (float& v : dw) v -= 0.5f;
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss);
  ExpectGradientMatches("dweight", w.data(), w.size(), dw, loss);
}

TEST(RmsNorm, ForwardHasUnitRmsAndBackwardMatchesFiniteDifferences) {
  const int n = 4, c = 12;
  const float eps = 1e-5f;
  std::vector<float> x = RandomVector(n * c, 43, 1.5f, 0.3f);
  std::vector<float> w = RandomVector(c, 44, 0.5f, 1.0f);
  const std::vector<float> dy = RandomVector(n * c, 45);
  std::vector<float> y(n * c), rstd(n), ones(c, 1.0f);
  RmsNormForward(y.data(), rstd.data(), x.data(), ones.data(), n, c, eps);
  for (int i = 0; i < n; ++i) {
    double ms = 0;
    for (int j = 0; j < c; ++j) ms += double(y[i * c + j]) * y[i * c + j];
    EXPECT_NEAR(ms / c, 1.0, 1e-3);  // eps shrinks it very slightly
  }
  auto loss = [&] {
    RmsNormForward(y.data(), rstd.data(), x.data(), w.data(), n, c, eps);
    return WeightedSum(y.data(), dy);
  };
  loss();
  std::vector<float> dx(n * c, 1.0f), dw(c, 0.0f);  // the input gradient accumulates onto 1
  RmsNormBackwardInput(dx.data(), dy.data(), x.data(), w.data(), rstd.data(), n, c);
  for (float& v : dx) v -= 1.0f;
  RmsNormBackwardWeight(dw.data(), dy.data(), x.data(), rstd.data(), n, c);
  ExpectGradientMatches("dx", x.data(), x.size(), dx, loss);
  ExpectGradientMatches("dweight", w.data(), w.size(), dw, loss);
}

TEST(Rope, RotatesHalvesAtAbsolutePositionsAndChunksAgree) {
  const int batch = 2, t = 6, heads = 2, d = 4, ld = 11;  // ld > heads·d: a q|k|v-like row
  const float theta = 10000.0f;
  const std::vector<float> x0 = RandomVector(batch * t * ld, 46);
  std::vector<float> x = x0;
  RopeForward(x.data(), ld, batch, t, heads, d, 0, theta);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < t; ++j)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < d / 2; ++i) {
          const double a = j * std::pow(double(theta), -2.0 * i / d);
          const long r = (long(b) * t + j) * ld + h * d;
          EXPECT_NEAR(x[r + i], x0[r + i] * std::cos(a) - x0[r + i + d / 2] * std::sin(a), 1e-5);
          EXPECT_NEAR(x[r + i + d / 2], x0[r + i + d / 2] * std::cos(a) + x0[r + i] * std::sin(a),
                      1e-5);
        }
  for (int b = 0; b < batch; ++b)  // columns past the heads are untouched
    for (int j = 0; j < t; ++j)
      for (int c = heads * d; c < ld; ++c)
        EXPECT_EQ(x[(long(b) * t + j) * ld + c], x0[(long(b) * t + j) * ld + c]);
  // A chunk of positions [2, 6) rotated with start_pos 2 equals those rows of the whole.
  const int begin = 2, len = t - begin;
  std::vector<float> chunk(batch * len * ld);
  for (int b = 0; b < batch; ++b)
    std::copy_n(x0.begin() + (long(b) * t + begin) * ld, len * ld,
                chunk.begin() + long(b) * len * ld);
  RopeForward(chunk.data(), ld, batch, len, heads, d, begin, theta);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < len * ld; ++j)
      EXPECT_FLOAT_EQ(chunk[long(b) * len * ld + j], x[(long(b) * t + begin) * ld + j]);
  // The backward is the adjoint: finite differences of Σ dy·rope(x).
  const std::vector<float> dy = RandomVector(batch * len * ld, 47);
  std::vector<float> xin(chunk.size());
  for (int b = 0; b < batch; ++b)
    std::copy_n(x0.begin() + (long(b) * t + begin) * ld, len * ld,
                xin.begin() + long(b) * len * ld);
  std::vector<float> y(xin.size());
  auto loss = [&] {
    y = xin;
    RopeForward(y.data(), ld, batch, len, heads, d, begin, theta);
    return WeightedSum(y.data(), dy);
  };
  std::vector<float> dx = dy;
  RopeBackward(dx.data(), ld, batch, len, heads, d, begin, theta);
  ExpectGradientMatches("dx", xin.data(), xin.size(), dx, loss);
}

TEST(Swiglu, ForwardAndBackwardMatchFiniteDifferences) {
  const long n = 3;
  const int f = 5;
  std::vector<float> gu = RandomVector(n * 2 * f, 48, 2.0f);
  const std::vector<float> dy = RandomVector(n * f, 49);
  std::vector<float> y(n * f);
  SwigluForward(y.data(), gu.data(), n, f);
  for (long r = 0; r < n; ++r)
    for (int j = 0; j < f; ++j) {
      const double g = gu[r * 2 * f + j], u = gu[r * 2 * f + f + j];
      EXPECT_NEAR(y[r * f + j], g / (1 + std::exp(-g)) * u, 1e-6);
    }
  auto loss = [&] {
    SwigluForward(y.data(), gu.data(), n, f);
    return WeightedSum(y.data(), dy);
  };
  std::vector<float> dgu(gu.size());
  SwigluBackward(dgu.data(), gu.data(), dy.data(), n, f);
  ExpectGradientMatches("dgu", gu.data(), gu.size(), dgu, loss);
}

}  // namespace
}  // namespace vp::engine::cpu
