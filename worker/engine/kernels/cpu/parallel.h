// Private to kernels/cpu: when a kernel's row loop is worth a parallel region.
//
// Every threaded kernel splits work so that each output element is computed by one thread with
// the same operations in the same order as the one-thread loop (rows for row-wise kernels,
// column strips for sums over rows), so results are bit-identical for any thread count.
#pragma once

// A loop function marked VP_ALSO_AVX512 is compiled twice: for AVX-512 hosts (x86-64-v4, 16
// float lanes) and for the build's x86-64-v2 baseline (4 lanes); the loader picks one (an
// ifunc). The files that use it compile with -ffp-contract=off (worker/engine/CMakeLists.txt),
// so neither clone fuses a multiply-add and both give the same bits. Only the elementwise loops
// get it: OpenBLAS already dispatches its GEMM kernels by host.
#define VP_ALSO_AVX512 __attribute__((target_clones("arch=x86-64-v4", "default")))

namespace vp::engine::cpu {

// Floats a kernel touches below which it stays on the calling thread: waking the team costs a
// few microseconds, more than a small loop (the tiny models of the tests and demos).
inline constexpr long kParallelMinWork = 1L << 15;

// Columns [*begin, *end) of c that thread `id` of a team of `threads` sums over the rows (bias
// and norm weight gradients): one contiguous strip per thread, cut at multiples of 16 floats
// (a 64-byte cache line) so two threads never write the same line. Each strip is read row by
// row, as the one-thread loop reads whole rows.
inline void ColumnStrip(int c, int id, int threads, int* begin, int* end) {
  const int lines = (c + 15) / 16;
  const int first = static_cast<int>(static_cast<long>(lines) * id / threads);
  const int last = static_cast<int>(static_cast<long>(lines) * (id + 1) / threads);
  *begin = first * 16 < c ? first * 16 : c;
  *end = last * 16 < c ? last * 16 : c;
}

}  // namespace vp::engine::cpu
