// The device column- and row-parallel linears (worker/engine/tensor_parallel/cuda) at t = 2 with
// sequence parallelism — two ranks as threads on one GPU, their tensor group a Gloo group staged
// through host memory — against the unpartitioned product computed on the host in double: every
// rank's forward output, input gradient and weight/bias gradients are its part of the t = 1
// layer's. Both weight layouts (Conv1D [in, out] with bias, nn.Linear [out, in]), fp32 and bf16.
// Without a GPU the cases skip with "no CUDA device".
#include "worker/engine/tensor_parallel/cuda/parallel_linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/support/cuda_test_device.h"
#include "tests/support/gloo_threads.h"
#include "worker/comm/nccl/staged_communicator.h"
#include "worker/engine/activation_pool.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"

namespace vp::engine::cuda::tp {
namespace {

constexpr int kT = 2;     // tensor ranks
constexpr int kN = 16;    // token rows of the chunk (m = 8 per rank)
constexpr int kIn = 16;   // whole input width
constexpr int kOut = 32;  // whole output width

using Matrix = std::vector<double>;  // row-major

std::vector<float> Random(size_t n, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// C (r, c) = A (r, k) · B (k, c) in double.
Matrix MatMul(const std::vector<float>& a, const std::vector<float>& b, int r, int k, int c) {
  Matrix out(static_cast<size_t>(r) * c, 0.0);
  for (int i = 0; i < r; ++i) {
    for (int j = 0; j < k; ++j) {
      for (int q = 0; q < c; ++q) out[i * c + q] += double(a[i * k + j]) * b[j * c + q];
    }
  }
  return out;
}

std::vector<float> Transpose(const std::vector<float>& a, int r, int c) {
  std::vector<float> t(a.size());
  for (int i = 0; i < r; ++i) {
    for (int j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  }
  return t;
}

// Columns [c0, c0 + w) of a (r, c) matrix; rows [r0, r0 + h) of one.
template <typename V>
V Cols(const V& a, int r, int c, int c0, int w) {
  V out(static_cast<size_t>(r) * w);
  for (int i = 0; i < r; ++i) {
    for (int j = 0; j < w; ++j) out[i * w + j] = a[i * c + c0 + j];
  }
  return out;
}
template <typename V>
V Rows(const V& a, int c, int r0, int h) {
  return V(a.begin() + static_cast<long>(r0) * c, a.begin() + static_cast<long>(r0 + h) * c);
}

// What one rank computed, as host floats.
struct RankOut {
  std::vector<float> y, dx, dw, db;
  std::string error;
};

// fp32: 1e-4 relative plus 1e-5 of the largest reference value; bf16: 3e-2 of both.
template <typename T>
void ExpectNear(const std::vector<float>& got, const Matrix& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double rel = std::is_same_v<T, float> ? 1e-4 : 3e-2;
  const double floor = std::is_same_v<T, float> ? 1e-5 : 3e-2;
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rel * std::abs(want[i]) + floor * scale)
        << what << " [" << i << "]";
  }
}

Matrix ToMatrix(const std::vector<float>& v) { return Matrix(v.begin(), v.end()); }

// One rank of the same layer on the CPU pieces (fp32, host memory), for the harness check.
template <typename Stored, typename Logical>
void RunCpuRank(comm::GlooCommunicator& gloo, WeightLayout layout, bool bias, const Stored& stored,
                const Logical& logical_grad, const std::vector<float>& x,
                const std::vector<float>& w, const std::vector<float>& b,
                const std::vector<float>& dy, RankOut* col, RankOut* row) {
  const int r = gloo.rank(), m = kN / kT;
  MemoryTracker tracker;
  ActivationPool pool(&tracker);
  engine::tp::SequenceParallel sp(TensorGroup(&gloo), &pool);
  {
    const int out_r = kOut / kT;
    std::vector<float> wr = stored(Cols(w, kIn, kOut, r * out_r, out_r), kIn, out_r);
    std::vector<float> br = Cols(b, 1, kOut, r * out_r, out_r);
    std::vector<float> dw(kIn * out_r, 0.0f), db(out_r, 0.0f);
    std::vector<float> xl = Rows(x, kIn, r * m, m), dyr = Cols(dy, kN, kOut, r * out_r, out_r);
    col->y.assign(kN * out_r, 0.0f);
    col->dx.assign(m * kIn, 9.0f);
    engine::tp::ColumnParallelLinear lin(
        &sp, {layout, kIn, out_r, wr.data(), bias ? br.data() : nullptr, dw.data(),
              bias ? db.data() : nullptr});
    absl::Status st = lin.Forward(col->y.data(), xl.data(), kN);
    if (st.ok()) st = lin.BackwardInput(col->dx.data(), dyr.data(), kN);
    if (st.ok()) st = lin.BackwardWeight(dyr.data(), xl.data(), kN);
    if (!st.ok()) col->error = st.ToString();
    col->dw = logical_grad(dw, kIn, out_r);
    col->db = db;
  }
  {
    const int in_r = kIn / kT;
    std::vector<float> wr = stored(Rows(w, kOut, r * in_r, in_r), in_r, kOut);
    std::vector<float> dw(in_r * kOut, 0.0f), db(kOut, 0.0f);
    std::vector<float> xr = Cols(x, kN, kIn, r * in_r, in_r), dyl = Rows(dy, kOut, r * m, m);
    row->y.assign(m * kOut, 0.0f);
    row->dx.assign(kN * in_r, 9.0f);
    engine::tp::RowParallelLinear lin(
        &sp, {layout, in_r, kOut, wr.data(), bias ? b.data() : nullptr, dw.data(),
              bias ? db.data() : nullptr});
    absl::Status st = lin.Forward(row->y.data(), xr.data(), kN);
    if (st.ok()) st = lin.BackwardInput(row->dx.data(), dyl.data(), kN);
    if (st.ok()) st = lin.BackwardWeight(dyl.data(), xr.data(), kN);
    if (!st.ok()) row->error = st.ToString();
    row->dw = logical_grad(dw, in_r, kOut);
    row->db = db;
  }
}

// cpu: the same layer through the CPU pieces (engine::tp, fp32), which their own tests prove
// equal to t = 1 — a device-free check of this test's slicing and references.
template <typename T>
void RunParallelLinears(WeightLayout layout, bool cpu = false) {
  if (!cpu && DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const bool bias = layout == WeightLayout::kInOut;
  const int m = kN / kT;
  // The whole layer in its logical orientation: W (in, out), X (n, in), dY (n, out).
  const std::vector<float> x = Random(kN * kIn, 1, 1.0f), w = Random(kIn * kOut, 2, 0.3f),
                           b = Random(kOut, 3, 0.1f), dy = Random(kN * kOut, 4, 1.0f);
  const Matrix y_full = [&] {
    Matrix y = MatMul(x, w, kN, kIn, kOut);
    if (bias) {
      for (int i = 0; i < kN; ++i) {
        for (int j = 0; j < kOut; ++j) y[i * kOut + j] += b[j];
      }
    }
    return y;
  }();
  const Matrix dx_full = MatMul(dy, Transpose(w, kIn, kOut), kN, kOut, kIn);  // (n, in)
  const Matrix dw_full = MatMul(Transpose(x, kN, kIn), dy, kIn, kN, kOut);    // (in, out)
  // A weight slice stored in the layout: [in, out] as is, [out, in] transposed.
  auto stored = [&](const std::vector<float>& logical, int in, int out) {
    return layout == WeightLayout::kInOut ? logical : Transpose(logical, in, out);
  };
  auto logical_grad = [&](const std::vector<float>& g, int in, int out) {
    return layout == WeightLayout::kInOut ? g : Transpose(g, out, in);
  };

  std::vector<RankOut> col(kT), row(kT);
  comm::testing::RunOnGlooRanks(kT, [&](comm::GlooCommunicator& gloo) {
    const int r = gloo.rank();
    if (cpu) {
      RunCpuRank(gloo, layout, bias, stored, logical_grad, x, w, b, dy, &col[r], &row[r]);
      return;
    }
    comm::StagedCommunicator staged(&gloo);
    test_support::TestDevice dev;
    if (!dev.error.empty()) {
      col[r].error = dev.error;
      return;
    }
    DeviceSequenceParallel<T> sp(TensorGroup(&staged), dev.ctx);
    // Column-parallel: this rank's output columns [r·out_r, (r+1)·out_r).
    {
      const int out_r = kOut / kT;
      auto wr = dev.Up<T>(stored(Cols(w, kIn, kOut, r * out_r, out_r), kIn, out_r));
      auto br = dev.Up<T>(Cols(b, 1, kOut, r * out_r, out_r));
      auto dw = dev.Up<float>(std::vector<float>(kIn * out_r, 0.0f));
      auto db = dev.Up<float>(std::vector<float>(out_r, 0.0f));
      auto xl = dev.Up<T>(Rows(x, kIn, r * m, m));
      auto dyr = dev.Up<T>(Cols(dy, kN, kOut, r * out_r, out_r));
      auto y = dev.Up<T>(std::vector<float>(kN * out_r, 0.0f));
      auto dxl = dev.Up<T>(std::vector<float>(m * kIn, 9.0f));
      DeviceColumnParallelLinear<T> lin(
          &sp, {layout, kIn, out_r, wr.data(), bias ? br.data() : nullptr, dw.data(),
                bias ? db.data() : nullptr});
      absl::Status st = lin.Forward(y.data(), xl.data(), kN);
      if (st.ok()) st = lin.BackwardInput(dxl.data(), dyr.data(), kN);
      if (st.ok()) st = lin.BackwardWeight(dyr.data(), xl.data(), kN);
      if (!st.ok()) {
        col[r].error = st.ToString();
        return;
      }
      col[r].y = dev.Down(y.data(), y.size());
      col[r].dx = dev.Down(dxl.data(), dxl.size());
      col[r].dw = logical_grad(dev.Down(dw.data(), dw.size()), kIn, out_r);
      col[r].db = dev.Down(db.data(), db.size());
    }
    // Row-parallel: this rank's input columns [r·in_r, (r+1)·in_r), i.e. W's rows.
    {
      const int in_r = kIn / kT;
      auto wr = dev.Up<T>(stored(Rows(w, kOut, r * in_r, in_r), in_r, kOut));
      auto bw = dev.Up<T>(b);
      auto dw = dev.Up<float>(std::vector<float>(in_r * kOut, 0.0f));
      auto db = dev.Up<float>(std::vector<float>(kOut, 0.0f));
      auto xr = dev.Up<T>(Cols(x, kN, kIn, r * in_r, in_r));
      auto dyl = dev.Up<T>(Rows(dy, kOut, r * m, m));
      auto yl = dev.Up<T>(std::vector<float>(m * kOut, 0.0f));
      auto dx = dev.Up<T>(std::vector<float>(kN * in_r, 9.0f));
      DeviceRowParallelLinear<T> lin(
          &sp, {layout, in_r, kOut, wr.data(), bias ? bw.data() : nullptr, dw.data(),
                bias ? db.data() : nullptr});
      absl::Status st = lin.Forward(yl.data(), xr.data(), kN);
      if (st.ok()) st = lin.BackwardInput(dx.data(), dyl.data(), kN);
      if (st.ok()) st = lin.BackwardWeight(dyl.data(), xr.data(), kN);
      if (!st.ok()) {
        row[r].error = st.ToString();
        return;
      }
      row[r].y = dev.Down(yl.data(), yl.size());
      row[r].dx = dev.Down(dx.data(), dx.size());
      row[r].dw = logical_grad(dev.Down(dw.data(), dw.size()), in_r, kOut);
      row[r].db = dev.Down(db.data(), db.size());
    }
  });
  const int out_r = kOut / kT, in_r = kIn / kT;
  Matrix db_row_sum(kOut, 0.0);
  for (int r = 0; r < kT; ++r) {
    ASSERT_EQ(col[r].error, "") << "rank " << r;
    ASSERT_EQ(row[r].error, "") << "rank " << r;
    const std::string at = absl::StrCat(" (rank ", r, ")");
    ExpectNear<T>(col[r].y, Cols(y_full, kN, kOut, r * out_r, out_r), "column Y" + at);
    ExpectNear<T>(col[r].dx, Rows(dx_full, kIn, r * m, m), "column dX" + at);
    ExpectNear<T>(col[r].dw, Cols(dw_full, kIn, kOut, r * out_r, out_r), "column dW" + at);
    ExpectNear<T>(row[r].y, Rows(y_full, kOut, r * m, m), "row Y" + at);
    ExpectNear<T>(row[r].dx, Cols(dx_full, kN, kIn, r * in_r, in_r), "row dX" + at);
    ExpectNear<T>(row[r].dw, Rows(dw_full, kOut, r * in_r, in_r), "row dW" + at);
    if (bias) {
      Matrix db(out_r, 0.0);
      for (int i = 0; i < kN; ++i) {
        for (int j = 0; j < out_r; ++j) db[j] += dy[i * kOut + r * out_r + j];
      }
      ExpectNear<T>(col[r].db, db, "column db" + at);
      for (int j = 0; j < kOut; ++j) db_row_sum[j] += row[r].db[j];
    }
  }
  if (bias) {  // the replicated bias: the ranks' partial sums add up to the whole column sum
    Matrix db(kOut, 0.0);
    for (int i = 0; i < kN; ++i) {
      for (int j = 0; j < kOut; ++j) db[j] += dy[i * kOut + j];
    }
    std::vector<float> sum(db_row_sum.begin(), db_row_sum.end());
    ExpectNear<T>(sum, db, "row db summed over the group");
  }
}

TEST(DeviceParallelLinear, Fp32Conv1DLayoutWithBias) {
  RunParallelLinears<float>(WeightLayout::kInOut);
}
TEST(DeviceParallelLinear, Fp32LinearLayout) { RunParallelLinears<float>(WeightLayout::kOutIn); }
TEST(DeviceParallelLinear, Bf16Conv1DLayoutWithBias) {
  RunParallelLinears<bf16>(WeightLayout::kInOut);
}
TEST(DeviceParallelLinear, Bf16LinearLayout) { RunParallelLinears<bf16>(WeightLayout::kOutIn); }

// Device-free: this test's slicing and host references hold for the CPU pieces.
TEST(DeviceParallelLinear, HarnessHoldsForTheCpuPieces) {
  RunParallelLinears<float>(WeightLayout::kInOut, /*cpu=*/true);
  RunParallelLinears<float>(WeightLayout::kOutIn, /*cpu=*/true);
}

// Device-free: rows that do not split over the group are refused before any device work (the
// rule the CPU pieces state, with the same words).
TEST(DeviceParallelLinear, RowsThatDoNotSplitAreRefused) {
  comm::testing::RunOnGlooRanks(kT, [&](comm::GlooCommunicator& gloo) {
    DeviceSequenceParallel<float> sp(TensorGroup(&gloo), DeviceContext{});
    absl::Status st = sp.ScatterSum(nullptr, 7, 8, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(std::string(st.message()).find("divisible by t"), std::string::npos) << st;
  });
}

}  // namespace
}  // namespace vp::engine::cuda::tp
