// LayerNorm. Rows are split over the calling thread's OpenMP team (blas.h, "Threads"); the
// weight gradient, a sum over rows, is split by column strips instead, each summing its rows in
// order, so every result is the one-thread result bit for bit.
#include <omp.h>

#include <cmath>

#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, int n, int c) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<long>(i) * c;
    float* y = out + static_cast<long>(i) * c;
    // Double accumulators: the statistics are cheap and this keeps them independent of c.
    double sum = 0.0;
    for (int j = 0; j < c; ++j) sum += x[j];
    const double m = sum / c;
    double var = 0.0;
    for (int j = 0; j < c; ++j) var += (x[j] - m) * (x[j] - m);
    const float s = static_cast<float>(1.0 / std::sqrt(var / c + kLayerNormEps));
    const float mf = static_cast<float>(m);
    for (int j = 0; j < c; ++j) y[j] = (x[j] - mf) * s * weight[j] + bias[j];
    mean[i] = mf;
    rstd[i] = s;
  }
}

void LayerNormBackwardInput(float* dinp, const float* dout, const float* inp, const float* weight,
                            const float* mean, const float* rstd, int n, int c) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
  for (int i = 0; i < n; ++i) {
    const float* dy = dout + static_cast<long>(i) * c;
    const float* x = inp + static_cast<long>(i) * c;
    float* dx = dinp + static_cast<long>(i) * c;
    const float m = mean[i];
    const float s = rstd[i];
    // Two reductions first: mean(dnorm) and mean(dnorm * xhat), dnorm = dy * weight.
    double dnorm_mean = 0.0, dnorm_xhat_mean = 0.0;
    for (int j = 0; j < c; ++j) {
      const float dnorm = dy[j] * weight[j];
      dnorm_mean += dnorm;
      dnorm_xhat_mean += static_cast<double>(dnorm) * ((x[j] - m) * s);
    }
    const float a = static_cast<float>(dnorm_mean / c);
    const float b = static_cast<float>(dnorm_xhat_mean / c);
    for (int j = 0; j < c; ++j) {
      const float xhat = (x[j] - m) * s;
      dx[j] += s * (dy[j] * weight[j] - a - xhat * b);
    }
  }
}

void LayerNormBackwardWeight(float* dweight, float* dbias, const float* dout, const float* inp,
                             const float* mean, const float* rstd, int n, int c) {
  const long work = static_cast<long>(n) * c;
#pragma omp parallel if (work >= kParallelMinWork)
  {
    int j0, j1;
    ColumnStrip(c, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
    for (int i = 0; i < n; ++i) {
      const float* dy = dout + static_cast<long>(i) * c;
      const float* x = inp + static_cast<long>(i) * c;
      const float m = mean[i];
      const float s = rstd[i];
      for (int j = j0; j < j1; ++j) {
        dweight[j] += dy[j] * ((x[j] - m) * s);
        dbias[j] += dy[j];
      }
    }
  }
}

}  // namespace vp::engine::cpu
