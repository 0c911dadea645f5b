// The plan executor behind PipelineRank, generic over the device engine (internal header of
// worker/runtime; the CPU instantiation is in pipeline_rank.cc, the CUDA ones in runtime/cuda).
//
// Compute actions run on the calling thread in plan order; communication actions run in plan
// order on communication threads — one when the point-to-point and the collective
// communicators are the same object (Gloo), two when they differ (NCCL: stage-to-stage
// transfers and the vocabulary barriers on their own communicators and streams). A thread waits
// only for the keys of earlier actions that produce or consume its data, so the split relaxes
// the plan's order and keeps it deadlock-free (the planner proves the plan under blocking
// sends).
//
// What an engine E provides (CpuStageEngine in cpu_engine.h is the reference):
//   using Elem;                        activation element type (float, or bf16 on a device)
//   using Buffer;                      move-only activation array: data() → Elem*, size(), empty()
//   using Model;                       stack(c) (F/B/W/BW on Elem*), input_layer(), output_layer()
//                                      with the CPU shards' pass names, has_output_layer()
//   using InputState, OutputState;     the shards' per-microbatch states (losses() is host data)
//   struct XState { Buffer x, x_last; ... };   X of the last layer group (+ ln_f statistics)
//   enum Thread { kCompute, kComm };
//   StatusOr<Buffer> Act(n, zero, thread)      activations charged to kActivations
//   Status EmbedChunk(x, in, b, s, len, h, start)           x = in rows [start, start+len) + wpe
//   Status EmbedChunkBackward(dembed, dx, b, s, len, h, start)  wpe grad, dx into dembed rows
//   Status FinalNormForward(XState&, Buffer out, n)          ln_f: X, keeps out as x_last
//   Status FinalNormBackward(dout, grad_input, XState&, n)   ln_f backward; frees x_last, stats
//   Status OptimizerStep(step, coll, tied_copy_sync, lr, clip, &grad_norm)
//   Status EnterThread()               first call on every thread the executor runs (device:
//                                      make the rank's device current)
//   void ActionDone(thread)            after every action (device: hand freed blocks back)
//   ZeroGrads(), tracker(), model()
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "proto/plan/plan.h"
#include "worker/comm/communicator.h"
#include "worker/engine/model/rank_model.h"
#include "worker/runtime/pipeline_rank.h"

namespace vp::runtime::internal {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
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

// P2P tags: a transfer is named by the group that produced it, so sender and receiver agree
// even when their local chunk numbers differ (interleaved placements).
inline uint64_t P2PTag(bool grad, int group, int q, int mb) {
  return ((((grad ? 1ull : 0ull) << 12 | static_cast<uint64_t>(group)) << 12 |
           static_cast<uint64_t>(q))
          << 20) |
         static_cast<uint64_t>(mb);
}

// What one rank holds and how its chunks map to layer groups, from the plan.
struct RankSetup {
  engine::RankLayout layout;
  std::vector<int> chunk_group;             // local chunk -> group
  std::map<int, int> local_chunk_of_group;  // group -> local chunk
  int groups = 0;
  int k = 1;
  int first_group_rank = 0;
  bool owner = false;
  bool tied_copy_sync = false;
  engine::vocab::OutputAlgorithm algorithm = engine::vocab::OutputAlgorithm::kAlgorithm2;
};

// Checks the plan against the rank and the job and derives the rank's layout.
absl::StatusOr<RankSetup> BuildRankSetup(const planner::Plan& plan, int rank,
                                         const TrainerOptions& options,
                                         const comm::Communicator* comm);

template <typename E>
class RankExecutor {
 public:
  using Buffer = typename E::Buffer;
  using Elem = typename E::Elem;
  using InputState = typename E::InputState;
  using OutputState = typename E::OutputState;
  using XState = typename E::XState;

  // p2p and coll: this rank's communicators over all plan.pipeline ranks (may be the same
  // object); they must outlive the executor.
  RankExecutor(const planner::Plan& plan, int rank, const TrainerOptions& options, RankSetup setup,
               std::unique_ptr<E> engine, comm::Communicator* p2p, comm::Communicator* coll)
      : plan_(plan),
        rank_(rank),
        opt_(options),
        s_(std::move(setup)),
        eng_(std::move(engine)),
        p2p_(p2p),
        coll_(coll),
        self_comm_(comm::MakeSelfCommunicator()) {}

  E& engine() { return *eng_; }
  int rank() const { return rank_; }

  absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches);

 private:
  // Output-layer state plus who still needs it.
  struct OutState {
    OutputState state;
    bool t_done = false;
    bool grad_consumed = false;  // the owner's B has read ∇X (or this rank is not the owner)
    bool barrier_done = false;   // the last barrier on this state (C1 or C2) has run
  };

  int b() const { return opt_.microbatch_size; }
  int s() const { return opt_.model.seq_len; }
  int h() const { return opt_.model.hidden; }
  int qb(int q) const { return plan_.seq_bounds[q]; }
  int qlen(int q) const { return plan_.seq_bounds[q + 1] - plan_.seq_bounds[q]; }
  size_t NH(int q) const { return static_cast<size_t>(b()) * qlen(q) * h(); }
  // Activation buffers are moved between ranks as raw floats (bf16: two per float; the engine
  // guarantees an even element count).
  static float* Floats(Buffer& buf) { return reinterpret_cast<float*>(buf.data()); }
  static size_t FloatCount(const Buffer& buf) { return buf.size() * sizeof(Elem) / sizeof(float); }

  // ---- synchronisation ----
  void Produce(Key key) {
    {
      std::lock_guard<std::mutex> l(mu_);
      ready_.insert(key);
    }
    cv_.notify_all();
  }
  absl::Status Wait(Key key, double* waited) {
    std::unique_lock<std::mutex> l(mu_);
    if (ready_.count(key) != 0) return absl::OkStatus();
    const auto t0 = Clock::now();
    cv_.wait(l, [&] { return ready_.count(key) != 0 || !error_.ok(); });
    if (waited != nullptr) *waited += Seconds(t0, Clock::now());
    return ready_.count(key) != 0 ? absl::OkStatus() : error_;
  }
  void Fail(const absl::Status& st) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (error_.ok()) error_ = st;
    }
    cv_.notify_all();
  }
  bool Failed() {
    std::lock_guard<std::mutex> l(mu_);
    return !error_.ok();
  }
  template <typename M>
  auto* Get(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = map.find(key);
    return it == map.end() ? nullptr : &it->second;
  }
  template <typename M, typename V>
  auto* Put(M& map, const typename M::key_type& key, V&& value) {
    std::lock_guard<std::mutex> l(mu_);
    return &(map.insert_or_assign(key, std::forward<V>(value)).first->second);
  }
  template <typename M>
  void Erase(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu_);
    map.erase(key);
  }

  absl::Status Missing(const planner::Action& a, const char* what) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ", what, " missing"));
  }

  // ---- compute actions ----
  absl::Status DoIF(const planner::Action& a) {
    auto st = eng_->model().input_layer().Forward(inputs_[a.mb].data(), b() * s());
    if (!st.ok()) return st.status();
    Put(in_state_, a.mb, std::move(*st));
    Produce({KeyKind::kInComputed, a.mb});
    // Not sharded: the lookup is already the whole embedding; no IF_REDUCE follows.
    if (!plan_.vocab_sharded) Produce({KeyKind::kInReduced, a.mb});
    return absl::OkStatus();
  }

  absl::Status DoF(const planner::Action& a, double* waited) {
    const int g = s_.chunk_group[a.chunk], q = a.seq;
    const int len = qlen(q);
    Buffer x;  // (b, len, h)
    if (g == 0) {
      if (auto st = Wait({KeyKind::kInReduced, a.mb}, waited); !st.ok()) return st;
      auto* in = Get(in_state_, a.mb);
      if (in == nullptr || in->output() == nullptr) return Missing(a, "embedding output");
      auto xb = eng_->Act(NH(q), /*zero=*/false, E::kCompute);
      if (!xb.ok()) return xb.status();
      x = std::move(*xb);
      if (auto st = eng_->EmbedChunk(x, *in, b(), s(), len, h(), qb(q)); !st.ok()) return st;
      if (q == s_.k - 1) in->ReleaseOutput();
    } else if (auto it = s_.local_chunk_of_group.find(g - 1); it != s_.local_chunk_of_group.end()) {
      const Mcq src{a.mb, it->second, q};
      if (auto st = Wait({KeyKind::kActOut, a.mb, it->second, q}, waited); !st.ok()) return st;
      Buffer* in = Get(act_out_, src);
      if (in == nullptr) return Missing(a, "local activation");
      x = std::move(*in);
      Erase(act_out_, src);
    } else {
      const Mcq src{a.mb, a.chunk, q};
      if (auto st = Wait({KeyKind::kActIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
      Buffer* in = Get(act_in_, src);
      if (in == nullptr) return Missing(a, "received activation");
      x = std::move(*in);
      Erase(act_in_, src);
    }
    auto out = eng_->Act(NH(q), /*zero=*/false, E::kCompute);
    if (!out.ok()) return out.status();
    if (auto st = eng_->model().stack(a.chunk).Forward({a.mb, q}, x.data(), out->data());
        !st.ok()) {
      return st;
    }
    if (g == s_.groups - 1) {
      // The last group: ln_f gives X, the output layer's input.
      XState xst;
      if (auto st = eng_->FinalNormForward(xst, std::move(*out), b() * len); !st.ok()) return st;
      Put(xs_, Mq{a.mb, q}, std::move(xst));
      Produce({KeyKind::kXReady, a.mb, 0, q});
    } else {
      Put(act_out_, Mcq{a.mb, a.chunk, q}, std::move(*out));
      Produce({KeyKind::kActOut, a.mb, a.chunk, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoS(const planner::Action& a, double* waited) {
    const int q = a.seq, len = qlen(q), n = b() * len;
    if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, waited); !st.ok()) return st;
    XState* x = Get(xs_, Mq{a.mb, q});
    if (x == nullptr) return Missing(a, "X");
    std::vector<int32_t> labels(static_cast<size_t>(n));
    for (int r = 0; r < b(); ++r) {
      std::copy_n(targets_[a.mb].data() + static_cast<size_t>(r) * s() + qb(q), len,
                  labels.data() + static_cast<size_t>(r) * len);
    }
    auto st = eng_->model().output_layer().S(x->x.data(), labels.data(), n, d_);
    if (!st.ok()) return st.status();
    OutState* o = Put(outs_, Mq{a.mb, q}, OutState{std::move(*st)});
    o->grad_consumed = !s_.owner;
    Produce({KeyKind::kSDone, a.mb, 0, q});
    if (plan_.barrier == 0) {  // the whole output layer is here: the barrier is local
      if (auto c1 = eng_->model().output_layer().C1(o->state, *self_comm_); !c1.ok()) return c1;
      Produce({KeyKind::kC1Done, a.mb, 0, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoT(const planner::Action& a, double* waited) {
    const int q = a.seq;
    if (auto st = Wait({KeyKind::kC1Done, a.mb, 0, q}, waited); !st.ok()) return st;
    XState* x = Get(xs_, Mq{a.mb, q});
    OutState* o = Get(outs_, Mq{a.mb, q});
    if (x == nullptr || o == nullptr) return Missing(a, "output-layer state");
    if (auto st = eng_->model().output_layer().T(o->state, x->x.data()); !st.ok()) return st;
    double sum = 0;
    for (int i = 0; i < o->state.n(); ++i) sum += o->state.losses()[i];
    loss_ += sum * d_;
    losses_seen_ += 1;
    // X is not needed after T (BCAST_X ran before C1 on this rank); the owner's B may still
    // need ln_f's input and statistics.
    x->x = Buffer();
    if (x->x_last.empty()) Erase(xs_, Mq{a.mb, q});
    {
      std::lock_guard<std::mutex> l(mu_);
      o->t_done = true;
      if (s_.algorithm == engine::vocab::OutputAlgorithm::kAlgorithm2 || plan_.barrier == 0) {
        o->barrier_done = true;
      }
    }
    Produce({KeyKind::kTDone, a.mb, 0, q});
    MaybeReleaseOut(Mq{a.mb, q});
    return absl::OkStatus();
  }

  void MaybeReleaseOut(Mq key) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = outs_.find(key);
    if (it != outs_.end() && it->second.t_done && it->second.grad_consumed &&
        it->second.barrier_done) {
      outs_.erase(it);
    }
  }

  // B (input gradient) of a chunk; with `weight` also W (the fused BW).
  absl::Status DoB(const planner::Action& a, bool weight, double* waited) {
    const int g = s_.chunk_group[a.chunk], q = a.seq, len = qlen(q), n = b() * len;
    Buffer dout;
    if (g == s_.groups - 1) {
      const KeyKind ready_key =
          plan_.barrier == 2 ? KeyKind::kC2Done : KeyKind::kC1Done;  // ∇X is final here
      if (auto st = Wait({ready_key, a.mb, 0, q}, waited); !st.ok()) return st;
      OutState* o = Get(outs_, Mq{a.mb, q});
      XState* x = Get(xs_, Mq{a.mb, q});
      if (o == nullptr || x == nullptr || o->state.grad_input() == nullptr) {
        return Missing(a, "output-layer gradient");
      }
      auto db = eng_->Act(NH(q), /*zero=*/true, E::kCompute);  // ln_f's B accumulates into it
      if (!db.ok()) return db.status();
      dout = std::move(*db);
      if (auto st = eng_->FinalNormBackward(dout, o->state.grad_input(), *x, n); !st.ok()) {
        return st;
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        o->grad_consumed = true;
        if (x->x.empty()) xs_.erase(Mq{a.mb, q});  // T already ran
      }
      MaybeReleaseOut(Mq{a.mb, q});
    } else if (auto it = s_.local_chunk_of_group.find(g + 1); it != s_.local_chunk_of_group.end()) {
      const Mcq src{a.mb, it->second, q};
      if (auto st = Wait({KeyKind::kGradOut, a.mb, it->second, q}, waited); !st.ok()) return st;
      Buffer* in = Get(grad_out_, src);
      if (in == nullptr) return Missing(a, "local gradient");
      dout = std::move(*in);
      Erase(grad_out_, src);
    } else {
      const Mcq src{a.mb, a.chunk, q};
      if (auto st = Wait({KeyKind::kGradIn, a.mb, a.chunk, q}, waited); !st.ok()) return st;
      Buffer* in = Get(grad_in_, src);
      if (in == nullptr) return Missing(a, "received gradient");
      dout = std::move(*in);
      Erase(grad_in_, src);
    }
    auto dx = eng_->Act(NH(q), /*zero=*/false, E::kCompute);
    if (!dx.ok()) return dx.status();
    auto& stack = eng_->model().stack(a.chunk);
    const engine::SlotKey slot{a.mb, q};
    if (auto st = weight ? stack.Backward(slot, dout.data(), dx->data())
                         : stack.BackwardInput(slot, dout.data(), dx->data());
        !st.ok()) {
      return st;
    }
    dout = Buffer();
    if (g == 0) {
      Buffer* de = Get(dembed_, a.mb);
      if (de == nullptr) {
        auto fresh = eng_->Act(static_cast<size_t>(b()) * s() * h(), /*zero=*/false, E::kCompute);
        if (!fresh.ok()) return fresh.status();
        de = Put(dembed_, a.mb, std::move(*fresh));
      }
      if (auto st = eng_->EmbedChunkBackward(*de, *dx, b(), s(), len, h(), qb(q)); !st.ok()) {
        return st;
      }
      if (q == 0) Produce({KeyKind::kDEmbedReady, a.mb});  // chunks run backward: 0 is last
    } else {
      Put(grad_out_, Mcq{a.mb, a.chunk, q}, std::move(*dx));
      Produce({KeyKind::kGradOut, a.mb, a.chunk, q});
    }
    return absl::OkStatus();
  }

  absl::Status DoIB(const planner::Action& a, double* waited) {
    auto* in = Get(in_state_, a.mb);
    if (in == nullptr) return Missing(a, "input-layer state");
    if (plan_.vocab_sharded) {
      if (auto st = Wait({KeyKind::kIbBcastDone, a.mb}, waited); !st.ok()) return st;
    } else {
      if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, waited); !st.ok()) return st;
      Buffer* de = Get(dembed_, a.mb);
      if (de == nullptr) return Missing(a, "embedding gradient");
      if (auto st = eng_->model().input_layer().BackwardBroadcast(*in, *self_comm_, 0, de->data());
          !st.ok()) {
        return st;
      }
      Erase(dembed_, a.mb);
    }
    if (auto st = eng_->model().input_layer().Backward(*in); !st.ok()) return st;
    Erase(in_state_, a.mb);
    return absl::OkStatus();
  }

  absl::Status RunCompute(const planner::Action& a, double* waited) {
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
        return eng_->model().stack(a.chunk).BackwardWeight({a.mb, a.seq});
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

  // ---- communication actions (communication threads) ----
  absl::Status RunComm(const planner::Action& a) {
    using planner::ActionKind;
    const int q = a.seq;
    switch (a.kind) {
      case ActionKind::kSendAct:
      case ActionKind::kSendGrad: {
        const bool grad = a.kind == ActionKind::kSendGrad;
        const KeyKind key = grad ? KeyKind::kGradOut : KeyKind::kActOut;
        auto& map = grad ? grad_out_ : act_out_;
        if (auto st = Wait({key, a.mb, a.chunk, q}, nullptr); !st.ok()) return st;
        Buffer* buf = Get(map, Mcq{a.mb, a.chunk, q});
        if (buf == nullptr) return Missing(a, grad ? "gradient to send" : "activation to send");
        auto st = p2p_->Send(Floats(*buf), FloatCount(*buf), a.peer,
                             P2PTag(grad, s_.chunk_group[a.chunk], q, a.mb));
        Erase(map, Mcq{a.mb, a.chunk, q});
        return st;
      }
      case ActionKind::kRecvAct:
      case ActionKind::kRecvGrad: {
        const bool grad = a.kind == ActionKind::kRecvGrad;
        auto buf = eng_->Act(NH(q), /*zero=*/false, E::kComm);
        if (!buf.ok()) return buf.status();
        const int from_group = s_.chunk_group[a.chunk] + (grad ? 1 : -1);
        if (auto st = p2p_->Recv(Floats(*buf), FloatCount(*buf), a.peer,
                                 P2PTag(grad, from_group, q, a.mb));
            !st.ok()) {
          return st;
        }
        Put(grad ? grad_in_ : act_in_, Mcq{a.mb, a.chunk, q}, std::move(*buf));
        Produce({grad ? KeyKind::kGradIn : KeyKind::kActIn, a.mb, a.chunk, q});
        return absl::OkStatus();
      }
      case ActionKind::kBcastX: {
        if (s_.owner) {
          if (auto st = Wait({KeyKind::kXReady, a.mb, 0, q}, nullptr); !st.ok()) return st;
          XState* x = Get(xs_, Mq{a.mb, q});
          if (x == nullptr) return Missing(a, "X to broadcast");
          return coll_->Broadcast(Floats(x->x), FloatCount(x->x), plan_.x_owner);
        }
        XState x;
        auto buf = eng_->Act(NH(q), /*zero=*/false, E::kComm);
        if (!buf.ok()) return buf.status();
        x.x = std::move(*buf);
        if (auto st = coll_->Broadcast(Floats(x.x), FloatCount(x.x), plan_.x_owner); !st.ok()) {
          return st;
        }
        Put(xs_, Mq{a.mb, q}, std::move(x));
        Produce({KeyKind::kXReady, a.mb, 0, q});
        return absl::OkStatus();
      }
      case ActionKind::kC1: {
        if (auto st = Wait({KeyKind::kSDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
        OutState* o = Get(outs_, Mq{a.mb, q});
        if (o == nullptr) return Missing(a, "S state");
        if (auto st = eng_->model().output_layer().C1(o->state, *coll_); !st.ok()) return st;
        Produce({KeyKind::kC1Done, a.mb, 0, q});
        return absl::OkStatus();
      }
      case ActionKind::kC2: {
        if (auto st = Wait({KeyKind::kTDone, a.mb, 0, q}, nullptr); !st.ok()) return st;
        OutState* o = Get(outs_, Mq{a.mb, q});
        if (o == nullptr) return Missing(a, "T state");
        if (auto st = eng_->model().output_layer().C2(o->state, *coll_); !st.ok()) return st;
        {
          std::lock_guard<std::mutex> l(mu_);
          o->barrier_done = true;
        }
        Produce({KeyKind::kC2Done, a.mb, 0, q});
        MaybeReleaseOut(Mq{a.mb, q});
        return absl::OkStatus();
      }
      case ActionKind::kIfReduce: {
        if (auto st = Wait({KeyKind::kInComputed, a.mb}, nullptr); !st.ok()) return st;
        auto* in = Get(in_state_, a.mb);
        if (in == nullptr) return Missing(a, "IF state");
        if (auto st = eng_->model().input_layer().ForwardReduce(*in, *coll_); !st.ok()) return st;
        if (rank_ != s_.first_group_rank) in->ReleaseOutput();  // only group 0 consumes it
        Produce({KeyKind::kInReduced, a.mb});
        return absl::OkStatus();
      }
      case ActionKind::kIbBcast: {
        const bool root = rank_ == s_.first_group_rank;
        const Elem* grad = nullptr;
        if (root) {
          if (auto st = Wait({KeyKind::kDEmbedReady, a.mb}, nullptr); !st.ok()) return st;
          Buffer* de = Get(dembed_, a.mb);
          if (de == nullptr) return Missing(a, "embedding gradient");
          grad = de->data();
        }
        auto* in = Get(in_state_, a.mb);
        if (in == nullptr) return Missing(a, "input-layer state");
        if (auto st = eng_->model().input_layer().BackwardBroadcast(*in, *coll_,
                                                                    s_.first_group_rank, grad);
            !st.ok()) {
          return st;
        }
        if (root) Erase(dembed_, a.mb);
        Produce({KeyKind::kIbBcastDone, a.mb});
        return absl::OkStatus();
      }
      default:
        return absl::InternalError(
            absl::StrCat("not a communication action: ", planner::ToString(a)));
    }
  }

  // Runs `actions` (communication, plan order) on the calling thread; times go to `comm`.
  void CommLoop(const std::vector<planner::Action>& actions,
                std::array<double, planner::kNumActionKinds>* comm) {
    if (auto st = eng_->EnterThread(); !st.ok()) {
      Fail(absl::Status(st.code(), absl::StrCat("rank ", rank_, ": ", st.message())));
      return;
    }
    for (const planner::Action& a : actions) {
      const auto c0 = Clock::now();
      absl::Status st = RunComm(a);
      eng_->ActionDone(E::kComm);
      (*comm)[static_cast<int>(a.kind)] += Seconds(c0, Clock::now());
      if (!st.ok()) {
        Fail(absl::Status(st.code(), absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ",
                                                  st.message())));
        return;
      }
      if (Failed()) return;
    }
  }

  planner::Plan plan_;
  int rank_ = 0;
  TrainerOptions opt_;
  RankSetup s_;
  std::unique_ptr<E> eng_;
  comm::Communicator* p2p_;
  comm::Communicator* coll_;
  std::unique_ptr<comm::Communicator> self_comm_;

  // Per-step state, guarded by mu_ (the buffers' contents are ordered by the keys).
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<Key> ready_;
  absl::Status error_;
  std::map<int, InputState> in_state_;
  std::map<Mcq, Buffer> act_in_, act_out_, grad_in_, grad_out_;
  std::map<Mq, XState> xs_;
  std::map<Mq, OutState> outs_;
  std::map<int, Buffer> dembed_;  // (b, s, h) per microbatch, on first_group_rank
  double loss_ = 0;
  int losses_seen_ = 0;

  // Step inputs.
  std::vector<std::vector<int32_t>> inputs_, targets_;  // per microbatch, (b, s)
  float d_ = 0;
};

template <typename E>
absl::StatusOr<RankStepResult> RankExecutor<E>::Step(int64_t step, const BatchFn& batches) {
  const auto t0 = Clock::now();
  RankStepResult r;
  r.step = step;
  if (auto st = eng_->EnterThread(); !st.ok()) return st;
  eng_->tracker().ResetPeaks();
  const int m = plan_.microbatches;
  d_ = 1.0f / (static_cast<float>(m) * b() * s());
  inputs_.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  targets_.assign(m, std::vector<int32_t>(static_cast<size_t>(b()) * s()));
  for (int j = 0; j < m; ++j) {
    if (auto st = batches(step, j, inputs_[j].data(), targets_[j].data()); !st.ok()) return st;
  }
  if (auto st = eng_->ZeroGrads(); !st.ok()) return st;
  {
    std::lock_guard<std::mutex> l(mu_);
    ready_.clear();
    error_ = absl::OkStatus();
    in_state_.clear();
    act_in_.clear();
    act_out_.clear();
    grad_in_.clear();
    grad_out_.clear();
    xs_.clear();
    outs_.clear();
    dembed_.clear();
  }
  loss_ = 0;
  losses_seen_ = 0;

  const std::vector<planner::Action>& actions = plan_.ranks[rank_].actions;
  // One communication thread when both roles share a communicator (it serves one thread at a
  // time), else point-to-point and collectives each on their own.
  const bool split = p2p_ != coll_;
  std::vector<planner::Action> comm_a, comm_b;
  for (const planner::Action& a : actions) {
    if (planner::IsCompute(a.kind)) continue;
    (split && planner::IsCollective(a.kind) ? comm_b : comm_a).push_back(a);
  }
  std::array<double, planner::kNumActionKinds> comm_time_b{};
  std::thread thread_a([&] { CommLoop(comm_a, &r.comm); });
  std::thread thread_b;
  if (split) thread_b = std::thread([&] { CommLoop(comm_b, &comm_time_b); });
  for (const planner::Action& a : actions) {
    if (!planner::IsCompute(a.kind) || a.kind == planner::ActionKind::kOpt) continue;
    const auto c0 = Clock::now();
    double waited = 0;
    absl::Status st = RunCompute(a, &waited);
    eng_->ActionDone(E::kCompute);
    r.compute_wait_seconds += waited;
    r.busy[static_cast<int>(a.kind)] += Seconds(c0, Clock::now()) - waited;
    if (!st.ok()) {
      Fail(absl::Status(
          st.code(), absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ", st.message())));
      break;
    }
  }
  thread_a.join();
  if (thread_b.joinable()) thread_b.join();
  for (int k = 0; k < planner::kNumActionKinds; ++k) r.comm[k] += comm_time_b[k];
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!error_.ok()) return error_;
  }
  const auto o0 = Clock::now();
  r.lr = opt_.lr.At(step);
  if (auto st =
          eng_->OptimizerStep(step, *coll_, s_.tied_copy_sync, r.lr, opt_.grad_clip, &r.grad_norm);
      !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("rank ", rank_, " OPT: ", st.message()));
  }
  eng_->ActionDone(E::kCompute);
  r.busy[static_cast<int>(planner::ActionKind::kOpt)] += Seconds(o0, Clock::now());
  if (eng_->model().has_output_layer()) eng_->model().output_layer().ReleaseWorkspace();
  const int expected = plan_.microbatches * s_.k;
  r.has_loss = losses_seen_ == expected;
  r.loss = loss_;
  if (r.has_loss && !std::isfinite(r.loss)) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " step ", step, ": loss is ", loss_));
  }
  const engine::MemoryTracker& tr = eng_->tracker();
  r.peak_parameters = tr.peak(engine::MemoryCategory::kParameters);
  r.peak_gradients = tr.peak(engine::MemoryCategory::kGradients);
  r.peak_optimizer = tr.peak(engine::MemoryCategory::kOptimizer);
  r.peak_activations = tr.peak(engine::MemoryCategory::kActivations);
  r.peak_total = tr.total_peak();
  r.seconds = Seconds(t0, Clock::now());
  return r;
}

}  // namespace vp::runtime::internal
