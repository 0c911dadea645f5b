// Private to kernels/cpu: when a kernel's row loop is worth a parallel region.
//
// Every threaded kernel splits work so that each output element is computed by one thread with
// the same operations in the same order as the one-thread loop (rows for row-wise kernels,
// column blocks for sums over rows), so results are bit-identical for any thread count.
#pragma once

namespace vp::engine::cpu {

// Floats a kernel touches below which it stays on the calling thread: waking the team costs a
// few microseconds, more than a small loop (the tiny models of the tests and demos).
inline constexpr long kParallelMinWork = 1L << 15;

// Column block of the sums over rows (bias and norm weight gradients): 64 floats, one
// cache-line-aligned strip per thread at a time.
inline constexpr int kColumnBlock = 64;

}  // namespace vp::engine::cpu
