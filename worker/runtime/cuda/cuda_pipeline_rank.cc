#include "worker/runtime/cuda/cuda_pipeline_rank.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/runtime/cuda/cuda_engine.h"
#include "worker/runtime/rank_executor_actions.h"

namespace vp::runtime {
namespace {

template <typename T>
class CudaPipelineRank final : public PipelineRank {
 public:
  explicit CudaPipelineRank(std::unique_ptr<internal::RankExecutor<CudaStageEngine<T>>> exec)
      : exec_(std::move(exec)) {}

  absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches) override {
    return exec_->Step(step, batches);
  }
  absl::StatusOr<RankEvalResult> Evaluate(int num_batches, const BatchFn& batches) override {
    return exec_->Evaluate(num_batches, batches);
  }
  engine::RankModel& model() override { return exec_->engine().model().host(); }
  engine::AdamW& optimizer() override { return exec_->engine().model().host_optimizer(); }
  absl::Status PullState() override {
    if (auto st = exec_->engine().EnterThread(); !st.ok()) return st;
    return exec_->engine().model().Download();
  }
  absl::Status PushState() override {
    if (auto st = exec_->engine().EnterThread(); !st.ok()) return st;
    return exec_->engine().model().Upload();
  }
  engine::MemoryTracker& memory() override { return exec_->engine().tracker(); }
  int rank() const override { return exec_->rank(); }

 private:
  std::unique_ptr<internal::RankExecutor<CudaStageEngine<T>>> exec_;
};

template <typename T>
absl::StatusOr<std::unique_ptr<PipelineRank>> Create(
    const planner::Plan& plan, int rank, const TrainerOptions& options, internal::RankSetup setup,
    int device, comm::Communicator* p2p, comm::Communicator* coll, comm::Communicator* data,
    comm::Communicator* tensor) {
  auto engine = CudaStageEngine<T>::Create(options, setup.layout, plan.seq_bounds, setup.algorithm,
                                           device, tensor);
  if (!engine.ok()) return engine.status();
  return std::make_unique<CudaPipelineRank<T>>(
      std::make_unique<internal::RankExecutor<CudaStageEngine<T>>>(
          plan, rank, options, std::move(setup), std::move(*engine), p2p, coll, data, tensor));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineRank>> CreateCudaPipelineRank(
    const planner::Plan& plan, int rank, const TrainerOptions& options, const CudaRankOptions& cuda,
    comm::Communicator* p2p, comm::Communicator* coll, comm::Communicator* data,
    comm::Communicator* tensor) {
  if (coll == nullptr || (p2p != nullptr && p2p->size() != coll->size())) {
    return absl::InvalidArgumentError("cuda rank: both communicators must span the pipeline");
  }
  auto setup = internal::BuildRankSetup(plan, rank, options, p2p, data, tensor);
  if (!setup.ok()) return setup.status();
  setup->overlap_data_sync = cuda.overlap_data_sync;
  if (cuda.untagged_p2p) {
    if (auto st = CheckP2POrderMatches(plan); !st.ok()) return st;
  }
  if (cuda.precision == DevicePrecision::kFp32) {
    return Create<float>(plan, rank, options, std::move(*setup), cuda.device, p2p, coll, data,
                         tensor);
  }
  return Create<engine::cuda::bf16>(plan, rank, options, std::move(*setup), cuda.device, p2p, coll,
                                    data, tensor);
}

}  // namespace vp::runtime
