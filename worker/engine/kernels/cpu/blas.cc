#include "worker/engine/kernels/cpu/blas.h"

#include <cblas.h>
#include <omp.h>

#include <thread>

namespace vp::engine::cpu {

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void SetBlasThreads(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads <= 0) threads = 1;
  // OpenBLAS's OpenMP build sizes each GEMM's team by omp_get_max_threads() of its caller, so
  // the per-thread OpenMP setting is the one that counts; openblas_set_num_threads keeps the
  // library's own count (and its per-thread buffers) in step.
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

int BlasThreads() { return omp_get_max_threads(); }

bool BlasUsesOpenMp() { return openblas_get_parallel() == OPENBLAS_OPENMP; }

}  // namespace vp::engine::cpu
