// The plan executor's action handlers and its step (declarations and the letters in
// rank_executor.h). Each handler waits for the keys its inputs need, runs one action through the
// engine, stores what it produced and announces it with Produce.
#pragma once

#include "worker/runtime/rank_executor.h"

namespace vp::runtime::internal {

// IF: this rank's shard of the embedding lookup.
template <StageEngine E>
absl::Status RankExecutor<E>::DoIF(const planner::Action& a) {
  // Under tensor parallelism the tokens go in gather order, so each rank's share of the lookup
  // is its rows of every sequence chunk (tensor_rows.h).
  std::vector<int32_t> ordered;
  const int32_t* tokens = inputs_[a.mb].data();
  if (t() > 1) {
    ordered = TensorRows(t(), options_.tensor.rank, b(), plan_.seq_bounds).GatherOrder(tokens, s());
    tokens = ordered.data();
  }
  auto st = engine_->model().input_layer().Forward(tokens, b() * s());
  if (!st.ok()) return st.status();
  Put(input_states_, a.mb, std::move(*st));
  Produce({KeyKind::kInComputed, a.mb});
  // Not sharded: the lookup is already the whole embedding; no IF_REDUCE follows.
  if (!plan_.vocab_sharded) Produce({KeyKind::kInReduced, a.mb});
  return absl::OkStatus();
}

// F: one model chunk's layers on one slot; the last group also runs ln_f (X).
template <StageEngine E>
absl::Status RankExecutor<E>::DoF(const planner::Action& a, double* waited) {
  const int g = setup_.chunk_group[a.chunk], q = a.seq;
  const int len = SeqLen(q);
  Buffer x;  // (b, len, h)
  if (g == 0) {
    if (auto st = Wait({KeyKind::kInReduced, a.mb}, waited); !st.ok()) return st;
    auto* in = Get(input_states_, a.mb);
    if (in == nullptr || in->output() == nullptr) return Missing(a, "embedding output");
    auto xb = engine_->Act(SlotElems(q), /*zero=*/false, E::kCompute);
    if (!xb.ok()) return xb.status();
    x = std::move(*xb);
    if (auto st = engine_->EmbedSeqChunk(x, *in, b(), s(), len, h(), SeqBegin(q)); !st.ok())
      return st;
    if (q == setup_.k - 1) in->ReleaseOutput();
  } else if (auto it = setup_.local_chunk_of_group.find(g - 1);
             it != setup_.local_chunk_of_group.end()) {
    const ChunkSlot src{a.mb, it->second, q};
    if (auto st = Wait({KeyKind::kActOut, a.mb, it->second, q}, waited); !st.ok()) return st;
    Buffer* in = Get(act_out_, src);
    if (in == nullptr) return Missing(a, "local activation");
    x = std::move(*in);
    Erase(act_out_, src);
  } else {
    const ChunkSlot src{a.mb, a.chunk, q};
    if (auto st = Wait({KeyKind::kActIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
    Buffer* in = Get(act_in_, src);
    if (in == nullptr) return Missing(a, "received activation");
    x = std::move(*in);
    Erase(act_in_, src);
  }
  auto out = engine_->Act(SlotElems(q), /*zero=*/false, E::kCompute);
  if (!out.ok()) return out.status();
  if (auto st = engine_->model().stack(a.chunk).Forward({a.mb, q}, x.data(), out->data());
      !st.ok()) {
    return st;
  }
  // Evaluation: no B will read the slots' saved activations or the K/V cache.
  if (forward_only_ && q == setup_.k - 1) engine_->model().stack(a.chunk).DiscardMicrobatch(a.mb);
  if (g == setup_.groups - 1) {
    // The last group: ln_f gives X, the output layer's input.
    XState xst;
    if (auto st = engine_->FinalNormForward(xst, std::move(*out), SlotRows(q)); !st.ok()) return st;
    Put(x_states_, SeqSlot{a.mb, q}, std::move(xst));
    Produce({KeyKind::kXReady, a.mb, 0, q});
  } else {
    Put(act_out_, ChunkSlot{a.mb, a.chunk, q}, std::move(*out));
    Produce({KeyKind::kActOut, a.mb, a.chunk, q});
  }
  return absl::OkStatus();
}

// S: the output layer's first pass on X.
template <StageEngine E>
absl::Status RankExecutor<E>::DoS(const planner::Action& a, double* waited) {
  const int q = a.seq, len = SeqLen(q), n = b() * len;
  if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, waited); !st.ok()) return st;
  XState* x = Get(x_states_, SeqSlot{a.mb, q});
  if (x == nullptr) return Missing(a, "X");
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int r = 0; r < b(); ++r) {
    std::copy_n(targets_[a.mb].data() + static_cast<size_t>(r) * s() + SeqBegin(q), len,
                labels.data() + static_cast<size_t>(r) * len);
  }
  auto st = engine_->model().output_layer().S(x->x.data(), labels.data(), n, loss_grad_);
  if (!st.ok()) return st.status();
  OutputEntry* o = Put(output_states_, SeqSlot{a.mb, q}, OutputEntry{std::move(*st)});
  o->grad_consumed = !setup_.owner;
  Produce({KeyKind::kSDone, a.mb, 0, q});
  if (plan_.barrier == 0) {  // the whole output layer is here: the barrier is local
    if (auto c1 = engine_->model().output_layer().C1(o->state, *self_comm_); !c1.ok()) return c1;
    Produce({KeyKind::kC1Done, a.mb, 0, q});
    if (forward_only_) TakeEvalLoss(SeqSlot{a.mb, q});
  }
  return absl::OkStatus();
}

// Forward-only evaluation: after C1 of a slot, adds its losses and drops its output-layer
// state and X (on the owner BCAST_X of the slot ran before its C1).
template <StageEngine E>
void RankExecutor<E>::TakeEvalLoss(SeqSlot key) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = output_states_.find(key);
  if (it == output_states_.end()) return;
  double sum = 0;
  for (int i = 0; i < it->second.state.n(); ++i) sum += it->second.state.losses()[i];
  loss_ += sum * loss_grad_;
  losses_seen_ += 1;
  output_states_.erase(it);
  x_states_.erase(key);
}

// T: the output layer's second pass; adds the slot's loss.
template <StageEngine E>
absl::Status RankExecutor<E>::DoT(const planner::Action& a, double* waited) {
  const int q = a.seq;
  if (auto st = Wait({KeyKind::kC1Done, a.mb, 0, q}, waited); !st.ok()) return st;
  XState* x = Get(x_states_, SeqSlot{a.mb, q});
  OutputEntry* o = Get(output_states_, SeqSlot{a.mb, q});
  if (x == nullptr || o == nullptr) return Missing(a, "output-layer state");
  if (auto st = engine_->model().output_layer().T(o->state, x->x.data()); !st.ok()) return st;
  double sum = 0;
  for (int i = 0; i < o->state.n(); ++i) sum += o->state.losses()[i];
  loss_ += sum * loss_grad_;
  losses_seen_ += 1;
  // X is not needed after T (BCAST_X ran before C1 on this rank); the owner's B may still
  // need ln_f's input and statistics.
  x->x = Buffer();
  if (x->x_last.empty()) Erase(x_states_, SeqSlot{a.mb, q});
  {
    std::lock_guard<std::mutex> l(mu_);
    o->t_done = true;
    if (setup_.algorithm == engine::vocab::OutputAlgorithm::kAlgorithm2 || plan_.barrier == 0) {
      o->barrier_done = true;
    }
  }
  Produce({KeyKind::kTDone, a.mb, 0, q});
  MaybeReleaseOut(SeqSlot{a.mb, q});
  return absl::OkStatus();
}

// Drops an output-layer state once T, its barrier and the owner's B are all done.
template <StageEngine E>
void RankExecutor<E>::MaybeReleaseOut(SeqSlot key) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = output_states_.find(key);
  if (it != output_states_.end() && it->second.t_done && it->second.grad_consumed &&
      it->second.barrier_done) {
    output_states_.erase(it);
  }
}

// B (input gradient) of a chunk; with `weight` also W (the fused BW).
template <StageEngine E>
absl::Status RankExecutor<E>::DoB(const planner::Action& a, bool weight, double* waited) {
  const int g = setup_.chunk_group[a.chunk], q = a.seq, len = SeqLen(q), n = SlotRows(q);
  Buffer dout;
  if (g == setup_.groups - 1) {
    const KeyKind ready_key =
        plan_.barrier == 2 ? KeyKind::kC2Done : KeyKind::kC1Done;  // ∇X is final here
    if (auto st = Wait({ready_key, a.mb, 0, q}, waited); !st.ok()) return st;
    OutputEntry* o = Get(output_states_, SeqSlot{a.mb, q});
    XState* x = Get(x_states_, SeqSlot{a.mb, q});
    if (o == nullptr || x == nullptr || o->state.grad_input() == nullptr) {
      return Missing(a, "output-layer gradient");
    }
    auto db =
        engine_->Act(SlotElems(q), /*zero=*/true, E::kCompute);  // ln_f's B accumulates into it
    if (!db.ok()) return db.status();
    dout = std::move(*db);
    if (auto st = engine_->FinalNormBackward(dout, o->state.grad_input(), *x, n); !st.ok()) {
      return st;
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      o->grad_consumed = true;
      if (x->x.empty()) x_states_.erase(SeqSlot{a.mb, q});  // T already ran
    }
    MaybeReleaseOut(SeqSlot{a.mb, q});
  } else if (auto it = setup_.local_chunk_of_group.find(g + 1);
             it != setup_.local_chunk_of_group.end()) {
    const ChunkSlot src{a.mb, it->second, q};
    if (auto st = Wait({KeyKind::kGradOut, a.mb, it->second, q}, waited); !st.ok()) return st;
    Buffer* in = Get(grad_out_, src);
    if (in == nullptr) return Missing(a, "local gradient");
    dout = std::move(*in);
    Erase(grad_out_, src);
  } else {
    const ChunkSlot src{a.mb, a.chunk, q};
    if (auto st = Wait({KeyKind::kGradIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
    Buffer* in = Get(grad_in_, src);
    if (in == nullptr) return Missing(a, "received gradient");
    dout = std::move(*in);
    Erase(grad_in_, src);
  }
  auto dx = engine_->Act(SlotElems(q), /*zero=*/false, E::kCompute);
  if (!dx.ok()) return dx.status();
  auto& stack = engine_->model().stack(a.chunk);
  const engine::SlotKey slot{a.mb, q};
  if (auto st = weight ? stack.Backward(slot, dout.data(), dx->data())
                       : stack.BackwardInput(slot, dout.data(), dx->data());
      !st.ok()) {
    return st;
  }
  dout = Buffer();
  if (g == 0) {
    Buffer* de = Get(embed_grads_, a.mb);
    if (de == nullptr) {
      auto fresh =
          engine_->Act(static_cast<size_t>(b()) * s() / t() * h(), /*zero=*/false, E::kCompute);
      if (!fresh.ok()) return fresh.status();
      de = Put(embed_grads_, a.mb, std::move(*fresh));
    }
    if (auto st = engine_->EmbedSeqChunkBackward(*de, *dx, b(), s(), len, h(), SeqBegin(q));
        !st.ok()) {
      return st;
    }
    if (q == 0) Produce({KeyKind::kDEmbedReady, a.mb});  // chunks run backward: 0 is last
  } else {
    Put(grad_out_, ChunkSlot{a.mb, a.chunk, q}, std::move(*dx));
    Produce({KeyKind::kGradOut, a.mb, a.chunk, q});
  }
  return absl::OkStatus();
}

// IB: the embedding gradient into this shard's rows.
template <StageEngine E>
absl::Status RankExecutor<E>::DoIB(const planner::Action& a, double* waited) {
  auto* in = Get(input_states_, a.mb);
  if (in == nullptr) return Missing(a, "input-layer state");
  if (plan_.vocab_sharded) {
    if (auto st = Wait({KeyKind::kIbBcastDone, a.mb}, waited); !st.ok()) return st;
  } else {
    if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, waited); !st.ok()) return st;
    Buffer* de = Get(embed_grads_, a.mb);
    if (de == nullptr) return Missing(a, "embedding gradient");
    if (auto st = engine_->model().input_layer().BackwardBroadcast(*in, *self_comm_, 0, de->data());
        !st.ok()) {
      return st;
    }
    Erase(embed_grads_, a.mb);
  }
  if (auto st = engine_->model().input_layer().Backward(*in); !st.ok()) return st;
  Erase(input_states_, a.mb);
  return absl::OkStatus();
}

// One compute action (compute thread).
template <StageEngine E>
absl::Status RankExecutor<E>::RunCompute(const planner::Action& a, double* waited) {
  using planner::ActionKind;
  switch (a.kind) {
    case ActionKind::kIF:
      return DoIF(a);
    case ActionKind::kF:
      return DoF(a, waited);
    case ActionKind::kB:
      return DoB(a, /*weight=*/false, waited);
    case ActionKind::kBW:
      return DoB(a, /*weight=*/true, waited);
    case ActionKind::kW:
      return engine_->model().stack(a.chunk).BackwardWeight({a.mb, a.seq});
    case ActionKind::kS:
      return DoS(a, waited);
    case ActionKind::kT:
      return DoT(a, waited);
    case ActionKind::kIB:
      return DoIB(a, waited);
    default:
      return absl::InternalError(absl::StrCat("not a compute action: ", planner::ToString(a)));
  }
}

// One communication action (a communication thread).
template <StageEngine E>
absl::Status RankExecutor<E>::RunComm(const planner::Action& a) {
  using planner::ActionKind;
  switch (a.kind) {
    case ActionKind::kSendAct:
    case ActionKind::kSendGrad:
      return DoSend(a);
    case ActionKind::kRecvAct:
    case ActionKind::kRecvGrad:
      return DoRecv(a);
    case ActionKind::kBcastX:
      return DoBcastX(a);
    case ActionKind::kC1:
      return DoC1(a);
    case ActionKind::kC2:
      return DoC2(a);
    case ActionKind::kIfReduce:
      return DoIfReduce(a);
    case ActionKind::kIbBcast:
      return DoIbBcast(a);
    case ActionKind::kGradSync:
      return DoGradSync(a);
    default:
      return absl::InternalError(
          absl::StrCat("not a communication action: ", planner::ToString(a)));
  }
}

// Runs `actions` (communication, plan order) on the calling thread; times go to `comm`.
template <StageEngine E>
void RankExecutor<E>::CommLoop(const std::vector<planner::Action>& actions,
                               std::array<double, planner::kNumActionKinds>* comm) {
  if (auto st = engine_->EnterThread(); !st.ok()) {
    Fail(absl::Status(st.code(), absl::StrCat("rank ", rank_, ": ", st.message())));
    return;
  }
  for (const planner::Action& a : actions) {
    const auto c0 = Clock::now();
    absl::Status st = RunComm(a);
    engine_->ActionDone(E::kComm);
    (*comm)[static_cast<int>(a.kind)] += Seconds(c0, Clock::now());
    if (!st.ok()) {
      Fail(absl::Status(
          st.code(), absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ", st.message())));
      return;
    }
    if (Failed()) return;
  }
}

// SEND_ACT / SEND_GRAD: the activation (gradient) this rank produced for the slot, to a.peer.
template <StageEngine E>
absl::Status RankExecutor<E>::DoSend(const planner::Action& a) {
  const int q = a.seq;
  const bool grad = a.kind == planner::ActionKind::kSendGrad;
  const KeyKind key = grad ? KeyKind::kGradOut : KeyKind::kActOut;
  auto& map = grad ? grad_out_ : act_out_;
  if (auto st = Wait({key, a.mb, a.chunk, q}, nullptr); !st.ok()) return st;
  Buffer* buf = Get(map, ChunkSlot{a.mb, a.chunk, q});
  if (buf == nullptr) return Missing(a, grad ? "gradient to send" : "activation to send");
  auto st = p2p_->Send(Floats(*buf), FloatCount(*buf), a.peer,
                       P2PTag(grad, setup_.chunk_group[a.chunk], q, a.mb));
  Erase(map, ChunkSlot{a.mb, a.chunk, q});
  return st;
}

// RECV_ACT / RECV_GRAD: the slot's activation (gradient) from a.peer, tagged by the group
// that sent it.
template <StageEngine E>
absl::Status RankExecutor<E>::DoRecv(const planner::Action& a) {
  const int q = a.seq;
  const bool grad = a.kind == planner::ActionKind::kRecvGrad;
  auto buf = engine_->Act(SlotElems(q), /*zero=*/false, E::kComm);
  if (!buf.ok()) return buf.status();
  const int from_group = setup_.chunk_group[a.chunk] + (grad ? 1 : -1);
  if (auto st =
          p2p_->Recv(Floats(*buf), FloatCount(*buf), a.peer, P2PTag(grad, from_group, q, a.mb));
      !st.ok()) {
    return st;
  }
  Put(grad ? grad_in_ : act_in_, ChunkSlot{a.mb, a.chunk, q}, std::move(*buf));
  Produce({grad ? KeyKind::kGradIn : KeyKind::kActIn, a.mb, a.chunk, q});
  return absl::OkStatus();
}

// BCAST_X (C0): the owner of the last layer group sends X to every rank.
template <StageEngine E>
absl::Status RankExecutor<E>::DoBcastX(const planner::Action& a) {
  const int q = a.seq;
  if (setup_.owner) {
    if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, nullptr); !st.ok()) return st;
    XState* x = Get(x_states_, SeqSlot{a.mb, q});
    if (x == nullptr) return Missing(a, "X to broadcast");
    return coll_->Broadcast(Floats(x->x), FloatCount(x->x), plan_.x_owner);
  }
  XState x;
  auto buf = engine_->Act(SlotElems(q), /*zero=*/false, E::kComm);
  if (!buf.ok()) return buf.status();
  x.x = std::move(*buf);
  if (auto st = coll_->Broadcast(Floats(x.x), FloatCount(x.x), plan_.x_owner); !st.ok()) {
    return st;
  }
  Put(x_states_, SeqSlot{a.mb, q}, std::move(x));
  Produce({KeyKind::kXReady, a.mb, 0, q});
  return absl::OkStatus();
}

// C1: the output layer's first barrier.
template <StageEngine E>
absl::Status RankExecutor<E>::DoC1(const planner::Action& a) {
  const int q = a.seq;
  if (auto st = Wait({KeyKind::kSDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
  OutputEntry* o = Get(output_states_, SeqSlot{a.mb, q});
  if (o == nullptr) return Missing(a, "S state");
  if (auto st = engine_->model().output_layer().C1(o->state, *coll_); !st.ok()) return st;
  Produce({KeyKind::kC1Done, a.mb, 0, q});
  if (forward_only_) TakeEvalLoss(SeqSlot{a.mb, q});
  return absl::OkStatus();
}

// C2: the output layer's second barrier (Algorithm 1).
template <StageEngine E>
absl::Status RankExecutor<E>::DoC2(const planner::Action& a) {
  const int q = a.seq;
  if (auto st = Wait({KeyKind::kTDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
  OutputEntry* o = Get(output_states_, SeqSlot{a.mb, q});
  if (o == nullptr) return Missing(a, "T state");
  if (auto st = engine_->model().output_layer().C2(o->state, *coll_); !st.ok()) return st;
  {
    std::lock_guard<std::mutex> l(mu_);
    o->barrier_done = true;
  }
  Produce({KeyKind::kC2Done, a.mb, 0, q});
  MaybeReleaseOut(SeqSlot{a.mb, q});
  return absl::OkStatus();
}

// IF_REDUCE: the embedding lookup summed over the vocabulary shards.
template <StageEngine E>
absl::Status RankExecutor<E>::DoIfReduce(const planner::Action& a) {
  if (auto st = Wait({KeyKind::kInComputed, a.mb}, nullptr); !st.ok()) return st;
  auto* in = Get(input_states_, a.mb);
  if (in == nullptr) return Missing(a, "IF state");
  if (auto st = engine_->model().input_layer().ForwardReduce(*in, *coll_); !st.ok()) return st;
  if (rank_ != setup_.first_group_rank) in->ReleaseOutput();  // only group 0 consumes it
  Produce({KeyKind::kInReduced, a.mb});
  return absl::OkStatus();
}

// IB_BCAST: the embedding-output gradient from the first group's rank to every shard.
template <StageEngine E>
absl::Status RankExecutor<E>::DoIbBcast(const planner::Action& a) {
  const bool root = rank_ == setup_.first_group_rank;
  const Elem* grad = nullptr;
  if (root) {
    if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, nullptr); !st.ok()) return st;
    Buffer* de = Get(embed_grads_, a.mb);
    if (de == nullptr) return Missing(a, "embedding gradient");
    grad = de->data();
  }
  auto* in = Get(input_states_, a.mb);
  if (in == nullptr) return Missing(a, "input-layer state");
  if (auto st = engine_->model().input_layer().BackwardBroadcast(*in, *coll_,
                                                                 setup_.first_group_rank, grad);
      !st.ok()) {
    return st;
  }
  if (root) Erase(embed_grads_, a.mb);
  Produce({KeyKind::kIbBcastDone, a.mb});
  return absl::OkStatus();
}
// GRAD_SYNC: after the chunk's last W, its gradients summed over the replicas.
template <StageEngine E>
absl::Status RankExecutor<E>::DoGradSync(const planner::Action& a) {
  // (BuildRankSetup refused a plan whose actions name a chunk the rank does not have.)
  if (auto st = Wait({KeyKind::kWeightsDone, 0, a.chunk}, nullptr); !st.ok()) return st;
  absl::StatusOr<comm::ShardRange> range = engine_->AllReduceChunkGrads(*data_, a.chunk);
  if (!range.ok()) return range.status();
  synced_.push_back(*range);
  return absl::OkStatus();
}

// The actions Evaluate runs: those that lead to the losses (C1) and nothing after them.
inline bool IsForwardAction(planner::ActionKind kind) {
  using planner::ActionKind;
  switch (kind) {
    case ActionKind::kIF:
    case ActionKind::kIfReduce:
    case ActionKind::kF:
    case ActionKind::kSendAct:
    case ActionKind::kRecvAct:
    case ActionKind::kBcastX:
    case ActionKind::kS:
    case ActionKind::kC1:
      return true;
    default:
      return false;
  }
}

template <StageEngine E>
absl::Status RankExecutor<E>::SumLossOverTensorGroup() {
  if (tensor_ == nullptr) return absl::OkStatus();
  float loss[1] = {static_cast<float>(loss_)};
  if (auto st = engine_->AllReduceHostFloats(*tensor_, loss, 1); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("rank ", rank_, " loss (tensor group sum): ", st.message()));
  }
  loss_ = loss[0];
  return absl::OkStatus();
}

template <StageEngine E>
absl::Status RankExecutor<E>::RunPlan(int64_t step, const BatchFn& batches, RankStepResult* r) {
  const int m = plan_.microbatches;
  inputs_.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  targets_.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  for (int j = 0; j < m; ++j) {
    if (auto st = batches(step, j, inputs_[j].data(), targets_[j].data()); !st.ok()) return st;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    ready_.clear();
    error_ = absl::OkStatus();
    input_states_.clear();
    act_in_.clear();
    act_out_.clear();
    grad_in_.clear();
    grad_out_.clear();
    x_states_.clear();
    output_states_.clear();
    embed_grads_.clear();
  }

  auto selected = [&](const planner::Action& a) {
    return !forward_only_ || IsForwardAction(a.kind);
  };
  const std::vector<planner::Action>& actions = plan_.ranks[rank_].actions;
  // One communication thread when both roles share a communicator (it serves one thread at a
  // time), else point-to-point and collectives each on their own.
  const bool split = p2p_ != coll_;
  // GRAD_SYNC runs on a thread of its own over the data communicator, so a chunk's reduction
  // overlaps the backward passes after it. Without replicas, under ZeRO-1 (whose OPT
  // reduce-scatters the whole buffer) or without overlap (RankSetup), a plan's GRAD_SYNC is
  // skipped and OPT sums what is left (all of it).
  const bool grad_sync = !forward_only_ && data_ != nullptr && data_->size() > 1 &&
                         !options_.data.zero && setup_.overlap_data_sync;
  std::vector<planner::Action> comm_a, comm_b, comm_data;
  for (const planner::Action& a : actions) {
    if (planner::IsCompute(a.kind) || !selected(a)) continue;
    if (planner::IsDataSync(a.kind)) {
      if (grad_sync) comm_data.push_back(a);
      continue;
    }
    (split && planner::IsCollective(a.kind) ? comm_b : comm_a).push_back(a);
  }
  synced_.clear();
  std::array<double, planner::kNumActionKinds> comm_time_b{}, comm_time_data{};
  std::thread thread_a([&] { CommLoop(comm_a, &r->comm); });
  std::thread thread_b, thread_data;
  if (split) thread_b = std::thread([&] { CommLoop(comm_b, &comm_time_b); });
  if (!comm_data.empty()) thread_data = std::thread([&] { CommLoop(comm_data, &comm_time_data); });
  for (size_t i = 0; i < actions.size(); ++i) {
    const planner::Action& a = actions[i];
    if (!planner::IsCompute(a.kind) || a.kind == planner::ActionKind::kOpt || !selected(a)) {
      continue;
    }
    const auto c0 = Clock::now();
    double waited = 0;
    absl::Status st = RunCompute(a, &waited);
    engine_->ActionDone(E::kCompute);
    r->compute_wait_seconds += waited;
    r->busy[static_cast<int>(a.kind)] += Seconds(c0, Clock::now()) - waited;
    if (!st.ok()) {
      Fail(absl::Status(
          st.code(), absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ", st.message())));
      break;
    }
    if (setup_.last_weight_action[a.chunk] == i) Produce({KeyKind::kWeightsDone, 0, a.chunk});
  }
  thread_a.join();
  if (thread_b.joinable()) thread_b.join();
  if (thread_data.joinable()) {
    // What the reduction adds to the step: the wait for its last chunk after the compute ends.
    const auto j0 = Clock::now();
    thread_data.join();
    r->data_parallel_seconds += Seconds(j0, Clock::now());
  }
  for (int k = 0; k < planner::kNumActionKinds; ++k) {
    r->comm[k] += comm_time_b[k] + comm_time_data[k];
  }
  std::lock_guard<std::mutex> l(mu_);
  return error_;
}

template <StageEngine E>
absl::StatusOr<RankEvalResult> RankExecutor<E>::Evaluate(int num_batches, const BatchFn& batches) {
  const int m = plan_.microbatches;
  if (num_batches < 1 || num_batches % m != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluation: the number of batches (", num_batches,
                     ") must be a positive multiple of the plan's microbatches (", m, ")"));
  }
  const auto t0 = Clock::now();
  if (auto st = engine_->EnterThread(); !st.ok()) return st;
  forward_only_ = true;
  loss_grad_ = 1.0f / (static_cast<float>(num_batches) * b() * s());
  loss_ = 0;
  losses_seen_ = 0;
  // With d replicas each evaluates every d-th round of m batches (replica r: rounds r, r + d,
  // ...), the losses normalised by the whole count, and the replicas' sums are added below:
  // the same mean as one pipeline evaluating every round, in 1/d of the time.
  const bool replicated = data_ != nullptr && data_->size() > 1;
  const int first = replicated ? options_.data.replica : 0, stride = replicated ? data_->size() : 1;
  absl::Status status;
  for (int round = first; round < num_batches / m && status.ok(); round += stride) {
    RankStepResult unused;
    status = RunPlan(round, batches, &unused);
  }
  forward_only_ = false;
  // Nothing of the evaluation outlives it (a failed round may leave slots in the stacks).
  for (int c = 0; c < static_cast<int>(setup_.chunk_group.size()); ++c) {
    for (int j = 0; j < m; ++j) engine_->model().stack(c).DiscardMicrobatch(j);
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    input_states_.clear();
    x_states_.clear();
    output_states_.clear();
  }
  if (engine_->model().has_output_layer()) engine_->model().output_layer().ReleaseWorkspace();
  if (!status.ok()) return status;
  if (auto st = SumLossOverTensorGroup(); !st.ok()) return st;
  if (replicated) {
    // Every rank of a stage's data group takes part; one without the losses adds zeros. The
    // count goes in rounds' worth of losses (m·k each), exact in a float for any allowed
    // eval_batches.
    const int per_round = m * setup_.k;
    float sums[2] = {static_cast<float>(loss_),
                     static_cast<float>(static_cast<double>(losses_seen_) / per_round)};
    if (auto st = engine_->AllReduceHostFloats(*data_, sums, 2); !st.ok()) {
      return absl::Status(
          st.code(), absl::StrCat("rank ", rank_, " evaluation (replicas' sum): ", st.message()));
    }
    loss_ = sums[0];
    losses_seen_ = static_cast<int>(std::lround(sums[1])) * per_round;
  }
  RankEvalResult r;
  r.has_loss = losses_seen_ == num_batches * setup_.k;
  r.loss = loss_;
  if (r.has_loss && !std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " evaluation: loss is ", loss_));
  }
  r.seconds = Seconds(t0, Clock::now());
  return r;
}

template <StageEngine E>
absl::StatusOr<RankStepResult> RankExecutor<E>::Step(int64_t step, const BatchFn& batches) {
  const auto t0 = Clock::now();
  RankStepResult r;
  r.step = step;
  if (auto st = engine_->EnterThread(); !st.ok()) return st;
  engine_->tracker().ResetPeaks();
  const int m = plan_.microbatches;
  // The loss is the mean over the step's tokens on every replica (d·m·b·s), so the replicas'
  // gradients sum to the exact mean (optimizer_step.h) and their losses to the step's.
  const int d = std::max(1, options_.data.replicas);
  loss_grad_ = 1.0f / (static_cast<float>(d) * m * b() * s());
  if (auto st = engine_->ZeroGrads(); !st.ok()) return st;
  loss_ = 0;
  losses_seen_ = 0;
  if (auto st = RunPlan(step, batches, &r); !st.ok()) return st;
  const auto o0 = Clock::now();
  r.lr = options_.lr.At(step);
  if (tensor_ != nullptr) {
    if (auto st = engine_->SumTensorReplicatedGrads(); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("rank ", rank_, " OPT: ", st.message()));
    }
    if (auto st = SumLossOverTensorGroup(); !st.ok()) return st;
  }
  double opt_data_seconds = 0;
  if (auto st =
          engine_->OptimizerStep(step, *coll_, data_, setup_.tied_copy_sync, r.lr,
                                 options_.grad_clip, &r.grad_norm, &opt_data_seconds, synced_);
      !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("rank ", rank_, " OPT: ", st.message()));
  }
  if (data_ != nullptr && data_->size() > 1) {
    // Each replica's loss covers its own microbatches: their sum is the step's mean. A rank
    // without the losses adds zeros alongside its replicas (the same stage: none has them).
    float loss[1] = {static_cast<float>(loss_)};
    if (auto st = engine_->AllReduceHostFloats(*data_, loss, 1); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("rank ", rank_, " OPT (loss): ", st.message()));
    }
    loss_ = loss[0];
  }
  r.data_parallel_seconds += opt_data_seconds;
  engine_->ActionDone(E::kCompute);
  r.busy[static_cast<int>(planner::ActionKind::kOpt)] += Seconds(o0, Clock::now());
  if (engine_->model().has_output_layer()) engine_->model().output_layer().ReleaseWorkspace();
  const int expected = plan_.microbatches * setup_.k;
  r.has_loss = losses_seen_ == expected;
  r.loss = loss_;
  if (r.has_loss && !std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " step ", step, ": loss is ", loss_));
  }
  const engine::MemoryTracker& tr = engine_->tracker();
  r.peak_parameters = tr.peak(engine::MemoryCategory::kParameters);
  r.peak_gradients = tr.peak(engine::MemoryCategory::kGradients);
  r.peak_optimizer = tr.peak(engine::MemoryCategory::kOptimizer);
  r.peak_activations = tr.peak(engine::MemoryCategory::kActivations);
  r.peak_total = tr.total_peak();
  r.seconds = Seconds(t0, Clock::now());
  return r;
}

}  // namespace vp::runtime::internal
