// Each CUDA kernel against the CPU engine on random inputs. fp32 path: 1e-5 relative (plus a
// small absolute floor for values near 0); bf16 path: tolerances in docs/cuda.md. Skips with
// "no CUDA device" when none is present.
#include "worker/engine/kernels/cpu/kernels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tests/support/scoped_env.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/cudnn_library.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernel_switches.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/norm_vector.h"
#include "worker/engine/kernels/cuda/phase_timer.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/optimizer.h"

namespace vp::engine::cuda {
namespace {

#define SKIP_WITHOUT_DEVICE() \
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device"

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A device copy of a host vector, freed at scope exit.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, n) * sizeof(T)),
              cudaSuccess);
    cudaMemset(p, 0, std::max<size_t>(1, n) * sizeof(T));
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) {
    cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> Get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel,
                 double abs_floor, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], abs_floor + rel * std::abs(want[i])) << what << " at " << i;
  }
}

// GELU's backward in float64: the reference both float implementations are held to.
std::vector<double> GeluBackwardExact(const std::vector<float>& x, const std::vector<float>& dy) {
  constexpr double kScale = 0.7978845608028654, kCubic = 0.044715;
  std::vector<double> dx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i], u = kScale * (xi + kCubic * xi * xi * xi), t = std::tanh(u);
    const double du = kScale * (1.0 + 3.0 * kCubic * xi * xi);
    dx[i] = dy[i] * (0.5 * (1.0 + t) + 0.5 * xi * (1.0 - t * t) * du);
  }
  return dx;
}

// What a float implementation of 0.5·(1 + t) + 0.5·x·(1 − t²)·u' can be held to: its tanh t is
// good to a few ulps *of 1* (both the CPU's exp-based Tanh and the device's 1 − 2/(e^{2u} + 1)),
// and for x ≪ 0 the two terms are differences of numbers near 1 (1 + t with t → −1), so the
// error is absolute, ~1e-6·|dy|·(0.5 + |x·u'|), not relative: at x ≈ −4.5 the true value is
// ~1e-4·dy and a few ulps of t are 2% of it (the first GPU run measured 1.9% between the two).
double GeluBackwardBound(float x, float dy, double exact) {
  const double du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * double(x) * x);
  return 1e-6 + 1e-5 * std::abs(exact) + 1e-6 * std::abs(dy) * (0.5 + std::abs(x * du));
}

void ExpectGeluBackward(const std::vector<float>& got, const std::vector<float>& x,
                        const std::vector<float>& dy, const char* what) {
  const std::vector<double> exact = GeluBackwardExact(x, dy);
  ASSERT_EQ(got.size(), exact.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], exact[i], GeluBackwardBound(x[i], dy[i], exact[i]))
        << what << " at " << i << ", x " << x[i] << ", dy " << dy[i];
  }
}

// Device-free: the CPU kernel (the reference of the device one in CI's CPU tests) is within the
// bound of the float64 GELU backward; and the bound is tight enough to matter: a relative error
// of 1e-3 everywhere exceeds it.
TEST(GeluBackwardReference, CpuKernelIsWithinTheFloatTanhBound) {
  const long n = 5000;
  auto x = Random(n, 5, 3.0f), dy = Random(n, 6);
  std::vector<float> dx(n);
  cpu::GeluBackward(dx.data(), x.data(), dy.data(), n);
  ExpectGeluBackward(dx, x, dy, "cpu gelu backward");
  const std::vector<double> exact = GeluBackwardExact(x, dy);
  int outside = 0;
  for (long i = 0; i < n; ++i) {
    outside += std::abs(1e-3 * exact[i]) > GeluBackwardBound(x[i], dy[i], exact[i]);
  }
  EXPECT_GT(outside, n / 2);
}

// Both kernel sets (MemoryKernels): n = 5000 and rows of 100 allow 16-byte accesses in fp32, 5002
// and 102 do not (the vector kernels fall back to the element ones there).
TEST(CudaKernels, GeluResidualAndBiasMatchCpu) {
  SKIP_WITHOUT_DEVICE();
  for (MemoryKernels kernels : {MemoryKernels::kElement, MemoryKernels::kVector}) {
    for (const long n : {5000L, 5002L}) {
      SCOPED_TRACE(std::string(kernels == MemoryKernels::kVector ? "vector" : "element") +
                   " kernels, n " + std::to_string(n));
      auto x = Random(n, 5, 3.0f), dy = Random(n, 6), y = Random(n, 7);
      std::vector<float> out(n), dx(n), res(n), da(n, 1.0f), dbv(n, 2.0f);
      cpu::GeluForward(out.data(), x.data(), n);
      cpu::GeluBackward(dx.data(), x.data(), dy.data(), n);
      cpu::ResidualForward(res.data(), x.data(), y.data(), n);
      cpu::ResidualBackward(da.data(), dbv.data(), dy.data(), n);
      Dev<float> gx(x), gdy(dy), gy(y), gout(n), gdx(n), gres(n), gda(std::vector<float>(n, 1.0f)),
          gdb(std::vector<float>(n, 2.0f));
      ASSERT_EQ(GeluForward(gout.p, gx.p, n, nullptr, kernels), cudaSuccess);
      ASSERT_EQ(GeluBackward(gdx.p, gx.p, gdy.p, n, nullptr, kernels), cudaSuccess);
      ASSERT_EQ(ResidualForward(gres.p, gx.p, gy.p, n, nullptr, kernels), cudaSuccess);
      ASSERT_EQ(ResidualBackward(gda.p, gdb.p, gdy.p, n, nullptr, kernels), cudaSuccess);
      ExpectClose(gout.Get(), out, 1e-5, 1e-6, "gelu");
      ExpectGeluBackward(gdx.Get(), x, dy, "gelu backward");
      ExpectClose(gres.Get(), res, 0, 0, "residual");
      ExpectClose(gda.Get(), da, 0, 0, "da");
      ExpectClose(gdb.Get(), dbv, 0, 0, "db");
    }
    for (const int c : {100, 102}) {
      const int rows = 50;
      auto o = Random(size_t(rows) * c, 8), b = Random(c, 9);
      std::vector<float> want = o;
      for (int r = 0; r < rows; ++r) {
        for (int j = 0; j < c; ++j) want[size_t(r) * c + j] += b[j];
      }
      Dev<float> go(o), gb(b);
      ASSERT_EQ(AddBias(go.p, gb.p, rows, c, nullptr, kernels), cudaSuccess);
      ExpectClose(go.Get(), want, 0, 0, c == 100 ? "bias, rows of 100" : "bias, rows of 102");
    }
  }
}

TEST(CudaKernels, LinearMatchesCpuFp32AndBf16) {
  SKIP_WITHOUT_DEVICE();
  const int n = 24, in = 64, out_dim = 48;
  auto x = Random(n * in, 8), w = Random(in * out_dim, 9, 0.1f), b = Random(out_dim, 10),
       dy = Random(n * out_dim, 11);
  std::vector<float> y(n * out_dim), dx(n * in), dw(in * out_dim, 0.3f), db(out_dim, 0.0f);
  cpu::LinearForward(y.data(), x.data(), w.data(), b.data(), n, in, out_dim);
  cpu::LinearBackwardInput(dx.data(), dy.data(), w.data(), n, in, out_dim);
  cpu::LinearBackwardWeight(dw.data(), db.data(), dy.data(), x.data(), n, in, out_dim);
  auto gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  Dev<float> gx(x), gw(w), gb(b), gdy(dy), gy(n * out_dim), gdx(n * in),
      gdw(std::vector<float>(in * out_dim, 0.3f)), gdb(out_dim);
  ASSERT_TRUE(LinearForward(**gemm, gy.p, gx.p, gw.p, gb.p, n, in, out_dim, nullptr).ok());
  ASSERT_TRUE(LinearBackwardInput(**gemm, gdx.p, gdy.p, gw.p, n, in, out_dim, nullptr).ok());
  ASSERT_TRUE(
      LinearBackwardWeight(**gemm, gdw.p, gdb.p, gdy.p, gx.p, n, in, out_dim, nullptr).ok());
  ExpectClose(gy.Get(), y, 1e-5, 1e-5, "linear");
  ExpectClose(gdx.Get(), dx, 1e-5, 1e-5, "dinp");
  ExpectClose(gdw.Get(), dw, 1e-5, 1e-5, "dweight");
  ExpectClose(gdb.Get(), db, 1e-5, 1e-5, "dbias");
  EXPECT_EQ((*gemm)->cached_plans(), 3u);
  // bf16 inputs, fp32 accumulation: error ~ 2^-8 relative per input, √in growth.
  Dev<bf16> hx(n * in), hw(in * out_dim), hb(out_dim), hy(n * out_dim);
  ASSERT_EQ(FloatToBf16(hx.p, gx.p, n * in, nullptr), cudaSuccess);
  ASSERT_EQ(FloatToBf16(hw.p, gw.p, in * out_dim, nullptr), cudaSuccess);
  ASSERT_EQ(FloatToBf16(hb.p, gb.p, out_dim, nullptr), cudaSuccess);
  ASSERT_TRUE(LinearForward(**gemm, hy.p, hx.p, hw.p, hb.p, n, in, out_dim, nullptr).ok());
  Dev<float> fy(n * out_dim);
  ASSERT_EQ(Bf16ToFloat(fy.p, hy.p, n * out_dim, nullptr), cudaSuccess);
  ExpectClose(fy.Get(), y, 2e-2, 3e-2, "bf16 linear");
}

// Uploads h as T and replaces h by the values the device holds (bf16-rounded for bf16), so the
// CPU reference sees exactly the kernel's inputs.
template <typename T>
void Upload(Dev<T>& dst, std::vector<float>& h) {
  ASSERT_EQ(dst.n, h.size());
  Dev<float> tmp(h);
  if constexpr (std::is_same_v<T, float>) {
    ASSERT_EQ(cudaMemcpy(dst.p, tmp.p, h.size() * sizeof(float), cudaMemcpyDeviceToDevice),
              cudaSuccess);
  } else {
    ASSERT_EQ(FloatToBf16(dst.p, tmp.p, static_cast<long>(h.size()), nullptr), cudaSuccess);
    ASSERT_EQ(Bf16ToFloat(tmp.p, dst.p, static_cast<long>(h.size()), nullptr), cudaSuccess);
    h = tmp.Get();
  }
}

template <typename T>
std::vector<float> Download(const Dev<T>& src) {
  if constexpr (std::is_same_v<T, float>) {
    return src.Get();
  } else {
    Dev<float> tmp(src.n);
    EXPECT_EQ(Bf16ToFloat(tmp.p, src.p, static_cast<long>(src.n), nullptr), cudaSuccess);
    return tmp.Get();
  }
}

// bf16: the vector kernels (V = 8) against the element ones on the same device inputs: the same
// math per element, so equal to within one bf16 ulp of the result (at most 2^-7 relative): an
// fp32 rounding apart at most (the compiler may fuse a multiply-add differently), rounded to bf16.
TEST(CudaKernels, VectorElementwiseKernelsMatchTheElementOnesInBf16) {
  SKIP_WITHOUT_DEVICE();
  const long rows = 64, c = 1024, f = 512;  // GPT-2's GELU, the residual stream, Llama's SwiGLU
  const long n = rows * c;
  auto x = Random(n, 30, 3.0f), y = Random(n, 31), dy = Random(n, 32), b = Random(c, 33);
  auto gu = Random(size_t(rows) * 2 * f, 34, 3.0f), dyf = Random(size_t(rows) * f, 35);
  Dev<bf16> bx(n), by(n), bdy(n), bb(c), bgu(rows * 2 * f), bdyf(rows * f);
  Upload(bx, x);
  Upload(by, y);
  Upload(bdy, dy);
  Upload(bb, b);
  Upload(bgu, gu);
  Upload(bdyf, dyf);
  std::vector<std::vector<float>> results[2];
  const MemoryKernels sets[2] = {MemoryKernels::kElement, MemoryKernels::kVector};
  for (int k = 0; k < 2; ++k) {
    Dev<bf16> gelu(n), dgelu(n), res(n), da(n), db(n), biased(n), sw(rows * f), dsw(rows * 2 * f);
    ASSERT_EQ(cudaMemcpy(biased.p, by.p, n * sizeof(bf16), cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(da.p, bx.p, n * sizeof(bf16), cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(db.p, by.p, n * sizeof(bf16), cudaMemcpyDeviceToDevice), cudaSuccess);
    ASSERT_EQ(GeluForward(gelu.p, bx.p, n, nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(GeluBackward(dgelu.p, bx.p, bdy.p, n, nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(ResidualForward(res.p, bx.p, by.p, n, nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(ResidualBackward(da.p, db.p, bdy.p, n, nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(AddBias(biased.p, bb.p, int(rows), int(c), nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(SwigluForward(sw.p, bgu.p, rows, int(f), nullptr, sets[k]), cudaSuccess);
    ASSERT_EQ(SwigluBackward(dsw.p, bgu.p, bdyf.p, rows, int(f), nullptr, sets[k]), cudaSuccess);
    for (const Dev<bf16>* d : {&gelu, &dgelu, &res, &da, &db, &biased, &sw, &dsw}) {
      results[k].push_back(Download(*d));
    }
  }
  const char* names[] = {"gelu", "gelu backward", "residual", "da",
                         "db",   "bias",          "swiglu",   "swiglu backward"};
  for (size_t i = 0; i < results[0].size(); ++i) {
    ExpectClose(results[1][i], results[0][i], 1.0 / 128, 1e-6, names[i]);
  }
}

// VOCABPIPE_GEMM_EPILOGUE=bias: the bias added in cuBLASLt's epilogue equals the separate
// kernel's result (fp32: to rounding; bf16: one rounding fewer, so within bf16 rounding), for a
// small shape and GPT-2's c_attn at h 2048 over 512 tokens.
TEST(CudaKernels, LinearBiasEpilogueMatchesSeparateBias) {
  SKIP_WITHOUT_DEVICE();
  const vp::testing::ScopedEnv epilogue("VOCABPIPE_GEMM_EPILOGUE");
  for (const auto& [n, in, out_dim] : {std::tuple{24, 64, 48}, std::tuple{512, 2048, 6144}}) {
    auto x = Random(size_t(n) * in, 12), w = Random(size_t(in) * out_dim, 13, 0.05f),
         b = Random(out_dim, 14);
    auto gemm = GemmRunner::Create();
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    Dev<float> gx(x), gw(w), gb(b), separate(size_t(n) * out_dim), fused(size_t(n) * out_dim);
    epilogue.Unset();
    EXPECT_FALSE(FusedBiasEpilogue());
    ASSERT_TRUE(LinearForward(**gemm, separate.p, gx.p, gw.p, gb.p, n, in, out_dim, nullptr).ok());
    epilogue.Set("bias");
    EXPECT_TRUE(FusedBiasEpilogue());
    ASSERT_TRUE(LinearForward(**gemm, fused.p, gx.p, gw.p, gb.p, n, in, out_dim, nullptr).ok());
    ExpectClose(fused.Get(), separate.Get(), 1e-5, 1e-5, "fp32 fused bias");
    Dev<bf16> hx(size_t(n) * in), hw(size_t(in) * out_dim), hb(out_dim), hsep(size_t(n) * out_dim),
        hfused(size_t(n) * out_dim);
    ASSERT_EQ(FloatToBf16(hx.p, gx.p, long(n) * in, nullptr), cudaSuccess);
    ASSERT_EQ(FloatToBf16(hw.p, gw.p, long(in) * out_dim, nullptr), cudaSuccess);
    ASSERT_EQ(FloatToBf16(hb.p, gb.p, out_dim, nullptr), cudaSuccess);
    epilogue.Unset();
    ASSERT_TRUE(LinearForward(**gemm, hsep.p, hx.p, hw.p, hb.p, n, in, out_dim, nullptr).ok());
    epilogue.Set("bias");
    ASSERT_TRUE(LinearForward(**gemm, hfused.p, hx.p, hw.p, hb.p, n, in, out_dim, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // Two roundings against one. The separate path rounds x·W to bf16 before adding b, so its
    // error scales with |x·W| + |b|, not with the sum, which cancels to near 0 at some entries
    // (the first GPU run saw 1 ulp of |x·W| ≈ 3 at an output of -0.28): within 2 bf16 ulps
    // (2^-7) of |x·W| + |b|, from the fp32 product, plus a floor.
    const std::vector<float> got = Download(hfused), want = Download(hsep), f32 = separate.Get();
    for (size_t i = 0; i < got.size(); ++i) {
      const double bias = b[i % out_dim], magnitude = std::abs(f32[i] - bias) + std::abs(bias);
      ASSERT_NEAR(got[i], want[i], 1e-2 + magnitude / 128) << "bf16 fused bias at " << i;
    }
  }
}

// VOCABPIPE_GEMM_EPILOGUE=gelu: GPT-2's c_fc with its GELU in cuBLASLt's GELU_AUX_BIAS epilogue
// (pre and gelu(pre) from one GEMM) and c_proj's input gradient through the GELU in the DGELU
// epilogue equal the GEMMs followed by the GELU kernels: fp32 to the GELU's evaluation error
// (cuBLASLt may evaluate tanh approximately, ~2^-11 relative, which gelu' amplifies up to ~3x
// for |pre| ~ 3: 4e-3 of |pre| or of |dout·W2ᵀ|; a wrong formula is off by O(1)), bf16 within 2
// ulps of the magnitudes, for a small shape and c_fc / c_proj at h 2048, f 8192 over 512 tokens.
// The fused GEMMs are called directly first: at the GPT-2 shape GELU_AUX_BIAS must be available
// (else the option would silently change nothing); DGELU's availability is printed.
// v on the device as T (rounded for bf16; v itself unchanged).
template <typename T>
std::unique_ptr<Dev<T>> UploadAs(const std::vector<float>& v) {
  auto d = std::make_unique<Dev<T>>(v.size());
  if constexpr (std::is_same_v<T, float>) {
    EXPECT_EQ(cudaMemcpy(d->p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
  } else {
    Dev<float> tmp(v);
    EXPECT_EQ(FloatToBf16(d->p, tmp.p, long(v.size()), nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  return d;
}

template <typename T>
void CheckGeluEpilogue(int n, int h, int f, const std::vector<float>& x,
                       const std::vector<float>& w1, const std::vector<float>& b1,
                       const std::vector<float>& w2, const std::vector<float>& dout, double rel,
                       double abs_floor, const vp::testing::ScopedEnv& epilogue) {
  auto gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  auto gx = UploadAs<T>(x), gw1 = UploadAs<T>(w1), gb1 = UploadAs<T>(b1), gw2 = UploadAs<T>(w2),
       gdo = UploadAs<T>(dout);
  const size_t nf = size_t(n) * f;
  Dev<T> pre_sep(nf), y_sep(nf), pre_fused(nf), y_fused(nf), dx(nf), dpre_sep(nf), dpre_fused(nf);
  // c_fc with its GELU and c_proj's input gradient through it (from the separate path's pre, so
  // both gradients see the same input), through the public functions.
  auto through_public = [&](T* y, T* pre, T* dpre) {
    ASSERT_TRUE(LinearGeluForward<T>(**gemm, y, pre, gx->p, gw1->p, gb1->p, n, h, f, nullptr).ok());
    ASSERT_TRUE(
        LinearBackwardInputGelu<T>(**gemm, dpre, gdo->p, gw2->p, pre_sep.p, n, f, h, nullptr).ok());
  };
  epilogue.Unset();
  ASSERT_FALSE(FusedGeluEpilogue());
  ASSERT_NO_FATAL_FAILURE(through_public(y_sep.p, pre_sep.p, dpre_sep.p));
  ASSERT_TRUE(LinearBackwardInput<T>(**gemm, dx.p, gdo->p, gw2->p, n, f, h, nullptr).ok());
  epilogue.Set("gelu");
  ASSERT_TRUE(FusedGeluEpilogue());
  ASSERT_TRUE(FusedBiasEpilogue());  // gelu implies the bias epilogue
  constexpr DType t = std::is_same_v<T, float> ? DType::kF32 : DType::kBF16;
  const absl::Status forward = (*gemm)->GemmBiasGelu(
      false, false, n, f, h, gx->p, h, gw1->p, f, y_fused.p, f, t, t, gb1->p, pre_fused.p, nullptr);
  const absl::Status backward = (*gemm)->GemmGeluGrad(false, true, n, f, h, gdo->p, h, gw2->p, h,
                                                      dpre_fused.p, f, t, t, pre_sep.p, nullptr);
  std::printf("  GELU epilogues, %s, n %d h %d f %d: GELU_AUX_BIAS %s, DGELU %s\n",
              std::is_same_v<T, float> ? "fp32" : "bf16", n, h, f, forward.ToString().c_str(),
              backward.ToString().c_str());
  if (std::is_same_v<T, bf16> && h == 2048) {
    EXPECT_TRUE(forward.ok()) << forward;
  }
  ASSERT_TRUE(forward.ok() || absl::IsUnimplemented(forward)) << forward;
  ASSERT_TRUE(backward.ok() || absl::IsUnimplemented(backward)) << backward;
  // Through the public functions (the fused GEMMs where available, else the fallback).
  ASSERT_NO_FATAL_FAILURE(through_public(y_fused.p, pre_fused.p, dpre_fused.p));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  epilogue.Unset();
  const auto ps = Download(pre_sep), pf = Download(pre_fused), ys = Download(y_sep),
             yf = Download(y_fused), gx_plain = Download(dx), ds = Download(dpre_sep),
             df = Download(dpre_fused);
  for (size_t i = 0; i < nf; ++i) {
    const double b = b1[i % f], magnitude = std::abs(ps[i] - b) + std::abs(b);
    ASSERT_NEAR(pf[i], ps[i], abs_floor + rel * magnitude) << "pre at " << i;
    ASSERT_NEAR(yf[i], ys[i], abs_floor + rel * magnitude) << "gelu(pre) at " << i;
    ASSERT_NEAR(df[i], ds[i], abs_floor + rel * std::abs(gx_plain[i])) << "dpre at " << i;
  }
}

TEST(CudaKernels, LinearGeluEpilogueMatchesSeparateKernels) {
  SKIP_WITHOUT_DEVICE();
  const vp::testing::ScopedEnv epilogue("VOCABPIPE_GEMM_EPILOGUE");
  for (const auto& [n, h, f] : {std::tuple{24, 64, 48}, std::tuple{512, 2048, 8192}}) {
    const auto x = Random(size_t(n) * h, 40), w1 = Random(size_t(h) * f, 41, 0.05f),
               b1 = Random(f, 42), w2 = Random(size_t(f) * h, 43, 0.05f),
               dout = Random(size_t(n) * h, 44);
    CheckGeluEpilogue<float>(n, h, f, x, w1, b1, w2, dout, 4e-3, 1e-5, epilogue);
    CheckGeluEpilogue<bf16>(n, h, f, x, w1, b1, w2, dout, 2.0 / 128, 1e-2, epilogue);
  }
}

// VOCABPIPE_GEMM_EPILOGUE=residual: a product written onto the residual stream with the residual
// read as cuBLASLt's C matrix (beta 1) equals the product followed by the residual kernel, in
// both weight layouts (GPT-2's [in, out] with its bias, Llama's [out, in] without), for a small
// shape and GPT-2's mlp.c_proj at h 2048, f 8192 over 512 tokens. fp32 to 1e-5 of the terms'
// magnitudes; bf16 within 2 ulps of them (the separate path rounds the product before the add,
// the fused one rounds once). At the GPT-2 shape in bf16 the fused GEMM must exist (else the
// option would silently change nothing); the residual is left as it was; an aliased one refused.
template <typename T>
void CheckResidualEpilogue(int n, int in, int out_dim, double rel, double abs_floor,
                           const vp::testing::ScopedEnv& epilogue) {
  SCOPED_TRACE(std::string(std::is_same_v<T, float> ? "fp32" : "bf16") + " n " + std::to_string(n) +
               " in " + std::to_string(in) + " out " + std::to_string(out_dim));
  constexpr DType t = std::is_same_v<T, float> ? DType::kF32 : DType::kBF16;
  auto gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  const size_t no = size_t(n) * out_dim;
  const auto x = Random(size_t(n) * in, 60), w = Random(size_t(in) * out_dim, 61, 0.05f),
             b = Random(out_dim, 62);
  auto gx = UploadAs<T>(x), gw = UploadAs<T>(w), gb = UploadAs<T>(b),
       gr = UploadAs<T>(Random(no, 63));
  const std::vector<float> r = Download(*gr);
  // The same weights read as [in, out] (with the bias) and as [out, in] (without).
  const bool kInOut[] = {true, false};
  for (bool in_out : kInOut) {
    SCOPED_TRACE(in_out ? "[in, out] + bias" : "[out, in]");
    const T* bias = in_out ? gb->p : nullptr;
    auto forward = [&](T* out) {
      return in_out ? LinearResidualForward<T>(**gemm, out, gx->p, gw->p, bias, gr->p, n, in,
                                               out_dim, nullptr)
                    : LinearTResidualForward<T>(**gemm, out, gx->p, gw->p, gr->p, n, in, out_dim,
                                                nullptr);
    };
    Dev<T> sep(no), fused(no);
    Dev<float> product(no);  // x·W in fp32, for the magnitudes
    ASSERT_TRUE((*gemm)
                    ->Gemm(false, !in_out, n, out_dim, in, 1.0f, gx->p, in, gw->p,
                           in_out ? out_dim : in, 0.0f, product.p, out_dim, t, DType::kF32, nullptr)
                    .ok());
    epilogue.Unset();
    ASSERT_FALSE(FusedResidualEpilogue());
    ASSERT_TRUE(forward(sep.p).ok());
    epilogue.Set("residual");
    ASSERT_TRUE(FusedResidualEpilogue());
    ASSERT_TRUE(FusedBiasEpilogue());  // residual implies the bias epilogue
    const absl::Status direct =
        (*gemm)->GemmResidual(false, !in_out, n, out_dim, in, gx->p, in, gw->p,
                              in_out ? out_dim : in, gr->p, fused.p, out_dim, t, t, bias, nullptr);
    std::printf("  residual epilogue, %s, n %d in %d out %d, %s: %s\n",
                std::is_same_v<T, float> ? "fp32" : "bf16", n, in, out_dim,
                in_out ? "[in, out] + bias" : "[out, in]", direct.ToString().c_str());
    if (std::is_same_v<T, bf16> && out_dim == 2048) {
      EXPECT_TRUE(direct.ok()) << direct;
    }
    ASSERT_TRUE(direct.ok() || absl::IsUnimplemented(direct)) << direct;
    EXPECT_TRUE(absl::IsInvalidArgument((*gemm)->GemmResidual(
        false, !in_out, n, out_dim, in, gx->p, in, gw->p, in_out ? out_dim : in, fused.p, fused.p,
        out_dim, t, t, bias, nullptr)))
        << "an aliased residual";
    ASSERT_TRUE(forward(fused.p).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    epilogue.Unset();
    const auto got = Download(fused), want = Download(sep), xw = product.Get();
    for (size_t i = 0; i < no; ++i) {
      const double magnitude =
          std::abs(xw[i]) + (in_out ? std::abs(b[i % out_dim]) : 0.0) + std::abs(r[i]);
      ASSERT_NEAR(got[i], want[i], abs_floor + rel * magnitude) << "at " << i;
    }
    EXPECT_EQ(Download(*gr), r) << "the residual must be left as it was";
  }
}

TEST(CudaKernels, LinearResidualEpilogueMatchesSeparateAdd) {
  SKIP_WITHOUT_DEVICE();
  const vp::testing::ScopedEnv epilogue("VOCABPIPE_GEMM_EPILOGUE");
  for (const auto& [n, in, out_dim] : {std::tuple{24, 64, 48}, std::tuple{512, 8192, 2048}}) {
    CheckResidualEpilogue<float>(n, in, out_dim, 1e-5, 1e-5, epilogue);
    CheckResidualEpilogue<bf16>(n, in, out_dim, 2.0 / 128, 1e-2, epilogue);
  }
}

// Which epilogues VOCABPIPE_GEMM_EPILOGUE selects (no device needed).
TEST(GemmEpilogueSwitch, FollowsVocabpipeGemmEpilogue) {
  const vp::testing::ScopedEnv epilogue("VOCABPIPE_GEMM_EPILOGUE");
  epilogue.Unset();
  EXPECT_FALSE(FusedBiasEpilogue());
  EXPECT_FALSE(FusedGeluEpilogue());
  epilogue.Set("bias");
  EXPECT_TRUE(FusedBiasEpilogue());
  EXPECT_FALSE(FusedGeluEpilogue());
  epilogue.Set("gelu");
  EXPECT_TRUE(FusedBiasEpilogue());
  EXPECT_TRUE(FusedGeluEpilogue());
  EXPECT_FALSE(FusedResidualEpilogue());
  epilogue.Set("residual");
  EXPECT_TRUE(FusedBiasEpilogue());
  EXPECT_FALSE(FusedGeluEpilogue());
  EXPECT_TRUE(FusedResidualEpilogue());
  for (const char* list : {" gelu, residual ", "residual+gelu", "all"}) {
    epilogue.Set(list);  // spaces around the words do not matter
    EXPECT_TRUE(FusedBiasEpilogue()) << list;
    EXPECT_TRUE(FusedGeluEpilogue()) << list;
    EXPECT_TRUE(FusedResidualEpilogue()) << list;
  }
  epilogue.Set("GELU,resid");  // exact names only
  EXPECT_FALSE(FusedBiasEpilogue());
  EXPECT_FALSE(FusedGeluEpilogue());
  EXPECT_FALSE(FusedResidualEpilogue());
}

struct AttentionTolerance {
  double rel, out_abs, grad_abs, lse_rel;
};

// The flash kernels in T against cpu::AttentionForward/Backward on the same (T-rounded) random
// inputs. q sits inside a (batch, q_len, 3·width) qkv buffer (ldq = 3·width) as in the model;
// dk/dv start at nonzero values to check that they are accumulated, dq at a sentinel outside
// its q columns to check that only those are written. lse is checked against a float64
// log-sum-exp of the scaled scores over each row's causal prefix.
//
// With a cuDNN runner (`dnn`) the pair runs through RunAttentionForward/Backward on a context that
// holds it — cuDNN where it covers the shape, the default kernels elsewhere — and a whole
// sequence's dk/dv start at zero: cuDNN writes those rather than adding to them
// (attention_cudnn.h); a chunk's are added to, as by the kernels.
template <typename T>
void CheckAttention(const cpu::AttentionShape& cs, uint32_t seed, const AttentionTolerance& tol,
                    AttentionKernels kernels = AttentionKernels::kFma,
                    CudnnAttention* dnn = nullptr) {
  const AttentionShape s{cs.batch, cs.heads,   cs.head_dim, cs.q_begin,
                         cs.q_end, cs.kv_rows, cs.kv_heads};
  const int w = cs.width(), kvw = cs.kv_width(), ldq = 3 * w, ql = cs.q_len(), hd = cs.head_dim;
  const int group = cs.heads / cs.num_kv_heads();
  const size_t q_n = size_t(cs.batch) * ql * ldq, kv_n = size_t(cs.batch) * cs.kv_rows * kvw,
               o_n = size_t(cs.batch) * ql * w, stat_n = size_t(cs.batch) * cs.heads * ql;
  auto q = Random(q_n, seed), k = Random(kv_n, seed + 1), v = Random(kv_n, seed + 2),
       dout = Random(o_n, seed + 3), dk = Random(kv_n, seed + 4, 0.5f),
       dv = Random(kv_n, seed + 5, 0.5f);
  if (dnn != nullptr && cs.q_begin == 0 && cs.q_end == cs.kv_rows) {
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
  }
  std::vector<float> dq(q_n, 7.0f);
  Dev<T> gq(q_n), gk(kv_n), gv(kv_n), gdo(o_n), gdk(kv_n), gdv(kv_n), gdq(q_n), gout(o_n);
  Upload(gq, q);
  Upload(gk, k);
  Upload(gv, v);
  Upload(gdo, dout);
  Upload(gdk, dk);
  Upload(gdv, dv);
  Upload(gdq, dq);
  Dev<float> glse(stat_n), gdelta(stat_n);

  std::vector<float> out(o_n), cpu_lse(stat_n),
      scratch(cpu::AttentionBackwardScratch(cs));  // tiles per thread the CPU uses
  cpu::AttentionForward(out.data(), cpu_lse.data(), q.data(), ldq, k.data(), v.data(), cs);
  if (dnn != nullptr) {
    // Neither path allocates from the context: the runner keeps its own workspace.
    const DeviceContext ctx{.attention = dnn};
    const absl::Status fwd = RunAttentionForward(ctx, gout.p, glse.p, gq.p, ldq, gk.p, gv.p, s);
    ASSERT_TRUE(fwd.ok()) << fwd;
    const absl::Status bwd = RunAttentionBackward(ctx, gdq.p, gdk.p, gdv.p, gdelta.p, gdo.p, gout.p,
                                                  glse.p, gq.p, ldq, gk.p, gv.p, s);
    ASSERT_TRUE(bwd.ok()) << bwd;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  } else {
    ASSERT_EQ(AttentionForward(gout.p, glse.p, gq.p, ldq, gk.p, gv.p, s, nullptr, kernels),
              cudaSuccess);
    // The backward reads the device's own forward output, as in training (for bf16 it is the
    // rounded out that delta = Σ dO·O sees; the CPU uses its fp32 out).
    ASSERT_EQ(AttentionBackward(gdq.p, gdk.p, gdv.p, gdelta.p, gdo.p, gout.p, glse.p, gq.p, ldq,
                                gk.p, gv.p, s, nullptr, kernels),
              cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cpu::AttentionBackward(dq.data(), ldq, dk.data(), dv.data(), scratch.data(), dout.data(),
                         out.data(), cpu_lse.data(), q.data(), ldq, k.data(), v.data(), cs);

  std::vector<float> lse(stat_n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int b = 0; b < cs.batch; ++b) {
    for (int h = 0; h < cs.heads; ++h) {
      for (int i = 0; i < ql; ++i) {
        const float* qi = q.data() + (size_t(b) * ql + i) * ldq + h * hd;
        std::vector<double> sc(cs.q_begin + i + 1);
        double mx = -INFINITY, sum = 0.0;
        for (size_t j = 0; j < sc.size(); ++j) {
          const float* kj = k.data() + (size_t(b) * cs.kv_rows + j) * kvw + (h / group) * hd;
          double dot = 0.0;
          for (int d = 0; d < hd; ++d) dot += double(qi[d]) * kj[d];
          sc[j] = scale * dot;
          mx = std::max(mx, sc[j]);
        }
        for (double x : sc) sum += std::exp(x - mx);
        lse[(size_t(b) * cs.heads + h) * ql + i] = static_cast<float>(mx + std::log(sum));
      }
    }
  }
  ExpectClose(glse.Get(), lse, tol.lse_rel, tol.lse_rel, "lse");
  ExpectClose(Download(gout), out, tol.rel, tol.out_abs, "out");
  ExpectClose(Download(gdq), dq, tol.rel, tol.grad_abs, "dq");
  ExpectClose(Download(gdk), dk, tol.rel, tol.grad_abs, "dk");
  ExpectClose(Download(gdv), dv, tol.rel, tol.grad_abs, "dv");
}

// fp32: same math, different summation order and expf → 1e-5 relative; the absolute floor
// covers gradients near 0, where dS = P·(dP − delta) cancels.
constexpr AttentionTolerance kFp32Tol{1e-5, 1e-5, 3e-5, 1e-5};

TEST(CudaKernels, AttentionWholeSequenceMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  // 75 rows: three query/key tiles, the last partial; head_dim 32 (bucket 64).
  CheckAttention<float>(
      {.batch = 2, .heads = 3, .head_dim = 32, .q_begin = 0, .q_end = 75, .kv_rows = 75}, 20,
      kFp32Tol);
}

TEST(CudaKernels, AttentionChunkMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  // A Seq1F1B middle chunk: q_begin and q_end off the 32-row tile grid, kv cache longer than
  // q_end (rows >= q_end must keep their dk/dv), head_dim 16.
  CheckAttention<float>(
      {.batch = 2, .heads = 2, .head_dim = 16, .q_begin = 37, .q_end = 70, .kv_rows = 96}, 30,
      kFp32Tol);
  // A one-row chunk and a chunk of exactly one tile.
  CheckAttention<float>(
      {.batch = 1, .heads = 2, .head_dim = 8, .q_begin = 40, .q_end = 41, .kv_rows = 48}, 40,
      kFp32Tol);
  CheckAttention<float>(
      {.batch = 1, .heads = 1, .head_dim = 24, .q_begin = 32, .q_end = 64, .kv_rows = 64}, 50,
      kFp32Tol);
}

TEST(CudaKernels, AttentionLargeHeadDimMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  // head_dim 80 and 128 use the 128 bucket (dynamic shared memory above 48 KiB).
  CheckAttention<float>(
      {.batch = 1, .heads = 2, .head_dim = 80, .q_begin = 20, .q_end = 53, .kv_rows = 64}, 60,
      kFp32Tol);
  CheckAttention<float>(
      {.batch = 1, .heads = 1, .head_dim = 128, .q_begin = 0, .q_end = 40, .kv_rows = 40}, 70,
      kFp32Tol);
}

TEST(CudaKernels, AttentionBf16MatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  // Same inputs on both sides (bf16-rounded), fp32 accumulation in the kernels; the error comes
  // from rounding out, dq, dk, dv to bf16 (2^-9 relative) and from delta computed on the rounded
  // out: 2e-2 relative + 2e-2 absolute. lse depends on the inputs only (bf16 products are exact
  // in fp32), so it keeps a tight tolerance.
  constexpr AttentionTolerance kBf16Tol{2e-2, 2e-2, 2e-2, 1e-4};
  CheckAttention<bf16>(
      {.batch = 2, .heads = 2, .head_dim = 64, .q_begin = 33, .q_end = 97, .kv_rows = 128}, 80,
      kBf16Tol);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 96, .q_begin = 0, .q_end = 50, .kv_rows = 50}, 90,
      kBf16Tol);
}

TEST(CudaKernels, GroupedQueryAttentionMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  // Llama's grouped-query attention: 4 query heads on 2 key/value heads (dK, dV summed over
  // each group of 2), and 6 on 1 (multi-query), in a mid-sequence chunk and whole sequences.
  CheckAttention<float>({.batch = 2,
                         .heads = 4,
                         .head_dim = 16,
                         .q_begin = 37,
                         .q_end = 70,
                         .kv_rows = 96,
                         .kv_heads = 2},
                        100, kFp32Tol);
  CheckAttention<float>({.batch = 1,
                         .heads = 6,
                         .head_dim = 32,
                         .q_begin = 0,
                         .q_end = 45,
                         .kv_rows = 45,
                         .kv_heads = 1},
                        110, kFp32Tol);
  CheckAttention<float>({.batch = 1,
                         .heads = 4,
                         .head_dim = 128,
                         .q_begin = 10,
                         .q_end = 43,
                         .kv_rows = 64,
                         .kv_heads = 2},
                        120, kFp32Tol);
  constexpr AttentionTolerance kBf16Tol{2e-2, 2e-2, 2e-2, 1e-4};
  CheckAttention<bf16>({.batch = 1,
                        .heads = 8,
                        .head_dim = 64,
                        .q_begin = 33,
                        .q_end = 97,
                        .kv_rows = 128,
                        .kv_heads = 2},
                       130, kBf16Tol);
}

// The tensor-core kernels (bf16 WMMA, 64-row tiles, P and dS rounded to bf16 before their
// products) against the CPU on the same bf16-rounded inputs, with the bf16 tolerance of the FMA
// kernels: several 64-row tiles with a partial last one, Seq1F1B chunks starting off the tile
// grid (the dK/dV kernel's first query tile is unaligned), both head_dim buckets (64, 128) and a
// head_dim that is no multiple of 8 (element loads instead of 16-byte ones), grouped-query
// attention, and a kv cache longer than the chunk.
TEST(CudaKernels, TensorCoreAttentionMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  constexpr AttentionTolerance kTol{2e-2, 2e-2, 2e-2, 1e-4};
  constexpr auto kTc = AttentionKernels::kTensorCore;
  // Whole sequences of 200 rows: 4 tiles, the last of 8 rows; GPT-2's head_dim.
  CheckAttention<bf16>(
      {.batch = 2, .heads = 2, .head_dim = 64, .q_begin = 0, .q_end = 200, .kv_rows = 200}, 300,
      kTol, kTc);
  // A Seq1F1B middle chunk off the tile grid, kv cache longer than q_end.
  CheckAttention<bf16>(
      {.batch = 1, .heads = 3, .head_dim = 32, .q_begin = 70, .q_end = 150, .kv_rows = 192}, 310,
      kTol, kTc);
  // head_dim 128 (Llama) and 80 (the 128 bucket with zero columns).
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 128, .q_begin = 0, .q_end = 130, .kv_rows = 130}, 320,
      kTol, kTc);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 80, .q_begin = 20, .q_end = 90, .kv_rows = 96}, 330,
      kTol, kTc);
  // head_dim 20: no multiple of 8, element loads.
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 20, .q_begin = 5, .q_end = 77, .kv_rows = 80}, 340, kTol,
      kTc);
  // One row, and one whole tile.
  CheckAttention<bf16>(
      {.batch = 1, .heads = 1, .head_dim = 64, .q_begin = 40, .q_end = 41, .kv_rows = 48}, 350,
      kTol, kTc);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 1, .head_dim = 64, .q_begin = 64, .q_end = 128, .kv_rows = 128}, 360,
      kTol, kTc);
  // Grouped-query attention: 8 query heads on 2 key/value heads, 4 on 1, 128 columns.
  CheckAttention<bf16>({.batch = 2,
                        .heads = 8,
                        .head_dim = 64,
                        .q_begin = 33,
                        .q_end = 161,
                        .kv_rows = 192,
                        .kv_heads = 2},
                       370, kTol, kTc);
  CheckAttention<bf16>({.batch = 1,
                        .heads = 4,
                        .head_dim = 128,
                        .q_begin = 0,
                        .q_end = 100,
                        .kv_rows = 100,
                        .kv_heads = 1},
                       380, kTol, kTc);
}

// Device-free: which shapes cuDNN runs (the rest fall back to the kernels).
TEST(CudnnAttentionCoverage, WholeSequencesAndChunks) {
  constexpr int64_t kV919 = 91900, kV95 = 90500;  // cuDNN 9.19, and one before 9.6
  const AttentionShape whole{
      .batch = 2, .heads = 16, .head_dim = 64, .q_begin = 0, .q_end = 1024, .kv_rows = 1024};
  EXPECT_TRUE(CudnnAttention::CoversForward(whole, 3 * 1024, kV919));
  EXPECT_TRUE(CudnnAttention::CoversBackward(whole, 3 * 1024, kV919));
  AttentionShape first = whole;  // Seq1F1B's first chunk (dK/dV added to the later chunks')
  first.q_end = 256;
  EXPECT_TRUE(CudnnAttention::CoversForward(first, 3 * 1024, kV919));
  EXPECT_TRUE(CudnnAttention::CoversBackward(first, 3 * 1024, kV919));
  AttentionShape later = whole;  // a later chunk: its queries start past position 0
  later.q_begin = 256;
  later.q_end = 600;
  EXPECT_TRUE(CudnnAttention::CoversForward(later, 3 * 1024, kV919));
  EXPECT_TRUE(CudnnAttention::CoversBackward(later, 3 * 1024, kV919));
  // Before cuDNN 9.6 the bottom-right mask needs lengths that are multiples of 64.
  EXPECT_FALSE(CudnnAttention::CoversForward(later, 3 * 1024, kV95));
  EXPECT_FALSE(CudnnAttention::CoversBackward(later, 3 * 1024, kV95));
  later.q_end = 640;  // 384 queries on 640 keys
  EXPECT_TRUE(CudnnAttention::CoversForward(later, 3 * 1024, kV95));
  EXPECT_TRUE(CudnnAttention::CoversForward(first, 3 * 1024, kV95));  // top-left: any length
  AttentionShape one = whole;  // one query on one key: forward only
  one.q_end = one.kv_rows = 1;
  EXPECT_TRUE(CudnnAttention::CoversForward(one, 3 * 1024, kV919));
  EXPECT_FALSE(CudnnAttention::CoversBackward(one, 3 * 1024, kV919));
  // One causal query row: refused by the frontend up to 9.9 (kernels), a chunk's too.
  EXPECT_FALSE(CudnnAttention::CoversForward(one, 3 * 1024, kV95));
  AttentionShape last_row = whole;
  last_row.q_begin = 1023;
  EXPECT_FALSE(CudnnAttention::CoversForward(last_row, 3 * 1024, 90900));
  EXPECT_TRUE(CudnnAttention::CoversForward(last_row, 3 * 1024, 91000));
  AttentionShape no_rows = whole;
  no_rows.q_begin = no_rows.q_end = 512;
  EXPECT_FALSE(CudnnAttention::CoversForward(no_rows, 3 * 1024, kV919));
  AttentionShape odd = whole;  // head_dim no multiple of 8, or above 128
  odd.head_dim = 20;
  EXPECT_FALSE(CudnnAttention::CoversForward(odd, 3 * 320, kV919));
  odd.head_dim = 256;
  EXPECT_FALSE(CudnnAttention::CoversForward(odd, 3 * 4096, kV919));
  // Rows not 16-byte aligned.
  EXPECT_FALSE(CudnnAttention::CoversForward(whole, 3 * 1024 + 4, kV919));
  AttentionShape gqa = whole;
  gqa.kv_heads = 4;
  EXPECT_TRUE(CudnnAttention::CoversBackward(gqa, 1024 + 2 * 256, kV919));
  gqa.kv_heads = 3;  // 16 query heads cannot share 3 key/value heads
  EXPECT_FALSE(CudnnAttention::CoversForward(gqa, 1024 + 2 * 192, kV919));
  AttentionShape empty = whole;  // no heads: never covered (and never divided by)
  empty.heads = 0;
  EXPECT_FALSE(CudnnAttention::CoversForward(empty, 0, kV919));
}

// Who gets a runner: none unless VOCABPIPE_ATTENTION=cudnn; asked for, it is created where a GPU
// and cuDNN are, and where it cannot be (here: no device for cuDNN's handle; or no cuDNN) the
// error names the variable, so a rank fails at start instead of silently running other kernels.
TEST(CudnnAttentionChoice, OnlyWhenAskedAndLoudWhenUnavailable) {
  MemoryTracker tracker;
  CachingAllocator alloc(MakeCudaMemoryBackend(), &tracker, CachingAllocator::Reuse::kImmediate);
  const vp::testing::ScopedEnv attention("VOCABPIPE_ATTENTION");
  attention.Unset();
  absl::StatusOr<std::unique_ptr<CudnnAttention>> none = ChosenCudnnAttention(&alloc);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  attention.Set("flash-wide");
  none = ChosenCudnnAttention(&alloc);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  attention.Set("cudnn");
  absl::StatusOr<std::unique_ptr<CudnnAttention>> chosen = ChosenCudnnAttention(&alloc);
  if (DeviceCount() > 0 && LoadCudnn().ok()) {
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_NE(*chosen, nullptr);
  } else {
    ASSERT_FALSE(chosen.ok());
    EXPECT_THAT(std::string(chosen.status().message()),
                ::testing::HasSubstr("VOCABPIPE_ATTENTION=cudnn"));
  }
}

// Device-free: every tensor and operation descriptor of both graphs is accepted and finalized
// by the cuDNN this build found (a wrong attribute type, count or mode fails here, in CI, not
// first on a GPU): GPT-2's multi-head shape, Llama's grouped one, a grouped Seq1F1B chunk, and,
// built as for cuDNN 9.15 (whose backward on key lengths off multiples of 128 gets the frontend's
// padding workaround: a padding mask and the products' M/N/K overridden by the lengths), 200 rows
// and a grouped chunk of 100 queries on 170 keys, and as for 9.9 (the padding mask twice) the 200
// rows again. compare_cudnn_graphs.py holds the twelve graphs,
// in this order, to cuDNN's frontend's. cuDNN is optional (only VOCABPIPE_ATTENTION=cudnn needs
// it): a build or machine without it has nothing to check.
TEST(CudnnAttentionGraphs, DescriptorsFinalizeWithoutADevice) {
  absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
  if (!dnn.ok()) GTEST_SKIP() << "no cuDNN: " << dnn.status();
  struct Case {
    AttentionShape shape;
    int ldq;
    int64_t as_version;  // 0: the loaded cuDNN's
  };
  const Case cases[] = {
      {{.batch = 2, .heads = 16, .head_dim = 64, .q_end = 1024, .kv_rows = 1024}, 3 * 1024, 0},
      {{.batch = 1, .heads = 32, .head_dim = 128, .q_end = 512, .kv_rows = 512, .kv_heads = 8},
       4096 + 2 * 1024,
       0},
      // Queries 512-767 of a 1024-row cache: the bottom-right mask, dK/dV in rows of their own.
      {{.batch = 2,
        .heads = 8,
        .head_dim = 128,
        .q_begin = 512,
        .q_end = 768,
        .kv_rows = 1024,
        .kv_heads = 2},
       1024 + 2 * 256,
       0},
      {{.batch = 2, .heads = 2, .head_dim = 64, .q_end = 200, .kv_rows = 200},
       128 + 2 * 128,
       91500},
      {{.batch = 2,
        .heads = 4,
        .head_dim = 64,
        .q_begin = 70,
        .q_end = 170,
        .kv_rows = 224,
        .kv_heads = 2},
       256 + 2 * 128,
       91500},
      // As for 9.9: the padding mask applied a second time, after lse is subtracted.
      {{.batch = 2, .heads = 2, .head_dim = 64, .q_end = 200, .kv_rows = 200},
       128 + 2 * 128,
       90900},
  };
  for (const Case& c : cases) {
    const absl::Status st = CudnnAttention::CheckDescriptors(c.shape, c.ldq, c.as_version);
    EXPECT_TRUE(st.ok()) << st << " (" << c.shape.q_len() << " queries on " << c.shape.q_end
                         << " keys)";
  }
}

// Device-free: a kernel switch holding a value its kernels do not know is refused by name (they
// would otherwise run the default silently); unset or known values pass.
TEST(KernelSwitches, UnknownValuesAreRefusedNamingTheVariable) {
  const vp::testing::ScopedEnv attention("VOCABPIPE_ATTENTION");
  const vp::testing::ScopedEnv memory("VOCABPIPE_MEMORY_KERNELS");
  const vp::testing::ScopedEnv epilogue("VOCABPIPE_GEMM_EPILOGUE");
  attention.Unset();
  memory.Unset();
  epilogue.Unset();
  EXPECT_TRUE(CheckKernelSwitches().ok());
  for (std::string_view name : AttentionKernelsNames()) {
    attention.Set(std::string(name));
    EXPECT_TRUE(CheckKernelSwitches().ok()) << name;
  }
  attention.Set("");  // empty: the default, like unset
  EXPECT_TRUE(CheckKernelSwitches().ok());
  memory.Set("vector");
  epilogue.Set("gelu, residual");
  EXPECT_TRUE(CheckKernelSwitches().ok());
  epilogue.Set("all");
  EXPECT_TRUE(CheckKernelSwitches().ok());

  attention.Set("cudnnn");
  absl::Status st = CheckKernelSwitches();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("VOCABPIPE_ATTENTION"));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("\"cudnnn\""));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("flash-pipelined"));  // the choices
  attention.Set("flash");
  memory.Set("vectors");
  st = CheckKernelSwitches();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("VOCABPIPE_MEMORY_KERNELS"));
  memory.Set("element");
  epilogue.Set("bias+gelo");
  st = CheckKernelSwitches();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("VOCABPIPE_GEMM_EPILOGUE"));
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("\"gelo\""));
  // A control character in the value is escaped, and a long one cut.
  epilogue.Set("bias,\x1b[31m" + std::string(100, 'x'));
  st = CheckKernelSwitches();
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("\\x1b[31m"));
  EXPECT_LT(st.message().size(), 200u) << st;
}

// The environment picks the bf16 kernels when the caller does not.
TEST(AttentionKernelsDefault, FollowsVocabpipeAttention) {
  const vp::testing::ScopedEnv attention("VOCABPIPE_ATTENTION");
  attention.Set("tensor-core");
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kTensorCore);
  attention.Set("fma");
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFma);
  attention.Set("flash");
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFlash);
  attention.Set("flash-pipelined");
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFlashPipelined);
  attention.Set("flash-wide");
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFlashWide);
  EXPECT_EQ(AttentionKernelsName(AttentionKernels::kDefault), "flash-wide");
  attention.Set("Flash");  // exact names only
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFlash);
  attention.Unset();
  EXPECT_EQ(DefaultAttentionKernels(), AttentionKernels::kFlash);
  // Each name selects the kernels it names.
  for (AttentionKernels k : {AttentionKernels::kFma, AttentionKernels::kTensorCore,
                             AttentionKernels::kFlash, AttentionKernels::kFlashPipelined,
                             AttentionKernels::kFlashWide, AttentionKernels::kCudnn}) {
    attention.Set(std::string(AttentionKernelsName(k)));
    EXPECT_EQ(DefaultAttentionKernels(), k) << AttentionKernelsName(k);
  }
}

TEST(CudaKernels, GroupedQueryAttentionRejectsUnevenGroups) {
  SKIP_WITHOUT_DEVICE();
  // 3 query heads cannot share 2 key/value heads evenly.
  const AttentionShape s{
      .batch = 1, .heads = 3, .head_dim = 8, .q_begin = 0, .q_end = 4, .kv_rows = 4, .kv_heads = 2};
  Dev<float> q(4 * 24), k(4 * 16), v(4 * 16), out(4 * 24), lse(12);
  EXPECT_EQ(AttentionForward(out.p, lse.p, q.p, 24, k.p, v.p, s, nullptr), cudaErrorInvalidValue);
}

// LayerNorm (layer_norm) or RMSNorm over n rows of c on the device with `kernels`, forward and
// both backward parts, against the CPU on the same inputs (for bf16: the bf16-rounded ones). The
// input gradient adds onto a skip gradient of 0.5 twice: in place (skip = dinp) and into a
// separate dinp filled with 7 first (which must be overwritten, not added to); the weight
// gradients accumulate onto 0.1 and 0.2. Tolerances: fp32
// 1e-5 relative; bf16 outputs one bf16 rounding of the fp32 result (2^-9 relative, checked at
// 8e-3 + 1e-2 absolute), the fp32 statistics and weight gradients 1e-5 / 1e-4.
template <typename T>
void CheckNorm(bool layer_norm, int n, int c, MemoryKernels kernels, uint32_t seed) {
  SCOPED_TRACE(std::string(layer_norm ? "LayerNorm" : "RMSNorm") +
               (std::is_same_v<T, bf16> ? " bf16" : " fp32") + " n " + std::to_string(n) + " c " +
               std::to_string(c) +
               (kernels == MemoryKernels::kVector ? " vector kernels" : " warp kernels"));
  const size_t nc = size_t(n) * c;
  auto x = Random(nc, seed), w = Random(c, seed + 1), b = Random(c, seed + 2),
       dy = Random(nc, seed + 3);
  std::vector<float> dx(nc, 0.5f), dw(c, 0.1f), db(c, 0.2f);
  Dev<T> gx(nc), gw(c), gb(c), gdy(nc), gout(nc), gdx(nc), gskip(nc), gdx_apart(nc);
  Upload(gx, x);
  Upload(gw, w);
  Upload(gb, b);
  Upload(gdy, dy);
  Upload(gdx, dx);  // 0.5 is exact in bf16
  Upload(gskip, dx);
  std::vector<float> sevens(nc, 7.0f);
  Upload(gdx_apart, sevens);
  Dev<float> gmean(n), grstd(n), gdw(dw), gdb(db);
  std::vector<float> out(nc), mean(n), rstd(n);
  constexpr float kRmsEps = 1e-5f;
  if (layer_norm) {
    cpu::LayerNormForward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), n, c);
    cpu::LayerNormBackwardInput(dx.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                n, c);
    cpu::LayerNormBackwardWeight(dw.data(), db.data(), dy.data(), x.data(), mean.data(),
                                 rstd.data(), n, c);
    ASSERT_EQ(LayerNormForward(gout.p, gmean.p, grstd.p, gx.p, gw.p, gb.p, n, c, nullptr, kernels),
              cudaSuccess);
    ASSERT_EQ(LayerNormBackwardInput(gdx.p, gdx.p, gdy.p, gx.p, gw.p, gmean.p, grstd.p, n, c,
                                     nullptr, kernels),
              cudaSuccess);
    ASSERT_EQ(LayerNormBackwardInput(gdx_apart.p, gskip.p, gdy.p, gx.p, gw.p, gmean.p, grstd.p, n,
                                     c, nullptr, kernels),
              cudaSuccess);
    ASSERT_EQ(LayerNormBackwardWeight(gdw.p, gdb.p, gdy.p, gx.p, gmean.p, grstd.p, n, c, nullptr,
                                      kernels),
              cudaSuccess);
  } else {
    cpu::RmsNormForward(out.data(), rstd.data(), x.data(), w.data(), n, c, kRmsEps);
    cpu::RmsNormBackwardInput(dx.data(), dy.data(), x.data(), w.data(), rstd.data(), n, c);
    cpu::RmsNormBackwardWeight(dw.data(), dy.data(), x.data(), rstd.data(), n, c);
    ASSERT_EQ(RmsNormForward(gout.p, grstd.p, gx.p, gw.p, n, c, kRmsEps, nullptr, kernels),
              cudaSuccess);
    ASSERT_EQ(
        RmsNormBackwardInput(gdx.p, gdx.p, gdy.p, gx.p, gw.p, grstd.p, n, c, nullptr, kernels),
        cudaSuccess);
    ASSERT_EQ(RmsNormBackwardInput(gdx_apart.p, gskip.p, gdy.p, gx.p, gw.p, grstd.p, n, c, nullptr,
                                   kernels),
              cudaSuccess);
    ASSERT_EQ(RmsNormBackwardWeight(gdw.p, gdy.p, gx.p, grstd.p, n, c, nullptr, kernels),
              cudaSuccess);
  }
  const bool bf = std::is_same_v<T, bf16>;
  ExpectClose(Download(gout), out, bf ? 8e-3 : 1e-5, bf ? 1e-2 : 1e-5, "out");
  ExpectClose(grstd.Get(), rstd, 1e-5, 1e-6, "rstd");
  if (layer_norm) ExpectClose(gmean.Get(), mean, 1e-5, 1e-6, "mean");
  ExpectClose(Download(gdx), dx, bf ? 8e-3 : 1e-5, bf ? 1e-2 : 1e-5, "dinp");
  EXPECT_EQ(Download(gdx_apart), Download(gdx)) << "dinp apart from skip";
  EXPECT_EQ(Download(gskip), std::vector<float>(nc, 0.5f)) << "skip must be left as it was";
  ExpectClose(gdw.Get(), dw, 1e-5, 1e-4, "dweight");
  if (layer_norm) ExpectClose(gdb.Get(), db, 1e-5, 1e-4, "dbias");
}

// Both kernel sets; c = 96 / 160 and 2048 allow 16-byte accesses, 98 / 162 and 100 do not (the
// vector kernels fall back to the warp ones there); GPT-2's and Llama's widths in bf16.
TEST(CudaKernels, LayerNormMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  for (MemoryKernels kernels : {MemoryKernels::kElement, MemoryKernels::kVector}) {
    CheckNorm<float>(true, 37, 96, kernels, 1);
    CheckNorm<float>(true, 37, 98, kernels, 5);
    CheckNorm<bf16>(true, 300, 2048, kernels, 9);
    CheckNorm<bf16>(true, 19, 100, kernels, 13);
  }
}

TEST(CudaKernels, RmsNormMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  for (MemoryKernels kernels : {MemoryKernels::kElement, MemoryKernels::kVector}) {
    CheckNorm<float>(false, 41, 160, kernels, 200);
    CheckNorm<float>(false, 41, 162, kernels, 204);
    CheckNorm<bf16>(false, 300, 4096, kernels, 208);
    CheckNorm<bf16>(false, 19, 100, kernels, 212);
  }
}

// Device-free: the environment picks the memory-bound kernels when the caller does not, and the
// vector norm kernels refuse (launching nothing) a width or a pointer that 16-byte accesses
// cannot serve.
TEST(MemoryKernelsDefault, FollowsTheEnvironmentAndNormsRefuseUnalignedRows) {
  const vp::testing::ScopedEnv memory_kernels("VOCABPIPE_MEMORY_KERNELS");
  memory_kernels.Set("vector");
  EXPECT_EQ(DefaultMemoryKernels(), MemoryKernels::kVector);
  memory_kernels.Set("element");
  EXPECT_EQ(DefaultMemoryKernels(), MemoryKernels::kElement);
  memory_kernels.Unset();
  EXPECT_EQ(DefaultMemoryKernels(), MemoryKernels::kElement);

  // Never dereferenced: the checks come before any launch.
  auto* aligned = reinterpret_cast<bf16*>(uintptr_t{1} << 20);
  auto* odd = reinterpret_cast<bf16*>((uintptr_t{1} << 20) + 8);
  auto* stats = reinterpret_cast<float*>(uintptr_t{1} << 21);
  EXPECT_EQ(NormForwardVector<bf16>(aligned, stats, stats, aligned, aligned, aligned, 4, 100, 1e-5f,
                                    nullptr),
            cudaErrorNotSupported);  // 100 is not a multiple of 8
  EXPECT_EQ(
      NormForwardVector<bf16>(aligned, stats, stats, odd, aligned, aligned, 4, 96, 1e-5f, nullptr),
      cudaErrorNotSupported);  // rows 8 bytes off the 16-byte grid
  EXPECT_EQ(NormBackwardInputVector<bf16>(odd, aligned, aligned, aligned, aligned, stats, stats, 4,
                                          96, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(NormBackwardInputVector<bf16>(aligned, odd, aligned, aligned, aligned, stats, stats, 4,
                                          96, nullptr),
            cudaErrorNotSupported);  // the skip rows off the grid
  EXPECT_EQ(NormBackwardWeightVector<float>(stats, stats, reinterpret_cast<float*>(odd),
                                            reinterpret_cast<float*>(aligned), stats, stats, 4, 96,
                                            nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(NormBackwardWeightVector<float>(stats, nullptr, reinterpret_cast<float*>(aligned),
                                            reinterpret_cast<float*>(aligned), nullptr, stats, 4, 6,
                                            nullptr),
            cudaErrorNotSupported);  // 6 is not a multiple of 4
}

TEST(CudaKernels, RopeMatchesCpuIncludingChunkOffset) {
  SKIP_WITHOUT_DEVICE();
  // q inside a qkv-like row of stride ld: 3 heads of 16 rotated, the rest untouched.
  const int batch = 2, t = 50, heads = 3, d = 16, ld = 80;
  const float theta = 500000.0f;
  auto x = Random(size_t(batch) * t * ld, 210), dy = Random(size_t(batch) * t * ld, 211);
  // A chunk starting at position 1000 (a Seq1F1B chunk mid-sequence) and the whole sequence.
  for (const int start : {0, 1000}) {
    std::vector<float> y = x, dx = dy;
    cpu::RopeForward(y.data(), ld, batch, t, heads, d, start, theta);
    cpu::RopeBackward(dx.data(), ld, batch, t, heads, d, start, theta);
    Dev<float> gy(x), gdx(dy);
    ASSERT_EQ(RopeForward(gy.p, ld, batch, t, heads, d, start, theta, nullptr), cudaSuccess);
    ASSERT_EQ(RopeBackward(gdx.p, ld, batch, t, heads, d, start, theta, nullptr), cudaSuccess);
    ExpectClose(gy.Get(), y, 1e-6, 1e-6, "rope forward");
    ExpectClose(gdx.Get(), dx, 1e-6, 1e-6, "rope backward");
  }
  // The chunk [20, 50) rotated with start_pos 20 equals rows 20.. of the whole sequence.
  std::vector<float> whole = x;
  cpu::RopeForward(whole.data(), ld, 1, t, heads, d, 0, theta);
  std::vector<float> tail(x.begin() + 20 * ld, x.begin() + t * ld);
  Dev<float> gtail(tail);
  ASSERT_EQ(RopeForward(gtail.p, ld, 1, t - 20, heads, d, 20, theta, nullptr), cudaSuccess);
  ExpectClose(gtail.Get(), std::vector<float>(whole.begin() + 20 * ld, whole.begin() + t * ld),
              1e-6, 1e-6, "chunk equals the whole sequence's rows");
  Dev<float> odd(16);
  EXPECT_EQ(RopeForward(odd.p, 16, 1, 1, 1, 15, 0, theta, nullptr), cudaErrorInvalidValue);
}

// Both kernel sets; f = 72 allows 16-byte accesses, 70 does not.
TEST(CudaKernels, SwigluMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  const long n = 33;
  for (MemoryKernels kernels : {MemoryKernels::kElement, MemoryKernels::kVector}) {
    for (const int f : {72, 70}) {
      SCOPED_TRACE(std::string(kernels == MemoryKernels::kVector ? "vector" : "element") +
                   " kernels, f " + std::to_string(f));
      auto gu = Random(size_t(n) * 2 * f, 220, 3.0f), dy = Random(size_t(n) * f, 221);
      std::vector<float> out(n * f), dgu(n * 2 * f);
      cpu::SwigluForward(out.data(), gu.data(), n, f);
      cpu::SwigluBackward(dgu.data(), gu.data(), dy.data(), n, f);
      Dev<float> ggu(gu), gdy(dy), gout(n * f), gdgu(std::vector<float>(n * 2 * f, 9.0f));
      ASSERT_EQ(SwigluForward(gout.p, ggu.p, n, f, nullptr, kernels), cudaSuccess);
      ASSERT_EQ(SwigluBackward(gdgu.p, ggu.p, gdy.p, n, f, nullptr, kernels), cudaSuccess);
      ExpectClose(gout.Get(), out, 1e-5, 1e-6, "swiglu");
      ExpectClose(gdgu.Get(), dgu, 1e-5, 1e-6, "swiglu backward (overwrites)");
    }
  }
}

TEST(CudaKernels, LinearTransposedMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  const int n = 24, in = 64, out_dim = 40;
  auto x = Random(n * in, 230), w = Random(out_dim * in, 231, 0.1f), dy = Random(n * out_dim, 232);
  std::vector<float> y(n * out_dim), dx(n * in), dw(out_dim * in, 0.3f);
  cpu::LinearTForward(y.data(), x.data(), w.data(), n, in, out_dim);
  cpu::LinearTBackwardInput(dx.data(), dy.data(), w.data(), n, in, out_dim);
  cpu::LinearTBackwardWeight(dw.data(), dy.data(), x.data(), n, in, out_dim);
  auto gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  Dev<float> gx(x), gw(w), gdy(dy), gy(n * out_dim), gdx(n * in),
      gdw(std::vector<float>(out_dim * in, 0.3f));
  ASSERT_TRUE(LinearTForward(**gemm, gy.p, gx.p, gw.p, n, in, out_dim, nullptr).ok());
  ASSERT_TRUE(LinearTBackwardInput(**gemm, gdx.p, gdy.p, gw.p, n, in, out_dim, nullptr).ok());
  ASSERT_TRUE(LinearTBackwardWeight(**gemm, gdw.p, gdy.p, gx.p, n, in, out_dim, nullptr).ok());
  ExpectClose(gy.Get(), y, 1e-5, 1e-5, "linear");
  ExpectClose(gdx.Get(), dx, 1e-5, 1e-5, "dinp");
  ExpectClose(gdw.Get(), dw, 1e-5, 1e-5, "dweight (accumulated onto 0.3)");
}

TEST(CudaKernels, EmbeddingShardAndPositions) {
  SKIP_WITHOUT_DEVICE();
  const int n = 6, h = 8, rows = 4;
  const int64_t begin = 10;
  std::vector<int32_t> tokens = {10, 3, 13, 11, 10, 14};  // 3 and 14 are outside [10, 14)
  auto wte = Random(rows * h, 16), dy = Random(n * h, 17);
  Dev<float> gw(wte), gout(n * h), gdw(rows * h), gdy(dy);
  Dev<int32_t> gt(tokens);
  ASSERT_EQ(EmbeddingForward(gout.p, gw.p, gt.p, n, h, begin, rows, nullptr), cudaSuccess);
  ASSERT_EQ(EmbeddingBackward(gdw.p, gdy.p, gt.p, n, h, begin, rows, nullptr), cudaSuccess);
  std::vector<float> out(n * h, 0.0f), dw(rows * h, 0.0f);
  for (int i = 0; i < n; ++i) {
    const int64_t l = tokens[i] - begin;
    if (l < 0 || l >= rows) continue;
    for (int k = 0; k < h; ++k) {
      out[i * h + k] = wte[l * h + k];
      dw[l * h + k] += dy[i * h + k];
    }
  }
  ExpectClose(gout.Get(), out, 0, 0, "lookup");
  ExpectClose(gdw.Get(), dw, 1e-6, 1e-6, "scatter-add");
  // Positions for a chunk starting at 3.
  const int batch = 2, t = 4, c = 8, start = 3;
  auto x = Random(batch * t * c, 18), wpe = Random((start + t) * c, 19);
  std::vector<float> xc = x, dwpe((start + t) * c, 0.0f);
  cpu::PositionEmbeddingForward(xc.data(), wpe.data(), batch, t, c, start);
  cpu::PositionEmbeddingBackward(dwpe.data(), x.data(), batch, t, c, start);
  Dev<float> gxx(x), gwpe(wpe), gdwpe(dwpe.size());
  ASSERT_EQ(PositionEmbeddingForward(gxx.p, gwpe.p, batch, t, c, start, nullptr), cudaSuccess);
  ASSERT_EQ(PositionEmbeddingBackward(gdwpe.p, Dev<float>(x).p, batch, t, c, start, nullptr),
            cudaSuccess);
  cudaDeviceSynchronize();
  ExpectClose(gxx.Get(), xc, 0, 0, "wpe forward");
  ExpectClose(gdwpe.Get(), dwpe, 1e-6, 1e-6, "wpe backward");
}

TEST(CudaKernels, OutputLayerSThenTMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  // One shard of 24 rows (20 valid) holding all of V = 20: C1 on one rank is local.
  const int n = 8, h = 32, rows = 24, valid = 20;
  const float d = 1.0f / n;
  auto x = Random(n * h, 20), w = Random(rows * h, 21, 0.2f);
  for (int i = valid * h; i < rows * h; ++i) w[i] = 0.0f;
  std::vector<int32_t> label = {0, 5, 19, 7, 7, 3, 12, 1};
  // Reference in double.
  std::vector<float> loss(n), grad(n * rows, 0.0f), dw(rows * h, 0.0f), gxr(n * h, 0.0f);
  for (int i = 0; i < n; ++i) {
    std::vector<double> y(valid);
    double m = -INFINITY;
    for (int j = 0; j < valid; ++j) {
      double a = 0;
      for (int k = 0; k < h; ++k) a += double(x[i * h + k]) * w[j * h + k];
      y[j] = a;
      m = std::max(m, a);
    }
    double s = 0;
    for (double a : y) s += std::exp(a - m);
    loss[i] = float(std::log(s) + m - y[label[i]]);
    for (int j = 0; j < valid; ++j) {
      grad[i * rows + j] = float(d * (std::exp(y[j] - m) / s - (j == label[i])));
    }
  }
  for (int j = 0; j < valid; ++j)
    for (int k = 0; k < h; ++k)
      for (int i = 0; i < n; ++i) dw[j * h + k] += grad[i * rows + j] * x[i * h + k];
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < h; ++k)
      for (int j = 0; j < valid; ++j) gxr[i * h + k] += grad[i * rows + j] * w[j * h + k];

  auto gemm = GemmRunner::Create();
  ASSERT_TRUE(gemm.ok());
  Dev<float> gx(x), gw(w), probs(n * rows), mx(n), sm(n), z(n), gmax(n), sums(2 * n), scale(n),
      gloss(n), gdw(rows * h), ggx(n * h);
  Dev<int32_t> glabel(label);
  ASSERT_TRUE(OutputLayerS(**gemm, probs.p, mx.p, sm.p, z.p, nullptr, gx.p, gw.p, glabel.p, n, h,
                           rows, valid, nullptr)
                  .ok());
  // C1 on one rank: the all-reduces are identities, so the global max is the local one.
  cudaMemcpy(gmax.p, mx.p, n * sizeof(float), cudaMemcpyDeviceToDevice);
  ASSERT_EQ(VocabC1Prepare(sums.p, scale.p, mx.p, gmax.p, sm.p, z.p, glabel.p, n, nullptr),
            cudaSuccess);
  ASSERT_EQ(VocabC1Finish(gloss.p, scale.p, sums.p, n, nullptr), cudaSuccess);
  ASSERT_TRUE(OutputLayerT(**gemm, probs.p, gdw.p, ggx.p, gx.p, gw.p, scale.p, glabel.p, d, n, h,
                           rows, valid, nullptr)
                  .ok());
  ExpectClose(gloss.Get(), loss, 1e-5, 1e-5, "loss");
  ExpectClose(probs.Get(), grad, 1e-4, 1e-6, "softmax - onehot");
  ExpectClose(gdw.Get(), dw, 1e-4, 1e-6, "dW");
  ExpectClose(ggx.Get(), gxr, 1e-4, 1e-6, "dX (Algorithm 1)");
  const auto dw_got = gdw.Get();
  for (int i = valid * h; i < rows * h; ++i) ASSERT_EQ(dw_got[i], 0.0f) << "padding row written";
}

// The S and T row kernels, both sets, against a float64 softmax of the same logits: rows of
// 1000 (16-byte accesses in fp32 and bf16; valid 997 leaves padding inside the last chunk) and
// 1002 (the vector kernels fall back), labels inside the shard, at its last valid row and
// absent (−1), and a shard with no valid rows.
TEST(CudaKernels, VocabSoftmaxRowKernelsMatchAFloat64Softmax) {
  SKIP_WITHOUT_DEVICE();
  const int n = 6;
  const float d = 0.25f;
  const std::vector<int32_t> label = {3, -1, 996, 0, 500, -1};
  for (MemoryKernels kernels : {MemoryKernels::kElement, MemoryKernels::kVector}) {
    for (const int64_t rows : {int64_t{1000}, int64_t{1002}}) {
      for (const int64_t valid : {rows - 3, int64_t{0}}) {
        SCOPED_TRACE(std::string(kernels == MemoryKernels::kVector ? "vector" : "element") +
                     " kernels, rows " + std::to_string(rows) + ", valid " + std::to_string(valid));
        auto logits = Random(size_t(n) * rows, 40, 4.0f);
        std::vector<float> mx(n), sum(n), z(n), probs(size_t(n) * rows, 0.0f), grad;
        const std::vector<float> scale = {1.0f, 0.5f, 2.0f, 1.5f, 0.75f, 1.0f};
        for (int i = 0; i < n; ++i) {
          double m = -INFINITY, total = 0;
          for (int64_t j = 0; j < valid; ++j) m = std::max<double>(m, logits[i * rows + j]);
          for (int64_t j = 0; j < valid; ++j) total += std::exp(logits[i * rows + j] - m);
          mx[i] = valid > 0 ? float(m) : -INFINITY;
          sum[i] = float(total);
          const bool local = valid > 0 && label[i] >= 0;
          z[i] = local ? float(logits[i * rows + label[i]] - m) : 0.0f;
          for (int64_t j = 0; j < valid; ++j) {
            probs[i * rows + j] = float(std::exp(logits[i * rows + j] - m) / total);
          }
        }
        grad = probs;
        for (int i = 0; i < n; ++i) {
          for (int64_t j = 0; j < valid; ++j) {
            grad[i * rows + j] = probs[i * rows + j] * d * scale[i] - (j == label[i] ? d : 0.0f);
          }
        }
        Dev<float> gy(logits), gmx(n), gsum(n), gz(n), gscale(scale);
        Dev<int32_t> glabel(label);
        ASSERT_EQ(VocabSoftmaxForward(gy.p, gmx.p, gsum.p, gz.p, glabel.p, n, rows, valid, nullptr,
                                      kernels),
                  cudaSuccess);
        if (valid > 0) {
          ExpectClose(gmx.Get(), mx, 0, 0, "m'");
        } else {
          for (float m : gmx.Get()) EXPECT_EQ(m, -INFINITY) << "m' of a shard with no rows";
        }
        ExpectClose(gsum.Get(), sum, 1e-5, 0, "s'");
        ExpectClose(gz.Get(), z, 1e-6, 1e-6, "label logit − m'");
        ExpectClose(gy.Get(), probs, 1e-5, 1e-9, "P' (padding 0)");
        ASSERT_EQ(
            VocabSoftmaxBackward(gy.p, gscale.p, glabel.p, d, n, rows, valid, nullptr, kernels),
            cudaSuccess);
        ExpectClose(gy.Get(), grad, 1e-5, 1e-8, "d·scale·P' − d·onehot");
      }
    }
  }
}

TEST(CudaKernels, AdamWMatchesCpuOptimizer) {
  SKIP_WITHOUT_DEVICE();
  const size_t count = 1000;
  auto p = Random(count, 22), g = Random(count, 23);
  std::vector<uint8_t> decay(count);
  for (size_t i = 0; i < count; ++i) decay[i] = i < 600;
  AdamWConfig cfg;
  auto opt = AdamW::Create(nullptr, count, cfg, {{0, 600, true}, {600, 400, false}});
  ASSERT_TRUE(opt.ok());
  std::vector<float> cpu_p = p;
  Dev<float> gp(p), gg(g), gm(count), gv(count);
  Dev<bf16> gbf(count);
  Dev<uint8_t> gdecay(decay);
  for (int step = 1; step <= 3; ++step) {
    opt->Step(cpu_p.data(), g.data(), 1e-3f, 0.5f);
    AdamWParams ap{.lr = 1e-3f,
                   .beta1 = cfg.beta1,
                   .beta2 = cfg.beta2,
                   .eps = cfg.eps,
                   .weight_decay = cfg.weight_decay,
                   .grad_scale = 0.5f,
                   .bc1 = 1.0 - std::pow(double(cfg.beta1), step),
                   .bc2 = 1.0 - std::pow(double(cfg.beta2), step)};
    ASSERT_EQ(AdamWStep(gp.p, gbf.p, gg.p, gm.p, gv.p, gdecay.p, count, ap, nullptr), cudaSuccess);
  }
  ExpectClose(gp.Get(), cpu_p, 1e-6, 1e-7, "master weights");
  Dev<float> back(count);
  ASSERT_EQ(Bf16ToFloat(back.p, gbf.p, count, nullptr), cudaSuccess);
  ExpectClose(back.Get(), cpu_p, 1.0 / 256, 0, "bf16 params");
}

// VOCABPIPE_MEMORY_KERNELS=vector: AdamW four elements per access equals the element kernel (the
// same per-element function; to 2e-7 relative, in case the compiler contracts differently), on a
// count with a tail (1003 = 4·250 + 3), from a 16-byte aligned shard start (offset 4: the vector
// kernel) and from a misaligned one (offset 2: the fall-back), with and without the bf16 copy.
TEST(CudaKernels, AdamWVectorKernelMatchesTheElementKernel) {
  SKIP_WITHOUT_DEVICE();
  const size_t count = 1003, pad = 8;
  const auto p = Random(count + pad, 24), g = Random(count + pad, 25, 0.1f);
  std::vector<uint8_t> decay(count + pad);
  for (size_t i = 0; i < decay.size(); ++i) decay[i] = i % 3 != 0;
  for (const size_t offset : {size_t{4}, size_t{2}}) {
    for (const bool copy : {true, false}) {
      std::vector<float> results[2][4];  // per kernel set: master, m, v, params
      const MemoryKernels sets[2] = {MemoryKernels::kElement, MemoryKernels::kVector};
      for (int k = 0; k < 2; ++k) {
        Dev<float> gp(p), gg(g), gm(count + pad), gv(count + pad);
        Dev<bf16> gbf(count + pad);
        Dev<uint8_t> gdecay(decay);
        for (int step = 1; step <= 3; ++step) {
          AdamWParams ap{.lr = 1e-3f,
                         .grad_scale = 0.5f,
                         .bc1 = 1.0 - std::pow(0.9, step),
                         .bc2 = 1.0 - std::pow(0.95, step)};
          ASSERT_EQ(AdamWStep(gp.p + offset, copy ? gbf.p + offset : nullptr, gg.p + offset,
                              gm.p + offset, gv.p + offset, gdecay.p + offset, count, ap, nullptr,
                              sets[k]),
                    cudaSuccess);
        }
        results[k][0] = gp.Get();
        results[k][1] = gm.Get();
        results[k][2] = gv.Get();
        results[k][3] = Download(gbf);
      }
      const char* names[] = {"master", "m", "v", "bf16 params"};
      for (int a = 0; a < 4; ++a) {
        ExpectClose(results[1][a], results[0][a], 2e-7, 0, names[a]);
      }
      // The elements outside the shard are untouched; inside, the update happened.
      EXPECT_EQ(results[1][0][offset - 1], p[offset - 1]);
      EXPECT_EQ(results[1][0][offset + count], p[offset + count]);
      EXPECT_NE(results[1][0][offset + count - 1], p[offset + count - 1]);
    }
  }
}

// cuda_bench's breakdown: without a timer MarkPhase does nothing; with one, the time between
// marks on its stream goes to the earlier mark's phase, marks on other streams are ignored and
// Collect starts a new window.
TEST(PhaseTimer, NamesAreDistinctAndMarksWithoutATimerAreFree) {
  std::vector<std::string> names;
  for (int i = 0; i < kPhaseCount; ++i) names.emplace_back(PhaseName(static_cast<Phase>(i)));
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
  MarkPhase(nullptr, Phase::kAttention);  // no timer: no CUDA call, so no device needed
}

TEST(PhaseTimer, ChargesDeviceTimeToTheMarkedPhases) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t stream = nullptr, other = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  constexpr long kN = 1 << 24;  // 64 MiB of fp32 → 32 MiB of bf16: tens of microseconds
  Dev<float> src(kN);
  Dev<bf16> dst(kN);
  {
    auto timer = PhaseTimer::Start(stream, 16);
    ASSERT_TRUE(timer.ok()) << timer.status();
    EXPECT_FALSE(PhaseTimer::Start(stream).ok());  // one at a time
    MarkPhase(stream, Phase::kAttention);
    for (int i = 0; i < 4; ++i) ASSERT_EQ(FloatToBf16(dst.p, src.p, kN, stream), cudaSuccess);
    MarkPhase(other, Phase::kCopy);  // another stream: ignored
    MarkPhase(stream, Phase::kNorm);
    ASSERT_EQ(FloatToBf16(dst.p, src.p, kN, stream), cudaSuccess);
    auto b = (*timer)->Collect();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->marks[static_cast<int>(Phase::kAttention)], 1);
    EXPECT_EQ(b->marks[static_cast<int>(Phase::kNorm)], 1);
    EXPECT_EQ(b->marks[static_cast<int>(Phase::kCopy)], 0);
    EXPECT_GT(b->ms[static_cast<int>(Phase::kAttention)], 0.0);
    EXPECT_GT(b->ms[static_cast<int>(Phase::kNorm)], 0.0);
    // Four conversions against one (generous: launch gaps and clocks vary).
    EXPECT_GT(b->ms[static_cast<int>(Phase::kAttention)],
              1.5 * b->ms[static_cast<int>(Phase::kNorm)]);
    EXPECT_EQ((*timer)->dropped(), 0);
    auto empty = (*timer)->Collect();  // a new window: nothing marked since
    ASSERT_TRUE(empty.ok());
    EXPECT_EQ(empty->total_ms(), 0.0);
    // Over capacity: the marks past it are dropped and counted.
    for (int i = 0; i < 20; ++i) MarkPhase(stream, Phase::kOther);
    auto full = (*timer)->Collect();
    ASSERT_TRUE(full.ok());
    EXPECT_GT((*timer)->dropped(), 0);
  }
  auto again = PhaseTimer::Start(stream, 4);  // the first one deactivated itself
  EXPECT_TRUE(again.ok());
  again->reset();
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(other), cudaSuccess);
}

// Last in the file and in a suite of its own, so it runs last: a fault in these kernels would be
// sticky and fail every later test.
// The mma.sync flash kernels (attention_flash.cu, VOCABPIPE_ATTENTION=flash) on the tensor-core
// test's shapes, which cover partial tiles, chunks off the tile grid, both head_dim buckets,
// element loads and grouped-query attention, plus the model's head_dims over sequences of
// 1000 rows (16 tiles, the last partial; the causal skip of whole tiles, the heaviest-first
// block order).
void CheckFlashAttention(AttentionKernels kernels) {
  constexpr AttentionTolerance kTol{2e-2, 2e-2, 2e-2, 1e-4};
  CheckAttention<bf16>(
      {.batch = 2, .heads = 2, .head_dim = 64, .q_begin = 0, .q_end = 200, .kv_rows = 200}, 400,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 3, .head_dim = 32, .q_begin = 70, .q_end = 150, .kv_rows = 192}, 410,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 128, .q_begin = 0, .q_end = 130, .kv_rows = 130}, 420,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 80, .q_begin = 20, .q_end = 90, .kv_rows = 96}, 430,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 20, .q_begin = 5, .q_end = 77, .kv_rows = 80}, 440, kTol,
      kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 1, .head_dim = 64, .q_begin = 40, .q_end = 41, .kv_rows = 48}, 450,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 1, .heads = 1, .head_dim = 64, .q_begin = 64, .q_end = 128, .kv_rows = 128}, 460,
      kTol, kernels);
  CheckAttention<bf16>({.batch = 2,
                        .heads = 8,
                        .head_dim = 64,
                        .q_begin = 33,
                        .q_end = 161,
                        .kv_rows = 192,
                        .kv_heads = 2},
                       470, kTol, kernels);
  CheckAttention<bf16>({.batch = 1,
                        .heads = 4,
                        .head_dim = 128,
                        .q_begin = 0,
                        .q_end = 100,
                        .kv_rows = 100,
                        .kv_heads = 1},
                       480, kTol, kernels);
  // GPT-2 (head_dim 128 at h 2048 / 16 heads; 64 at GPT-2 small) and Llama (128, 4 → 1 here)
  // over 1000 rows.
  CheckAttention<bf16>(
      {.batch = 1, .heads = 2, .head_dim = 128, .q_begin = 0, .q_end = 1000, .kv_rows = 1000}, 490,
      kTol, kernels);
  CheckAttention<bf16>(
      {.batch = 2, .heads = 1, .head_dim = 64, .q_begin = 0, .q_end = 1000, .kv_rows = 1000}, 500,
      kTol, kernels);
  CheckAttention<bf16>({.batch = 1,
                        .heads = 4,
                        .head_dim = 128,
                        .q_begin = 0,
                        .q_end = 1000,
                        .kv_rows = 1000,
                        .kv_heads = 1},
                       510, kTol, kernels);
}

TEST(CudaFlashAttention, MatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  CheckFlashAttention(AttentionKernels::kFlash);
}

// The same shapes through the pipelined flash kernels (double-buffered cp.async tile loads,
// ldmatrix operands; VOCABPIPE_ATTENTION=flash-pipelined): head_dim 20 takes their synchronous
// fall-back loads, every other shape the asynchronous ones; the 1000-row sequences stream 16 key
// tiles through the two stages, and grouped-query attention streams 4 heads' query tiles.
TEST(CudaFlashAttention, PipelinedMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  CheckFlashAttention(AttentionKernels::kFlashPipelined);
}

// The wide forward (128 query rows per block, 32 per warp as two m-tiles; VOCABPIPE_ATTENTION=
// flash-wide) with the pipelined backward, on the same shapes: chunks whose queries end inside
// a block's second m-tile or a warp's second half (100, 128 and 1000 rows), query tiles off the
// key grid (q_begin 33), head_dim 20 through the synchronous fall-back loads, grouped-query.
TEST(CudaFlashAttention, WideMatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  CheckFlashAttention(AttentionKernels::kFlashWide);
}

// Last in the file: a library path never run before on a GPU, so a fault in it (a sticky CUDA
// error ends the process) cannot cost the kernel tests above.
//
// cuDNN's fused attention (attention_cudnn.h) against the CPU, with the kernels' bf16 tolerance
// (P and dS are rounded to bf16 before their products there too): whole sequences — GPT-2's
// head_dim on 200 rows (no multiple of cuDNN's 64-row tiles), Llama's 128 with grouped-query
// attention (dK/dV summed over each group); and Seq1F1B's chunks, whose dK/dV cuDNN computes
// into its workspace and adds to the cache's gradient rows [0, q_end) (which start nonzero here,
// as after a later chunk's backward): the first (positions 0-95 of a 192-row cache), a middle
// one off cuDNN's 64-row tiles (positions 70-169 of 224: the bottom-right causal diagonal) and a
// grouped last one (128-255 of 256 at head_dim 128). Chunks past position 0 need cuDNN 9.6
// (lengths off multiples of 64): before it they run on the kernels, which the test says.
TEST(CudaCudnnAttention, MatchesCpu) {
  SKIP_WITHOUT_DEVICE();
  MemoryTracker tracker;
  CachingAllocator alloc(MakeCudaMemoryBackend(), &tracker, CachingAllocator::Reuse::kImmediate);
  absl::StatusOr<std::unique_ptr<CudnnAttention>> dnn = CudnnAttention::Create(&alloc);
  ASSERT_TRUE(dnn.ok()) << dnn.status();
  std::printf("cuDNN %ld\n", static_cast<long>((*dnn)->version()));
  constexpr AttentionTolerance kTol{2e-2, 2e-2, 2e-2, 1e-4};
  constexpr auto kAny = AttentionKernels::kDefault;
  if ((*dnn)->version() < 90600) std::printf("cuDNN before 9.6: the middle chunk on the kernels\n");
  if ((*dnn)->version() <= 91500) {  // the cases with 200, 130, 96 and 170 keys
    std::printf("cuDNN up to 9.15: backward passes off 128 keys with the padding workaround\n");
  }
  struct Case {
    cpu::AttentionShape shape;
    uint32_t seed;
  };
  const Case cases[] = {
      // Whole sequences: 200 rows at head_dim 64; grouped 8 -> 2 at 128.
      {{.batch = 2, .heads = 2, .head_dim = 64, .q_begin = 0, .q_end = 200, .kv_rows = 200}, 400},
      {{.batch = 1, .heads = 8, .head_dim = 128, .q_end = 130, .kv_rows = 130, .kv_heads = 2}, 410},
      // Seq1F1B chunks: the first, a middle one off the 64-row tiles, a grouped last one.
      {{.batch = 2, .heads = 3, .head_dim = 64, .q_begin = 0, .q_end = 96, .kv_rows = 192}, 420},
      {{.batch = 2, .heads = 2, .head_dim = 64, .q_begin = 70, .q_end = 170, .kv_rows = 224}, 430},
      {{.batch = 1,
        .heads = 4,
        .head_dim = 128,
        .q_begin = 128,
        .q_end = 256,
        .kv_rows = 256,
        .kv_heads = 2},
       440},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "seed " << c.seed);
    CheckAttention<bf16>(c.shape, c.seed, kTol, kAny, dnn->get());
  }
  // RunAttention* falls back to the kernels where cuDNN finds no engine: none of these may have.
  EXPECT_EQ((*dnn)->refused_shapes(), 0) << (*dnn)->last_refusal();
}

}  // namespace
}  // namespace vp::engine::cuda
