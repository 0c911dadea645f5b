// The list scheduler: times per-rank pass orders with the real costs (generator.h).
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"
#include "coordinator/planner/internal.h"

namespace vp::planner::internal {
namespace {

// A rank's pick in the greedy scan: a stream index, or one of these.
constexpr int kFromWQueue = -1;  // the oldest deferred W
constexpr int kNoPick = -2;      // nothing can run on this rank now

}  // namespace

// Fixed orders (one stream per rank, nothing greedy): a pass starts at max(rank free, inputs
// ready), whatever order the ranks are visited in, so a worklist that wakes the ranks waiting
// on a finished pass gives the same times as the global scan below in O(passes).
absl::StatusOr<Timeline> ListScheduler::RunFixed(std::vector<RankGen> gens) {
  const int p = l_.p;
  Timeline out(p);
  std::vector<double> free(p, 0);
  for (const RankGen& g : gens)
    for (const Action& a : g.streams[0].acts) output_ = output_ || a.kind == ActionKind::kS;
  if (output_) {
    const size_t units = static_cast<size_t>(l_.m) * l_.k;
    s_ = t_ = Done{std::vector<int>(units, 0), std::vector<double>(units, 0)};
  }
  RankWorklist work(p);
  auto wake_all = [&] {
    for (int q = 0; q < p; ++q) work.Wake(q);
  };
  while (!work.empty()) {
    const int r = work.Pop();
    Stream& st = gens[r].streams[0];
    while (st.next < st.acts.size()) {
      const Action& a = st.acts[st.next];
      const double ready = Ready(r, a);
      if (ready == kInf) break;
      const double start = std::max(free[r], ready);
      const double end = start + internal::ActionCost(l_, c_.in.costs, r, a);
      free[r] = end;
      const int g = l_.group_of[r][a.chunk];
      const size_t u = static_cast<size_t>(a.mb) * l_.k + a.seq;
      if (a.kind == ActionKind::kS) {
        if (Count(s_, u, end, p)) wake_all();
      } else if (a.kind == ActionKind::kT) {
        if (Count(t_, u, end, p)) work.Wake(l_.x_owner());
      } else if (a.kind == ActionKind::kF) {
        fend_[Idx(g, a.mb, a.seq)] = end;
        if (g + 1 < l_.groups) work.Wake(l_.owner_rank[g + 1]);
        if (g + 1 == l_.groups && output_) wake_all();
      } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
        bend_[Idx(g, a.mb, a.seq)] = end;
        if (g > 0) work.Wake(l_.owner_rank[g - 1]);
      }
      out[r].push_back({a, start, end});
      ++st.next;
    }
  }
  std::vector<std::string> heads;
  for (int r = 0; r < p; ++r) {
    const Stream& st = gens[r].streams[0];
    if (st.next < st.acts.size())
      heads.push_back(absl::StrCat("rank ", r, " ", ToString(st.acts[st.next])));
  }
  if (!heads.empty())
    return absl::InternalError(
        absl::StrCat("schedule generator ", ScheduleName(c_.in.schedule),
                     " produced an order that cannot run; waiting: ", absl::StrJoin(heads, ", ")));
  return out;
}

absl::StatusOr<Timeline> ListScheduler::Run(std::vector<RankGen> gens) {
  const int p = l_.p;
  bool fixed = true;
  for (const RankGen& g : gens) fixed = fixed && !g.greedy && g.streams.size() == 1;
  if (fixed) return RunFixed(std::move(gens));
  Timeline out(p);
  std::vector<double> free(p, 0);
  const Costs& costs = c_.in.costs;
  for (;;) {
    int best_r = -1;
    double best_t = kInf;
    Action best_a;
    int best_stream = kFromWQueue;
    bool any_left = false;
    for (int r = 0; r < p; ++r) {
      RankGen& rg = gens[r];
      double t0 = free[r];
      int pick = kNoPick;
      double pick_t = kInf;
      double early_t = kInf;
      int early = kNoPick;
      bool mem_blocked = false;
      bool left = !rg.wq.empty();
      for (size_t s = 0; s < rg.streams.size(); ++s) {
        const Stream& st = rg.streams[s];
        if (st.next >= st.acts.size()) continue;
        left = true;
        const Action& x = st.acts[st.next];
        if (rg.greedy && st.forward && rg.mem + Charge(r, x) > rg.cap + 1e-9) {
          mem_blocked = true;
          continue;
        }
        const double rx = Ready(r, x);
        if (rx <= t0) {
          pick = static_cast<int>(s);
          pick_t = t0;
          break;
        }
        if (rx < early_t) {
          early_t = rx;
          early = static_cast<int>(s);
        }
      }
      if (!left) continue;
      any_left = true;
      if (pick == kNoPick) {
        if (!rg.wq.empty() && (rg.greedy || mem_blocked)) {
          pick = kFromWQueue;
          pick_t = t0;
        } else if (early >= 0) {
          pick = early;
          pick_t = early_t;
        } else if (!rg.wq.empty()) {
          pick = kFromWQueue;
          pick_t = t0;
        }
      }
      if (pick == kNoPick) continue;
      if (pick_t < best_t) {
        best_t = pick_t;
        best_r = r;
        best_stream = pick;
        best_a = pick == kFromWQueue ? rg.wq.front() : rg.streams[pick].acts[rg.streams[pick].next];
      }
    }
    if (!any_left) break;
    if (best_r < 0) {
      std::vector<std::string> heads;
      for (int r = 0; r < p; ++r)
        for (const Stream& st : gens[r].streams)
          if (st.next < st.acts.size())
            heads.push_back(absl::StrCat("rank ", r, " ", ToString(st.acts[st.next])));
      return absl::InternalError(absl::StrCat(
          "schedule generator ", ScheduleName(c_.in.schedule),
          " produced an order that cannot run; waiting: ", absl::StrJoin(heads, ", ")));
    }
    RankGen& rg = gens[best_r];
    if (best_stream == kFromWQueue) {
      rg.wq.pop_front();
    } else {
      ++rg.streams[best_stream].next;
    }
    const double end = best_t + internal::ActionCost(l_, costs, best_r, best_a);
    free[best_r] = end;
    const int g = l_.group_of[best_r][best_a.chunk];
    if (best_a.kind == ActionKind::kF) fend_[Idx(g, best_a.mb, best_a.seq)] = end;
    if (best_a.kind == ActionKind::kB || best_a.kind == ActionKind::kBW)
      bend_[Idx(g, best_a.mb, best_a.seq)] = end;
    if (best_a.kind == ActionKind::kB && rg.greedy) {
      Action w = best_a;
      w.kind = ActionKind::kW;
      rg.wq.push_back(w);
    }
    rg.mem += Charge(best_r, best_a);
    out[best_r].push_back({best_a, best_t, end});
  }
  return out;
}

}  // namespace vp::planner::internal
