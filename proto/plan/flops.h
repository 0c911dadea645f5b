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
// A Llama layer, kv = kv_heads·head_dim (the K and V width; h without grouping): q and o are
// h×h, k and v h×kv, SwiGLU has three h×f matrices (gate, up, down), so the forward is
// 2bs(2h² + 2h·kv + 3hf) + 4bs²h. Norms, RoPE and SwiGLU's elementwise work are not counted,
// as GPT-2's LayerNorm and GELU are not.
constexpr double LlamaLayerForward(double b, double s, double h, double f, double kv) {
  return 2 * b * s * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * b * s * s * h;
}
constexpr double LlamaLayer(double b, double s, double h, double f, double kv) {
  return 3 * LlamaLayerForward(b, s, h, f, kv);
}
// The output layer (logits matmul forward, and its two backward matmuls): 6bshV.
constexpr double OutputLayer(double b, double s, double h, double V) { return 6 * b * s * h * V; }
// The input layer (embedding gather and scatter-add): 3bsh.
constexpr double InputLayer(double b, double s, double h) { return 3 * b * s * h; }

}  // namespace vp::flops
