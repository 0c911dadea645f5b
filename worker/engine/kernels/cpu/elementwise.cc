// GELU, residual add and position embedding: the elementwise kernels. Each loop is split over
// the calling thread's OpenMP team (blas.h, "Threads"); every element is computed the same way
// by whichever thread owns it, so the result does not depend on the thread count. GELU's tanh
// is fast_exp.h's, so its loops vectorize (-O3, and an AVX-512 clone: parallel.h).
#include <omp.h>

#include <cmath>
#include <numbers>

#include "worker/engine/kernels/cpu/fast_exp.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {
namespace {
// sqrt(2/pi), the tanh-GELU constant.
const float kGeluScale = static_cast<float>(std::sqrt(2.0 / std::numbers::pi));
constexpr float kGeluCubic = 0.044715f;

// Elements [begin, end) of each GELU pass (parallel.h: VP_ALSO_AVX512).
VP_ALSO_AVX512 void GeluForwardRange(float* out, const float* inp, long begin, long end) {
  for (long i = begin; i < end; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    out[i] = 0.5f * x * (1.0f + Tanh(u));
  }
}

VP_ALSO_AVX512 void GeluBackwardRange(float* dinp, const float* inp, const float* dout, long begin,
                                      long end) {
  for (long i = begin; i < end; ++i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + kGeluCubic * x * x * x);
    const float t = Tanh(u);
    const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    const float grad = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    dinp[i] = dout[i] * grad;
  }
}

// Splits elements [0, n) over the calling thread's team, one contiguous range per thread:
// range(begin, end) runs once per thread (once in all when n is small).
template <typename RangeFn>
void SplitElements(long n, RangeFn range) {
#pragma omp parallel if (n >= kParallelMinWork)
  {
    const long id = omp_get_thread_num(), threads = omp_get_num_threads();
    range(n * id / threads, n * (id + 1) / threads);
  }
}
}  // namespace

void GeluForward(float* out, const float* inp, long n) {
  SplitElements(n, [&](long begin, long end) { GeluForwardRange(out, inp, begin, end); });
}

void GeluBackward(float* dinp, const float* inp, const float* dout, long n) {
  SplitElements(n, [&](long begin, long end) { GeluBackwardRange(dinp, inp, dout, begin, end); });
}

void ResidualForward(float* out, const float* a, const float* b, long n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinWork)
  for (long i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void ResidualBackward(float* da, float* db, const float* dout, long n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinWork)
  for (long i = 0; i < n; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

void PositionEmbeddingForward(float* x, const float* wpe, int batch, int t, int c, int start_pos) {
  const long rows = static_cast<long>(batch) * t;
#pragma omp parallel for schedule(static) if (rows * c >= kParallelMinWork)
  for (long r = 0; r < rows; ++r) {
    float* row = x + r * c;
    const float* pos = wpe + static_cast<long>(start_pos + r % t) * c;
    for (int j = 0; j < c; ++j) row[j] += pos[j];
  }
}

void PositionEmbeddingBackward(float* dwpe, const float* dx, int batch, int t, int c,
                               int start_pos) {
  // Threads own positions; each position sums its batch rows in order b = 0, 1, ...
  const long work = static_cast<long>(batch) * t * c;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int i = 0; i < t; ++i) {
    float* pos = dwpe + static_cast<long>(start_pos + i) * c;
    for (int b = 0; b < batch; ++b) {
      const float* row = dx + (static_cast<long>(b) * t + i) * c;
      for (int j = 0; j < c; ++j) pos[j] += row[j];
    }
  }
}

}  // namespace vp::engine::cpu
