#include "worker/engine/vocab/output_layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/kernels/cpu/fast_exp.h"

namespace vp::engine::vocab {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

const char* PhaseName(OutputLayerState::Phase p) {
  switch (p) {
    case OutputLayerState::Phase::kNone:
      return "none";
    case OutputLayerState::Phase::kS:
      return "S";
    case OutputLayerState::Phase::kC1:
      return "C1";
    case OutputLayerState::Phase::kT:
      return "T";
    case OutputLayerState::Phase::kC2:
      return "C2";
  }
  return "?";
}

absl::Status ExpectPhase(const OutputLayerState& state, OutputLayerState::Phase want,
                         const char* pass) {
  if (state.phase() == want) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("output layer ", pass, " needs a state after ",
                                                    PhaseName(want), ", got one after ",
                                                    PhaseName(state.phase())));
}

// One token's row of logits y (valid) → P' in place; returns m' and s' and, if label >= 0,
// the shifted label logit y[label] − m'. Only the `valid` real rows are touched: padding
// columns stay exactly 0, so they never enter the max, the sum or P'.
void SoftmaxRowForward(float* y,  // (valid) logits in, P' out
                       int64_t valid, int32_t label, float* m_out, float* s_out, float* z_out) {
  // Eight running maxima: a single one is a serial dependency the compiler may not split.
  float mx[8];
  std::fill_n(mx, 8, kNegInf);
  int64_t j = 0;
  for (; j + 8 <= valid; j += 8) {
    for (int q = 0; q < 8; ++q) mx[q] = y[j + q] > mx[q] ? y[j + q] : mx[q];
  }
  for (; j < valid; ++j) mx[0] = y[j] > mx[0] ? y[j] : mx[0];
  float m = mx[0];
  for (int q = 1; q < 8; ++q) m = mx[q] > m ? mx[q] : m;
  *z_out = label >= 0 ? y[label] - m : 0.0f;
  for (j = 0; j < valid; ++j) y[j] = cpu::ExpNonPositive(y[j] - m);
  // The sum in double (V/p terms <= 1; the loss is log s), four partial sums for throughput.
  double s4[4] = {0, 0, 0, 0};
  for (j = 0; j + 4 <= valid; j += 4) {
    for (int q = 0; q < 4; ++q) s4[q] += y[j + q];
  }
  for (; j < valid; ++j) s4[0] += y[j];
  const double s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
  const float inv = static_cast<float>(1.0 / s);
  for (j = 0; j < valid; ++j) y[j] *= inv;
  *m_out = m;
  *s_out = static_cast<float>(s);
}

}  // namespace

void GroupShareTerms(int n, const float* local_max, const float* group_max, const float* local_sum,
                     const float* label_logit, const int32_t* local_label, float* share,
                     float* sums) {
  for (int i = 0; i < n; ++i) {
    // <= 0, or -inf for an all-padding shard (also when the whole group is padding, where
    // -inf − -inf would be NaN): it then adds exactly 0.
    const float delta = local_max[i] == kNegInf ? kNegInf : local_max[i] - group_max[i];
    share[i] = local_sum[i] * std::exp(delta);
    sums[i] = share[i];
    sums[n + i] = local_label[i] >= 0 ? label_logit[i] + delta : 0.0f;
  }
}

void NormalizeGroupShares(int n, const float* group_sums, float* share) {
  for (int i = 0; i < n; ++i) {
    const float total = group_sums[i];  // 0 only when all t shards are padding
    share[i] = total > 0 ? share[i] / total : 0.0f;
  }
}

bool OutputLayerState::grad_input_ready() const {
  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    return phase_ == Phase::kC1 || phase_ == Phase::kT;
  }
  return phase_ == Phase::kC2;
}

void OutputLayerState::Release() {
  probs_ = Buffer();
  group_share_ = Buffer();
  label_rows_ = Buffer();
  label_here_.clear();
  label_here_.shrink_to_fit();
  local_max_ = Buffer();
  local_sum_ = Buffer();
  label_logit_ = Buffer();
  scale_ = Buffer();
  loss_ = Buffer();
  grad_x_ = Buffer();
  local_label_.clear();
  local_label_.shrink_to_fit();
}

int64_t OutputLayerState::bytes() const {
  size_t floats = probs_.size() + local_max_.size() + local_sum_.size() + label_logit_.size() +
                  scale_.size() + loss_.size() + grad_x_.size() + group_share_.size() +
                  label_rows_.size();
  return static_cast<int64_t>(floats * sizeof(float));
}

absl::StatusOr<OutputLayerShard> OutputLayerShard::Create(const VocabPartition& partition,
                                                          int hidden, OutputAlgorithm algorithm,
                                                          const float* weight, float* weight_grad,
                                                          MemoryTracker* tracker,
                                                          tp::TensorGroup tensor) {
  if (absl::Status st = ValidateShardArgs("output layer", partition, hidden, weight, weight_grad);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = ValidateTensorShard("output layer", partition, tensor); !st.ok()) return st;
  return OutputLayerShard(partition, hidden, algorithm, weight, weight_grad, tracker, tensor);
}

bool OutputLayerShard::GroupOwns(int64_t label) const {
  const int t = sp_.group().size();
  const int64_t group_begin =
      partition_.begin - static_cast<int64_t>(sp_.group().rank()) * partition_.rows;
  const int64_t group_end = std::min(group_begin + t * partition_.rows, partition_.vocab);
  return label >= group_begin && label < group_end;
}

Buffer OutputLayerShard::TakeWorkspace(size_t count) const {
  {
    std::lock_guard<std::mutex> lock(spare_->mu);
    // Reused as (n, rows) with the same rows: the valid columns are overwritten by S's GEMM
    // (beta = 0) and the padding columns were never written, so no zeroing is needed.
    if (spare_->buffer.size() >= count) return std::move(spare_->buffer);
  }
  return Buffer(tracker_, MemoryCategory::kActivations, count);
}

void OutputLayerShard::ReleaseWorkspace() const {
  std::lock_guard<std::mutex> lock(spare_->mu);
  spare_->buffer = Buffer();
}

absl::StatusOr<OutputLayerState> OutputLayerShard::S(const float* x, const int32_t* labels, int n,
                                                     float d) const {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("output layer S: n ", n, " < 1"));
  if (x == nullptr || labels == nullptr) {
    return absl::InvalidArgumentError("output layer S: x and labels must be non-null");
  }
  if (!std::isfinite(d)) return absl::InvalidArgumentError("output layer S: d must be finite");
  const int t = sp_.group().size();
  if (n % t != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("output layer S: n ", n, " tokens do not split over ", t, " tensor ranks"));
  }
  const int64_t rows = partition_.rows, valid = partition_.valid_rows;
  const int h = hidden_;
  const auto act = MemoryCategory::kActivations;

  OutputLayerState st;
  st.algorithm_ = algorithm_;
  st.n_ = n / t;
  st.n_all_ = n;
  st.d_ = d;
  st.local_label_.resize(n);
  for (int i = 0; i < n; ++i) {
    if (labels[i] < 0 || labels[i] >= partition_.vocab) {
      return absl::InvalidArgumentError(absl::StrCat("output layer S: labels[", i,
                                                     "] = ", labels[i],
                                                     " outside [0, V = ", partition_.vocab, ")"));
    }
    st.local_label_[i] =
        partition_.Owns(labels[i]) ? static_cast<int32_t>(labels[i] - partition_.begin) : -1;
  }
  // Under tensor parallelism the logits are computed for all the group's rows.
  Buffer gathered;
  if (t > 1) {
    gathered = Buffer(tracker_, act, static_cast<size_t>(n) * h);
    if (absl::Status s = sp_.GatherInto(x, n, h, gathered.data()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("output layer S gather: ", s.message()));
    }
    x = gathered.data();
  }
  st.probs_ = TakeWorkspace(static_cast<size_t>(n) * rows);
  st.local_max_ = Buffer(tracker_, act, n);
  st.local_sum_ = Buffer(tracker_, act, n);
  st.label_logit_ = Buffer(tracker_, act, n);

  float* y = st.probs_.data();  // (n, rows)
  if (valid > 0) {
    // Y (n, valid) = X (n, h) · W_rᵀ (h, valid); padding columns are skipped and stay 0.
    cpu::Gemm(false, true, n, static_cast<int>(valid), h, 1.0f, x, h, weight_, h, 0.0f, y,
              static_cast<int>(rows));
    for (int i = 0; i < n; ++i) {
      SoftmaxRowForward(y + static_cast<size_t>(i) * rows, valid, st.local_label_[i],
                        &st.local_max_.data()[i], &st.local_sum_.data()[i],
                        &st.label_logit_.data()[i]);
    }
  } else {
    // All-padding shard: contributes m' = -inf, s' = 0, P' = 0 (the buffer is zeroed).
    for (int i = 0; i < n; ++i) st.local_max_.data()[i] = kNegInf;
  }

  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    // A (n, h) = P' (n, valid) · W_r (valid, h). Rescaled and reduced in C1.
    st.grad_x_ = Buffer(tracker_, act, static_cast<size_t>(n) * h);
    if (valid > 0) {
      cpu::Gemm(false, false, n, h, static_cast<int>(valid), 1.0f, y, static_cast<int>(rows),
                weight_, h, 0.0f, st.grad_x_.data(), h);
    }
  }
  if (t == 1) {
    st.label_here_.resize(n);
    for (int i = 0; i < n; ++i) st.label_here_[i] = st.local_label_[i] >= 0;
  } else {
    st.label_here_.resize(st.n_);
    const int first = sp_.group().rank() * st.n_;
    for (int i = 0; i < st.n_; ++i) st.label_here_[i] = GroupOwns(labels[first + i]);
    if (absl::Status s = MergeOverTensorGroup(st); !s.ok()) return s;
  }
  st.phase_ = OutputLayerState::Phase::kS;
  return st;
}

// The group's t shards as one: with M the max of their m' and S = Σ s'·exp(m' − M), the
// merged shard's P' on shard v's rows is share_v · P'_v, share_v = s'_v·exp(m'_v − M)/S; its
// label logit is the owning shard's, shifted to M; and (Algorithm 2) its A = Σ_v share_v·A_v.
// The n-sized vectors are all-reduced (every rank keeps share for T); A and the label's weight
// rows are reduce-scattered, each rank keeping its m rows.
absl::Status OutputLayerShard::MergeOverTensorGroup(OutputLayerState& st) const {
  const int n = st.n_all_, m = st.n_, h = hidden_, first = sp_.group().rank() * m;
  const auto act = MemoryCategory::kActivations;
  comm::Communicator& comm = *sp_.group().comm();
  Buffer group_max(tracker_, act, n);
  std::memcpy(group_max.data(), st.local_max_.data(), n * sizeof(float));
  if (absl::Status s = comm.AllReduce(group_max.data(), n, comm::ReduceOp::kMax); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("output layer S group max: ", s.message()));
  }
  Buffer sums(tracker_, act, 2 * static_cast<size_t>(n));  // [s'·exp(m' − M) | z' + m' − M]
  st.group_share_ = Buffer(tracker_, act, n);
  GroupShareTerms(n, st.local_max_.data(), group_max.data(), st.local_sum_.data(),
                  st.label_logit_.data(), st.local_label_.data(), st.group_share_.data(),
                  sums.data());
  if (absl::Status s = comm.AllReduce(sums.data(), sums.size(), comm::ReduceOp::kSum); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("output layer S group sum: ", s.message()));
  }
  NormalizeGroupShares(n, sums.data(), st.group_share_.data());
  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    // One reduce-scatter of (n, 2h) rows [share·A | label's weight row where it is here].
    Buffer both(tracker_, act, static_cast<size_t>(n) * 2 * h);
    for (int i = 0; i < n; ++i) {
      float* row = both.data() + static_cast<size_t>(i) * 2 * h;
      const float* a = st.grad_x_.data() + static_cast<size_t>(i) * h;
      const float c = st.group_share_.data()[i];
      for (int k = 0; k < h; ++k) row[k] = a[k] * c;
      if (st.local_label_[i] >= 0) {
        std::memcpy(row + h, weight_ + static_cast<size_t>(st.local_label_[i]) * h,
                    h * sizeof(float));
      } else {
        std::fill_n(row + h, h, 0.0f);
      }
    }
    Buffer mine(tracker_, act, static_cast<size_t>(m) * 2 * h);
    if (absl::Status s = sp_.ScatterSum(both.data(), n, 2 * h, mine.data()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("output layer S group A: ", s.message()));
    }
    st.grad_x_ = Buffer(tracker_, act, static_cast<size_t>(m) * h);
    st.label_rows_ = Buffer(tracker_, act, static_cast<size_t>(m) * h);
    for (int i = 0; i < m; ++i) {
      const float* row = mine.data() + static_cast<size_t>(i) * 2 * h;
      std::memcpy(st.grad_x_.data() + static_cast<size_t>(i) * h, row, h * sizeof(float));
      std::memcpy(st.label_rows_.data() + static_cast<size_t>(i) * h, row + h, h * sizeof(float));
    }
  }
  // The merged statistics of this rank's own m tokens, for C1.
  Buffer merged_max(tracker_, act, m), merged_sum(tracker_, act, m), merged_label(tracker_, act, m);
  for (int i = 0; i < m; ++i) {
    merged_max.data()[i] = group_max.data()[first + i];
    merged_sum.data()[i] = sums.data()[first + i];
    merged_label.data()[i] = sums.data()[n + first + i];
  }
  st.local_max_ = std::move(merged_max);
  st.local_sum_ = std::move(merged_sum);
  st.label_logit_ = std::move(merged_label);
  return absl::OkStatus();
}

absl::Status OutputLayerShard::C1(OutputLayerState& st, comm::Communicator& comm) const {
  if (absl::Status s = ExpectPhase(st, OutputLayerState::Phase::kS, "C1"); !s.ok()) return s;
  const int n = st.n_;
  const auto act = MemoryCategory::kActivations;

  // m = max over ranks of m'.
  Buffer global_max(tracker_, act, n);
  std::memcpy(global_max.data(), st.local_max_.data(), n * sizeof(float));
  if (absl::Status s = comm.AllReduce(global_max.data(), n, comm::ReduceOp::kMax); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("output layer C1 max: ", s.message()));
  }

  // One sum all-reduce of [s'·exp(m' − m) (n) | shifted label logit y_label − m (n)]. The
  // label logit is non-zero only on the rank owning the label. For an all-padding shard
  // m' = -inf, so exp(m' − m) = 0 and s' = 0: it adds exactly 0, never a NaN.
  Buffer sums(tracker_, act, 2 * static_cast<size_t>(n));
  st.scale_ = Buffer(tracker_, act, n);
  for (int i = 0; i < n; ++i) {
    const float delta = st.local_max_.data()[i] - global_max.data()[i];  // <= 0 or -inf
    const float rescaled = st.local_sum_.data()[i] * std::exp(delta);
    st.scale_.data()[i] = rescaled;  // s_loc, divided by s below
    sums.data()[i] = rescaled;
    sums.data()[n + i] = st.label_here_[i] ? st.label_logit_.data()[i] + delta : 0.0f;
  }
  if (absl::Status s = comm.AllReduce(sums.data(), sums.size(), comm::ReduceOp::kSum); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("output layer C1 sum: ", s.message()));
  }
  st.loss_ = Buffer(tracker_, act, n);
  for (int i = 0; i < n; ++i) {
    const float s = sums.data()[i];  // >= 1: the owner of the max contributes exp(0)
    st.loss_.data()[i] = std::log(s) - sums.data()[n + i];
    st.scale_.data()[i] /= s;
  }

  if (algorithm_ == OutputAlgorithm::kAlgorithm2) {
    // ∇X (n, h) = d·(A·scale − Bg), Bg = W_r row of the label where it is local. Bg is read
    // straight from W_r rather than copied in S (same values: weights are fixed in a step);
    // under tensor parallelism the label's row came from its shard in S.
    const int h = hidden_;
    float* gx = st.grad_x_.data();
    for (int i = 0; i < n; ++i) {
      float* row = gx + static_cast<size_t>(i) * h;
      const float c = st.d_ * st.scale_.data()[i];
      for (int k = 0; k < h; ++k) row[k] *= c;
      if (st.label_here_[i]) {
        const float* w = st.label_rows_.empty()
                             ? weight_ + static_cast<size_t>(st.local_label_[i]) * h
                             : st.label_rows_.data() + static_cast<size_t>(i) * h;
        for (int k = 0; k < h; ++k) row[k] -= st.d_ * w[k];
      }
    }
    const size_t count = static_cast<size_t>(n) * h;
    if (absl::Status s = comm.AllReduce(gx, count, comm::ReduceOp::kSum); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("output layer C1 grad_x: ", s.message()));
    }
  }
  // m', s' and the label logit are folded into scale and loss; free them now.
  st.local_max_ = Buffer();
  st.local_sum_ = Buffer();
  st.label_logit_ = Buffer();
  st.label_rows_ = Buffer();
  st.phase_ = OutputLayerState::Phase::kC1;
  return absl::OkStatus();
}

absl::Status OutputLayerShard::T(OutputLayerState& st, const float* x) const {
  if (absl::Status s = ExpectPhase(st, OutputLayerState::Phase::kC1, "T"); !s.ok()) return s;
  if (x == nullptr) return absl::InvalidArgumentError("output layer T: x must be non-null");
  const int n = st.n_all_, h = hidden_;
  const int64_t rows = partition_.rows, valid = partition_.valid_rows;
  const auto act = MemoryCategory::kActivations;
  // Under tensor parallelism: the group's rows again, and every token's merged scale (the
  // factor turning the merged P' into the softmax) times this shard's share of it.
  const float* scale = st.scale_.data();
  Buffer gathered, all_scale;
  if (sp_.group().size() > 1) {
    gathered = Buffer(tracker_, act, static_cast<size_t>(n) * h);
    all_scale = Buffer(tracker_, act, n);
    absl::Status s = sp_.GatherInto(x, n, h, gathered.data());
    if (s.ok()) s = sp_.GatherInto(st.scale_.data(), n, 1, all_scale.data());
    if (!s.ok())
      return absl::Status(s.code(), absl::StrCat("output layer T gather: ", s.message()));
    for (int i = 0; i < n; ++i) all_scale.data()[i] *= st.group_share_.data()[i];
    x = gathered.data();
    scale = all_scale.data();
  }
  float* g = st.probs_.data();  // (n, rows): P' → grad = d·(softmax − onehot), in place
  for (int i = 0; i < n; ++i) {
    float* row = g + static_cast<size_t>(i) * rows;
    const float c = st.d_ * scale[i];
    for (int64_t j = 0; j < valid; ++j) row[j] *= c;
    if (st.local_label_[i] >= 0) row[st.local_label_[i]] -= st.d_;
  }
  if (valid > 0) {
    // ∇W_r (valid, h) += gradᵀ (valid, n) · X (n, h); padding rows are never written.
    cpu::Gemm(true, false, static_cast<int>(valid), h, n, 1.0f, g, static_cast<int>(rows), x, h,
              1.0f, weight_grad_, h);
  }
  if (algorithm_ == OutputAlgorithm::kAlgorithm1) {
    // ∇X' (n, h) = grad (n, valid) · W_r (valid, h), this rank's partial sum for C2; under
    // tensor parallelism summed over the group first, each rank keeping its own rows.
    st.grad_x_ = Buffer(tracker_, act, static_cast<size_t>(n) * h);
    if (valid > 0) {
      cpu::Gemm(false, false, n, h, static_cast<int>(valid), 1.0f, g, static_cast<int>(rows),
                weight_, h, 0.0f, st.grad_x_.data(), h);
    }
    if (sp_.group().size() > 1) {
      Buffer mine(tracker_, act, static_cast<size_t>(st.n_) * h);
      if (absl::Status s = sp_.ScatterSum(st.grad_x_.data(), n, h, mine.data()); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("output layer T grad_x: ", s.message()));
      }
      st.grad_x_ = std::move(mine);
    }
  }
  st.group_share_ = Buffer();
  {
    // T is the last reader of the n×rows buffer; keep it for the next S.
    std::lock_guard<std::mutex> lock(spare_->mu);
    if (st.probs_.size() > spare_->buffer.size()) spare_->buffer = std::move(st.probs_);
    st.probs_ = Buffer();
  }
  st.phase_ = OutputLayerState::Phase::kT;
  return absl::OkStatus();
}

absl::Status OutputLayerShard::C2(OutputLayerState& st, comm::Communicator& comm) const {
  if (algorithm_ != OutputAlgorithm::kAlgorithm1) {
    return absl::FailedPreconditionError(
        "output layer C2 is Algorithm 1's barrier; Algorithm 2 has no C2");
  }
  if (absl::Status s = ExpectPhase(st, OutputLayerState::Phase::kT, "C2"); !s.ok()) return s;
  if (absl::Status s = comm.AllReduce(st.grad_x_.data(), st.grad_x_.size(), comm::ReduceOp::kSum);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("output layer C2 grad_x: ", s.message()));
  }
  st.phase_ = OutputLayerState::Phase::kC2;
  return absl::OkStatus();
}

}  // namespace vp::engine::vocab
