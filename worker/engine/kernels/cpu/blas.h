// Row-major single-precision GEMM through OpenBLAS, and the CPU engine's thread count. Every
// matrix product in the CPU engine (linear layers, attention, the vocabulary S/T passes) goes
// through here, so thread count and layout conventions live in one place.
//
// Threads: OpenBLAS is Debian's OpenMP build, and the row loops of the elementwise kernels are
// `omp parallel for` regions, so BLAS and our kernels run on one libgomp pool: the team of the
// thread that calls them. A GEMM called inside a parallel region (attention's per-head products)
// runs single-threaded on its caller, so the two never nest or oversubscribe.
#pragma once

namespace vp::engine::cpu {

// C (m,n) = alpha * op(A) (m,k) * op(B) (k,n) + beta * C, all row-major.
// op(A) = A (m,k; lda >= k) or, with trans_a, A stored as (k,m; lda >= m); likewise for B.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);

// Sets how many threads the GEMMs and the elementwise kernels called *from this thread* use
// (0 = all cores). The count is OpenMP's per-thread nthreads setting, so a thread that runs a
// rank (a worker's main thread, a test's rank thread) calls it before its first kernel; a thread
// that never calls it uses all cores (or OMP_NUM_THREADS).
void SetBlasThreads(int threads);
// The calling thread's count.
int BlasThreads();

// True when the OpenBLAS loaded at run time is its OpenMP build (the one CMake links, found by
// the binaries' RUNPATH). Another build would keep a second thread pool that competes with the
// kernels' one; the results are the same, only slower.
bool BlasUsesOpenMp();

}  // namespace vp::engine::cpu
