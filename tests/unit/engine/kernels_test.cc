#include "worker/engine/kernels/cpu/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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
  const int ldq = GetParam().ldq, w = sh.width(), tq = sh.q_len();
  const std::vector<float> q = RandomVector(sh.batch * tq * ldq, 20);
  const std::vector<float> k = RandomVector(sh.batch * sh.kv_rows * w, 21);
  const std::vector<float> v = RandomVector(sh.batch * sh.kv_rows * w, 22);
  std::vector<float> out(sh.batch * tq * w), att(sh.batch * sh.heads * tq * sh.q_end);
  AttentionForward(out.data(), att.data(), q.data(), ldq, k.data(), v.data(), sh);
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
                 k[(b * sh.kv_rows + j) * w + h * sh.head_dim + d];
          p[j] = s * scale;
          maxv = std::max(maxv, p[j]);
        }
        for (double& e : p) sum += (e = std::exp(e - maxv));
        for (int d = 0; d < sh.head_dim; ++d) {
          double o = 0;
          for (int j = 0; j <= pos; ++j)
            o += p[j] / sum * v[(b * sh.kv_rows + j) * w + h * sh.head_dim + d];
          EXPECT_NEAR(out[(b * tq + i) * w + h * sh.head_dim + d], o, 1e-5);
        }
        // Nothing above the diagonal.
        for (int j = pos + 1; j < sh.q_end; ++j)
          EXPECT_EQ(att[((b * sh.heads + h) * tq + i) * sh.q_end + j], 0.0f);
      }
}

TEST_P(AttentionTest, BackwardMatchesFiniteDifferences) {
  const AttentionShape sh = GetParam().shape;
  const int ldq = GetParam().ldq, w = sh.width(), tq = sh.q_len();
  std::vector<float> q = RandomVector(sh.batch * tq * ldq, 30);
  std::vector<float> k = RandomVector(sh.batch * sh.kv_rows * w, 31);
  std::vector<float> v = RandomVector(sh.batch * sh.kv_rows * w, 32);
  const std::vector<float> dy = RandomVector(sh.batch * tq * w, 33);
  std::vector<float> out(sh.batch * tq * w), att(sh.batch * sh.heads * tq * sh.q_end);
  auto loss = [&] {
    AttentionForward(out.data(), att.data(), q.data(), ldq, k.data(), v.data(), sh);
    return WeightedSum(out.data(), dy);
  };
  loss();
  std::vector<float> dq(q.size(), 0.0f), scratch(tq * sh.q_end);
  // dk/dv accumulate: start from 2 and take it off again.
  std::vector<float> dk(k.size(), 2.0f), dv(v.size(), 2.0f);
  AttentionBackward(dq.data(), dk.data(), dv.data(), scratch.data(), dy.data(), att.data(),
                    q.data(), ldq, k.data(), v.data(), sh);
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
    ::testing::Values(AttentionCase{{2, 2, 3, 0, 5, 5}, 6},    // whole sequence, packed q
                      AttentionCase{{2, 2, 3, 2, 5, 7}, 18},   // middle chunk inside a qkv row
                      AttentionCase{{1, 3, 2, 4, 5, 5}, 6}));  // one-token last chunk

}  // namespace
}  // namespace vp::engine::cpu
