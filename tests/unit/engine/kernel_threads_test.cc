// Every threaded CPU kernel against its one-thread result, bit for bit: the kernels split work so
// that each output element is computed by one thread in the one-thread order (kernels.h), so
// any difference is a race or a split that reorders a sum. Shapes are odd and include fewer
// rows (or attention blocks) than threads; they are large enough to pass the size threshold
// below which a kernel stays on its calling thread, so the threaded path is the one tested.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "tests/unit/engine/grad_check.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {
namespace {

using ::vp::engine::testing::RandomVector;

constexpr int kThreads[] = {2, 3, 4, 7};

// Odd row counts: 37 rows (more than the threads), and 3 rows (fewer than 4 and 7 threads).
struct RowShape {
  int n, c;
};
constexpr RowShape kShapes[] = {{37, 1001}, {3, 12001}};
static_assert(37L * 1001 >= kParallelMinWork && 3L * 12001 >= kParallelMinWork,
              "the shapes must take the threaded path");

// Runs `kernel` (which writes into `outputs`, starting from the given contents each time) on one
// thread and on each of kThreads, and expects identical bits, or with ulps > 0 a difference of at
// most that many float ulps of the output's largest magnitude.
void ExpectSameOnAnyThreadCount(const char* what, std::vector<std::vector<float>> initial,
                                const std::function<void(std::vector<std::vector<float>>&)>& kernel,
                                int ulps = 0) {
  SetBlasThreads(1);
  std::vector<std::vector<float>> one = initial;
  kernel(one);
  for (const int threads : kThreads) {
    SetBlasThreads(threads);
    ASSERT_EQ(BlasThreads(), threads);
    std::vector<std::vector<float>> many = initial;
    kernel(many);
    for (size_t o = 0; o < one.size(); ++o) {
      ASSERT_EQ(one[o].size(), many[o].size());
      size_t differ = 0;
      float largest = 0, worst = 0;
      for (size_t i = 0; i < one[o].size(); ++i) {
        differ += one[o][i] != many[o][i];
        largest = std::max(largest, std::abs(one[o][i]));
        worst = std::max(worst, std::abs(one[o][i] - many[o][i]));
      }
      if (ulps == 0) {
        EXPECT_EQ(differ, 0u) << what << ": output " << o << " on " << threads << " threads";
      } else {
        EXPECT_LE(worst, ulps * std::numeric_limits<float>::epsilon() * largest)
            << what << ": output " << o << " on " << threads << " threads";
      }
    }
  }
  SetBlasThreads(1);
}

TEST(KernelThreads, LoadedBlasIsTheOpenMpBuild) {
  // Otherwise GEMMs keep OpenBLAS's own pthread pool beside the kernels' OpenMP team.
  EXPECT_TRUE(BlasUsesOpenMp());
  SetBlasThreads(3);
  EXPECT_EQ(BlasThreads(), 3);
  SetBlasThreads(1);
  EXPECT_EQ(BlasThreads(), 1);
}

TEST(KernelThreads, LayerNorm) {
  for (const RowShape s : kShapes) {
    const int n = s.n, c = s.c;
    const auto x = RandomVector(size_t(n) * c, 1, 2.0f, 0.5f), w = RandomVector(c, 2),
               b = RandomVector(c, 3), dy = RandomVector(size_t(n) * c, 4);
    // Outputs: y, mean, rstd, dx (accumulates), dw, db (accumulate).
    ExpectSameOnAnyThreadCount(
        "LayerNorm",
        {std::vector<float>(size_t(n) * c), std::vector<float>(n), std::vector<float>(n),
         RandomVector(size_t(n) * c, 5), RandomVector(c, 6), RandomVector(c, 7)},
        [&](std::vector<std::vector<float>>& o) {
          LayerNormForward(o[0].data(), o[1].data(), o[2].data(), x.data(), w.data(), b.data(), n,
                           c);
          LayerNormBackwardInput(o[3].data(), dy.data(), x.data(), w.data(), o[1].data(),
                                 o[2].data(), n, c);
          LayerNormBackwardWeight(o[4].data(), o[5].data(), dy.data(), x.data(), o[1].data(),
                                  o[2].data(), n, c);
        });
  }
}

TEST(KernelThreads, RmsNorm) {
  for (const RowShape s : kShapes) {
    const int n = s.n, c = s.c;
    const auto x = RandomVector(size_t(n) * c, 11), w = RandomVector(c, 12),
               dy = RandomVector(size_t(n) * c, 13);
    ExpectSameOnAnyThreadCount(
        "RmsNorm",
        {std::vector<float>(size_t(n) * c), std::vector<float>(n), RandomVector(size_t(n) * c, 14),
         RandomVector(c, 15)},
        [&](std::vector<std::vector<float>>& o) {
          RmsNormForward(o[0].data(), o[1].data(), x.data(), w.data(), n, c, 1e-5f);
          RmsNormBackwardInput(o[2].data(), dy.data(), x.data(), w.data(), o[1].data(), n, c);
          RmsNormBackwardWeight(o[3].data(), dy.data(), x.data(), o[1].data(), n, c);
        });
  }
}

TEST(KernelThreads, GeluResidualSwiglu) {
  for (const RowShape s : kShapes) {
    const long n = s.n;
    const int f = s.c;
    const long nf = n * f;
    const auto x = RandomVector(nf, 21, 3.0f), d = RandomVector(nf, 22),
               gu = RandomVector(2 * nf, 23, 3.0f);
    ExpectSameOnAnyThreadCount("Gelu/Residual/Swiglu",
                               {std::vector<float>(nf), std::vector<float>(nf),
                                std::vector<float>(nf), RandomVector(nf, 24), RandomVector(nf, 25),
                                std::vector<float>(nf), std::vector<float>(2 * nf)},
                               [&](std::vector<std::vector<float>>& o) {
                                 GeluForward(o[0].data(), x.data(), nf);
                                 GeluBackward(o[1].data(), x.data(), d.data(), nf);
                                 ResidualForward(o[2].data(), x.data(), d.data(), nf);
                                 ResidualBackward(o[3].data(), o[4].data(), d.data(), nf);
                                 SwigluForward(o[5].data(), gu.data(), n, f);
                                 SwigluBackward(o[6].data(), gu.data(), d.data(), n, f);
                               });
  }
}

TEST(KernelThreads, PositionEmbedding) {
  // (batch, t) = (3, 5) and (1, 3): 15 and 3 rows, positions starting mid-sequence.
  for (const auto& [batch, t, c] : {std::tuple{3, 5, 2401}, std::tuple{1, 3, 12001}}) {
    const int start = 2;
    const auto wpe = RandomVector(size_t(start + t) * c, 31),
               dx = RandomVector(size_t(batch) * t * c, 32);
    ExpectSameOnAnyThreadCount(
        "PositionEmbedding",
        {RandomVector(size_t(batch) * t * c, 33), RandomVector(size_t(start + t) * c, 34)},
        [&](std::vector<std::vector<float>>& o) {
          PositionEmbeddingForward(o[0].data(), wpe.data(), batch, t, c, start);
          PositionEmbeddingBackward(o[1].data(), dx.data(), batch, t, c, start);
        });
  }
}

TEST(KernelThreads, Rope) {
  // ld wider than heads·d (q inside a q|k|v row); 3·7 and 1·3 rows.
  for (const auto& [batch, t, heads] : {std::tuple{3, 7, 9}, std::tuple{1, 3, 41}}) {
    const int d = 64, ld = heads * d + 5;
    ExpectSameOnAnyThreadCount("Rope", {RandomVector(size_t(batch) * t * ld, 41)},
                               [&](std::vector<std::vector<float>>& o) {
                                 RopeForward(o[0].data(), ld, batch, t, heads, d, 1000, 1e4f);
                                 RopeBackward(o[0].data(), ld, batch, t, heads, d, 3, 5e5f);
                               });
  }
}

// The linear layers are one OpenBLAS GEMM each, and OpenBLAS's threaded GEMM is not bit-identical
// to its one-thread GEMM: it cuts the output into per-thread blocks, and elements at a block's
// edge go through its edge micro-kernels, which add the same k products in another order. Each
// element is still one dot product, so the difference is a few ulps (measured: at most 3 ulps of
// the largest output); 8 ulps leaves room for other block cuts. (The bias loops are exact,
// and held to the same bound here.)
TEST(KernelThreads, Linear) {
  for (const RowShape s : kShapes) {
    const int n = s.n, in = 67, out = s.c / 7;
    const auto x = RandomVector(size_t(n) * in, 51), w = RandomVector(size_t(in) * out, 52),
               bias = RandomVector(out, 53), dy = RandomVector(size_t(n) * out, 54);
    ExpectSameOnAnyThreadCount(
        "Linear",
        {std::vector<float>(size_t(n) * out), std::vector<float>(size_t(n) * in),
         RandomVector(size_t(in) * out, 55), RandomVector(out, 56),
         std::vector<float>(size_t(n) * in), std::vector<float>(size_t(n) * out),
         RandomVector(size_t(in) * out, 57)},
        [&](std::vector<std::vector<float>>& o) {
          LinearForward(o[0].data(), x.data(), w.data(), bias.data(), n, in, out);
          LinearBackwardInput(o[1].data(), dy.data(), w.data(), n, in, out);
          LinearBackwardWeight(o[2].data(), o[3].data(), dy.data(), x.data(), n, in, out);
          // The nn.Linear layout: the same weight read as (out_dim=in, in_dim=out).
          LinearTForward(o[4].data(), dy.data(), w.data(), n, out, in);
          LinearTBackwardInput(o[5].data(), x.data(), w.data(), n, out, in);
          LinearTBackwardWeight(o[6].data(), x.data(), dy.data(), n, out, in);
        },
        /*ulps=*/8);
  }
}

TEST(KernelThreads, Attention) {
  // Middle chunks inside a wider q row: 15 (batch, head) blocks of 1 query tile each; grouped-
  // query attention with 2 key/value blocks for the backward (fewer than 3, 4 and 7 threads) and
  // 6 x 4 query tiles for the forward; and a single block. With several units each runs on one
  // thread, tile GEMMs included: exact. A single block's backward (and its forward, too few
  // scores for a team) runs on the calling thread and its GEMMs take OpenBLAS's split, so it is
  // held to ulps (see Linear).
  const AttentionShape shapes[] = {
      {3, 5, 16, 40, 101, 110, 0}, {1, 6, 8, 30, 230, 230, 2}, {1, 1, 8, 0, 200, 200, 0}};
  for (const AttentionShape& sh : shapes) {
    SCOPED_TRACE(::testing::Message() << "batch " << sh.batch << ", heads " << sh.heads
                                      << ", kv_heads " << sh.num_kv_heads());
    // Enough scores for the threaded path (fewer stay on the calling thread).
    ASSERT_GE(long(sh.batch) * sh.num_kv_heads() * sh.q_len() * sh.q_end, kParallelMinWork);
    const int ldq = sh.width() + 2 * sh.kv_width(), tq = sh.q_len();
    const size_t nq = size_t(sh.batch) * tq, nkv = size_t(sh.batch) * sh.kv_rows;
    const auto q = RandomVector(nq * ldq, 61), k = RandomVector(nkv * sh.kv_width(), 62),
               v = RandomVector(nkv * sh.kv_width(), 63), dy = RandomVector(nq * sh.width(), 64);
    ExpectSameOnAnyThreadCount(
        "Attention",
        {std::vector<float>(nq * sh.width()), std::vector<float>(size_t(sh.batch) * sh.heads * tq),
         std::vector<float>(nq * ldq), RandomVector(nkv * sh.kv_width(), 65),
         RandomVector(nkv * sh.kv_width(), 66)},
        [&](std::vector<std::vector<float>>& o) {
          AttentionForward(o[0].data(), o[1].data(), q.data(), ldq, k.data(), v.data(), sh);
          // The workspace is sized for the calling thread's count: one block per thread.
          std::vector<float> scratch(AttentionBackwardScratch(sh));
          AttentionBackward(o[2].data(), ldq, o[3].data(), o[4].data(), scratch.data(), dy.data(),
                            o[0].data(), o[1].data(), q.data(), ldq, k.data(), v.data(), sh);
        },
        /*ulps=*/sh.batch * sh.heads == 1 ? 8 : 0);
  }
}

}  // namespace
}  // namespace vp::engine::cpu
