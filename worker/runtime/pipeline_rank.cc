#include "worker/runtime/pipeline_rank.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/runtime/cpu_engine.h"
#include "worker/runtime/rank_executor_actions.h"

namespace vp::runtime {

double RankStepResult::busy_seconds() const {
  double s = 0;
  for (double b : busy) s += b;
  return s;
}

namespace internal {

absl::StatusOr<RankSetup> BuildRankSetup(const planner::Plan& plan, int rank,
                                         const TrainerOptions& options,
                                         const comm::Communicator* comm,
                                         const comm::Communicator* data,
                                         const comm::Communicator* tensor) {
  if (comm == nullptr || comm->size() != plan.pipeline || comm->rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline rank ", rank, ": the communicator must have rank ", rank, " of ", plan.pipeline));
  }
  const DataParallelOptions& dp = options.data;
  if (dp.replicas < 1 || dp.replica < 0 || dp.replica >= dp.replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline rank ", rank, ": replica ", dp.replica, " of ", dp.replicas));
  }
  if (dp.replicas > 1 &&
      (data == nullptr || data->size() != dp.replicas || data->rank() != dp.replica)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline rank ", rank,
                                                   ": the data-parallel communicator must have "
                                                   "rank ",
                                                   dp.replica, " of ", dp.replicas));
  }
  const TensorParallelOptions& tp = options.tensor;
  if (tp.size < 1 || tp.rank < 0 || tp.rank >= tp.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline rank ", rank, ": tensor rank ", tp.rank, " of ", tp.size));
  }
  if (tp.size > 1) {
    if (tensor == nullptr || tensor->size() != tp.size || tensor->rank() != tp.rank) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline rank ", rank,
                                                     ": the tensor-parallel communicator must "
                                                     "have rank ",
                                                     tp.rank, " of ", tp.size));
    }
    // Tensor parallelism splits the vocabulary over the p·t ranks: the methods that keep it
    // whole on one stage, and interlaced (whose passes assume p shards), are refused.
    if (!plan.vocab_sharded || plan.vocab == "interlaced") {
      return absl::InvalidArgumentError(
          absl::StrCat("parallel.vocab: ", plan.vocab,
                       " does not run with parallel.tensor > 1 (use vocab1 or vocab2)"));
    }
    for (size_t q = 0; q + 1 < plan.seq_bounds.size(); ++q) {
      if ((plan.seq_bounds[q + 1] - plan.seq_bounds[q]) % tp.size != 0) {
        return absl::InvalidArgumentError(absl::StrCat("plan: sequence chunk ", q,
                                                       " is not a multiple of parallel.tensor ",
                                                       tp.size, " tokens long"));
      }
    }
  }
  if (rank < 0 || rank >= plan.pipeline || static_cast<int>(plan.ranks.size()) != plan.pipeline) {
    return absl::InvalidArgumentError(absl::StrCat("plan has no rank ", rank));
  }
  if (plan.microbatches != options.microbatches || plan.layers != options.model.layers) {
    return absl::InvalidArgumentError(absl::StrCat("plan (", plan.microbatches, " microbatches, ",
                                                   plan.layers, " layers) does not match the job (",
                                                   options.microbatches, " microbatches, ",
                                                   options.model.layers, " layers)"));
  }
  if (plan.seq_bounds.size() < 2 || plan.seq_bounds.front() != 0 ||
      plan.seq_bounds.back() != options.model.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan seq_bounds do not cover seq_len ", options.model.seq_len));
  }
  RankSetup s;
  s.groups = plan.groups();
  s.k = static_cast<int>(plan.seq_bounds.size()) - 1;
  s.owner = rank == plan.x_owner;
  s.algorithm = plan.barrier == 2 ? engine::vocab::OutputAlgorithm::kAlgorithm1
                                  : engine::vocab::OutputAlgorithm::kAlgorithm2;
  for (int r = 0; r < plan.pipeline; ++r) {
    for (const planner::ModelChunk& c : plan.ranks[r].chunks) {
      if (c.group == 0) s.first_group_rank = r;
    }
  }
  engine::RankLayout& layout = s.layout;
  layout.rank = rank;
  layout.world = plan.pipeline;
  layout.holds_first_group = false;
  layout.holds_last_group = false;
  const auto& chunks = plan.ranks[rank].chunks;
  for (size_t c = 0; c < chunks.size(); ++c) {
    layout.chunks.push_back({chunks[c].first_layer, chunks[c].num_layers});
    s.chunk_group.push_back(chunks[c].group);
    s.local_chunk_of_group[chunks[c].group] = static_cast<int>(c);
    if (chunks[c].group == 0) layout.holds_first_group = true;
    if (chunks[c].group == s.groups - 1) layout.holds_last_group = true;
  }
  // Every action of this rank names its own chunks, microbatches and sequence chunks: the
  // executor indexes by them.
  const std::vector<planner::Action>& actions = plan.ranks[rank].actions;
  s.last_weight_action.assign(chunks.size(), actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    const planner::Action& a = actions[i];
    if (a.kind == planner::ActionKind::kOpt) continue;
    if (a.chunk < 0 || a.chunk >= static_cast<int>(chunks.size()) || a.mb < 0 ||
        a.mb >= plan.microbatches || a.seq < 0 || a.seq >= s.k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan: rank ", rank, " ", planner::ToString(a),
          " names a chunk, microbatch or sequence chunk it does not have (", chunks.size(),
          " chunks, ", plan.microbatches, " microbatches, ", s.k, " sequence chunks)"));
    }
    if (a.kind == planner::ActionKind::kW || a.kind == planner::ActionKind::kBW) {
      s.last_weight_action[a.chunk] = i;
    }
  }
  if (layout.holds_last_group != s.owner) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: x_owner ", plan.x_owner, " does not hold the last layer group"));
  }
  layout.vocab_sharded = plan.vocab_sharded;
  layout.holds_input_layer = layout.holds_first_group;
  layout.holds_output_layer = s.owner;
  s.tied_copy_sync =
      options.model.tie_embeddings && !plan.vocab_sharded && s.first_group_rank != plan.x_owner;
  return s;
}

}  // namespace internal

absl::Status CheckP2POrderMatches(const planner::Plan& plan) {
  using planner::ActionKind;
  // (from, to) -> tags in plan order, as sent and as received.
  std::map<std::pair<int, int>, std::vector<uint64_t>> sent, received;
  // A rank's slice (planner::RankSlice) has no other rank's actions: only pairs whose two
  // action lists are both present can be compared. The coordinator validated the whole plan
  // (planner::ValidatePlan fires a send only with the matching receive at the peer's head,
  // so a validated plan has the same order on both ends of every pair).
  auto present = [&](int r) {
    return r >= 0 && r < static_cast<int>(plan.ranks.size()) && !plan.ranks[r].actions.empty();
  };
  for (int r = 0; r < static_cast<int>(plan.ranks.size()); ++r) {
    const auto& chunks = plan.ranks[r].chunks;
    for (const planner::Action& a : plan.ranks[r].actions) {
      if (!planner::IsP2P(a.kind)) continue;
      if (a.chunk < 0 || a.chunk >= static_cast<int>(chunks.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan: rank ", r, " ", planner::ToString(a), " names no local chunk"));
      }
      const int group = chunks[a.chunk].group;
      const bool grad = a.kind == ActionKind::kSendGrad || a.kind == ActionKind::kRecvGrad;
      if (a.kind == ActionKind::kSendAct || a.kind == ActionKind::kSendGrad) {
        sent[{r, a.peer}].push_back(internal::P2PTag(grad, group, a.seq, a.mb));
      } else {
        const int from = group + (grad ? 1 : -1);
        received[{a.peer, r}].push_back(internal::P2PTag(grad, from, a.seq, a.mb));
      }
    }
  }
  for (const auto& [pair, tags] : sent) {
    if (!present(pair.first) || !present(pair.second)) continue;
    const std::vector<uint64_t>& other = received[pair];
    for (size_t i = 0; i < std::max(tags.size(), other.size()); ++i) {
      if (i >= tags.size() || i >= other.size() || tags[i] != other[i]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "plan: transfer ", i, " from rank ", pair.first, " to rank ", pair.second,
            " differs between the sender's and the receiver's order; an untagged transport "
            "(NCCL) needs them in the same order"));
      }
    }
  }
  for (const auto& [pair, tags] : received) {
    if (!present(pair.first) || !present(pair.second)) continue;
    if (!tags.empty() && !sent.contains(pair)) {
      return absl::FailedPreconditionError(absl::StrCat("plan: rank ", pair.second,
                                                        " receives from rank ", pair.first,
                                                        " which sends it nothing"));
    }
  }
  return absl::OkStatus();
}

namespace {

class CpuPipelineRank final : public PipelineRank {
 public:
  explicit CpuPipelineRank(std::unique_ptr<internal::RankExecutor<CpuStageEngine>> exec)
      : exec_(std::move(exec)) {}

  absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches) override {
    return exec_->Step(step, batches);
  }
  absl::StatusOr<RankEvalResult> Evaluate(int num_batches, const BatchFn& batches) override {
    return exec_->Evaluate(num_batches, batches);
  }
  engine::RankModel& model() override { return exec_->engine().model(); }
  engine::AdamW& optimizer() override { return exec_->engine().optimizer(); }
  engine::MemoryTracker& memory() override { return exec_->engine().tracker(); }
  int rank() const override { return exec_->rank(); }

 private:
  std::unique_ptr<internal::RankExecutor<CpuStageEngine>> exec_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineRank>> PipelineRank::Create(
    const planner::Plan& plan, int rank, const TrainerOptions& options, comm::Communicator* comm,
    comm::Communicator* data, comm::Communicator* tensor) {
  auto setup = internal::BuildRankSetup(plan, rank, options, comm, data, tensor);
  if (!setup.ok()) return setup.status();
  auto engine =
      CpuStageEngine::Create(options, setup->layout, plan.seq_bounds, setup->algorithm, tensor);
  if (!engine.ok()) return engine.status();
  return std::make_unique<CpuPipelineRank>(std::make_unique<internal::RankExecutor<CpuStageEngine>>(
      plan, rank, options, std::move(*setup), std::move(*engine), comm, comm, data, tensor));
}

}  // namespace vp::runtime
