#include "worker/engine/vocab/cuda/vocab_shards.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

using Phase = vocab::OutputLayerState::Phase;
constexpr MemoryCategory kAct = MemoryCategory::kActivations;

const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kNone:
      return "none";
    case Phase::kS:
      return "S";
    case Phase::kC1:
      return "C1";
    case Phase::kT:
      return "T";
    case Phase::kC2:
      return "C2";
  }
  return "?";
}

// The CPU shard's phase rule and message (../output_layer.cc), so both engines report the same.
absl::Status ExpectPhase(Phase have, Phase want, const char* pass) {
  if (have == want) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("output layer ", pass, " needs a state after ",
                                                    PhaseName(want), ", got one after ",
                                                    PhaseName(have)));
}

// Prefixes a communicator error with the collective that failed, keeping its code.
absl::Status Annotate(const absl::Status& s, const char* what) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// The communicator is called with device pointers and runs on its own stream (NCCL) or copies
// with cudaMemcpy (StagedCommunicator): the data this context's stream produces must be in
// place first.
absl::Status Idle(const DeviceContext& ctx) {
  VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
  return absl::OkStatus();
}

// Every public method returns after Finish(ctx), error or not: an early return may leave kernels
// queued that read buffers this thread just released.
absl::Status Finished(absl::Status pass, const DeviceContext& ctx) {
  absl::Status fin = Finish(ctx);
  return pass.ok() ? fin : pass;
}

// Create's checks, shared by both shards; `layer` names the shard in the message. Done before
// touching the device, so they are testable without one.
absl::Status ValidateDeviceShardArgs(const char* layer, const vocab::VocabPartition& partition,
                                     int hidden, const void* weight, const void* weight_grad,
                                     const DeviceContext& compute, const DeviceContext& comm) {
  // cuBLASLt wants 16-byte aligned operands: rows of h bf16 elements start at multiples of 16
  // bytes only when h % 8 == 0, and the n×rows buffer's rows likewise need rows % 8 == 0.
  if (hidden < 1 || hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": hidden ", hidden,
                     " must be > 0 and a multiple of 8 (cuBLASLt 16-byte alignment)"));
  }
  if (partition.rows < 1 || partition.rows % 8 != 0 || partition.rows > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(layer, ": partition.rows ", partition.rows,
                     " must be >= 1, <= INT_MAX and a multiple of 8 (cuBLASLt 16-byte alignment "
                     "of the shard's rows)"));
  }
  if (partition.valid_rows < 0 || partition.valid_rows > partition.rows) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": partition.valid_rows ",
                                                   partition.valid_rows,
                                                   " must be in [0, rows = ", partition.rows, "]"));
  }
  if (weight == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": weight must be non-null"));
  }
  if (weight_grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": weight_grad must be non-null"));
  }
  if (compute.gemm == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": compute.gemm must be non-null"));
  }
  if (compute.alloc == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": compute.alloc must be non-null"));
  }
  if (comm.alloc == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(layer, ": comm.alloc must be non-null"));
  }
  return absl::OkStatus();
}

// Host → device copy of `n` values into a fresh array on ctx (kActivations).
template <typename V>
absl::StatusOr<DeviceArray<V>> Upload(const DeviceContext& ctx, const V* host, size_t n) {
  auto a = DeviceArray<V>::Create(ctx, kAct, n, /*zero=*/false);
  if (!a.ok()) return a.status();
  VP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(a->data(), host, n * sizeof(V), cudaMemcpyHostToDevice, ctx.stream));
  return a;
}

// Device → host copies of `n` floats from each of `device`, with one synchronisation of
// ctx.stream for all of them.
absl::StatusOr<std::vector<std::vector<float>>> Download(const DeviceContext& ctx,
                                                         std::initializer_list<const float*> device,
                                                         size_t n) {
  std::vector<std::vector<float>> host;
  for (const float* d : device) {
    host.emplace_back(n);
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.back().data(), d, n * sizeof(float),
                                            cudaMemcpyDeviceToHost, ctx.stream));
  }
  VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
  return host;
}

// Checks a host id array against [0, V); `what` is e.g. "output layer S: labels".
absl::Status CheckIds(const int32_t* ids, int n, int64_t vocab, const char* what) {
  for (int i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", i, "] = ", ids[i], " outside [0, V = ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DeviceOutputLayerState

template <typename E>
bool DeviceOutputLayerState<E>::grad_input_ready() const {
  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    return phase_ == Phase::kC1 || phase_ == Phase::kT;
  }
  return phase_ == Phase::kC2;
}

template <typename E>
const float* DeviceOutputLayerState<E>::grad_input() const {
  return grad_input_ready() ? grad_x_.data() : nullptr;
}

template <typename E>
void DeviceOutputLayerState<E>::Release() {
  local_label_.Reset();
  probs_.Reset();
  local_max_.Reset();
  local_sum_.Reset();
  label_logit_.Reset();
  scale_.Reset();
  sums_.Reset();
  loss_.Reset();
  grad_x_.Reset();
  loss_host_.clear();
  loss_host_.shrink_to_fit();
  c1_label_.Reset();
  no_label_.Reset();
  label_rows_.Reset();
  group_share_.clear();
  group_share_.shrink_to_fit();
}

template <typename E>
int64_t DeviceOutputLayerState<E>::bytes() const {
  const size_t b = local_label_.bytes() + probs_.bytes() + local_max_.bytes() + local_sum_.bytes() +
                   label_logit_.bytes() + scale_.bytes() + sums_.bytes() + loss_.bytes() +
                   grad_x_.bytes() + c1_label_.bytes() + no_label_.bytes() + label_rows_.bytes();
  return static_cast<int64_t>(b);
}

// ---------------------------------------------------------------------------------------------
// DeviceOutputLayerShard

template <typename E>
absl::StatusOr<std::unique_ptr<DeviceOutputLayerShard<E>>> DeviceOutputLayerShard<E>::Create(
    const vocab::VocabPartition& partition, int hidden, OutputAlgorithm algorithm, const E* weight,
    float* weight_grad, const DeviceContext& compute, const DeviceContext& comm,
    engine::tp::TensorGroup tensor) {
  if (absl::Status st = ValidateDeviceShardArgs("output layer", partition, hidden, weight,
                                                weight_grad, compute, comm);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = vocab::ValidateTensorShard("output layer", partition, tensor); !st.ok()) {
    return st;
  }
  // The constructor is private (only Create validates), so make_unique cannot reach it.
  std::unique_ptr<DeviceOutputLayerShard> shard(new DeviceOutputLayerShard());
  shard->partition_ = partition;
  shard->hidden_ = hidden;
  shard->algorithm_ = algorithm;
  shard->weight_ = weight;
  shard->weight_grad_ = weight_grad;
  shard->compute_ = compute;
  shard->comm_ = comm;
  shard->tensor_ = tensor;
  shard->rows_ = std::make_unique<tp::DeviceSequenceParallel<E>>(tensor, compute);
  shard->sums_ = std::make_unique<tp::DeviceSequenceParallel<float>>(tensor, compute);
  return shard;
}

template <typename E>
bool DeviceOutputLayerShard<E>::GroupOwns(int64_t label) const {
  const int t = tensor_.size();
  const int64_t group_begin =
      partition_.begin - static_cast<int64_t>(tensor_.rank()) * partition_.rows;
  const int64_t group_end = std::min(group_begin + t * partition_.rows, partition_.vocab);
  return label >= group_begin && label < group_end;
}

template <typename E>
absl::StatusOr<DeviceOutputLayerState<E>> DeviceOutputLayerShard<E>::S(const E* x,
                                                                       const int32_t* labels, int n,
                                                                       float d) const {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("output layer S: n ", n, " < 1"));
  if (x == nullptr || labels == nullptr) {
    return absl::InvalidArgumentError("output layer S: x and labels must be non-null");
  }
  if (!std::isfinite(d)) return absl::InvalidArgumentError("output layer S: d must be finite");
  if (absl::Status s = CheckIds(labels, n, partition_.vocab, "output layer S: labels"); !s.ok()) {
    return s;
  }
  const int t = tensor_.size();
  if (n % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("output layer S: n ", n, " tokens do not split over ", t, " tensor ranks"));
  }
  const DeviceContext& ctx = compute_;
  const int64_t rows = partition_.rows, valid = partition_.valid_rows;
  const int h = hidden_;
  // Under tensor parallelism the logits are computed for all the group's rows.
  absl::StatusOr<tp::DeviceGatheredRows<E>> gathered = rows_->Gather(x, n, h);
  if (!gathered.ok()) return Annotate(gathered.status(), "output layer S gather");
  x = gathered->data();

  // The label → shard row mapping on the host (labels arrive as a host array): one (n) int32
  // upload instead of a kernel.
  std::vector<int32_t> local_label(n);  // (n) row in this shard, -1 where not local
  for (int i = 0; i < n; ++i) {
    local_label[i] =
        partition_.Owns(labels[i]) ? static_cast<int32_t>(labels[i] - partition_.begin) : -1;
  }

  DeviceOutputLayerState<E> st;
  st.algorithm_ = algorithm_;
  st.n_ = n / t;
  st.n_all_ = n;
  st.d_ = d;
  absl::Status pass = [&]() -> absl::Status {
    // No zero fill anywhere below: the softmax kernel writes every column of the n×rows buffer
    // (padding columns as 0) and the statistics; OutputLayerS writes (or zeroes) A.
    auto label = DeviceArray<int32_t>::Create(ctx, kAct, n, /*zero=*/false);
    auto probs = DeviceArray<E>::Create(ctx, kAct, static_cast<size_t>(n) * rows, false);
    auto mx = DeviceArray<float>::Create(ctx, kAct, n, false);
    auto sum = DeviceArray<float>::Create(ctx, kAct, n, false);
    auto z = DeviceArray<float>::Create(ctx, kAct, n, false);
    for (const absl::Status& s :
         {label.status(), probs.status(), mx.status(), sum.status(), z.status()}) {
      if (!s.ok()) return s;
    }
    st.local_label_ = std::move(*label);
    st.probs_ = std::move(*probs);
    st.local_max_ = std::move(*mx);
    st.local_sum_ = std::move(*sum);
    st.label_logit_ = std::move(*z);
    // Pageable source: the call returns once the bytes are staged, and the kernels below are
    // ordered after the copy on the same stream.
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.local_label_.data(), local_label.data(),
                                            n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                            ctx.stream));
    float* a_out = nullptr;  // (n, h) Algorithm 2's A = P'·W_r, rescaled and reduced in C1
    if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
      auto gx = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(n) * h, false);
      if (!gx.ok()) return gx.status();
      st.grad_x_ = std::move(*gx);
      a_out = st.grad_x_.data();
    }
    return OutputLayerS<E>(*ctx.gemm, st.probs_.data(), st.local_max_.data(), st.local_sum_.data(),
                           st.label_logit_.data(), a_out, x, weight_, st.local_label_.data(), n, h,
                           rows, valid, ctx.stream);
  }();
  if (absl::Status s = Finished(std::move(pass), ctx); !s.ok()) return s;
  if (t > 1) {
    absl::Status merged = MergeOverTensorGroup(st, labels, local_label);
    if (absl::Status s = Finished(std::move(merged), ctx); !s.ok()) return s;
  }
  st.phase_ = Phase::kS;
  return st;
}

// The group's t shards as one (the CPU shard's MergeOverTensorGroup): with M the max of their
// m' and S = Σ s'·exp(m' − M), the merged shard's P' on shard v's rows is share_v · P'_v,
// share_v = s'_v·exp(m'_v − M)/S; its label logit is the owning shard's, shifted to M; and
// (Algorithm 2) its A = Σ_v share_v·A_v. The n-sized vectors go through the host (a few floats a
// token; every rank keeps share for T); A and the label's weight rows are reduce-scattered in
// fp32, each rank keeping its m rows.
template <typename E>
absl::Status DeviceOutputLayerShard<E>::MergeOverTensorGroup(
    DeviceOutputLayerState<E>& st, const int32_t* labels,
    const std::vector<int32_t>& local_label) const {
  const DeviceContext& ctx = compute_;
  const int n = st.n_all_, m = st.n_, h = hidden_, first = tensor_.rank() * m;
  comm::Communicator& comm = *tensor_.comm();
  auto group_max = DeviceArray<float>::Create(ctx, kAct, n, false);  // (n) M
  if (!group_max.ok()) return group_max.status();
  VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(group_max->data(), st.local_max_.data(),
                                          n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream));
  if (absl::Status s = Idle(ctx); !s.ok()) return s;
  if (absl::Status s = comm.AllReduce(group_max->data(), n, comm::ReduceOp::kMax); !s.ok()) {
    return Annotate(s, "output layer S group max");
  }
  auto stats = Download(
      ctx, {st.local_max_.data(), st.local_sum_.data(), st.label_logit_.data(), group_max->data()},
      n);
  if (!stats.ok()) return stats.status();
  const std::vector<float>&lmax = (*stats)[0], &lsum = (*stats)[1], &llogit = (*stats)[2],
        &gmax = (*stats)[3];
  std::vector<float> share(n), sums(2 * static_cast<size_t>(n));  // [share | label term]
  vocab::GroupShareTerms(n, lmax.data(), gmax.data(), lsum.data(), llogit.data(),
                         local_label.data(), share.data(), sums.data());
  auto sums_dev = Upload(ctx, sums.data(), sums.size());
  if (!sums_dev.ok()) return sums_dev.status();
  if (absl::Status s = Idle(ctx); !s.ok()) return s;
  if (absl::Status s = comm.AllReduce(sums_dev->data(), sums.size(), comm::ReduceOp::kSum);
      !s.ok()) {
    return Annotate(s, "output layer S group sum");
  }
  auto summed = Download(ctx, {sums_dev->data()}, sums.size());
  if (!summed.ok()) return summed.status();
  const std::vector<float>& total = (*summed)[0];
  vocab::NormalizeGroupShares(n, total.data(), share.data());
  // All -1: VocabGradInputFix without a label is a row scaling (here and in C1).
  const std::vector<int32_t> none(n, -1);
  auto no_label = Upload(ctx, none.data(), none.size());
  if (!no_label.ok()) return no_label.status();
  st.no_label_ = std::move(*no_label);
  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    // A ← share·A, then summed over the group.
    auto share_dev = Upload(ctx, share.data(), share.size());
    auto labels_dev = Upload(ctx, labels, static_cast<size_t>(n));
    auto label_rows = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(n) * h, false);
    auto mine_a = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(m) * h, false);
    auto mine_rows = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(m) * h, false);
    for (const absl::Status& s : {share_dev.status(), labels_dev.status(), label_rows.status(),
                                  mine_a.status(), mine_rows.status()}) {
      if (!s.ok()) return s;
    }
    VP_CUDA_RETURN_IF_ERROR(VocabGradInputFix<E>(st.grad_x_.data(), share_dev->data(), weight_,
                                                 st.no_label_.data(), 1.0f, n, h, ctx.stream));
    if (absl::Status s = sums_->ScatterSum(st.grad_x_.data(), n, h, mine_a->data()); !s.ok()) {
      return Annotate(s, "output layer S group A");
    }
    // The label's weight row (fp32) where this shard owns it, zero elsewhere; summed over the
    // group, each token gets its label's row from the shard that has it.
    VP_CUDA_RETURN_IF_ERROR(EmbeddingForwardToFloat<E>(label_rows->data(), weight_,
                                                       labels_dev->data(), n, h, partition_.begin,
                                                       partition_.valid_rows, ctx.stream));
    if (absl::Status s = sums_->ScatterSum(label_rows->data(), n, h, mine_rows->data()); !s.ok()) {
      return Annotate(s, "output layer S group label rows");
    }
    // Kept as −d·W[label], so that C1 adds it to d·scale·A.
    const std::vector<float> minus_d(m, -st.d_);
    auto minus_d_dev = Upload(ctx, minus_d.data(), minus_d.size());
    if (!minus_d_dev.ok()) return minus_d_dev.status();
    VP_CUDA_RETURN_IF_ERROR(VocabGradInputFix<E>(mine_rows->data(), minus_d_dev->data(), weight_,
                                                 st.no_label_.data(), 1.0f, m, h, ctx.stream));
    st.grad_x_ = std::move(*mine_a);
    st.label_rows_ = std::move(*mine_rows);
  }
  // The merged statistics of this rank's own m tokens, for C1, and its label test there.
  std::vector<int32_t> c1_label(m);
  for (int i = 0; i < m; ++i) c1_label[i] = GroupOwns(labels[first + i]) ? 0 : -1;
  auto merged_max = Upload(ctx, gmax.data() + first, m);
  auto merged_sum = Upload(ctx, total.data() + first, m);
  auto merged_label = Upload(ctx, total.data() + n + first, m);
  auto c1 = Upload(ctx, c1_label.data(), c1_label.size());
  for (const absl::Status& s :
       {merged_max.status(), merged_sum.status(), merged_label.status(), c1.status()}) {
    if (!s.ok()) return s;
  }
  st.local_max_ = std::move(*merged_max);
  st.local_sum_ = std::move(*merged_sum);
  st.label_logit_ = std::move(*merged_label);
  st.c1_label_ = std::move(*c1);
  st.group_share_ = std::move(share);
  return absl::OkStatus();
}

template <typename E>
absl::Status DeviceOutputLayerShard<E>::C1(DeviceOutputLayerState<E>& st,
                                           comm::Communicator& comm) const {
  if (absl::Status s = ExpectPhase(st.phase_, Phase::kS, "C1"); !s.ok()) return s;
  const DeviceContext& ctx = comm_;
  const int n = st.n_;
  absl::Status pass = [&]() -> absl::Status {
    // m = max over ranks of m'. A copy: m' itself is needed for δ = m' − m below.
    auto global_max = DeviceArray<float>::Create(ctx, kAct, n, false);  // (n)
    if (!global_max.ok()) return global_max.status();
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(global_max->data(), st.local_max_.data(),
                                            n * sizeof(float), cudaMemcpyDeviceToDevice,
                                            ctx.stream));
    if (absl::Status s = Idle(ctx); !s.ok()) return s;
    if (absl::Status s = comm.AllReduce(global_max->data(), n, comm::ReduceOp::kMax); !s.ok()) {
      return Annotate(s, "output layer C1 max");
    }

    // One sum all-reduce of [s'·exp(m' − m) (n) | y_label − m where local, else 0 (n)].
    auto sums = DeviceArray<float>::Create(ctx, kAct, 2 * static_cast<size_t>(n), false);
    auto scale = DeviceArray<float>::Create(ctx, kAct, n, false);
    auto loss = DeviceArray<float>::Create(ctx, kAct, n, false);
    for (const absl::Status& s : {sums.status(), scale.status(), loss.status()}) {
      if (!s.ok()) return s;
    }
    st.sums_ = std::move(*sums);
    st.scale_ = std::move(*scale);
    st.loss_ = std::move(*loss);
    // The label test: this shard's row (t = 1), or the merged group's (t > 1).
    const bool grouped = tensor_.size() > 1;
    VP_CUDA_RETURN_IF_ERROR(
        VocabC1Prepare(st.sums_.data(), st.scale_.data(), st.local_max_.data(), global_max->data(),
                       st.local_sum_.data(), st.label_logit_.data(),
                       grouped ? st.c1_label_.data() : st.local_label_.data(), n, ctx.stream));
    if (absl::Status s = Idle(ctx); !s.ok()) return s;
    if (absl::Status s = comm.AllReduce(st.sums_.data(), st.sums_.size(), comm::ReduceOp::kSum);
        !s.ok()) {
      return Annotate(s, "output layer C1 sum");
    }
    // loss = log s − z and scale = s'·exp(m' − m) / s, the factor turning P' into the softmax.
    VP_CUDA_RETURN_IF_ERROR(
        VocabC1Finish(st.loss_.data(), st.scale_.data(), st.sums_.data(), n, ctx.stream));

    if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
      // This rank's ∇X part d·(A·scale − W_r[label]); the sum over ranks is the full ∇X.
      // Under tensor parallelism the label's row came from its shard in S (as −d·W[label]).
      VP_CUDA_RETURN_IF_ERROR(VocabGradInputFix<E>(
          st.grad_x_.data(), st.scale_.data(), weight_,
          grouped ? st.no_label_.data() : st.local_label_.data(), st.d_, n, hidden_, ctx.stream));
      if (grouped) {
        VP_CUDA_RETURN_IF_ERROR(ResidualForward<float>(st.grad_x_.data(), st.grad_x_.data(),
                                                       st.label_rows_.data(),
                                                       static_cast<long>(n) * hidden_, ctx.stream));
      }
      if (absl::Status s = Idle(ctx); !s.ok()) return s;
      if (absl::Status s =
              comm.AllReduce(st.grad_x_.data(), st.grad_x_.size(), comm::ReduceOp::kSum);
          !s.ok()) {
        return Annotate(s, "output layer C1 grad_x");
      }
    }
    st.loss_host_.resize(n);
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.loss_host_.data(), st.loss_.data(),
                                            n * sizeof(float), cudaMemcpyDeviceToHost, ctx.stream));
    return absl::OkStatus();
  }();
  if (pass.ok()) {
    // m', s', the label logit and the packed sums are folded into scale and loss; the device
    // losses have their host copy (after Finish). Released here, reused after Finish's sync.
    st.local_max_.Reset();
    st.local_sum_.Reset();
    st.label_logit_.Reset();
    st.sums_.Reset();
    st.loss_.Reset();
    st.c1_label_.Reset();
    st.no_label_.Reset();
    st.label_rows_.Reset();
  }
  if (absl::Status s = Finished(std::move(pass), ctx); !s.ok()) return s;
  st.phase_ = Phase::kC1;
  return absl::OkStatus();
}

template <typename E>
absl::Status DeviceOutputLayerShard<E>::T(DeviceOutputLayerState<E>& st, const E* x) const {
  if (absl::Status s = ExpectPhase(st.phase_, Phase::kC1, "T"); !s.ok()) return s;
  if (x == nullptr) return absl::InvalidArgumentError("output layer T: x must be non-null");
  const DeviceContext& ctx = compute_;
  const int n = st.n_all_, m = st.n_, h = hidden_;
  const bool grouped = tensor_.size() > 1;
  absl::Status pass = [&]() -> absl::Status {
    // Under tensor parallelism: the group's rows again, and every token's merged scale (the
    // factor turning the merged P' into the softmax) times this shard's share of it.
    absl::StatusOr<tp::DeviceGatheredRows<E>> rows = rows_->Gather(x, n, h);
    if (!rows.ok()) return Annotate(rows.status(), "output layer T gather");
    const float* scale = st.scale_.data();
    DeviceArray<float> all_scale;
    if (grouped) {
      auto a = DeviceArray<float>::Create(ctx, kAct, n, false);
      if (!a.ok()) return a.status();
      all_scale = std::move(*a);
      if (absl::Status s = sums_->GatherInto(st.scale_.data(), n, 1, all_scale.data()); !s.ok()) {
        return Annotate(s, "output layer T gather");
      }
      auto host = Download(ctx, {all_scale.data()}, n);
      if (!host.ok()) return host.status();
      std::vector<float>& values = (*host)[0];
      for (int i = 0; i < n; ++i) values[i] *= st.group_share_[i];
      VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all_scale.data(), values.data(), n * sizeof(float),
                                              cudaMemcpyHostToDevice, ctx.stream));
      VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));  // host vector goes away
      scale = all_scale.data();
    }
    DeviceArray<float> partial;  // (n, h) Algorithm 1's ∇X', overwritten by OutputLayerT
    float* grad_x_partial = nullptr;
    if (algorithm_ == OutputAlgorithm::kAlgorithm1) {
      auto gx = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(n) * h, false);
      if (!gx.ok()) return gx.status();
      partial = std::move(*gx);
      grad_x_partial = partial.data();
    }
    // probs → d·(scale·P' − onehot) in place; ∇W_r += gradᵀ·X (accumulates in fp32).
    if (absl::Status s =
            OutputLayerT<E>(*ctx.gemm, st.probs_.data(), weight_grad_, grad_x_partial, rows->data(),
                            weight_, scale, st.local_label_.data(), st.d_, n, h, partition_.rows,
                            partition_.valid_rows, ctx.stream);
        !s.ok()) {
      return s;
    }
    if (algorithm_ == OutputAlgorithm::kAlgorithm1) {
      if (!grouped) {
        st.grad_x_ = std::move(partial);
      } else {
        // This rank's partial sum for C2, summed over the group first (its own rows kept).
        auto mine = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(m) * h, false);
        if (!mine.ok()) return mine.status();
        if (absl::Status s = sums_->ScatterSum(partial.data(), n, h, mine->data()); !s.ok()) {
          return Annotate(s, "output layer T grad_x");
        }
        st.grad_x_ = std::move(*mine);
      }
    }
    return absl::OkStatus();
  }();
  if (pass.ok()) {
    // T is the last reader of the n×rows buffer, the scale and the label rows; only the losses
    // and ∇X remain. The caching allocator hands the n×rows block to the next S.
    st.probs_.Reset();
    st.scale_.Reset();
    st.local_label_.Reset();
    st.group_share_.clear();
  }
  if (absl::Status s = Finished(std::move(pass), ctx); !s.ok()) return s;
  st.phase_ = Phase::kT;
  return absl::OkStatus();
}

template <typename E>
absl::Status DeviceOutputLayerShard<E>::C2(DeviceOutputLayerState<E>& st,
                                           comm::Communicator& comm) const {
  if (algorithm_ != OutputAlgorithm::kAlgorithm1) {
    return absl::FailedPreconditionError(
        "output layer C2 is Algorithm 1's barrier; Algorithm 2 has no C2");
  }
  if (absl::Status s = ExpectPhase(st.phase_, Phase::kT, "C2"); !s.ok()) return s;
  const DeviceContext& ctx = comm_;
  absl::Status pass = [&]() -> absl::Status {
    if (absl::Status s = Idle(ctx); !s.ok()) return s;
    if (absl::Status s = comm.AllReduce(st.grad_x_.data(), st.grad_x_.size(), comm::ReduceOp::kSum);
        !s.ok()) {
      return Annotate(s, "output layer C2 grad_x");
    }
    return absl::OkStatus();
  }();
  if (absl::Status s = Finished(std::move(pass), ctx); !s.ok()) return s;
  st.phase_ = Phase::kC2;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// DeviceInputLayerShard

template <typename E>
absl::StatusOr<std::unique_ptr<DeviceInputLayerShard<E>>> DeviceInputLayerShard<E>::Create(
    const vocab::VocabPartition& partition, int hidden, const E* weight, float* weight_grad,
    const DeviceContext& compute, const DeviceContext& comm, engine::tp::TensorGroup tensor) {
  if (absl::Status st = ValidateDeviceShardArgs("input layer", partition, hidden, weight,
                                                weight_grad, compute, comm);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = vocab::ValidateTensorShard("input layer", partition, tensor); !st.ok()) {
    return st;
  }
  // The constructor is private (only Create validates), so make_unique cannot reach it.
  std::unique_ptr<DeviceInputLayerShard> shard(new DeviceInputLayerShard());
  shard->partition_ = partition;
  shard->hidden_ = hidden;
  shard->weight_ = weight;
  shard->weight_grad_ = weight_grad;
  shard->compute_ = compute;
  shard->comm_ = comm;
  shard->rows_ = std::make_unique<tp::DeviceSequenceParallel<E>>(tensor, compute);
  shard->sums_ = std::make_unique<tp::DeviceSequenceParallel<float>>(tensor, compute);
  return shard;
}

template <typename E>
absl::StatusOr<DeviceInputLayerState<E>> DeviceInputLayerShard<E>::Forward(const int32_t* tokens,
                                                                           int n) const {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("input layer IF: n ", n, " < 1"));
  if (tokens == nullptr) return absl::InvalidArgumentError("input layer IF: tokens is null");
  if (absl::Status s = CheckIds(tokens, n, partition_.vocab, "input layer IF: tokens"); !s.ok()) {
    return s;
  }
  const DeviceContext& ctx = compute_;
  const int h = hidden_, t = sums_->group().size();
  if (n % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("input layer IF: n ", n, " tokens do not split over ", t, " tensor ranks"));
  }
  DeviceInputLayerState<E> st;
  st.n_ = n / t;
  st.n_all_ = n;
  absl::Status pass = [&]() -> absl::Status {
    auto tok = DeviceArray<int32_t>::Create(ctx, kAct, n, false);
    // Not zero-filled: the lookup kernel writes every element (zero rows for foreign tokens).
    auto out = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(n) * h, false);
    for (const absl::Status& s : {tok.status(), out.status()}) {
      if (!s.ok()) return s;
    }
    st.tokens_ = std::move(*tok);
    st.output_ = std::move(*out);
    // Global ids go up as they are: both the lookup and IB's scatter-add test the shard range.
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.tokens_.data(), tokens, n * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, ctx.stream));
    VP_CUDA_RETURN_IF_ERROR(EmbeddingForwardToFloat<E>(st.output_.data(), weight_,
                                                       st.tokens_.data(), n, h, partition_.begin,
                                                       partition_.valid_rows, ctx.stream));
    if (t > 1) {
      // The group's t shards summed, each rank keeping its own m rows.
      auto mine = DeviceArray<float>::Create(ctx, kAct, static_cast<size_t>(st.n_) * h, false);
      if (!mine.ok()) return mine.status();
      if (absl::Status s = sums_->ScatterSum(st.output_.data(), n, h, mine->data()); !s.ok()) {
        return Annotate(s, "input layer IF group sum");
      }
      st.output_ = std::move(*mine);
    }
    return absl::OkStatus();
  }();
  if (absl::Status s = Finished(std::move(pass), ctx); !s.ok()) return s;
  return st;
}

template <typename E>
absl::Status DeviceInputLayerShard<E>::ForwardReduce(DeviceInputLayerState<E>& st,
                                                     comm::Communicator& comm) const {
  if (st.output_.empty()) {
    return absl::FailedPreconditionError("input layer IF_REDUCE: no forward output in state");
  }
  const DeviceContext& ctx = comm_;
  absl::Status pass = [&]() -> absl::Status {
    if (absl::Status s = Idle(ctx); !s.ok()) return s;
    if (absl::Status s = comm.AllReduce(st.output_.data(), st.output_.size(), comm::ReduceOp::kSum);
        !s.ok()) {
      return Annotate(s, "input layer IF_REDUCE");
    }
    return absl::OkStatus();
  }();
  return Finished(std::move(pass), ctx);
}

template <typename E>
absl::Status DeviceInputLayerShard<E>::BackwardBroadcast(DeviceInputLayerState<E>& st,
                                                         comm::Communicator& comm, int root,
                                                         const E* root_grad) const {
  if (st.n_ < 1) return absl::FailedPreconditionError("input layer IB_BCAST: empty state");
  if (root < 0 || root >= comm.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input layer IB_BCAST: root ", root, " outside [0, ", comm.size(), ")"));
  }
  const bool is_root = comm.rank() == root;
  if (is_root && root_grad == nullptr) {
    return absl::InvalidArgumentError("input layer IB_BCAST: root_grad is null on the root");
  }
  const size_t count = static_cast<size_t>(st.n_) * hidden_;  // E elements
  // The communicator moves floats; E travels as raw bytes (a broadcast is a byte-exact copy).
  static_assert(sizeof(float) % sizeof(E) == 0, "E must pack evenly into floats");
  constexpr size_t kPerFloat = sizeof(float) / sizeof(E);  // 1 for float, 2 for bf16
  if (count % kPerFloat != 0) {
    return absl::InvalidArgumentError(absl::StrCat("input layer IB_BCAST: n·h = ", count,
                                                   " must be a multiple of ", kPerFloat,
                                                   " to be sent as floats"));
  }
  const DeviceContext& ctx = comm_;
  absl::Status pass = [&]() -> absl::Status {
    // Not zero-filled: the root copies into it and the broadcast overwrites it elsewhere.
    auto grad = DeviceArray<E>::Create(ctx, kAct, count, false);
    if (!grad.ok()) return grad.status();
    st.output_grad_ = std::move(*grad);
    if (is_root) {
      // root_grad was produced by a compute pass that returned after Finish: it is complete.
      VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.output_grad_.data(), root_grad, count * sizeof(E),
                                              cudaMemcpyDeviceToDevice, ctx.stream));
    }
    if (absl::Status s = Idle(ctx); !s.ok()) return s;
    if (absl::Status s = comm.Broadcast(reinterpret_cast<float*>(st.output_grad_.data()),
                                        count / kPerFloat, root);
        !s.ok()) {
      return Annotate(s, "input layer IB_BCAST");
    }
    return absl::OkStatus();
  }();
  if (!pass.ok()) st.output_grad_.Reset();  // no half-received gradient reaches IB
  return Finished(std::move(pass), ctx);
}

template <typename E>
absl::Status DeviceInputLayerShard<E>::Backward(DeviceInputLayerState<E>& st) const {
  if (st.output_grad_.empty()) {
    return absl::FailedPreconditionError("input layer IB: no broadcast gradient in state");
  }
  const DeviceContext& ctx = compute_;
  // Scatter-add with fp32 atomics: a token repeated in the microbatch adds once per occurrence.
  absl::Status pass = [&]() -> absl::Status {
    // Under tensor parallelism the group's rows of the gradient first (E rows, byte moves).
    const int n = rows_->group().size() > 1 ? st.n_all_ : st.n_;
    absl::StatusOr<tp::DeviceGatheredRows<E>> grad =
        rows_->Gather(st.output_grad_.data(), n, hidden_);
    if (!grad.ok()) return Annotate(grad.status(), "input layer IB gather");
    VP_CUDA_RETURN_IF_ERROR(EmbeddingBackward<E>(weight_grad_, grad->data(), st.tokens_.data(), n,
                                                 hidden_, partition_.begin, partition_.valid_rows,
                                                 ctx.stream));
    return absl::OkStatus();
  }();
  // The kernel may still be reading it: released to this thread's pending list, reusable only
  // after Finish's sync.
  st.output_grad_.Reset();
  return Finished(std::move(pass), ctx);
}

template class DeviceOutputLayerState<float>;
template class DeviceOutputLayerState<bf16>;
template class DeviceOutputLayerShard<float>;
template class DeviceOutputLayerShard<bf16>;
template class DeviceInputLayerShard<float>;
template class DeviceInputLayerShard<bf16>;

}  // namespace vp::engine::cuda
