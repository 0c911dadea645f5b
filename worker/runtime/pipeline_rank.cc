#include "worker/runtime/pipeline_rank.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cpu/kernels.h"

namespace vp::runtime {

using engine::Buffer;
using engine::MemoryCategory;
using planner::Action;
using planner::ActionKind;
using Clock = std::chrono::steady_clock;

double RankStepResult::busy_seconds() const {
  double s = 0;
  for (double b : busy) s += b;
  return s;
}

namespace {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// What an action produces or waits for. Each key is produced once per step by one action,
// earlier in the plan than every action that waits for it, so waiting cannot deadlock.
enum class KeyKind : uint8_t {
  kInComputed,   // IF done (mb)
  kInReduced,    // the full embedding output is available (mb)
  kActIn,        // activation received for local chunk c (mb, c, q)
  kActOut,       // activation produced by local chunk c (mb, c, q)
  kGradIn,       // gradient received for local chunk c (mb, c, q)
  kGradOut,      // input gradient produced by local chunk c (mb, c, q)
  kXReady,       // X of the last layer group available here (mb, q)
  kSDone,        // S done (mb, q)
  kC1Done,       // C1 done (mb, q)
  kTDone,        // T done (mb, q)
  kC2Done,       // C2 done (mb, q)
  kDEmbedReady,  // the embedding-output gradient is complete (mb)
  kIbBcastDone,  // IB_BCAST done (mb)
};

struct Key {
  KeyKind kind;
  int mb = 0, c = 0, q = 0;
  auto operator<=>(const Key&) const = default;
};

// Slot of a (microbatch, chunk, sequence chunk).
using Mcq = std::tuple<int, int, int>;
using Mq = std::pair<int, int>;

// X of the last layer group for one (microbatch, sequence chunk).
struct XState {
  Buffer x;       // (n, h) the output layer's input (after ln_f); every rank, until T
  Buffer x_last;  // (n, h) the last layer's output, before ln_f (owner only, until B)
  Buffer mean;    // (n) ln_f statistics (owner only)
  Buffer rstd;    // (n)
};

// Output-layer state plus who still needs it.
struct OutState {
  engine::vocab::OutputLayerState state;
  bool t_done = false;
  bool grad_consumed = false;  // the owner's B has read ∇X (or this rank is not the owner)
  bool barrier_done = false;   // the last barrier on this state (C1 or C2) has run
};

// P2P tags: a transfer is named by the group that produced it, so sender and receiver agree
// even when their local chunk numbers differ (interleaved placements).
uint64_t P2PTag(bool grad, int group, int q, int mb) {
  return ((((grad ? 1ull : 0ull) << 12 | static_cast<uint64_t>(group)) << 12 |
           static_cast<uint64_t>(q))
          << 20) |
         static_cast<uint64_t>(mb);
}

}  // namespace

struct PipelineRank::Impl {
  planner::Plan plan;
  int rank = 0;
  TrainerOptions opt;
  comm::Communicator* comm = nullptr;
  std::unique_ptr<comm::Communicator> self_comm;
  std::unique_ptr<engine::MemoryTracker> tracker;
  std::unique_ptr<engine::RankModel> model;
  std::unique_ptr<engine::AdamW> optimizer;

  int groups = 0;
  int k = 1;                                // sequence chunks
  int first_group_rank = 0;                 // holds group 0 (and the input layer when not sharded)
  std::vector<int> chunk_group;             // local chunk -> group
  std::map<int, int> local_chunk_of_group;  // group -> local chunk, for groups on this rank
  bool owner = false;                       // holds the last group (x_owner)
  engine::vocab::OutputAlgorithm algorithm = engine::vocab::OutputAlgorithm::kAlgorithm2;
  bool tied_copy_sync = false;  // tied embeddings kept as two copies on different ranks

  // Per-step state, guarded by mu (the buffers' contents are ordered by the keys).
  std::mutex mu;
  std::condition_variable cv;
  std::set<Key> ready;
  absl::Status error;
  std::map<int, engine::vocab::InputLayerState> in_state;
  std::map<Mcq, Buffer> act_in, act_out, grad_in, grad_out;
  std::map<Mq, XState> xs;
  std::map<Mq, OutState> outs;
  std::map<int, Buffer> dembed;  // (b, s, h) per microbatch, on first_group_rank
  double loss = 0;
  int losses_seen = 0;

  // Step inputs.
  std::vector<std::vector<int32_t>> inputs, targets;  // per microbatch, (b, s)
  float d = 0;

  int b() const { return opt.microbatch_size; }
  int s() const { return opt.model.seq_len; }
  int h() const { return opt.model.hidden; }
  int qb(int q) const { return plan.seq_bounds[q]; }
  int qlen(int q) const { return plan.seq_bounds[q + 1] - plan.seq_bounds[q]; }
  size_t NH(int q) const { return static_cast<size_t>(b()) * qlen(q) * h(); }
  Buffer Act(size_t n) { return Buffer(tracker.get(), MemoryCategory::kActivations, n); }

  // ---- synchronisation ----
  void Produce(Key key) {
    {
      std::lock_guard<std::mutex> l(mu);
      ready.insert(key);
    }
    cv.notify_all();
  }
  absl::Status Wait(Key key, double* waited) {
    std::unique_lock<std::mutex> l(mu);
    if (ready.count(key) != 0) return absl::OkStatus();
    const auto t0 = Clock::now();
    cv.wait(l, [&] { return ready.count(key) != 0 || !error.ok(); });
    if (waited != nullptr) *waited += Seconds(t0, Clock::now());
    return ready.count(key) != 0 ? absl::OkStatus() : error;
  }
  void Fail(const absl::Status& st) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (error.ok()) error = st;
    }
    cv.notify_all();
  }
  template <typename M>
  auto* Get(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu);
    auto it = map.find(key);
    return it == map.end() ? nullptr : &it->second;
  }
  template <typename M, typename V>
  auto* Put(M& map, const typename M::key_type& key, V&& value) {
    std::lock_guard<std::mutex> l(mu);
    return &(map.insert_or_assign(key, std::forward<V>(value)).first->second);
  }
  template <typename M>
  void Erase(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu);
    map.erase(key);
  }

  absl::Status Missing(const Action& a, const char* what) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, " ", planner::ToString(a), ": ", what, " missing"));
  }

  // ---- compute actions ----
  absl::Status DoIF(const Action& a) {
    auto st = model->input_layer().Forward(inputs[a.mb].data(), b() * s());
    if (!st.ok()) return st.status();
    Put(in_state, a.mb, std::move(*st));
    Produce({KeyKind::kInComputed, a.mb});
    // Not sharded: the lookup is already the whole embedding; no IF_REDUCE follows.
    if (!plan.vocab_sharded) Produce({KeyKind::kInReduced, a.mb});
    return absl::OkStatus();
  }

  absl::Status DoF(const Action& a, double* waited) {
    const int g = chunk_group[a.chunk], q = a.seq;
    const int len = qlen(q);
    Buffer x = Act(NH(q));  // (b, len, h)
    if (g == 0) {
      if (auto st = Wait({KeyKind::kInReduced, a.mb}, waited); !st.ok()) return st;
      auto* in = Get(in_state, a.mb);
      if (in == nullptr || in->output() == nullptr) return Missing(a, "embedding output");
      for (int r = 0; r < b(); ++r) {  // rows [qb, qb + len) of each sample
        std::memcpy(x.data() + static_cast<size_t>(r) * len * h(),
                    in->output() + (static_cast<size_t>(r) * s() + qb(q)) * h(),
                    sizeof(float) * len * h());
      }
      engine::cpu::PositionEmbeddingForward(x.data(), model->wpe(), b(), len, h(), qb(q));
      if (q == k - 1) in->ReleaseOutput();
    } else if (auto it = local_chunk_of_group.find(g - 1); it != local_chunk_of_group.end()) {
      const Mcq src{a.mb, it->second, q};
      if (auto st = Wait({KeyKind::kActOut, a.mb, it->second, q}, waited); !st.ok()) return st;
      Buffer* in = Get(act_out, src);
      if (in == nullptr) return Missing(a, "local activation");
      x = std::move(*in);
      Erase(act_out, src);
    } else {
      const Mcq src{a.mb, a.chunk, q};
      if (auto st = Wait({KeyKind::kActIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
      Buffer* in = Get(act_in, src);
      if (in == nullptr) return Missing(a, "received activation");
      x = std::move(*in);
      Erase(act_in, src);
    }
    Buffer out = Act(NH(q));
    if (auto st = model->stack(a.chunk).Forward({a.mb, q}, x.data(), out.data()); !st.ok()) {
      return st;
    }
    if (g == groups - 1) {
      // The last group: ln_f gives X, the output layer's input.
      const int n = b() * len;
      XState xst;
      xst.x = Act(NH(q));
      xst.mean = Act(n);
      xst.rstd = Act(n);
      engine::cpu::LayerNormForward(xst.x.data(), xst.mean.data(), xst.rstd.data(), out.data(),
                                    model->lnf_weight(), model->lnf_bias(), n, h());
      xst.x_last = std::move(out);
      Put(xs, Mq{a.mb, q}, std::move(xst));
      Produce({KeyKind::kXReady, a.mb, 0, q});
    } else {
      Put(act_out, Mcq{a.mb, a.chunk, q}, std::move(out));
      Produce({KeyKind::kActOut, a.mb, a.chunk, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoS(const Action& a, double* waited) {
    const int q = a.seq, len = qlen(q), n = b() * len;
    if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, waited); !st.ok()) return st;
    XState* x = Get(xs, Mq{a.mb, q});
    if (x == nullptr) return Missing(a, "X");
    std::vector<int32_t> labels(static_cast<size_t>(n));
    for (int r = 0; r < b(); ++r) {
      std::memcpy(labels.data() + static_cast<size_t>(r) * len,
                  targets[a.mb].data() + static_cast<size_t>(r) * s() + qb(q),
                  sizeof(int32_t) * len);
    }
    auto st = model->output_layer().S(x->x.data(), labels.data(), n, d);
    if (!st.ok()) return st.status();
    OutState* o = Put(outs, Mq{a.mb, q}, OutState{std::move(*st)});
    o->grad_consumed = !owner;
    Produce({KeyKind::kSDone, a.mb, 0, q});
    if (plan.barrier == 0) {  // the whole output layer is here: the barrier is local
      if (auto c1 = model->output_layer().C1(o->state, *self_comm); !c1.ok()) return c1;
      Produce({KeyKind::kC1Done, a.mb, 0, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoT(const Action& a, double* waited) {
    const int q = a.seq;
    if (auto st = Wait({KeyKind::kC1Done, a.mb, 0, q}, waited); !st.ok()) return st;
    XState* x = Get(xs, Mq{a.mb, q});
    OutState* o = Get(outs, Mq{a.mb, q});
    if (x == nullptr || o == nullptr) return Missing(a, "output-layer state");
    if (auto st = model->output_layer().T(o->state, x->x.data()); !st.ok()) return st;
    double sum = 0;
    for (int i = 0; i < o->state.n(); ++i) sum += o->state.losses()[i];
    loss += sum * d;
    losses_seen += 1;
    // X is not needed after T (BCAST_X ran before C1 on this rank); the owner's B may still
    // need ln_f's input and statistics.
    x->x = Buffer();
    if (x->x_last.empty()) Erase(xs, Mq{a.mb, q});
    {
      std::lock_guard<std::mutex> l(mu);
      o->t_done = true;
      if (algorithm == engine::vocab::OutputAlgorithm::kAlgorithm2 || plan.barrier == 0) {
        o->barrier_done = true;
      }
    }
    Produce({KeyKind::kTDone, a.mb, 0, q});
    MaybeReleaseOut(Mq{a.mb, q});
    return absl::OkStatus();
  }

  void MaybeReleaseOut(Mq key) {
    std::lock_guard<std::mutex> l(mu);
    auto it = outs.find(key);
    if (it != outs.end() && it->second.t_done && it->second.grad_consumed &&
        it->second.barrier_done) {
      outs.erase(it);
    }
  }

  // B (input gradient) of a chunk; with `weight` also W (the fused BW).
  absl::Status DoB(const Action& a, bool weight, double* waited) {
    const int g = chunk_group[a.chunk], q = a.seq, len = qlen(q), n = b() * len;
    Buffer dout;
    if (g == groups - 1) {
      const KeyKind ready_key =
          plan.barrier == 2 ? KeyKind::kC2Done : KeyKind::kC1Done;  // ∇X is final here
      if (auto st = Wait({ready_key, a.mb, 0, q}, waited); !st.ok()) return st;
      OutState* o = Get(outs, Mq{a.mb, q});
      XState* x = Get(xs, Mq{a.mb, q});
      if (o == nullptr || x == nullptr || o->state.grad_input() == nullptr) {
        return Missing(a, "output-layer gradient");
      }
      dout = Act(NH(q));  // LayerNormBackwardInput accumulates into a zeroed buffer
      engine::cpu::LayerNormBackwardInput(dout.data(), o->state.grad_input(), x->x_last.data(),
                                          model->lnf_weight(), x->mean.data(), x->rstd.data(), n,
                                          h());
      engine::cpu::LayerNormBackwardWeight(model->lnf_weight_grad(), model->lnf_bias_grad(),
                                           o->state.grad_input(), x->x_last.data(), x->mean.data(),
                                           x->rstd.data(), n, h());
      x->x_last = Buffer();
      x->mean = Buffer();
      x->rstd = Buffer();
      {
        std::lock_guard<std::mutex> l(mu);
        o->grad_consumed = true;
        if (x->x.empty()) xs.erase(Mq{a.mb, q});  // T already ran
      }
      MaybeReleaseOut(Mq{a.mb, q});
    } else if (auto it = local_chunk_of_group.find(g + 1); it != local_chunk_of_group.end()) {
      const Mcq src{a.mb, it->second, q};
      if (auto st = Wait({KeyKind::kGradOut, a.mb, it->second, q}, waited); !st.ok()) return st;
      Buffer* in = Get(grad_out, src);
      if (in == nullptr) return Missing(a, "local gradient");
      dout = std::move(*in);
      Erase(grad_out, src);
    } else {
      const Mcq src{a.mb, a.chunk, q};
      if (auto st = Wait({KeyKind::kGradIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
      Buffer* in = Get(grad_in, src);
      if (in == nullptr) return Missing(a, "received gradient");
      dout = std::move(*in);
      Erase(grad_in, src);
    }
    Buffer dx = Act(NH(q));
    engine::LayerStack& stack = model->stack(a.chunk);
    const engine::SlotKey slot{a.mb, q};
    if (auto st = weight ? stack.Backward(slot, dout.data(), dx.data())
                         : stack.BackwardInput(slot, dout.data(), dx.data());
        !st.ok()) {
      return st;
    }
    dout = Buffer();
    if (g == 0) {
      engine::cpu::PositionEmbeddingBackward(model->wpe_grad(), dx.data(), b(), len, h(), qb(q));
      Buffer* de = Get(dembed, a.mb);
      if (de == nullptr) de = Put(dembed, a.mb, Act(static_cast<size_t>(b()) * s() * h()));
      for (int r = 0; r < b(); ++r) {
        std::memcpy(de->data() + (static_cast<size_t>(r) * s() + qb(q)) * h(),
                    dx.data() + static_cast<size_t>(r) * len * h(), sizeof(float) * len * h());
      }
      if (q == 0) Produce({KeyKind::kDEmbedReady, a.mb});  // chunks run backward: 0 is last
    } else {
      Put(grad_out, Mcq{a.mb, a.chunk, q}, std::move(dx));
      Produce({KeyKind::kGradOut, a.mb, a.chunk, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoIB(const Action& a, double* waited) {
    auto* in = Get(in_state, a.mb);
    if (in == nullptr) return Missing(a, "input-layer state");
    if (plan.vocab_sharded) {
      if (auto st = Wait({KeyKind::kIbBcastDone, a.mb}, waited); !st.ok()) return st;
    } else {
      if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, waited); !st.ok()) return st;
      Buffer* de = Get(dembed, a.mb);
      if (de == nullptr) return Missing(a, "embedding gradient");
      if (auto st = model->input_layer().BackwardBroadcast(*in, *self_comm, 0, de->data());
          !st.ok()) {
        return st;
      }
      Erase(dembed, a.mb);
    }
    if (auto st = model->input_layer().Backward(*in); !st.ok()) return st;
    Erase(in_state, a.mb);
    return absl::OkStatus();
  }

  absl::Status RunCompute(const Action& a, double* waited) {
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
        return model->stack(a.chunk).BackwardWeight({a.mb, a.seq});
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

  // ---- communication actions (communication thread) ----
  absl::Status RunComm(const Action& a) {
    const int q = a.seq;
    switch (a.kind) {
      case ActionKind::kSendAct: {
        if (auto st = Wait({KeyKind::kActOut, a.mb, a.chunk, q}, nullptr); !st.ok()) return st;
        Buffer* buf = Get(act_out, Mcq{a.mb, a.chunk, q});
        if (buf == nullptr) return Missing(a, "activation to send");
        auto st = comm->Send(buf->data(), buf->size(), a.peer,
                             P2PTag(false, chunk_group[a.chunk], q, a.mb));
        Erase(act_out, Mcq{a.mb, a.chunk, q});
        return st;
      }
      case ActionKind::kRecvAct: {
        Buffer buf = Act(NH(q));
        if (auto st = comm->Recv(buf.data(), buf.size(), a.peer,
                                 P2PTag(false, chunk_group[a.chunk] - 1, q, a.mb));
            !st.ok()) {
          return st;
        }
        Put(act_in, Mcq{a.mb, a.chunk, q}, std::move(buf));
        Produce({KeyKind::kActIn, a.mb, a.chunk, q});
        return absl::OkStatus();
      }
      case ActionKind::kSendGrad: {
        if (auto st = Wait({KeyKind::kGradOut, a.mb, a.chunk, q}, nullptr); !st.ok()) return st;
        Buffer* buf = Get(grad_out, Mcq{a.mb, a.chunk, q});
        if (buf == nullptr) return Missing(a, "gradient to send");
        auto st = comm->Send(buf->data(), buf->size(), a.peer,
                             P2PTag(true, chunk_group[a.chunk], q, a.mb));
        Erase(grad_out, Mcq{a.mb, a.chunk, q});
        return st;
      }
      case ActionKind::kRecvGrad: {
        Buffer buf = Act(NH(q));
        if (auto st = comm->Recv(buf.data(), buf.size(), a.peer,
                                 P2PTag(true, chunk_group[a.chunk] + 1, q, a.mb));
            !st.ok()) {
          return st;
        }
        Put(grad_in, Mcq{a.mb, a.chunk, q}, std::move(buf));
        Produce({KeyKind::kGradIn, a.mb, a.chunk, q});
        return absl::OkStatus();
      }
      case ActionKind::kBcastX: {
        if (owner) {
          if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, nullptr); !st.ok()) return st;
          XState* x = Get(xs, Mq{a.mb, q});
          if (x == nullptr) return Missing(a, "X to broadcast");
          return comm->Broadcast(x->x.data(), x->x.size(), plan.x_owner);
        }
        XState x;
        x.x = Act(NH(q));
        if (auto st = comm->Broadcast(x.x.data(), x.x.size(), plan.x_owner); !st.ok()) return st;
        Put(xs, Mq{a.mb, q}, std::move(x));
        Produce({KeyKind::kXReady, a.mb, 0, q});
        return absl::OkStatus();
      }
      case ActionKind::kC1: {
        if (auto st = Wait({KeyKind::kSDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
        OutState* o = Get(outs, Mq{a.mb, q});
        if (o == nullptr) return Missing(a, "S state");
        if (auto st = model->output_layer().C1(o->state, *comm); !st.ok()) return st;
        Produce({KeyKind::kC1Done, a.mb, 0, q});
        return absl::OkStatus();
      }
      case ActionKind::kC2: {
        if (auto st = Wait({KeyKind::kTDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
        OutState* o = Get(outs, Mq{a.mb, q});
        if (o == nullptr) return Missing(a, "T state");
        if (auto st = model->output_layer().C2(o->state, *comm); !st.ok()) return st;
        {
          std::lock_guard<std::mutex> l(mu);
          o->barrier_done = true;
        }
        Produce({KeyKind::kC2Done, a.mb, 0, q});
        MaybeReleaseOut(Mq{a.mb, q});
        return absl::OkStatus();
      }
      case ActionKind::kIfReduce: {
        if (auto st = Wait({KeyKind::kInComputed, a.mb}, nullptr); !st.ok()) return st;
        auto* in = Get(in_state, a.mb);
        if (in == nullptr) return Missing(a, "IF state");
        if (auto st = model->input_layer().ForwardReduce(*in, *comm); !st.ok()) return st;
        if (rank != first_group_rank) in->ReleaseOutput();  // only group 0 consumes it
        Produce({KeyKind::kInReduced, a.mb});
        return absl::OkStatus();
      }
      case ActionKind::kIbBcast: {
        const bool root = rank == first_group_rank;
        const float* grad = nullptr;
        if (root) {
          if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, nullptr); !st.ok()) return st;
          Buffer* de = Get(dembed, a.mb);
          if (de == nullptr) return Missing(a, "embedding gradient");
          grad = de->data();
        }
        auto* in = Get(in_state, a.mb);
        if (in == nullptr) return Missing(a, "input-layer state");
        if (auto st = model->input_layer().BackwardBroadcast(*in, *comm, first_group_rank, grad);
            !st.ok()) {
          return st;
        }
        if (root) Erase(dembed, a.mb);
        Produce({KeyKind::kIbBcastDone, a.mb});
        return absl::OkStatus();
      }
      default:
        return absl::InternalError(
            absl::StrCat("not a communication action: ", planner::ToString(a)));
    }
  }

  // The optimizer step: gradients of tied copies summed, global norm, clipping, AdamW. Runs
  // on the calling thread after the communication thread has finished the step.
  absl::Status DoOpt(int64_t step, RankStepResult* r) {
    if (tied_copy_sync) {
      // Both copies end with ∇wte = ∇(input use) + ∇(output use); the others add zeros.
      const int64_t rows = engine::vocab::PaddedVocab(opt.model.vocab, 1);
      Buffer sum = Act(static_cast<size_t>(rows) * h());
      const engine::ParamTensor* in = model->Find("transformer.wte.weight");
      const engine::ParamTensor* out = model->tied_output_copy();
      for (const engine::ParamTensor* t : {in, out}) {
        if (t == nullptr) continue;
        for (size_t i = 0; i < sum.size(); ++i) sum.data()[i] += model->grads()[t->offset + i];
      }
      if (auto st = comm->AllReduce(sum.data(), sum.size(), comm::ReduceOp::kSum); !st.ok()) {
        return st;
      }
      for (const engine::ParamTensor* t : {in, out}) {
        if (t != nullptr) {
          std::memcpy(model->grads() + t->offset, sum.data(), sizeof(float) * sum.size());
        }
      }
    }
    // Σ g² over this rank's parameters, the tied output copy counted once (by its twin).
    double sq = engine::SquaredNorm(model->grads(), model->param_count());
    if (const engine::ParamTensor* copy = tied_copy_sync ? model->tied_output_copy() : nullptr) {
      sq -= engine::SquaredNorm(model->grads() + copy->offset, copy->count());
    }
    float sqf[1] = {static_cast<float>(sq)};
    // fp32 all-reduce of the partial sums: the norm only scales clipping.
    if (auto st = comm->AllReduce(sqf, 1, comm::ReduceOp::kSum); !st.ok()) return st;
    r->grad_norm = std::sqrt(static_cast<double>(sqf[0]));
    r->lr = opt.lr.At(step);
    optimizer->Step(model->params(), model->grads(), r->lr,
                    engine::ClipScale(static_cast<double>(sqf[0]), opt.grad_clip));
    return absl::OkStatus();
  }

  absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches);
};

absl::StatusOr<RankStepResult> PipelineRank::Impl::Step(int64_t step, const BatchFn& batches) {
  const auto t0 = Clock::now();
  RankStepResult r;
  r.step = step;
  tracker->ResetPeaks();
  const int m = plan.microbatches;
  d = 1.0f / (static_cast<float>(m) * b() * s());
  inputs.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  targets.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  for (int j = 0; j < m; ++j) {
    if (auto st = batches(step, j, inputs[j].data(), targets[j].data()); !st.ok()) return st;
  }
  model->ZeroGrads();
  {
    std::lock_guard<std::mutex> l(mu);
    ready.clear();
    error = absl::OkStatus();
    in_state.clear();
    act_in.clear();
    act_out.clear();
    grad_in.clear();
    grad_out.clear();
    xs.clear();
    outs.clear();
    dembed.clear();
  }
  loss = 0;
  losses_seen = 0;

  const std::vector<Action>& actions = plan.ranks[rank].actions;
  std::vector<Action> comm_actions;
  for (const Action& a : actions) {
    if (!planner::IsCompute(a.kind)) comm_actions.push_back(a);
  }
  // The communication thread: P2P and collectives in plan order.
  std::thread comm_thread([&] {
    for (const Action& a : comm_actions) {
      const auto c0 = Clock::now();
      absl::Status st = RunComm(a);
      r.comm[static_cast<int>(a.kind)] += Seconds(c0, Clock::now());
      if (!st.ok()) {
        Fail(absl::Status(
            st.code(), absl::StrCat("rank ", rank, " ", planner::ToString(a), ": ", st.message())));
        return;
      }
      std::lock_guard<std::mutex> l(mu);
      if (!error.ok()) return;
    }
  });
  for (const Action& a : actions) {
    if (!planner::IsCompute(a.kind) || a.kind == ActionKind::kOpt) continue;
    const auto c0 = Clock::now();
    double waited = 0;
    absl::Status st = RunCompute(a, &waited);
    r.compute_wait_seconds += waited;
    r.busy[static_cast<int>(a.kind)] += Seconds(c0, Clock::now()) - waited;
    if (!st.ok()) {
      Fail(absl::Status(
          st.code(), absl::StrCat("rank ", rank, " ", planner::ToString(a), ": ", st.message())));
      break;
    }
  }
  comm_thread.join();
  {
    std::lock_guard<std::mutex> l(mu);
    if (!error.ok()) return error;
  }
  const auto o0 = Clock::now();
  if (auto st = DoOpt(step, &r); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("rank ", rank, " OPT: ", st.message()));
  }
  r.busy[static_cast<int>(ActionKind::kOpt)] += Seconds(o0, Clock::now());
  if (model->has_output_layer()) model->output_layer().ReleaseWorkspace();
  const int expected = plan.microbatches * k;
  r.has_loss = losses_seen == expected;
  r.loss = loss;
  if (r.has_loss && !std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("rank ", rank, " step ", step, ": loss is ", loss));
  }
  r.peak_parameters = tracker->peak(MemoryCategory::kParameters);
  r.peak_gradients = tracker->peak(MemoryCategory::kGradients);
  r.peak_optimizer = tracker->peak(MemoryCategory::kOptimizer);
  r.peak_activations = tracker->peak(MemoryCategory::kActivations);
  r.peak_total = tracker->total_peak();
  r.seconds = Seconds(t0, Clock::now());
  return r;
}

PipelineRank::PipelineRank(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineRank::~PipelineRank() = default;

absl::StatusOr<std::unique_ptr<PipelineRank>> PipelineRank::Create(const planner::Plan& plan,
                                                                   int rank,
                                                                   const TrainerOptions& options,
                                                                   comm::Communicator* comm) {
  if (comm == nullptr || comm->size() != plan.pipeline || comm->rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline rank ", rank, ": the communicator must have rank ", rank, " of ", plan.pipeline));
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
  auto impl = std::make_unique<Impl>();
  impl->plan = plan;
  impl->rank = rank;
  impl->opt = options;
  impl->comm = comm;
  impl->self_comm = comm::MakeSelfCommunicator();
  impl->tracker = std::make_unique<engine::MemoryTracker>();
  impl->groups = plan.groups();
  impl->k = static_cast<int>(plan.seq_bounds.size()) - 1;
  impl->owner = rank == plan.x_owner;
  impl->algorithm = plan.barrier == 2 ? engine::vocab::OutputAlgorithm::kAlgorithm1
                                      : engine::vocab::OutputAlgorithm::kAlgorithm2;
  for (int r = 0; r < plan.pipeline; ++r) {
    for (const planner::ModelChunk& c : plan.ranks[r].chunks) {
      if (c.group == 0) impl->first_group_rank = r;
    }
  }
  engine::RankLayout layout;
  layout.rank = rank;
  layout.world = plan.pipeline;
  layout.holds_first_group = false;
  layout.holds_last_group = false;
  const auto& chunks = plan.ranks[rank].chunks;
  for (size_t c = 0; c < chunks.size(); ++c) {
    layout.chunks.push_back({chunks[c].first_layer, chunks[c].num_layers});
    impl->chunk_group.push_back(chunks[c].group);
    impl->local_chunk_of_group[chunks[c].group] = static_cast<int>(c);
    if (chunks[c].group == 0) layout.holds_first_group = true;
    if (chunks[c].group == impl->groups - 1) layout.holds_last_group = true;
  }
  if (layout.holds_last_group != impl->owner) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: x_owner ", plan.x_owner, " does not hold the last layer group"));
  }
  layout.vocab_sharded = plan.vocab_sharded;
  layout.holds_input_layer = layout.holds_first_group;
  layout.holds_output_layer = impl->owner;
  impl->tied_copy_sync =
      options.model.tie_embeddings && !plan.vocab_sharded && impl->first_group_rank != plan.x_owner;
  auto model = engine::RankModel::Create(options.model, layout, options.microbatch_size,
                                         plan.seq_bounds, impl->algorithm, impl->tracker.get());
  if (!model.ok()) return model.status();
  impl->model = std::move(*model);
  impl->model->Init(options.seed);
  auto opt = engine::AdamW::Create(impl->tracker.get(), impl->model->param_count(), options.adamw,
                                   impl->model->DecayRanges());
  if (!opt.ok()) return opt.status();
  impl->optimizer = std::make_unique<engine::AdamW>(std::move(*opt));
  return std::make_unique<PipelineRank>(std::move(impl));
}

absl::StatusOr<RankStepResult> PipelineRank::Step(int64_t step, const BatchFn& batches) {
  return impl_->Step(step, batches);
}

engine::RankModel& PipelineRank::model() { return *impl_->model; }
engine::AdamW& PipelineRank::optimizer() { return *impl_->optimizer; }
engine::MemoryTracker& PipelineRank::memory() { return *impl_->tracker; }
int PipelineRank::rank() const { return impl_->rank; }

}  // namespace vp::runtime
