// What the plan executor (rank_executor.h) needs from a device engine, as C++20 concepts.
// CpuStageEngine (cpu_engine.h: host buffers, OpenBLAS) is the reference; CudaStageEngine
// (cuda/cuda_engine.h) keeps the same contract on a GPU. Both name their passes after the CPU
// model's (engine::RankModel, LayerStack, OutputLayerShard, InputLayerShard), so the executor is
// one template whatever the device.
//
// Letters: b microbatch size, s sequence length, h hidden size, len the length of one sequence
// chunk, n = b·len token rows of one slot.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/memory.h"
#include "worker/engine/transformer/slot_order.h"

namespace vp::runtime {

// A move-only activation array of Elem on the engine's device.
template <typename B, typename Elem>
concept ActivationBuffer = std::movable<B> && std::default_initializable<B> &&
    requires(B& b, const B& cb) {
  { b.data() } -> std::convertible_to<Elem*>;
  { cb.size() } -> std::convertible_to<size_t>;
  { cb.empty() } -> std::convertible_to<bool>;
};

// A pipeline stage's layers of one model chunk: F / B / W per (microbatch, sequence chunk) slot
// in the order of worker/engine/transformer/slot_order.h; x, out, dout, dx are (b, len, h).
template <typename S, typename Elem>
concept StageLayerStack = requires(S& stack, engine::SlotKey slot, const Elem* in, Elem* out) {
  { stack.Forward(slot, in, out) } -> std::same_as<absl::Status>;
  { stack.BackwardInput(slot, in, out) } -> std::same_as<absl::Status>;
  { stack.BackwardWeight(slot) } -> std::same_as<absl::Status>;
  { stack.Backward(slot, in, out) } -> std::same_as<absl::Status>;  // B then W
  stack.DiscardMicrobatch(slot.microbatch);  // forward-only evaluation: drop what F kept
};

// The input layer's vocabulary shard: IF, IF_REDUCE, IB_BCAST, IB (docs/vocab-parallel-math.md).
template <typename L, typename State, typename Elem>
concept StageInputLayer = requires(L& layer, State& state, const int32_t* tokens, int n,
                                   comm::Communicator& comm, int root, const Elem* grad) {
  { layer.Forward(tokens, n) } -> std::same_as<absl::StatusOr<State>>;
  { layer.ForwardReduce(state, comm) } -> std::same_as<absl::Status>;
  { layer.BackwardBroadcast(state, comm, root, grad) } -> std::same_as<absl::Status>;
  { layer.Backward(state) } -> std::same_as<absl::Status>;
  { state.output() } -> std::convertible_to<const float*>;  // (b, s, h), null once released
  state.ReleaseOutput();
};

// The output layer's vocabulary shard: S, C1, T, C2; losses and ∇X are host-readable / (n, h).
template <typename L, typename State, typename Elem>
concept StageOutputLayer = requires(L& layer, State& state, const State& cstate, const Elem* x,
                                    const int32_t* labels, int n, float d,
                                    comm::Communicator& comm) {
  { layer.S(x, labels, n, d) } -> std::same_as<absl::StatusOr<State>>;
  { layer.C1(state, comm) } -> std::same_as<absl::Status>;
  { layer.T(state, x) } -> std::same_as<absl::Status>;
  { layer.C2(state, comm) } -> std::same_as<absl::Status>;
  layer.ReleaseWorkspace();
  { cstate.n() } -> std::convertible_to<int>;
  { cstate.losses() } -> std::convertible_to<const float*>;      // (n) on the host, after C1
  { cstate.grad_input() } -> std::convertible_to<const float*>;  // (n, h) ∇X, null until final
};

// A rank's model: its stacks (one per local model chunk c) and the vocabulary shards it holds.
template <typename M, typename E>
concept StageModel = requires(M& model, int c) {
  requires StageLayerStack < std::remove_cvref_t<decltype(model.stack(c))>,
  typename E::Elem > ;
  requires StageInputLayer < std::remove_cvref_t<decltype(model.input_layer())>,
  typename E::InputState, typename E::Elem > ;
  requires StageOutputLayer < std::remove_cvref_t<decltype(model.output_layer())>,
  typename E::OutputState, typename E::Elem > ;
  { model.has_output_layer() } -> std::convertible_to<bool>;
};

// The device engine the executor runs a plan on.
//   Act(n, zero, thread)            n activation elements charged to kActivations (zeroed when
//                                   asked; a host engine always zeroes), for the given thread
//   EmbedSeqChunk(x, in, b, s, len, h, start)          x = in.output() rows [start, start+len) of
//                                                    every sequence + wpe rows; x (b, len, h)
//   EmbedSeqChunkBackward(dembed, dx, b, s, len, h, start)  wpe grad += Σ_b dx; dx into rows
//                                                    [start, start+len) of dembed (b, s, h)
//   FinalNormForward(xs, out, n)    ln_f on out (n, h): fills xs.x, keeps out as xs.x_last
//   FinalNormBackward(dout, grad_input, xs, n)   dout (n, h, zeroed) += ln_f's input gradient;
//                                   ln_f's weight gradients; frees x_last and the statistics
//   OptimizerStep(step, comm, data, tied_copy_sync, lr, clip, &grad_norm, &data_seconds,
//                 reduced)          optimizer_step.h (data: the replicas' communicator, null
//                                   without any; data_seconds: its collectives' wall time;
//                                   reduced: the ranges GRAD_SYNC summed already this step)
//   AllReduceChunkGrads(data, c)    GRAD_SYNC: model chunk c's gradients summed over `data`
//                                   (after its last W); returns the flat range it covered
//   SumTensorReplicatedGrads()      tensor parallelism: the replicated tensors' gradients summed
//                                   over the stage's tensor group (before OPT)
//   AllReduceHostFloats(comm, v, n) n host floats summed over `comm` (a device engine stages
//                                   them through device memory: its communicators take device
//                                   pointers) — the replicas' loss and evaluation sums
//   EnterThread()                   first call on every thread the executor runs (a device
//                                   engine makes the rank's device current)
//   ActionDone(thread)              after every action (a device engine hands freed blocks back)
template <typename E>
concept StageEngine = ActivationBuffer<typename E::Buffer, typename E::Elem> &&
    StageModel<typename E::Model, E> && std::movable<typename E::InputState> &&
    std::movable<typename E::OutputState> && std::movable<typename E::XState> &&
    requires(E& e, typename E::Buffer& buf, typename E::Buffer moved,
             const typename E::Buffer& cbuf, const typename E::InputState& in,
             typename E::XState& xs, const float* grad_input, int64_t step,
             comm::Communicator& comm, double* grad_norm, size_t count, int b, int s, int len,
             int h, int start, int n, float lr, float clip, bool flag,
             const std::vector<comm::ShardRange>& ranges, float* host_floats) {
  { E::kCompute } -> std::convertible_to<typename E::Thread>;
  { E::kComm } -> std::convertible_to<typename E::Thread>;
  { e.Act(count, flag, E::kCompute) } -> std::same_as<absl::StatusOr<typename E::Buffer>>;
  { e.EmbedSeqChunk(buf, in, b, s, len, h, start) } -> std::same_as<absl::Status>;
  { e.EmbedSeqChunkBackward(buf, cbuf, b, s, len, h, start) } -> std::same_as<absl::Status>;
  { e.FinalNormForward(xs, std::move(moved), n) } -> std::same_as<absl::Status>;
  { e.FinalNormBackward(buf, grad_input, xs, n) } -> std::same_as<absl::Status>;
  { xs.x } -> std::convertible_to<typename E::Buffer&>;       // X, the output layer's input
  { xs.x_last } -> std::convertible_to<typename E::Buffer&>;  // ln_f's input (owner only)
  {
    e.OptimizerStep(step, comm, &comm, flag, lr, clip, grad_norm, grad_norm, ranges)
    } -> std::same_as<absl::Status>;
  { e.AllReduceChunkGrads(comm, n) } -> std::same_as<absl::StatusOr<comm::ShardRange>>;
  { e.AllReduceHostFloats(comm, host_floats, count) } -> std::same_as<absl::Status>;
  { e.ZeroGrads() } -> std::same_as<absl::Status>;
  { e.SumTensorReplicatedGrads() } -> std::same_as<absl::Status>;
  { e.EnterThread() } -> std::same_as<absl::Status>;
  e.ActionDone(E::kCompute);
  { e.tracker() } -> std::convertible_to<engine::MemoryTracker&>;
  { e.model() } -> std::same_as<typename E::Model&>;
};

}  // namespace vp::runtime
