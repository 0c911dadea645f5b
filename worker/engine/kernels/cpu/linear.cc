// Linear layers: one GEMM each (threaded by OpenBLAS); the bias loops are split over the same
// OpenMP team, the bias gradient by column strips so each column sums its rows in order.
#include <omp.h>

#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/kernels.h"
#include "worker/engine/kernels/cpu/parallel.h"

namespace vp::engine::cpu {

void LinearForward(float* out, const float* inp, const float* weight, const float* bias, int n,
                   int in_dim, int out_dim) {
  if (bias != nullptr) {
    // Seed out with the bias and let the GEMM accumulate onto it (beta = 1): one pass.
    const long work = static_cast<long>(n) * out_dim;
#pragma omp parallel for schedule(static) if (work >= kParallelMinWork)
    for (int i = 0; i < n; ++i) {
      float* row = out + static_cast<long>(i) * out_dim;
      for (int j = 0; j < out_dim; ++j) row[j] = bias[j];
    }
  }
  Gemm(false, false, n, out_dim, in_dim, 1.0f, inp, in_dim, weight, out_dim,
       bias != nullptr ? 1.0f : 0.0f, out, out_dim);
}

void LinearBackwardInput(float* dinp, const float* dout, const float* weight, int n, int in_dim,
                         int out_dim) {
  Gemm(false, true, n, in_dim, out_dim, 1.0f, dout, out_dim, weight, out_dim, 0.0f, dinp, in_dim);
}

void LinearBackwardWeight(float* dweight, float* dbias, const float* dout, const float* inp, int n,
                          int in_dim, int out_dim) {
  Gemm(true, false, in_dim, out_dim, n, 1.0f, inp, in_dim, dout, out_dim, 1.0f, dweight, out_dim);
  if (dbias != nullptr) {
    const long work = static_cast<long>(n) * out_dim;
#pragma omp parallel if (work >= kParallelMinWork)
    {
      int j0, j1;
      ColumnStrip(out_dim, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);
      for (int i = 0; i < n; ++i) {
        const float* row = dout + static_cast<long>(i) * out_dim;
        for (int j = j0; j < j1; ++j) dbias[j] += row[j];
      }
    }
  }
}

}  // namespace vp::engine::cpu
