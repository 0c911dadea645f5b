// Validator and simulator: one abstract machine executes a lowered plan.
//
// Every rank runs its actions strictly in order. Compute actions need local "tokens" (data the
// rank holds: its own activations, received activations/gradients, collective results). A
// SEND fires only together with the matching RECV at the peer's head (rendezvous: a send
// blocks until matched), a collective only when it is at the head of every rank. Data crosses
// ranks only through these actions, so a compute whose token is missing can never run: the
// rank is stuck. If every rank reaches its end the plan is deadlock-free under blocking sends
// (and under any looser semantics), every dependency is respected, and the firing order is a
// global order of which every rank's list is a projection (docs/planner.md).
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/internal.h"
#include "coordinator/planner/planner.h"
#include "proto/plan/flops.h"

namespace vp::planner {

double ModelShape::LayerForwardFlops() const {
  const double b = microbatch_size, s = seq_len, h = hidden;
  const double f = ffn > 0 ? ffn : 4 * h;
  if (llama) {
    const double kv = kv_heads > 0 && heads > 0 ? h / heads * kv_heads : h;
    return flops::LlamaLayerForward(b, s, h, f, kv);
  }
  return flops::TransformerLayerForward(b, s, h, f);
}

double ModelShape::LayerParams() const {
  const double h = hidden, f = ffn > 0 ? ffn : 4 * h;
  if (llama) {  // q, o h×h; k, v h×kv; gate, up, down h×f; two RMSNorm weights
    const double kv = kv_heads > 0 && heads > 0 ? h / heads * kv_heads : h;
    return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h;
  }
  return 4 * h * h + 2 * h * f + 9 * h + f;  // GPT-2, with biases and LayerNorms
}

double ModelShape::LayerParamsPerTensorRank() const {
  const double t = std::max(1, tensor_parallel);
  const double h = hidden;
  // Whole on every tensor rank: the two norms, and (GPT-2) the two row-parallel biases; Llama
  // with one key/value head keeps k and v whole too.
  double replicated = llama ? 2 * h : 6 * h;
  if (llama && t > 1 && kv_heads == 1 && heads > 0) replicated += 2 * h * (h / heads);
  return replicated + (LayerParams() - replicated) / t;
}
namespace internal {

absl::StatusOr<Layout> LayoutFromPlan(const Plan& plan) {
  Layout l;
  l.p = plan.pipeline;
  l.m = plan.microbatches;
  l.k = plan.seq_chunks;
  l.layers = plan.layers;
  l.sharded = plan.vocab_sharded;
  l.barrier = plan.barrier;
  if (l.p < 1 || static_cast<int>(plan.ranks.size()) != l.p)
    return absl::InvalidArgumentError("plan.pipeline: must equal the number of rank plans (>= 1)");
  if (l.m < 1) return absl::InvalidArgumentError("plan.microbatches: must be >= 1");
  if (l.k < 1 || static_cast<int>(plan.seq_bounds.size()) != l.k + 1)
    return absl::InvalidArgumentError("plan.seq_bounds: need seq_chunks + 1 offsets");
  for (int q = 0; q < l.k; ++q) {
    if (plan.seq_bounds[q + 1] <= plan.seq_bounds[q])
      return absl::InvalidArgumentError("plan.seq_bounds: must be strictly increasing");
  }
  if (l.barrier < 0 || l.barrier > 2 || (!l.sharded && l.barrier != 0))
    return absl::InvalidArgumentError("plan.barrier: 0 without vocabulary sharding, else 1 or 2");
  l.groups = plan.groups();
  l.owner_rank.assign(l.groups, -1);
  l.owner_chunk.assign(l.groups, -1);
  l.group_layers.assign(l.groups, 0);
  std::vector<int> first(l.groups, 0);
  l.group_of.resize(l.p);
  for (int r = 0; r < l.p; ++r) {
    if (plan.ranks[r].chunks.empty())
      return absl::InvalidArgumentError(absl::StrCat("plan rank ", r, ": holds no model chunk"));
    for (size_t c = 0; c < plan.ranks[r].chunks.size(); ++c) {
      const ModelChunk& mc = plan.ranks[r].chunks[c];
      if (mc.group < 0 || mc.group >= l.groups || l.owner_rank[mc.group] >= 0)
        return absl::InvalidArgumentError(absl::StrCat("plan rank ", r, " chunk ", c, ": group ",
                                                       mc.group, " out of range or held twice"));
      l.owner_rank[mc.group] = r;
      l.owner_chunk[mc.group] = static_cast<int>(c);
      l.group_layers[mc.group] = mc.num_layers;
      first[mc.group] = mc.first_layer;
      l.group_of[r].push_back(mc.group);
    }
  }
  int next = 0;
  for (int g = 0; g < l.groups; ++g) {
    if (first[g] != next || l.group_layers[g] < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("plan placement: group ", g, " must start at layer ", next,
                       " (layers must be covered once, in group order)"));
    next += l.group_layers[g];
  }
  if (next != l.layers)
    return absl::InvalidArgumentError(
        absl::StrCat("plan placement: groups cover ", next, " layers, plan.layers is ", l.layers));
  const double total = plan.seq_bounds[l.k] - plan.seq_bounds[0];
  for (int q = 0; q < l.k; ++q) {
    l.seq_mem_share.push_back((plan.seq_bounds[q + 1] - plan.seq_bounds[q]) / total);
    l.seq_cost_share.push_back(1.0 / l.k);  // computation-wise partition: equal FLOPs
  }
  return l;
}

double ActionCost(const Layout& l, const Costs& c, int rank, const Action& a) {
  const double stage_layers = static_cast<double>(l.layers) / l.p;
  auto share = [&] {
    const int g = l.group_of[rank][a.chunk];
    return l.group_layers[g] / stage_layers * l.seq_cost_share[a.seq];
  };
  const double vocab_scale = l.sharded ? 1.0 : l.p;
  switch (a.kind) {
    case ActionKind::kF:
      return c.f * share();
    case ActionKind::kB:
      return (c.b + c.recompute) * share();
    case ActionKind::kW:
      return c.w * share();
    case ActionKind::kBW:
      return (c.b + c.recompute + c.w) * share();
    case ActionKind::kS:
      return c.s * vocab_scale * l.seq_cost_share[a.seq];
    case ActionKind::kT:
      return c.t * vocab_scale * l.seq_cost_share[a.seq];
    case ActionKind::kIF:
      return c.input_f;
    case ActionKind::kIB:
      return c.input_b;
    case ActionKind::kOpt:
      return c.opt;
    default:
      return 0;
  }
}

double CommSeconds(const Layout& l, const PlannerInput& in, ActionKind kind, int q) {
  const Costs& c = in.costs;
  const ModelShape& ms = in.model;
  // b·s, and under tensor parallelism the 1/t of them that each rank moves.
  const double tokens =
      static_cast<double>(ms.microbatch_size) * ms.seq_len / std::max(1, ms.tensor_parallel);
  const double n = tokens * l.seq_mem_share[q];  // tokens of sequence chunk q
  const double h = static_cast<double>(ms.hidden), e = ms.activation_bytes_per_element;
  switch (kind) {
    case ActionKind::kSendAct:
    case ActionKind::kRecvAct:
    case ActionKind::kSendGrad:
    case ActionKind::kRecvGrad:
      return c.comm + c.p2p.Seconds(n * h * e);
    case ActionKind::kBcastX:
      return c.collective + c.broadcast.Seconds(n * h * e);
    case ActionKind::kC1:
      return c.collective + c.allreduce.Seconds(n * 4) + c.allreduce.Seconds(2 * n * 4) +
             (l.barrier == 1 ? c.allreduce.Seconds(n * h * 4) : 0);
    case ActionKind::kC2:
      return c.collective + c.allreduce.Seconds(n * h * 4);
    case ActionKind::kIfReduce:
      return c.collective + c.allreduce.Seconds(tokens * h * 4);
    case ActionKind::kIbBcast:
      return c.collective + c.broadcast.Seconds(tokens * h * 4);
    default:
      return 0;
  }
}

double ActivationUnits(const Layout& l, int rank, const Action& a) {
  if (a.kind != ActionKind::kF && a.kind != ActionKind::kW && a.kind != ActionKind::kBW) return 0;
  const int g = l.group_of[rank][a.chunk];
  const double u =
      l.group_layers[g] / (static_cast<double>(l.layers) / l.p) * l.seq_mem_share[a.seq];
  return a.kind == ActionKind::kF ? u : -u;
}

}  // namespace internal

namespace {

using internal::Layout;
constexpr double kAbsent = -1;

// Token kinds. Per chunk: own activation, own input gradient, own weight gradient, received
// input activation, received output gradient. Per (mb, seq): vocabulary-layer results.
enum ChunkTok { kActOwn, kGradOwn, kWDone, kActIn, kGradIn, kNumChunkTok };
enum VocabTok { kX, kSDone, kC1, kTDone, kC2, kIfDone, kEmb, kIbGrad, kIbDone, kNumVocabTok };

class Machine {
 public:
  // in: the costs and shape to time with; nullptr validates only.
  Machine(const Plan& plan, const Layout& l, const PlannerInput* in)
      : plan_(plan), l_(l), in_(in), costs_(in != nullptr ? &in->costs : nullptr) {
    v_ = 0;
    for (int r = 0; r < l.p; ++r) v_ = std::max<int>(v_, l.group_of[r].size());
    per_rank_ = static_cast<size_t>(kNumChunkTok * v_ + kNumVocabTok) * l.m * l.k;
    tok_.assign(static_cast<size_t>(l.p) * per_rank_, kAbsent);
    pc_.assign(l.p, 0);
    lane_.assign(l.p, 0);
    lanes_ = in_ != nullptr && in_->comm_lanes == 2 ? 2 : 1;
    comm_lane_.assign(static_cast<size_t>(l.p) * lanes_, 0);
    comm_busy_.assign(l.p, 0);
    stuck_.assign(l.p, "");
    waits_for_.assign(l.p, -1);
    synced_.resize(l.p);
    for (int r = 0; r < l.p; ++r) synced_[r].assign(l.group_of[r].size(), 0);
    opt_done_.assign(l.p, 0);
    if (costs_ != nullptr) {
      times_.resize(l.p);
      for (int r = 0; r < l.p; ++r) times_[r].resize(plan.ranks[r].actions.size());
    }
  }

  absl::Status Run();
  std::string StallGrid() const;
  std::vector<std::vector<TimedAction>>& times() { return times_; }
  const std::vector<double>& comm_busy() const { return comm_busy_; }

 private:
  double& ChunkT(int r, int kind, int c, int mb, int q) {
    return tok_[r * per_rank_ + ((static_cast<size_t>(kind) * v_ + c) * l_.m + mb) * l_.k + q];
  }
  double& VocabT(int r, int kind, int mb, int q) {
    return tok_[r * per_rank_ +
                ((static_cast<size_t>(kNumChunkTok) * v_ + kind) * l_.m + mb) * l_.k + q];
  }
  const Action* Head(int r) const {
    const auto& acts = plan_.ranks[r].actions;
    return pc_[r] < acts.size() ? &acts[pc_[r]] : nullptr;
  }
  absl::Status CheckRanges(int r, const Action& a) const;
  // Fires a compute action or returns why it cannot run (empty = fired).
  std::string FireCompute(int r, const Action& a);
  std::string FireCollective(const Action& a);
  // GRAD_SYNC: its chunk's weight passes are all done, once per step, before OPT.
  std::string FireGradSync(int r, const Action& a);
  void Record(int r, double start, double end) {
    if (costs_ != nullptr) times_[r][pc_[r]] = {start, end};
  }
  double Cost(int r, const Action& a) const {
    return costs_ ? internal::ActionCost(l_, *costs_, r, a) : 0;
  }
  double CommCost(const Action& a) const {
    return in_ ? internal::CommSeconds(l_, *in_, a.kind, a.seq) : 0;
  }
  // The communication lane of rank r that runs actions of `kind` (Gloo: one for all; NCCL:
  // point-to-point on lane 0, collectives on lane 1).
  double& CommLane(int r, ActionKind kind) {
    return comm_lane_[static_cast<size_t>(r) * lanes_ + (lanes_ == 2 && IsCollective(kind))];
  }

  const Plan& plan_;
  const Layout& l_;
  const PlannerInput* in_;
  const Costs* costs_;
  int v_;
  size_t per_rank_;
  std::vector<double> tok_;
  std::vector<size_t> pc_;
  std::vector<double> lane_;       // compute lane of each rank: free from this time
  int lanes_ = 1;                  // communication lanes per rank
  std::vector<double> comm_lane_;  // [rank · lanes_ + lane]: free from this time
  std::vector<double> comm_busy_;  // per rank: seconds in transfers and collectives
  std::vector<std::string> stuck_;
  std::vector<int> waits_for_;  // peer a blocked P2P head waits on, -1 none
  std::vector<std::vector<TimedAction>> times_;
  std::vector<std::vector<char>> synced_;  // [rank][chunk]: GRAD_SYNC fired
  std::vector<char> opt_done_;             // [rank]: OPT fired
};

absl::Status Machine::CheckRanges(int r, const Action& a) const {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", r, " action ", pc_[r], " ", ToString(a), ": ", why));
  };
  if (a.kind == ActionKind::kOpt) return absl::OkStatus();
  if (a.mb < 0 || a.mb >= l_.m) return bad("microbatch outside [0, microbatches)");
  if (a.seq < 0 || a.seq >= l_.k) return bad("sequence chunk outside [0, seq_chunks)");
  if (a.chunk < 0 || a.chunk >= static_cast<int>(l_.group_of[r].size()))
    return bad("no such model chunk on this rank");
  if (IsP2P(a.kind) && (a.peer < 0 || a.peer >= l_.p || a.peer == r)) return bad("bad peer");
  return absl::OkStatus();
}

std::string Machine::FireCompute(int r, const Action& a) {
  const int q = a.seq, mb = a.mb;
  double ready = lane_[r];
  auto need = [&](double t, absl::string_view what) -> bool {
    if (t == kAbsent) {
      stuck_[r] = absl::StrCat("needs ", what);
      return false;
    }
    ready = std::max(ready, t);
    return true;
  };
  auto fire = [&](double& out) {
    const double end = ready + Cost(r, a);
    Record(r, ready, end);
    lane_[r] = end;
    out = end;
  };
  const bool mine = !l_.sharded;
  switch (a.kind) {
    case ActionKind::kF: {
      const int g = l_.group_of[r][a.chunk];
      if (ChunkT(r, kActOwn, a.chunk, mb, q) != kAbsent) return "duplicate forward";
      if (g == 0) {
        if (!need(VocabT(r, kEmb, mb, 0), "the embedding output (IF/IF_REDUCE)")) return stuck_[r];
      } else if (l_.owner_rank[g - 1] == r) {
        if (!need(ChunkT(r, kActOwn, l_.owner_chunk[g - 1], mb, q), "the previous group's F"))
          return stuck_[r];
      } else if (!need(ChunkT(r, kActIn, a.chunk, mb, q), "RECV_ACT of its input")) {
        return stuck_[r];
      }
      if (q > 0 && !need(ChunkT(r, kActOwn, a.chunk, mb, q - 1), "F of the previous seq chunk"))
        return stuck_[r];
      fire(ChunkT(r, kActOwn, a.chunk, mb, q));
      if (g == l_.groups - 1) VocabT(r, kX, mb, q) = ChunkT(r, kActOwn, a.chunk, mb, q);
      return "";
    }
    case ActionKind::kB:
    case ActionKind::kBW: {
      const int g = l_.group_of[r][a.chunk];
      if (ChunkT(r, kGradOwn, a.chunk, mb, q) != kAbsent) return "duplicate backward";
      if (!need(ChunkT(r, kActOwn, a.chunk, mb, q), "its own F")) return stuck_[r];
      if (g == l_.groups - 1) {
        if (!l_.sharded) {
          if (!need(VocabT(r, kTDone, mb, q), "the loss gradient (T on this rank)"))
            return stuck_[r];
        } else if (l_.barrier == 1) {
          if (!need(VocabT(r, kC1, mb, q), "barrier C1 (grad X)")) return stuck_[r];
        } else if (!need(VocabT(r, kC2, mb, q), "barrier C2 (grad X)")) {
          return stuck_[r];
        }
      } else if (l_.owner_rank[g + 1] == r) {
        if (!need(ChunkT(r, kGradOwn, l_.owner_chunk[g + 1], mb, q), "the next group's B"))
          return stuck_[r];
      } else if (!need(ChunkT(r, kGradIn, a.chunk, mb, q), "RECV_GRAD of its output")) {
        return stuck_[r];
      }
      if (q + 1 < l_.k &&
          !need(ChunkT(r, kGradOwn, a.chunk, mb, q + 1), "B of the next seq chunk (dK/dV)"))
        return stuck_[r];
      fire(ChunkT(r, kGradOwn, a.chunk, mb, q));
      if (a.kind == ActionKind::kBW) ChunkT(r, kWDone, a.chunk, mb, q) = lane_[r];
      return "";
    }
    case ActionKind::kW:
      if (ChunkT(r, kWDone, a.chunk, mb, q) != kAbsent) return "duplicate W";
      if (!need(ChunkT(r, kGradOwn, a.chunk, mb, q), "its B")) return stuck_[r];
      fire(ChunkT(r, kWDone, a.chunk, mb, q));
      return "";
    case ActionKind::kIF:
      if (mine && l_.owner_rank[0] != r) return "input layer lives on the owner of group 0";
      if (VocabT(r, kIfDone, mb, 0) != kAbsent) return "duplicate IF";
      fire(VocabT(r, kIfDone, mb, 0));
      if (mine) VocabT(r, kEmb, mb, 0) = lane_[r];
      return "";
    case ActionKind::kIB:
      if (VocabT(r, kIbDone, mb, 0) != kAbsent) return "duplicate IB";
      if (mine) {
        if (l_.owner_rank[0] != r) return "input layer lives on the owner of group 0";
        for (int s = 0; s < l_.k; ++s)
          if (!need(ChunkT(r, kGradOwn, l_.owner_chunk[0], mb, s), "B of layer group 0"))
            return stuck_[r];
      } else if (!need(VocabT(r, kIbGrad, mb, 0), "IB_BCAST")) {
        return stuck_[r];
      }
      fire(VocabT(r, kIbDone, mb, 0));
      return "";
    case ActionKind::kS:
      if (mine && l_.x_owner() != r) return "output layer lives on the owner of the last group";
      if (VocabT(r, kSDone, mb, q) != kAbsent) return "duplicate S";
      if (!need(VocabT(r, kX, mb, q), "X (F of the last group or BCAST_X)")) return stuck_[r];
      fire(VocabT(r, kSDone, mb, q));
      return "";
    case ActionKind::kT:
      if (mine && l_.x_owner() != r) return "output layer lives on the owner of the last group";
      if (VocabT(r, kTDone, mb, q) != kAbsent) return "duplicate T";
      if (!need(VocabT(r, mine ? kSDone : kC1, mb, q), mine ? "its S" : "barrier C1"))
        return stuck_[r];
      fire(VocabT(r, kTDone, mb, q));
      return "";
    case ActionKind::kOpt: {
      // Everything this rank computes must be done: weight gradients of every chunk, T and IB.
      // (Messages are built only on failure: this loop runs m·v·k times per rank.)
      for (size_t c = 0; c < l_.group_of[r].size(); ++c)
        for (int i = 0; i < l_.m; ++i)
          for (int s = 0; s < l_.k; ++s)
            if (const double t = ChunkT(r, kWDone, c, i, s); t != kAbsent) {
              ready = std::max(ready, t);
            } else {
              need(t, absl::StrCat("W/BW of mb ", i, " chunk ", c, " seq ", s, " before OPT"));
              return stuck_[r];
            }
      for (int i = 0; i < l_.m; ++i) {
        if (l_.sharded || l_.owner_rank[0] == r) {
          if (const double t = VocabT(r, kIbDone, i, 0); t != kAbsent) {
            ready = std::max(ready, t);
          } else {
            need(t, absl::StrCat("IB(", i, ") before OPT"));
            return stuck_[r];
          }
        }
        if (l_.sharded || l_.x_owner() == r) {
          for (int s = 0; s < l_.k; ++s) {
            if (const double t = VocabT(r, kTDone, i, s); t != kAbsent) {
              ready = std::max(ready, t);
            } else {
              need(t, absl::StrCat("T(", i, ") before OPT"));
              return stuck_[r];
            }
          }
        }
      }
      double dummy;
      fire(dummy);
      return "";
    }
    default:
      return "not a compute action";
  }
}

std::string Machine::FireCollective(const Action& a) {
  const int mb = a.mb, q = a.seq;
  if (!l_.sharded) return "vocabulary collectives need a sharded vocabulary method";
  // Every rank's communication lane must be free (the collective runs when the last one
  // reaches it) and its inputs computed.
  double ready = 0;
  for (int r = 0; r < l_.p; ++r) ready = std::max(ready, CommLane(r, a.kind));
  std::vector<std::pair<int, int>> outs;  // (rank, vocab token kind)
  auto need_all = [&](int kind) -> std::string {
    for (int r = 0; r < l_.p; ++r) {
      if (VocabT(r, kind, mb, q) == kAbsent)
        return absl::StrCat("rank ", r, " has not run its pass");
      ready = std::max(ready, VocabT(r, kind, mb, q));
    }
    return "";
  };
  std::string err;
  int out_kind = -1;
  bool to_all = true;
  switch (a.kind) {
    case ActionKind::kBcastX:
      if (VocabT(l_.x_owner(), kX, mb, q) == kAbsent) return "X owner has not run the last F";
      ready = std::max(ready, VocabT(l_.x_owner(), kX, mb, q));
      out_kind = kX;
      break;
    case ActionKind::kC1:
      err = need_all(kSDone);
      out_kind = kC1;
      break;
    case ActionKind::kC2:
      if (l_.barrier != 2) return "C2 only with Algorithm 1 (barrier 2)";
      err = need_all(kTDone);
      out_kind = kC2;
      break;
    case ActionKind::kIfReduce:
      if (q != 0) return "IF_REDUCE has no sequence chunk";
      err = need_all(kIfDone);
      out_kind = kEmb;
      to_all = false;
      break;
    case ActionKind::kIbBcast: {
      const int r0 = l_.owner_rank[0], c0 = l_.owner_chunk[0];
      for (int s = 0; s < l_.k; ++s) {
        if (ChunkT(r0, kGradOwn, c0, mb, s) == kAbsent) return "owner of group 0 has not run B";
        ready = std::max(ready, ChunkT(r0, kGradOwn, c0, mb, s));
      }
      out_kind = kIbGrad;
      break;
    }
    default:
      return "not a collective";
  }
  if (!err.empty()) return err;
  const double end = ready + CommCost(a);
  for (int r = 0; r < l_.p; ++r) {
    CommLane(r, a.kind) = end;
    comm_busy_[r] += end - ready;
  }
  for (int r = 0; r < l_.p; ++r) {
    if (to_all || r == l_.owner_rank[0]) {
      double& t = VocabT(r, out_kind, mb, a.kind == ActionKind::kIfReduce ? 0 : q);
      if (t == kAbsent || a.kind != ActionKind::kBcastX || r != l_.x_owner()) t = end;
    }
    Record(r, ready, end);
  }
  return "";
}

std::string Machine::FireGradSync(int r, const Action& a) {
  const int c = a.chunk;
  if (opt_done_[r]) return "GRAD_SYNC after OPT: the optimizer has used the gradients";
  if (synced_[r][c]) return absl::StrCat("chunk ", c, " is summed twice in one step");
  double ready = lane_[r];
  for (int i = 0; i < l_.m; ++i)
    for (int q = 0; q < l_.k; ++q) {
      const double t = ChunkT(r, kWDone, c, i, q);
      if (t == kAbsent) {
        return absl::StrCat("GRAD_SYNC before W/BW of mb ", i, " chunk ", c, " seq ", q,
                            ": the sum would miss that gradient");
      }
      ready = std::max(ready, t);
    }
  synced_[r][c] = 1;
  // The data group's link is modelled after the run (Simulate); the rank's lanes go on.
  Record(r, ready, ready);
  return "";
}

// Rank-by-step grid around a stall: each rank's actions from a few steps before its program
// counter to a few after; the action it is blocked at in [brackets], done ones plain, the
// ones not reached in lower case. Reading down a column shows who waits for whom.
std::string Machine::StallGrid() const {
  constexpr size_t kBefore = 4, kAfter = 3, kWidth = 18;
  std::string out = "  rank-by-step grid ([blocked], lower case: not reached):\n";
  for (int r = 0; r < l_.p; ++r) {
    const auto& acts = plan_.ranks[r].actions;
    const size_t pc = pc_[r];
    const size_t from = pc > kBefore ? pc - kBefore : 0;
    const size_t to = std::min(acts.size(), pc + kAfter + 1);
    absl::StrAppend(&out, "  rank ", r, " step ", from, ":");
    for (size_t i = from; i < to; ++i) {
      std::string cell = ToString(acts[i]);
      if (i == pc) {
        cell = absl::StrCat("[", cell, "]");
      } else if (i > pc) {
        absl::AsciiStrToLower(&cell);
      }
      cell.resize(std::max(cell.size() + 1, kWidth), ' ');
      absl::StrAppend(&out, " ", cell);
    }
    if (pc >= acts.size()) absl::StrAppend(&out, " (done)");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

absl::Status Machine::Run() {
  // Collectives: the same sequence on every rank (checked up front for a clear message).
  std::vector<std::vector<const Action*>> colls(l_.p);
  for (int r = 0; r < l_.p; ++r)
    for (const Action& a : plan_.ranks[r].actions)
      if (IsCollective(a.kind)) colls[r].push_back(&a);
  for (int r = 1; r < l_.p; ++r) {
    const size_t n = std::min(colls[r].size(), colls[0].size());
    size_t i = 0;
    while (i < n && colls[r][i]->kind == colls[0][i]->kind && colls[r][i]->mb == colls[0][i]->mb &&
           colls[r][i]->seq == colls[0][i]->seq)
      ++i;
    if (i < n || colls[r].size() != colls[0].size())
      return absl::FailedPreconditionError(
          absl::StrCat("collective order differs: rank ", r, " collective #", i, " is ",
                       i < colls[r].size() ? ToString(*colls[r][i]) : "missing", ", rank 0 has ",
                       i < colls[0].size() ? ToString(*colls[0][i]) : "missing"));
  }
  for (int r = 0; r < l_.p; ++r)
    for (size_t i = 0; i < plan_.ranks[r].actions.size(); ++i) {
      pc_[r] = i;
      if (absl::Status s = CheckRanges(r, plan_.ranks[r].actions[i]); !s.ok()) return s;
    }
  std::fill(pc_.begin(), pc_.end(), 0);

  internal::RankWorklist work(l_.p);
  int arrived = 0;
  std::vector<char> at_coll(l_.p, 0);
  while (!work.empty()) {
    const int r = work.Pop();
    while (const Action* a = Head(r)) {
      if (IsCompute(a->kind)) {
        std::string why = FireCompute(r, *a);
        if (!why.empty()) {
          stuck_[r] = why;
          break;
        }
        if (a->kind == ActionKind::kOpt) opt_done_[r] = 1;
        ++pc_[r];
        continue;
      }
      if (IsDataSync(a->kind)) {
        // Only this rank's replicas take part, and they run this same list: nothing to match
        // across the pipeline, and the data group's order is this list's order by construction.
        std::string why = FireGradSync(r, *a);
        if (!why.empty()) {
          stuck_[r] = why;
          break;
        }
        ++pc_[r];
        continue;
      }
      if (IsCollective(a->kind)) {
        if (at_coll[r]) break;
        at_coll[r] = 1;
        if (++arrived < l_.p) {
          stuck_[r] = "waits for the other ranks at this collective";
          break;
        }
        std::string why = FireCollective(*a);
        if (!why.empty()) {
          for (int i = 0; i < l_.p; ++i) stuck_[i] = absl::StrCat("collective blocked: ", why);
          break;
        }
        arrived = 0;
        for (int i = 0; i < l_.p; ++i) {
          at_coll[i] = 0;
          stuck_[i].clear();
          ++pc_[i];
          if (i != r) work.Wake(i);
        }
        continue;
      }
      // Point to point: fire when the peer's head is the matching counterpart.
      const bool send = a->kind == ActionKind::kSendAct || a->kind == ActionKind::kSendGrad;
      const bool act = a->kind == ActionKind::kSendAct || a->kind == ActionKind::kRecvAct;
      const int s = send ? r : a->peer, d = send ? a->peer : r;
      const Action* other = Head(a->peer);
      const Action* sa = send ? a : other;
      const Action* ra = send ? other : a;
      const ActionKind want = send ? (act ? ActionKind::kRecvAct : ActionKind::kRecvGrad)
                                   : (act ? ActionKind::kSendAct : ActionKind::kSendGrad);
      if (other == nullptr || other->kind != want || other->peer != r || other->mb != a->mb ||
          other->seq != a->seq) {
        // The reason is spelled out only if the plan ends stuck (this wait is common).
        waits_for_[r] = a->peer;
        stuck_[r].clear();
        break;
      }
      const int gs = l_.group_of[s][sa->chunk], gd = l_.group_of[d][ra->chunk];
      if (gd != gs + (act ? 1 : -1) || l_.owner_rank[gs] == l_.owner_rank[gd]) {
        stuck_[r] = "send and receive chunks are not adjacent layer groups on different ranks";
        break;
      }
      const double t = ChunkT(s, act ? kActOwn : kGradOwn, sa->chunk, a->mb, a->seq);
      if (t == kAbsent) {
        stuck_[s] = absl::StrCat("sends data it has not computed");
        break;
      }
      // The transfer starts once the data is computed and both communication lanes are free
      // (the sender's thread blocks in the send until the receiver posts its receive).
      const double start = std::max({t, CommLane(s, a->kind), CommLane(d, a->kind)});
      const double arrive = start + CommCost(*a);
      CommLane(s, a->kind) = CommLane(d, a->kind) = arrive;
      ChunkT(d, act ? kActIn : kGradIn, ra->chunk, a->mb, a->seq) = arrive;
      if (costs_ != nullptr) {
        times_[s][pc_[s]] = {start, arrive};
        times_[d][pc_[d]] = {start, arrive};
        comm_busy_[s] += arrive - start;
        comm_busy_[d] += arrive - start;
      }
      stuck_[r].clear();
      stuck_[a->peer].clear();
      waits_for_[r] = waits_for_[a->peer] = -1;
      ++pc_[r];
      ++pc_[a->peer];
      work.Wake(a->peer);
    }
  }
  std::vector<std::string> errors;
  for (int r = 0; r < l_.p; ++r) {
    if (const Action* a = Head(r))
      errors.push_back(absl::StrCat("rank ", r, " action ", pc_[r], " ", ToString(*a), ": ",
                                    !stuck_[r].empty() ? stuck_[r]
                                    : waits_for_[r] >= 0
                                        ? absl::StrCat("waits for rank ", waits_for_[r],
                                                       " to post the matching receive or send")
                                        : "blocked"));
  }
  if (!errors.empty())
    return absl::FailedPreconditionError(absl::StrCat(
        "plan cannot run to the end:\n  ", absl::StrJoin(errors, "\n  "), "\n", StallGrid()));
  // Coverage: every pass of every (mb, seq) exactly once on the rank holding it.
  for (int r = 0; r < l_.p; ++r) {
    for (size_t c = 0; c < l_.group_of[r].size(); ++c)
      for (int i = 0; i < l_.m; ++i)
        for (int s = 0; s < l_.k; ++s)
          if (ChunkT(r, kWDone, c, i, s) == kAbsent)
            return absl::FailedPreconditionError(
                absl::StrCat("rank ", r, " never runs F/B/W of mb ", i, " chunk ", c, " seq ", s));
    for (int i = 0; i < l_.m; ++i) {
      const bool in = l_.sharded || l_.owner_rank[0] == r;
      const bool out = l_.sharded || l_.x_owner() == r;
      if (in && VocabT(r, kIbDone, i, 0) == kAbsent)
        return absl::FailedPreconditionError(absl::StrCat("rank ", r, " never runs IB(", i, ")"));
      for (int s = 0; s < l_.k; ++s)
        if (out && VocabT(r, kTDone, i, s) == kAbsent)
          return absl::FailedPreconditionError(
              absl::StrCat("rank ", r, " never runs T(", i, ",s", s, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePlan(const Plan& plan) {
  absl::StatusOr<Layout> l = internal::LayoutFromPlan(plan);
  if (!l.ok()) return l.status();
  Machine machine(plan, *l, nullptr);
  return machine.Run();
}

absl::StatusOr<SimResult> Simulate(const Plan& plan, const PlannerInput& in) {
  absl::StatusOr<Layout> l = internal::LayoutFromPlan(plan);
  if (!l.ok()) return l.status();
  Machine machine(plan, *l, &in);
  if (absl::Status s = machine.Run(); !s.ok()) return s;
  SimResult res;
  res.times = std::move(machine.times());
  const std::vector<double> comm_busy = machine.comm_busy();
  const ModelShape& ms = in.model;
  const double b = ms.microbatch_size, s = ms.seq_len, h = ms.hidden;
  // Activation bytes of one layer for one microbatch when nothing was measured: Megatron's
  // sbh·34 for 2-byte activations, scaled to the element size, plus the fp32 log-sum-exp per
  // (head, query). Both engines' attention is flash-style (the softmax is recomputed in the
  // backward), so Megatron's 5as/h term for the stored s × s probabilities does not apply.
  // Under tensor parallelism with sequence parallelism a rank keeps 1/t of every activation
  // (its token rows, or its heads and MLP columns) and 1/t of the backward's working set.
  // Recomputation without a measurement: selective drops the attention output (b·s·h
  // elements) and the log-sum-exp; full keeps the layer input only.
  const int tp = std::max(1, ms.tensor_parallel);
  const double elem = ms.activation_bytes_per_element;
  const double lse_bytes = b * ms.heads * s * 4;
  double estimate = h > 0 ? b * s * h * 34 * elem / 2 + lse_bytes : 0;
  if (ms.recompute == Recompute::kSelective) estimate -= b * s * h * elem + lse_bytes;
  if (ms.recompute == Recompute::kFull) estimate = b * s * h * elem;
  const double layer_act =
      (ms.layer_activation_bytes > 0 ? ms.layer_activation_bytes : estimate) / tp;
  const double stage_act = layer_act * l->layers / l->p;
  // Per stage microbatch: what a slot holds between its split B and its W beyond its F bytes
  // (under full recomputation nearly all of it: F kept only the layer inputs).
  const double stage_w_extra =
      ms.layer_held_for_w_bytes > 0
          ? std::max(0.0, ms.layer_held_for_w_bytes / tp - layer_act) * l->layers / l->p
          : 0;
  // Sequence chunks (Seq1F1B): the output layer's buffers and a backward's working set are
  // those of one chunk (the largest one for the output layer's, at worst); the layer's dK/dV
  // accumulators span the whole sequence whatever the chunk. (The kept activations are
  // counted per chunk by ActivationUnits.)
  auto share = [&](int q) { return l->seq_mem_share.empty() ? 1.0 : l->seq_mem_share[q]; };
  const double chunk_share = l->seq_mem_share.empty() ? 1.0
                                                      : *std::max_element(l->seq_mem_share.begin(),
                                                                          l->seq_mem_share.end());
  const double kv_dim =
      ms.llama && ms.kv_heads > 0 && ms.heads > 0 ? h / ms.heads * ms.kv_heads : h;
  const double transient = ms.layer_backward_transient_bytes / tp;
  // Whole-sequence buffers of the backward whatever the chunk: dK/dV, and under full
  // recomputation the K/V cache it rebuilds.
  const double kv_buffers = ms.recompute == Recompute::kFull ? 4 : 2;
  const double kv_grads = std::min<double>(
      transient, kv_buffers * b * s * kv_dim * ms.activation_bytes_per_element / tp);
  // Sequence chunks: those whole-sequence buffers live from the microbatch's first B (its last
  // chunk) to its last B (chunk 0), for every layer of the stage; a later chunk's B finds its
  // own already held.
  const int k = l->k;
  auto chunk_transient = [&](int q) {
    return (transient - kv_grads) * share(q) + (k > 1 && q < k - 1 ? 0 : kv_grads);
  };
  const double stage_kv_held = k > 1 ? kv_grads * l->layers / l->p : 0;
  const double stage_kv_cache =
      k > 1 && ms.recompute == Recompute::kFull ? stage_kv_held / 2 : 0;  // K and V of 4 buffers
  const double chunk_tokens = b * s * chunk_share;
  const double layer_params = ms.LayerParamsPerTensorRank();
  const double vocab_rows = static_cast<double>(ms.vocab);
  double busy_total = 0;
  double data_end = 0;  // when the last rank's step ends with its data-parallel reduction
  for (int r = 0; r < l->p; ++r) {
    RankStats st;
    st.rank = r;
    st.comm = comm_busy[r];
    double mem = 0, peak = 0, peak_bytes = 0;
    double mem_bytes = 0;  // mem · stage_act, plus what the slots between their B and W add
    bool first = true;
    const auto& acts = plan.ranks[r].actions;
    for (size_t i = 0; i < acts.size(); ++i) {
      const TimedAction& t = res.times[r][i];
      if (IsCompute(acts[i].kind)) {
        const double c = internal::ActionCost(*l, in.costs, r, acts[i]);
        st.busy += c;
        if (first) st.first_start = t.start;
        first = false;
        // A backward's working set comes on top of what is live when it starts, and is that
        // of its own sequence chunk (Seq1F1B runs the smallest, last chunk's first, while
        // every chunk is still held).
        const ActionKind kind = acts[i].kind;
        // The slot's share of a stage microbatch (its F's units), and what it holds from its
        // B to its W beyond its F bytes. B runs the slot's layers last to first, each keeping
        // its stash for W, so at the first layer's B the others' stashes are already held;
        // full recomputation's unsplit backward runs each layer's W right after its B instead.
        const int layers_here = l->group_layers[l->group_of[r][acts[i].chunk]];
        Action as_f = acts[i];
        as_f.kind = ActionKind::kF;
        const double slot_units = internal::ActivationUnits(*l, r, as_f);
        const double slot_w_extra = slot_units * stage_w_extra;
        const bool backward = kind == ActionKind::kB || kind == ActionKind::kBW;
        const double layer_frac = static_cast<double>(layers_here) / l->layers * l->p;
        const double slot_kv_held = stage_kv_held * layer_frac;
        if (backward) {
          const bool stashes = kind == ActionKind::kB || ms.recompute != Recompute::kFull;
          const double earlier = (layers_here - 1.0) / std::max(1, layers_here);
          const double earlier_layers = (stashes ? slot_w_extra * earlier : 0) +
                                        (acts[i].seq == k - 1 ? slot_kv_held * earlier : 0);
          peak_bytes =
              std::max(peak_bytes, mem_bytes + earlier_layers + chunk_transient(acts[i].seq));
          if (acts[i].seq == k - 1) mem_bytes += slot_kv_held;
          if (acts[i].seq == 0) mem_bytes -= slot_kv_held;
        }
        // Full recomputation drops each F's activations but not the K/V cache the microbatch's
        // later chunks attend to: held from chunk 0's F until chunk k−1's F is done.
        const double slot_kv_cache = stage_kv_cache * layer_frac;
        if (kind == ActionKind::kF && acts[i].seq == 0) mem_bytes += slot_kv_cache;
        if (kind == ActionKind::kB) mem_bytes += slot_w_extra;
        if (kind == ActionKind::kW) mem_bytes -= slot_w_extra;
        const double units = internal::ActivationUnits(*l, r, acts[i]);
        mem += units;
        mem_bytes += units * stage_act;
        peak = std::max(peak, mem);
        peak_bytes = std::max(peak_bytes, mem_bytes);
        if (kind == ActionKind::kF && acts[i].seq == k - 1) mem_bytes -= slot_kv_cache;
      }
      st.last_end = std::max(st.last_end, t.end);
      res.makespan = std::max(res.makespan, t.end);
    }
    st.peak_activation_microbatches = std::round(peak * 1e6) / 1e6;
    for (int g : l->group_of[r]) st.layers += l->group_layers[g];
    double params = st.layers * layer_params;
    double vocab_act = 0;
    if (l->sharded) {
      const double shard_rows = vocab_rows / (l->p * tp);
      params += shard_rows * h * (ms.tie_embeddings ? 1 : 2);
      // The shard's n×V/(p·t) fp32 buffer lives from S to T; T hands it to the next S, so at
      // most max_pending_t are alive at once. Plus X and ∇X (the rank's n/t rows of h) of the
      // microbatch in flight.
      vocab_act = in.max_pending_t * chunk_tokens * shard_rows * 4 + 2 * chunk_tokens / tp * h * 4;
    } else {
      if (l->owner_rank[0] == r) params += vocab_rows * h;
      if (l->x_owner() == r && (!ms.tie_embeddings || l->owner_rank[0] != r)) {
        params += vocab_rows * h;
        vocab_act = chunk_tokens * vocab_rows * 4 + 2 * chunk_tokens * h * 4;
      }
    }
    if (l->owner_rank[0] == r && !ms.llama) params += s * h;  // GPT-2's position embedding
    if (l->x_owner() == r) params += ms.llama ? h : 2 * h;    // final norm (RMSNorm: no bias)
    st.parameter_bytes = static_cast<int64_t>(params * 4);
    // AdamW's m and v (8 bytes a parameter) are split over the replicas under ZeRO-1.
    const int d = std::max(1, ms.data_parallel);
    const double optimizer_bytes = ms.zero && d > 1 ? 8.0 * std::ceil(params / d) : 8.0 * params;
    st.state_bytes =
        static_cast<int64_t>(params * (ms.state_bytes_per_param - 8) + optimizer_bytes);
    if (d > 1) {
      // A ring all-reduce (or reduce-scatter + all-gather: the same bytes) of fp32 gradients.
      const double calls = 2.0 * (d - 1);
      auto ring = [&](double bytes) {
        return calls * in.costs.allreduce.latency +
               (in.costs.allreduce.bandwidth > 0 ? calls / d * bytes / in.costs.allreduce.bandwidth
                                                 : 0);
      };
      // GRAD_SYNC(c) starts when its chunk's last weight pass is done and the data link is
      // free, and overlaps whatever the rank computes after it; OPT waits for the link, then
      // sums the rest (the vocabulary shards and the small tensors) before the update.
      double link = 0, opt_start = st.last_end, synced = 0;
      for (size_t i = 0; i < acts.size(); ++i) {
        if (IsDataSync(acts[i].kind)) {
          const double bytes = 4.0 * l->group_layers[l->group_of[r][acts[i].chunk]] * layer_params;
          link = std::max(link, res.times[r][i].start) + ring(bytes);
          synced += bytes;
        } else if (acts[i].kind == ActionKind::kOpt) {
          opt_start = res.times[r][i].start;
        }
      }
      const double exposed =
          std::max(0.0, link - opt_start) + ring(std::max(0.0, 4.0 * params - synced));
      data_end = std::max(data_end, st.last_end + exposed);
    }
    st.peak_activation_bytes = static_cast<int64_t>(peak_bytes + vocab_act);
    busy_total += st.busy;
    res.ranks.push_back(st);
  }
  res.bubble_ratio = res.makespan > 0 ? 1 - busy_total / (l->p * res.makespan) : 0;
  res.data_parallel_seconds = std::max(0.0, data_end - res.makespan);
  res.step_time = res.makespan + res.data_parallel_seconds;
  res.data_parallel = std::max(1, ms.data_parallel);
  res.zero = ms.zero;
  if (h > 0) {
    res.model_flops = l->m * (l->layers * 3 * ms.LayerForwardFlops() +
                              flops::OutputLayer(b, s, h, vocab_rows) + flops::InputLayer(b, s, h));
  }
  // One replica's pipeline runs on p·t devices.
  if (ms.peak_flops > 0 && res.step_time > 0)
    res.mfu = res.model_flops / (res.step_time * l->p * tp * ms.peak_flops);
  res.tensor_parallel = tp;
  return res;
}

}  // namespace vp::planner
