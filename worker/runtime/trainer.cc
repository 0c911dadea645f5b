#include "worker/runtime/trainer.h"

#include <chrono>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::runtime {

using engine::Buffer;
using engine::MemoryCategory;

absl::StatusOr<std::unique_ptr<StandaloneTrainer>> StandaloneTrainer::Create(
    const TrainerOptions& options) {
  auto t = std::make_unique<StandaloneTrainer>(PassKey{});
  t->options_ = options;
  t->tracker_ = std::make_unique<engine::MemoryTracker>();
  t->comm_ = comm::MakeSelfCommunicator();
  const engine::ModelConfig& cfg = options.model;
  auto model =
      engine::RankModel::Create(cfg, engine::RankLayout::Standalone(cfg), options.microbatch_size,
                                {0, cfg.seq_len}, options.algorithm, t->tracker_.get());
  if (!model.ok()) return model.status();
  t->model_ = std::move(*model);
  t->model_->Init(options.seed);
  auto opt = engine::AdamW::Create(t->tracker_.get(), t->model_->param_count(), options.adamw,
                                   t->model_->DecayRanges());
  if (!opt.ok()) return opt.status();
  t->optimizer_ = std::make_unique<engine::AdamW>(std::move(*opt));
  return t;
}

struct StandaloneTrainer::Forwarded {
  engine::vocab::InputLayerState in;
  Buffer x_last;                       // (n, h) output of the layer stack
  Buffer lnf_out, lnf_mean, lnf_rstd;  // (n, h), (n), (n)
  engine::vocab::OutputLayerState out;
};

absl::StatusOr<StandaloneTrainer::Forwarded> StandaloneTrainer::Forward(
    int j, const int32_t* inputs, const int32_t* targets, float d, bool keep_for_backward,
    double* loss) {
  const engine::ModelConfig& cfg = options_.model;
  const int b = options_.microbatch_size, s = cfg.seq_len, h = cfg.hidden;
  const int n = b * s;
  engine::RankModel& model = *model_;
  engine::MemoryTracker* mem = tracker_.get();

  // IF: embedding lookup on the vocabulary shard + reduce, then position embeddings.
  auto in_state = model.input_layer().Forward(inputs, n);
  if (!in_state.ok()) return in_state.status();
  if (auto st = model.input_layer().ForwardReduce(*in_state, *comm_); !st.ok()) return st;
  float* x0 = in_state->mutable_output();  // (b, s, h)
  if (!cfg.llama()) engine::cpu::PositionEmbeddingForward(x0, model.wpe(), b, s, h, 0);

  // F of the layer stack, then the final LayerNorm.
  Buffer x_last(mem, MemoryCategory::kActivations, static_cast<size_t>(n) * h);  // (n, h)
  const engine::SlotKey slot{j, 0};
  absl::Status st = model.stack(0).Forward(slot, x0, x_last.data());
  if (!keep_for_backward) model.stack(0).DiscardMicrobatch(j);
  if (!st.ok()) return st;
  in_state->ReleaseOutput();  // the stack keeps its own copy of its input
  // The buffers the stack's pool still has parked now are those this forward did not take
  // back: sizes only the backward uses (d_qkv, the attention backward's scratch, ...). They are
  // resident but charged to nothing, and the final norm and the output layer's n×V block come
  // on top of them: at s = 32768 that put the process 192 MiB above the tracker at S
  // (docs/benchmarks.md §13). Give them back; the backward maps them again (page faults on
  // about a quarter of the pool's bytes per microbatch).
  model.stack(0).pool().ReleaseCached();
  Buffer lnf_out(mem, MemoryCategory::kActivations, static_cast<size_t>(n) * h);  // (n, h)
  Buffer lnf_mean(mem, MemoryCategory::kActivations, n);                          // (n)
  Buffer lnf_rstd(mem, MemoryCategory::kActivations, n);                          // (n)
  if (cfg.llama()) {                                                              // final RMSNorm
    engine::cpu::RmsNormForward(lnf_out.data(), lnf_rstd.data(), x_last.data(), model.lnf_weight(),
                                n, h, cfg.rms_eps);
  } else {
    engine::cpu::LayerNormForward(lnf_out.data(), lnf_mean.data(), lnf_rstd.data(), x_last.data(),
                                  model.lnf_weight(), model.lnf_bias(), n, h);
  }

  // Output layer: S and barrier C1 give every token's loss.
  engine::vocab::OutputLayerShard& out = model.output_layer();
  auto out_state = out.S(lnf_out.data(), targets, n, d);
  if (!out_state.ok()) return out_state.status();
  if (auto c1 = out.C1(*out_state, *comm_); !c1.ok()) return c1;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += out_state->losses()[i];
  *loss += sum * d;
  return Forwarded{.in = std::move(*in_state),
                   .x_last = std::move(x_last),
                   .lnf_out = std::move(lnf_out),
                   .lnf_mean = std::move(lnf_mean),
                   .lnf_rstd = std::move(lnf_rstd),
                   .out = std::move(*out_state)};
}

absl::Status StandaloneTrainer::Microbatch(int j, const int32_t* inputs, const int32_t* targets,
                                           float d, double* loss) {
  const engine::ModelConfig& cfg = options_.model;
  const int b = options_.microbatch_size, s = cfg.seq_len, h = cfg.hidden;
  const int n = b * s;
  engine::RankModel& model = *model_;
  engine::MemoryTracker* mem = tracker_.get();

  auto f = Forward(j, inputs, targets, d, /*keep_for_backward=*/true, loss);
  if (!f.ok()) return f.status();
  // T (and C2 for Algorithm 1) finish the output layer.
  engine::vocab::OutputLayerShard& out = model.output_layer();
  if (auto st = out.T(f->out, f->lnf_out.data()); !st.ok()) return st;
  // T keeps its n×V buffer for the next microbatch's S. After the step's last T there is none,
  // and the backward that follows is the step's memory peak: holding the buffer through it
  // cost 125 MiB of the tracker's 1017 at s = 32768, V = 1000 (docs/benchmarks.md §13). The
  // next step maps a fresh one (page faults once per step, not per microbatch).
  if (j == options_.microbatches - 1) out.ReleaseWorkspace();
  if (options_.algorithm == engine::vocab::OutputAlgorithm::kAlgorithm1) {
    if (auto st = out.C2(f->out, *comm_); !st.ok()) return st;
  }

  // Backward: final LayerNorm (B then W), the layer stack, position embeddings, IB.
  const float* d_lnf_out = f->out.grad_input();  // (n, h), d already applied
  Buffer d_x_last(mem, MemoryCategory::kActivations, static_cast<size_t>(n) * h);
  if (cfg.llama()) {
    engine::cpu::RmsNormBackwardInput(d_x_last.data(), d_lnf_out, f->x_last.data(),
                                      model.lnf_weight(), f->lnf_rstd.data(), n, h);
    engine::cpu::RmsNormBackwardWeight(model.lnf_weight_grad(), d_lnf_out, f->x_last.data(),
                                       f->lnf_rstd.data(), n, h);
  } else {
    engine::cpu::LayerNormBackwardInput(d_x_last.data(), d_lnf_out, f->x_last.data(),
                                        model.lnf_weight(), f->lnf_mean.data(), f->lnf_rstd.data(),
                                        n, h);
    engine::cpu::LayerNormBackwardWeight(model.lnf_weight_grad(), model.lnf_bias_grad(), d_lnf_out,
                                         f->x_last.data(), f->lnf_mean.data(), f->lnf_rstd.data(),
                                         n, h);
  }
  // Nothing of the output layer or the final norm is read again: free it (2·n×h and ∇X)
  // before the layer stack's backward, which is where the step peaks.
  f->out.Release();
  f->x_last = Buffer();
  f->lnf_out = Buffer();
  f->lnf_mean = Buffer();
  f->lnf_rstd = Buffer();
  Buffer d_x0(mem, MemoryCategory::kActivations, static_cast<size_t>(n) * h);
  const engine::SlotKey slot{j, 0};
  if (auto st = model.stack(0).Backward(slot, d_x_last.data(), d_x0.data()); !st.ok()) return st;
  if (!cfg.llama())
    engine::cpu::PositionEmbeddingBackward(model.wpe_grad(), d_x0.data(), b, s, h, 0);
  if (auto st = model.input_layer().BackwardBroadcast(f->in, *comm_, 0, d_x0.data()); !st.ok()) {
    return st;
  }
  return model.input_layer().Backward(f->in);
}

absl::Status StandaloneTrainer::ForwardOnly(int j, const int32_t* inputs, const int32_t* targets,
                                            float d, double* loss) {
  // T (the weight gradients) and the backward are skipped.
  auto f = Forward(j, inputs, targets, d, /*keep_for_backward=*/false, loss);
  if (!f.ok()) return f.status();
  f->out.Release();
  return absl::OkStatus();
}

absl::StatusOr<double> StandaloneTrainer::Evaluate(int64_t step, int num_batches,
                                                   const BatchFn& batches) {
  if (num_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation needs at least 1 batch (got ", num_batches, ")"));
  }
  const int b = options_.microbatch_size, s = options_.model.seq_len;
  const float d = 1.0f / (static_cast<float>(num_batches) * b * s);
  std::vector<int32_t> inputs(static_cast<size_t>(b) * s), targets(inputs.size());
  double loss = 0;
  for (int j = 0; j < num_batches; ++j) {
    if (auto st = batches(step, j, inputs.data(), targets.data()); !st.ok()) return st;
    if (auto st = ForwardOnly(j, inputs.data(), targets.data(), d, &loss); !st.ok()) return st;
  }
  model_->output_layer().ReleaseWorkspace();
  return loss;
}

absl::StatusOr<double> StandaloneTrainer::ComputeGradients(int64_t step, const BatchFn& batches) {
  const int b = options_.microbatch_size, s = options_.model.seq_len;
  const int m = options_.microbatches;
  // Mean over all m·b·s tokens of the step: each token's loss gradient is 1/(m·b·s), known
  // before the step, so the output layer applies it directly (no loss-gradient broadcast).
  const float d = 1.0f / (static_cast<float>(m) * b * s);
  std::vector<int32_t> inputs(static_cast<size_t>(b) * s), targets(inputs.size());
  model_->ZeroGrads();
  double loss = 0;
  for (int j = 0; j < m; ++j) {
    if (auto st = batches(step, j, inputs.data(), targets.data()); !st.ok()) return st;
    if (auto st = Microbatch(j, inputs.data(), targets.data(), d, &loss); !st.ok()) return st;
  }
  return loss;
}

absl::StatusOr<StepResult> StandaloneTrainer::Step(int64_t step, const BatchFn& batches) {
  const auto t0 = std::chrono::steady_clock::now();
  auto loss = ComputeGradients(step, batches);
  if (!loss.ok()) return loss.status();
  StepResult r;
  r.step = step;
  r.loss = *loss;
  if (!std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("step ", step, ": loss is ", r.loss));
  }
  const double sq = engine::SquaredNorm(model_->grads(), model_->param_count());
  r.grad_norm = std::sqrt(sq);
  r.lr = options_.lr.At(step);
  optimizer_->Step(model_->params(), model_->grads(), r.lr,
                   engine::ClipScale(sq, options_.grad_clip));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace vp::runtime
