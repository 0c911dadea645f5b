// Row-major single-precision GEMM through OpenBLAS. Every matrix product in the CPU engine
// (linear layers, attention, the vocabulary S/T passes) goes through here, so thread count and
// layout conventions live in one place.
#pragma once

namespace vp::engine::cpu {

// C (m,n) = alpha * op(A) (m,k) * op(B) (k,n) + beta * C, all row-major.
// op(A) = A (m,k; lda >= k) or, with trans_a, A stored as (k,m; lda >= m); likewise for B.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);

// Fixes the number of threads OpenBLAS uses in this process (0 = all cores). Call once at start;
// elementwise kernels are single-threaded, so BLAS never competes with another thread pool.
void SetBlasThreads(int threads);
int BlasThreads();

}  // namespace vp::engine::cpu
