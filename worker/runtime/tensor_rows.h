// Which token rows a tensor rank holds (docs/tensor-parallel.md, "Rows"). Under sequence
// parallelism a rank of a tensor group of t holds, of every sequence chunk q of a microbatch,
// block r of the chunk's n_q = b·len_q token rows flattened batch-major: rows [r·n_q/t,
// (r+1)·n_q/t). The transformer passes, the pipeline transfers and the output layer work on
// those blocks; the input layer's lookup of a whole microbatch gives each rank its blocks of
// every chunk, q = 0..k-1 in order (its "embedding rows"), when it is fed the microbatch's
// tokens in gather order: rank 0's blocks, then rank 1's, ...
//
// Letters: b microbatch size, s sequence length, k sequence chunks, t the tensor group's size.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace vp::runtime {

class TensorRows {
 public:
  TensorRows(int t, int r, int b, std::vector<int> seq_bounds)
      : t_(t), r_(r), b_(b), bounds_(std::move(seq_bounds)) {}

  int size() const { return t_; }
  int k() const { return static_cast<int>(bounds_.size()) - 1; }
  int Len(int q) const { return bounds_[q + 1] - bounds_[q]; }
  // The chunk q whose first position is `start`.
  int ChunkAt(int start) const {
    for (int q = 0; q < k(); ++q) {
      if (bounds_[q] == start) return q;
    }
    return -1;
  }
  // Rows of chunk q this rank holds: b·len_q / t.
  int LocalRows(int q) const { return b_ * Len(q) / t_; }
  // Where chunk q's rows start among this rank's embedding rows.
  int EmbedOffset(int q) const {
    int at = 0;
    for (int p = 0; p < q; ++p) at += LocalRows(p);
    return at;
  }
  // Rows of a whole microbatch this rank holds: b·s / t.
  int EmbedRows() const { return EmbedOffset(k()); }
  // (sample, position) of the i-th row of chunk q that rank `rank` holds.
  std::pair<int, int> Row(int q, int i, int rank) const {
    const int j = rank * LocalRows(q) + i;  // row of the chunk, flattened (b, len)
    return {j / Len(q), bounds_[q] + j % Len(q)};
  }
  std::pair<int, int> Row(int q, int i) const { return Row(q, i, r_); }
  // A microbatch's (b, s) values in gather order: for each rank, its blocks of every chunk.
  std::vector<int32_t> GatherOrder(const int32_t* values, int s) const {
    std::vector<int32_t> out;
    out.reserve(static_cast<size_t>(b_) * s);
    for (int rank = 0; rank < t_; ++rank) {
      for (int q = 0; q < k(); ++q) {
        for (int i = 0; i < LocalRows(q); ++i) {
          const auto [sample, pos] = Row(q, i, rank);
          out.push_back(values[static_cast<size_t>(sample) * s + pos]);
        }
      }
    }
    return out;
  }

 private:
  int t_, r_, b_;
  std::vector<int> bounds_;
};

}  // namespace vp::runtime
