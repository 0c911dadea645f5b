// The one FLOP model (paper Table 4) shared by the planner's costs and MFU and the runtime's
// measured MFU, so that predicted and measured MFU count the same work.
//
// Letters: b microbatch size (sequences), s sequence length, h hidden size, f FFN hidden size,
// V vocabulary size. A transformer layer's forward is 2bs(4h² + 2hf) for the matmuls plus
// 4bs²h for attention scores and values; backward (B + W) is twice the forward.
#pragma once

namespace vp::flops {

constexpr double TransformerLayerForward(double b, double s, double h, double f) {
  return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h;
}
// Forward + backward of one layer for one microbatch.
constexpr double TransformerLayer(double b, double s, double h, double f) {
  return 3 * TransformerLayerForward(b, s, h, f);
}
// The output layer (logits matmul forward, and its two backward matmuls): 6bshV.
constexpr double OutputLayer(double b, double s, double h, double V) { return 6 * b * s * h * V; }
// The input layer (embedding gather and scatter-add): 3bsh.
constexpr double InputLayer(double b, double s, double h) { return 3 * b * s * h; }

}  // namespace vp::flops
