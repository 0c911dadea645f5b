// Lowering: compute orders -> compute + communication, one pass for every schedule.
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <array>
#include <cstdint>
#include <queue>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"

namespace vp::planner::internal {

// Lowering: an event simulation of the compute orders places every transfer and collective.
// Events are emitted in one global order (time, then creation); each transfer or collective
// is appended to all participants' lists at the same point of that order, so every rank's
// list is a projection of one global sequence: no deadlock under blocking sends, and one
// collective sequence for all ranks.

namespace {

// What a lowering event does when it comes up in the global order.
enum class EventKind : uint8_t {
  kCompute,     // a rank's next compute action runs
  kTransfer,    // a SEND/RECV pair is appended to both ranks
  kCollective,  // a collective is appended to every rank
};

}  // namespace

absl::StatusOr<std::vector<RankPlan>> Lower(const Ctx& c,
                                            const std::vector<std::vector<Action>>& orders) {
  const Layout& l = c.l;
  const Costs& costs = c.in.costs;
  const int p = l.p, m = l.m, k = l.k, G = l.groups;
  const size_t n = static_cast<size_t>(G) * m * k, units = static_cast<size_t>(m) * k;
  auto idx = [&](int g, int mb, int q) { return (static_cast<size_t>(g) * m + mb) * k + q; };
  std::vector<double> act_in(n, kInf), grad_in(n, kInf);
  std::vector<double> bcast(units, kInf), c1(units, kInf), c2(units, kInf), ifr(m, kInf),
      ibb(m, kInf);
  std::vector<int> cnt_s(units, 0), cnt_t(units, 0), cnt_if(m, 0), cnt_b0(m, 0);
  std::vector<double> max_s(units, 0), max_t(units, 0), max_if(m, 0);
  std::vector<RankPlan> out(p);
  std::vector<size_t> next(p, 0);
  std::vector<double> lane(p, 0);
  std::vector<char> pending(p, 0);
  double coll_free = 0;

  // 32 bytes (the queue moves about a million of them for p = 64, m = 1024): a transfer keeps
  // only the sender's SEND; the receiver and its RECV follow from the layout.
  struct Ev {
    double t;
    uint32_t seq;
    int16_t r;  // compute rank / sender
    EventKind type;
    Action a;  // compute action / sender's SEND / collective
    bool operator>(const Ev& o) const { return t != o.t ? t > o.t : seq > o.seq; }
  };
  static_assert(sizeof(Ev) <= 32);
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> q;
  uint32_t seq = 0;
  for (int r = 0; r < p; ++r) out[r].actions.reserve(2 * orders[r].size());
  // Data parallelism without ZeRO: each model chunk's gradients are summed over the replicas
  // (GRAD_SYNC) as soon as the chunk's last weight pass is done, overlapping the rest of the
  // backward; the vocabulary shards and the other tensors wait for OPT. (ZeRO-1 reduce-scatters
  // the whole buffer at OPT: its ranges are of the whole buffer, not of a chunk.)
  const bool grad_sync = c.in.model.data_parallel > 1 && !c.in.model.zero;
  std::vector<std::vector<size_t>> last_weight(p);  // [r][chunk]: index in orders[r]
  if (grad_sync) {
    for (int r = 0; r < p; ++r) {
      last_weight[r].assign(l.group_of[r].size(), orders[r].size());
      for (size_t i = 0; i < orders[r].size(); ++i) {
        const Action& a = orders[r][i];
        if (a.kind == ActionKind::kW || a.kind == ActionKind::kBW) last_weight[r][a.chunk] = i;
      }
    }
  }

  auto ready_time = [&](int r, const Action& a) -> double {
    double t = lane[r];
    const int u = a.mb * k + a.seq;
    switch (a.kind) {
      case ActionKind::kF: {
        const int g = l.group_of[r][a.chunk];
        if (g == 0 && l.sharded) t = std::max(t, ifr[a.mb]);
        if (g > 0 && l.owner_rank[g - 1] != r) t = std::max(t, act_in[idx(g, a.mb, a.seq)]);
        break;
      }
      case ActionKind::kB:
      case ActionKind::kBW: {
        const int g = l.group_of[r][a.chunk];
        if (g == G - 1 && l.barrier == 1) t = std::max(t, c1[u]);
        if (g == G - 1 && l.barrier == 2) t = std::max(t, c2[u]);
        if (g < G - 1 && l.owner_rank[g + 1] != r) t = std::max(t, grad_in[idx(g, a.mb, a.seq)]);
        break;
      }
      case ActionKind::kS:
        if (l.sharded && r != l.x_owner()) t = std::max(t, bcast[u]);
        break;
      case ActionKind::kT:
        if (l.sharded) t = std::max(t, c1[u]);
        break;
      case ActionKind::kIB:
        if (l.sharded) t = std::max(t, ibb[a.mb]);
        break;
      default:
        break;
    }
    return t;
  };
  auto try_rank = [&](int r) {
    if (pending[r] || next[r] >= orders[r].size()) return;
    const Action& a = orders[r][next[r]];
    const double t = ready_time(r, a);
    if (t == kInf) return;
    pending[r] = 1;
    q.push({t, seq++, static_cast<int16_t>(r), EventKind::kCompute, a});
  };
  auto collective = [&](double t, ActionKind kind, int mb, int qq) {
    q.push({t, seq++, -1, EventKind::kCollective, MakeAction(kind, mb, 0, qq)});
  };
  for (int r = 0; r < p; ++r) try_rank(r);
  while (!q.empty()) {
    Ev ev = q.top();
    q.pop();
    if (ev.type == EventKind::kCompute) {
      const int r = ev.r;
      const Action& a = ev.a;
      const double end = ev.t + internal::ActionCost(l, costs, r, a);
      lane[r] = end;
      out[r].actions.push_back(a);
      if (grad_sync && (a.kind == ActionKind::kW || a.kind == ActionKind::kBW) &&
          last_weight[r][a.chunk] == next[r]) {
        out[r].actions.push_back(MakeAction(ActionKind::kGradSync, 0, a.chunk, 0));
      }
      ++next[r];
      pending[r] = 0;
      const int u = a.mb * k + a.seq;
      if (a.kind == ActionKind::kF) {
        const int g = l.group_of[r][a.chunk];
        if (g + 1 < G && l.owner_rank[g + 1] != r) {
          Action s = MakeAction(ActionKind::kSendAct, a.mb, a.chunk, a.seq);
          s.peer = static_cast<int16_t>(l.owner_rank[g + 1]);
          q.push({end, seq++, static_cast<int16_t>(r), EventKind::kTransfer, s});
        }
        if (g == G - 1 && l.sharded) collective(end, ActionKind::kBcastX, a.mb, a.seq);
      } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
        const int g = l.group_of[r][a.chunk];
        if (g > 0 && l.owner_rank[g - 1] != r) {
          Action s = MakeAction(ActionKind::kSendGrad, a.mb, a.chunk, a.seq);
          s.peer = static_cast<int16_t>(l.owner_rank[g - 1]);
          q.push({end, seq++, static_cast<int16_t>(r), EventKind::kTransfer, s});
        }
        if (g == 0 && l.sharded && ++cnt_b0[a.mb] == k)
          collective(end, ActionKind::kIbBcast, a.mb, 0);
      } else if (l.sharded && a.kind == ActionKind::kS) {
        max_s[u] = std::max(max_s[u], end);
        if (++cnt_s[u] == p) collective(max_s[u], ActionKind::kC1, a.mb, a.seq);
      } else if (l.sharded && a.kind == ActionKind::kT && l.barrier == 2) {
        max_t[u] = std::max(max_t[u], end);
        if (++cnt_t[u] == p) collective(max_t[u], ActionKind::kC2, a.mb, a.seq);
      } else if (l.sharded && a.kind == ActionKind::kIF) {
        max_if[a.mb] = std::max(max_if[a.mb], end);
        if (++cnt_if[a.mb] == p) collective(max_if[a.mb], ActionKind::kIfReduce, a.mb, 0);
      }
      try_rank(r);
    } else if (ev.type == EventKind::kTransfer) {
      const bool act = ev.a.kind == ActionKind::kSendAct;
      const int g = l.group_of[ev.r][ev.a.chunk] + (act ? 1 : -1);  // the receiver's group
      Action recv = MakeAction(act ? ActionKind::kRecvAct : ActionKind::kRecvGrad, ev.a.mb,
                               l.owner_chunk[g], ev.a.seq);
      recv.peer = ev.r;
      out[ev.r].actions.push_back(ev.a);
      out[ev.a.peer].actions.push_back(recv);
      (act ? act_in : grad_in)[idx(g, ev.a.mb, ev.a.seq)] =
          ev.t + CommSeconds(l, c.in, ev.a.kind, ev.a.seq);
      try_rank(ev.a.peer);
    } else {
      const double start = std::max(ev.t, coll_free);
      const double end = start + CommSeconds(l, c.in, ev.a.kind, ev.a.seq);
      coll_free = end;
      const int u = ev.a.mb * k + ev.a.seq;
      switch (ev.a.kind) {
        case ActionKind::kBcastX:
          bcast[u] = end;
          break;
        case ActionKind::kC1:
          c1[u] = end;
          break;
        case ActionKind::kC2:
          c2[u] = end;
          break;
        case ActionKind::kIfReduce:
          ifr[ev.a.mb] = end;
          break;
        default:
          ibb[ev.a.mb] = end;
          break;
      }
      for (int r = 0; r < p; ++r) {
        out[r].actions.push_back(ev.a);
        try_rank(r);
      }
    }
  }
  std::vector<std::string> stuck;
  for (int r = 0; r < p; ++r)
    if (next[r] < orders[r].size())
      stuck.push_back(absl::StrCat("rank ", r, " at ", ToString(orders[r][next[r]])));
  if (!stuck.empty())
    return absl::InternalError(
        absl::StrCat("lowering: compute orders are inconsistent (", ScheduleName(c.in.schedule),
                     " x ", VocabName(c.in.vocab), "); stuck: ", absl::StrJoin(stuck, ", ")));
  return out;
}

}  // namespace vp::planner::internal
