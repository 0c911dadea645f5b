// The optimizer step of one rank (the plan's OPT), one protocol for every backend: the CPU and
// CUDA stage engines supply the arithmetic on their own memory (a GradOps), this file the order
// and the collectives, so both backends sum tied copies, measure the norm and clip alike.
//
//   1. Tied embeddings split across ranks (tied_copy_sync): both copies of wte, the input
//      layer's and the output layer's, must end with ∇wte = ∇(input use) + ∇(output use). Each
//      rank sums the copies it holds into a (V_pad, h) fp32 buffer, the buffers are all-reduced
//      (every rank takes part; one that holds neither copy adds zeros) and both copies are
//      overwritten with the sum.
//   2. Data parallelism (a `data` communicator over d > 1 replicas of this stage): every
//      replica's loss was scaled by 1 / (d·m·b·s), the global token count, so the sum of the
//      replicas' gradients is the exact mean and no 1/d rescale follows. Without ZeRO the whole
//      flat gradient buffer is all-reduced (less the model chunks a GRAD_SYNC of the plan summed
//      already, overlapping the backward); with ZeRO-1 it is reduce-scattered so that each
//      replica holds the sum of its own range (comm::RangeOf) — the only range its AdamW state
//      covers. Summing is linear, so step 1 before step 2 gives the same sums as after.
//   3. The global gradient norm: Σ g² over this rank's parameters with the tied output copy
//      counted once (by its twin), all-reduced in fp32 over the pipeline — the norm only scales
//      clipping. Every replica holds the same sums, so each parameter counts once; under ZeRO-1
//      each replica measures its own range and the partial sums are first added over `data`.
//   4. Clipping scale min(1, clip / (‖g‖ + 1e-6)) (1 when clip ≤ 0, engine::ClipScale), then
//      AdamW with that scale on the gradients (under ZeRO-1 on the rank's range only, then the
//      parameters are all-gathered over `data`, so every replica again holds the whole stage).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/engine/model/rank_model.h"
#include "worker/engine/optimizer.h"
#include "worker/engine/vocab/partition.h"

namespace vp::runtime {

// What a backend provides to the protocol. Offsets and counts are in elements of the rank's
// flat fp32 gradient block (the tensor table of host()).
template <typename G>
concept GradOps = requires(G& g, const G& cg, typename G::Scratch& scratch, size_t offset, size_t n,
                           comm::Communicator& comm, float lr, float scale) {
  typename G::Scratch;  // an fp32 buffer in the backend's memory
  { cg.host() } -> std::same_as<const engine::RankModel&>;  // tensor table, param_count()
  { g.ZeroScratch(n) } -> std::same_as<absl::StatusOr<typename G::Scratch>>;
  // scratch (n) += grads[offset, offset + n)
  { g.AddGrads(scratch, offset) } -> std::same_as<absl::Status>;
  // grads[offset, offset + n) = scratch (n)
  { g.SetGrads(offset, scratch) } -> std::same_as<absl::Status>;
  // Work queued by the calls above is done (a device backend drains its stream).
  { g.Sync() } -> std::same_as<absl::Status>;
  { g.AllReduceSum(comm, scratch) } -> std::same_as<absl::Status>;
  // Σ g² of grads[offset, offset + n), in double.
  { g.SquaredNorm(offset, n) } -> std::same_as<absl::StatusOr<double>>;
  // One fp32 value summed over the ranks (through the memory the communicator takes).
  { g.AllReduceScalar(comm, scale) } -> std::same_as<absl::StatusOr<float>>;
  // AdamW on the range the optimizer state covers (the whole buffer, or a ZeRO-1 shard).
  { g.AdamW(lr, scale) } -> std::same_as<absl::Status>;
  // Over the data-parallel group: grads[offset, offset + n) summed; the reduce-scatter and the
  // gather on the whole flat buffer (comm::RangeOf splits it).
  { g.AllReduceGrads(comm, offset, n) } -> std::same_as<absl::Status>;
  { g.ReduceScatterGrads(comm) } -> std::same_as<absl::Status>;
  { g.AllGatherParams(comm) } -> std::same_as<absl::Status>;
};

// The parts of [0, total) that `done` (disjoint ranges, any order) leaves out, in order.
inline std::vector<comm::ShardRange> RangesLeft(size_t total, std::vector<comm::ShardRange> done) {
  std::sort(done.begin(), done.end(),
            [](const comm::ShardRange& a, const comm::ShardRange& b) { return a.begin < b.begin; });
  std::vector<comm::ShardRange> left;
  size_t at = 0;
  for (const comm::ShardRange& r : done) {
    if (r.begin > at) left.push_back({at, r.begin - at});
    at = std::max(at, r.end());
  }
  if (at < total) left.push_back({at, total - at});
  return left;
}

// comm: the pipeline's communicator (this replica's stages); data: the replicas of this stage
// (null or size 1: no data parallelism); zero: ZeRO-1 (the optimizer state covers this
// replica's comm::RangeOf range of the flat buffer). reduced: ranges of the flat buffer already
// summed over `data` this step (the plan's GRAD_SYNC, never under ZeRO-1): only the rest is
// all-reduced here. data_seconds (may be null): the wall time of the data-parallel collectives
// run here (reduction, ZeRO-1's norm sum and parameter gather). tensor: the stage's tensor
// group (null or size 1: none), over which the norm is also summed (the replicated tensors'
// gradients must already be summed over it, RankModel::SumReplicatedGrads).
template <GradOps G>
absl::Status RunOptimizerStep(G& ops, comm::Communicator& comm, comm::Communicator* data, bool zero,
                              bool tied_copy_sync, float lr, float grad_clip, double* grad_norm,
                              double* data_seconds = nullptr,
                              const std::vector<comm::ShardRange>& reduced = {},
                              comm::Communicator* tensor = nullptr) {
  using Clock = std::chrono::steady_clock;
  double data_time = 0;
  auto timed = [&data_time](auto&& collective) {
    const auto t0 = Clock::now();
    absl::Status st = collective();
    data_time += std::chrono::duration<double>(Clock::now() - t0).count();
    return st;
  };
  const engine::RankModel& host = ops.host();
  const bool replicated = data != nullptr && data->size() > 1;
  const size_t params = host.param_count();
  const comm::ShardRange mine = replicated && zero
                                    ? comm::RangeOf(params, data->size(), data->rank())
                                    : comm::ShardRange{0, params};
  const engine::ParamTensor* copy = tied_copy_sync ? host.tied_output_copy() : nullptr;
  if (tied_copy_sync) {
    const engine::ParamTensor* wte = host.Find(engine::EmbeddingTensorName(host.config()));
    const size_t count = static_cast<size_t>(engine::vocab::PaddedVocab(host.config().vocab, 1)) *
                         host.config().hidden;
    auto sum = ops.ZeroScratch(count);  // (V_pad, h)
    if (!sum.ok()) return sum.status();
    for (const engine::ParamTensor* t : {wte, copy}) {
      if (t == nullptr) continue;
      if (absl::Status st = ops.AddGrads(*sum, t->offset); !st.ok()) return st;
    }
    if (absl::Status st = ops.Sync(); !st.ok()) return st;
    if (absl::Status st = ops.AllReduceSum(comm, *sum); !st.ok()) return st;
    for (const engine::ParamTensor* t : {wte, copy}) {
      if (t == nullptr) continue;
      if (absl::Status st = ops.SetGrads(t->offset, *sum); !st.ok()) return st;
    }
    if (absl::Status st = ops.Sync(); !st.ok()) return st;
  }
  if (replicated && zero && !reduced.empty()) {
    return absl::InternalError(
        "ZeRO-1 reduce-scatters the whole buffer: nothing may be summed "
        "before OPT (a plan with GRAD_SYNC under zero: 1)");
  }
  if (replicated) {
    absl::Status st = timed([&] {
      if (zero) return ops.ReduceScatterGrads(*data);
      for (const comm::ShardRange& r : RangesLeft(params, reduced)) {
        if (absl::Status s = ops.AllReduceGrads(*data, r.begin, r.count); !s.ok()) return s;
      }
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
  }
  auto sq = ops.SquaredNorm(mine.begin, mine.count);
  if (!sq.ok()) return sq.status();
  double local = *sq;
  if (copy != nullptr) {  // the part of the twin inside this rank's range
    const size_t lo = std::max(copy->offset, mine.begin);
    const size_t hi = std::min(copy->offset + copy->count(), mine.end());
    if (lo < hi) {
      auto twin = ops.SquaredNorm(lo, hi - lo);
      if (!twin.ok()) return twin.status();
      local -= *twin;
    }
  }
  // Tensor parallelism: each rank's slices count once, the replicated tensors (whole and equal
  // on every tensor rank after their group sum) once per group, on tensor rank 0.
  if (tensor != nullptr && tensor->size() > 1) {
    if (tensor->rank() != 0) {
      for (const engine::DecayRange& r : host.ReplicatedRanges()) {
        const size_t lo = std::max(r.offset, mine.begin);
        const size_t hi = std::min(r.offset + r.count, mine.end());
        if (lo >= hi) continue;
        auto rep = ops.SquaredNorm(lo, hi - lo);
        if (!rep.ok()) return rep.status();
        local -= *rep;
      }
    }
    auto group = ops.AllReduceScalar(*tensor, static_cast<float>(local));
    if (!group.ok()) return group.status();
    local = *group;
  }
  if (replicated && zero) {
    absl::StatusOr<float> replicas;
    (void)timed([&] {
      replicas = ops.AllReduceScalar(*data, static_cast<float>(local));
      return replicas.status();
    });
    if (!replicas.ok()) return replicas.status();
    local = *replicas;
  }
  auto global = ops.AllReduceScalar(comm, static_cast<float>(local));
  if (!global.ok()) return global.status();
  *grad_norm = std::sqrt(static_cast<double>(*global));
  if (absl::Status st = ops.AdamW(lr, engine::ClipScale(static_cast<double>(*global), grad_clip));
      !st.ok()) {
    return st;
  }
  absl::Status st;
  if (replicated && zero) st = timed([&] { return ops.AllGatherParams(*data); });
  if (data_seconds != nullptr) *data_seconds = data_time;
  return st;
}

}  // namespace vp::runtime
