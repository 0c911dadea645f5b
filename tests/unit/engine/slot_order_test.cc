// The pass-order rules that the CPU LayerStack and the CUDA DeviceLayerStack share
// (worker/engine/transformer/slot_order.h), checked here without tensors or a device.
#include "worker/engine/transformer/slot_order.h"

#include <gtest/gtest.h>

#include <string>

namespace vp::engine {
namespace {

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& part) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(std::string(s.message()).find(part), std::string::npos) << s;
}

TEST(SlotOrder, ForwardInOrderBackwardInReverseWeightAfterBackward) {
  SlotOrder order(2);
  ExpectStatus(order.CheckForward({0, 2}), absl::StatusCode::kInvalidArgument, "slot.seq");
  ExpectStatus(order.CheckForward({0, 1}), absl::StatusCode::kFailedPrecondition, "expected seq 0");
  ExpectStatus(order.CheckBackwardInput({0, 0}), absl::StatusCode::kFailedPrecondition,
               "not forwarded");
  ExpectStatus(order.CheckBackwardWeight({0, 0}), absl::StatusCode::kFailedPrecondition, "needs B");

  ASSERT_TRUE(order.CheckForward({0, 0}).ok());
  order.ForwardDone({0, 0});
  EXPECT_EQ(order.live_slots(), 1);
  ExpectStatus(order.CheckForward({0, 0}), absl::StatusCode::kFailedPrecondition,
               "already forwarded");
  // B needs every sequence chunk of the microbatch forwarded.
  ExpectStatus(order.CheckBackwardInput({0, 0}), absl::StatusCode::kFailedPrecondition,
               "expected seq 1");
  ASSERT_TRUE(order.CheckForward({0, 1}).ok());
  order.ForwardDone({0, 1});
  // Another microbatch interleaves freely.
  ASSERT_TRUE(order.CheckForward({1, 0}).ok());
  order.ForwardDone({1, 0});
  // Backward in reverse order.
  ExpectStatus(order.CheckBackwardInput({0, 0}), absl::StatusCode::kFailedPrecondition,
               "reverse order; expected seq 1");
  ExpectStatus(order.CheckBackwardWeight({0, 1}), absl::StatusCode::kFailedPrecondition, "needs B");
  ASSERT_TRUE(order.CheckBackwardInput({0, 1}).ok());
  EXPECT_FALSE(order.BackwardInputDone({0, 1}));  // seq 0 still to go
  ExpectStatus(order.CheckBackwardInput({0, 1}), absl::StatusCode::kFailedPrecondition,
               "backward already ran");
  ASSERT_TRUE(order.CheckBackwardWeight({0, 1}).ok());
  order.BackwardWeightDone({0, 1});
  EXPECT_EQ(order.live_slots(), 2);
  ExpectStatus(order.CheckBackwardWeight({0, 1}), absl::StatusCode::kFailedPrecondition, "needs B");
  ASSERT_TRUE(order.CheckBackwardInput({0, 0}).ok());
  EXPECT_TRUE(order.BackwardInputDone({0, 0}));  // the microbatch's last B
  // W may be deferred past other passes; the finished microbatch id starts afresh at seq 0.
  ExpectStatus(order.CheckForward({0, 1}), absl::StatusCode::kFailedPrecondition, "expected seq 0");
  ASSERT_TRUE(order.CheckBackwardWeight({0, 0}).ok());
  order.BackwardWeightDone({0, 0});
  EXPECT_EQ(order.live_slots(), 1);  // microbatch 1's forward
}

TEST(SlotOrder, StackArgumentsAreCheckedOnce) {
  ModelConfig cfg{.layers = 2,
                  .hidden = 8,
                  .heads = 2,
                  .vocab = 16,
                  .seq_len = 8,
                  .ffn_hidden = 32,
                  .tie_embeddings = false};
  float p = 0, g = 0;
  EXPECT_TRUE(ValidateLayerStackArgs(cfg, 0, 2, 1, &p, &g, {0, 4, 8}).ok());
  ExpectStatus(ValidateLayerStackArgs(cfg, 1, 2, 1, &p, &g, {0, 8}),
               absl::StatusCode::kInvalidArgument, "layers [1, 3)");
  ExpectStatus(ValidateLayerStackArgs(cfg, 0, 1, 0, &p, &g, {0, 8}),
               absl::StatusCode::kInvalidArgument, "microbatch_size");
  ExpectStatus(ValidateLayerStackArgs(cfg, 0, 1, 1, nullptr, &g, {0, 8}),
               absl::StatusCode::kInvalidArgument, "params/grads");
  ExpectStatus(ValidateLayerStackArgs(cfg, 0, 1, 1, &p, &g, {0, 4, 4, 8}),
               absl::StatusCode::kInvalidArgument, "seq_bounds: must be strictly increasing");
  ExpectStatus(ValidateLayerStackArgs(cfg, 0, 1, 1, &p, &g, {0, 7}),
               absl::StatusCode::kInvalidArgument, "seq_bounds: must start at 0 and end at");
  cfg.heads = 3;
  ExpectStatus(ValidateLayerStackArgs(cfg, 0, 1, 1, &p, &g, {0, 8}),
               absl::StatusCode::kInvalidArgument, "hidden % heads");
  EXPECT_EQ(EqualSeqBounds(7, 3), (std::vector<int>{0, 2, 4, 7}));
}

}  // namespace
}  // namespace vp::engine
