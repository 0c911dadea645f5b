// Shared by the planner's generator files (not part of the API): the context of one request,
// the list scheduler that times per-rank pass orders, and the stages of BuildPlan:
//   schedule_*.cc   compute orders, one file per schedule family
//   vocab_passes.cc S, T, IF, IB placed on the transformer timeline
//   lower.cc        compute orders -> compute + communication (one pass for every schedule)
//   generate.cc     context, placement, dispatch, BuildPlan
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#pragma once

#include <deque>
#include <limits>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/planner/internal.h"
#include "coordinator/planner/planner.h"
#include "proto/plan/plan.h"

namespace vp::planner::internal {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

struct Ctx {
  PlannerInput in;
  Layout l;
  int v = 1;         // chunks per rank
  int d = 0;         // barrier intervals inserted between the last group's F and B
  double delay = 0;  // the same in time, for timed generators
  bool split_w = false;
};

inline bool VShape(Schedule s) {
  return s == Schedule::kVHalf || s == Schedule::kVMin || s == Schedule::kZBV;
}
inline bool Interleaved(Schedule s) {
  return s == Schedule::kInterleaved || s == Schedule::kSeq1F1BInterleaved;
}
inline bool SeqSchedule(Schedule s) {
  return s == Schedule::kSeq1F1B || s == Schedule::kSeq1F1BInterleaved;
}

absl::StatusOr<Ctx> MakeContext(const PlannerInput& in);

inline Action MakeAction(ActionKind kind, int mb, int chunk = 0, int seq = 0) {
  Action a;
  a.kind = kind;
  a.mb = mb;
  a.chunk = static_cast<int16_t>(chunk);
  a.seq = static_cast<int16_t>(seq);
  return a;
}

// List scheduler: list-schedules per-rank streams of transformer passes. Static schedules give
// each rank one fixed stream; greedy ones (ZB-H1, ZB-V) give several streams in priority order
// plus a FIFO of deferred W passes that fills idle time or frees memory.

struct Stream {
  std::vector<Action> acts;
  size_t next = 0;
  bool forward = false;
};
struct RankGen {
  std::vector<Stream> streams;
  std::deque<Action> wq;
  bool greedy = false;
  double cap = kInf;  // activation cap (microbatch units), greedy only
  double mem = 0;
};
struct Timed {
  Action a;
  double start = 0, end = 0;
};

using Timeline = std::vector<std::vector<Timed>>;  // per rank, passes with their times

class ListScheduler {
 public:
  explicit ListScheduler(const Ctx& c) : c_(c), l_(c.l) {
    const size_t n = static_cast<size_t>(l_.groups) * l_.m * l_.k;
    fend_.assign(n, kInf);
    bend_.assign(n, kInf);
  }
  // Fixed orders may hold the sharded output layer's S and T themselves (the aligned
  // interlaced block); they are timed with its collectives: S after X's broadcast, T after C1
  // (every rank's S), the last group's B after C2 (every rank's T) instead of the fixed
  // barrier delay.
  absl::StatusOr<Timeline> Run(std::vector<RankGen> gens);

 private:
  absl::StatusOr<Timeline> RunFixed(std::vector<RankGen> gens);
  size_t Idx(int g, int mb, int q) const { return (static_cast<size_t>(g) * l_.m + mb) * l_.k + q; }
  // A transfer of sequence chunk q from group g's rank to rank r (0 on the same rank).
  double Comm(int r, int g, int q) const {
    return l_.owner_rank[g] != r ? CommSeconds(l_, c_.in, ActionKind::kSendAct, q) : 0;
  }
  double Ready(int r, const Action& a) const {
    if (a.kind == ActionKind::kS) {
      const double x = fend_[Idx(l_.groups - 1, a.mb, a.seq)];
      return r == l_.x_owner() ? x : x + CommSeconds(l_, c_.in, ActionKind::kBcastX, a.seq);
    }
    if (a.kind == ActionKind::kT) return Barrier(s_, a, ActionKind::kC1);
    const int g = l_.group_of[r][a.chunk];
    double t = 0;
    if (a.kind == ActionKind::kF) {
      if (g > 0) t = fend_[Idx(g - 1, a.mb, a.seq)] + Comm(r, g - 1, a.seq);
      if (a.seq > 0) t = std::max(t, fend_[Idx(g, a.mb, a.seq - 1)]);
    } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
      t = fend_[Idx(g, a.mb, a.seq)];
      if (g == l_.groups - 1) {
        t = output_ ? std::max(t, Barrier(t_, a, ActionKind::kC2)) : t + c_.delay;
      } else {
        t = std::max(t, bend_[Idx(g + 1, a.mb, a.seq)] + Comm(r, g + 1, a.seq));
      }
      if (a.seq + 1 < l_.k) t = std::max(t, bend_[Idx(g, a.mb, a.seq + 1)]);
    } else {
      t = bend_[Idx(g, a.mb, a.seq)];
    }
    return t;
  }
  // Memory charge of a pass in the greedy generators. ZB-V reserves a whole microbatch at the
  // chunk-0 forward so that its chunk-1 forward can always run (no memory deadlock).
  double Charge(int r, const Action& a) const {
    const double u = internal::ActivationUnits(l_, r, a);
    if (VShape(c_.in.schedule) && a.kind == ActionKind::kF) {
      if (a.chunk == 1) return 0;
      Action other = a;
      other.chunk = 1;
      return u + internal::ActivationUnits(l_, r, other);
    }
    return u;
  }

  // S or T of one unit on every rank: how many ran, the last end.
  struct Done {
    std::vector<int> count;
    std::vector<double> last;
  };
  // When the collective `kind` after every rank's pass of `a`'s unit has ended (inf until all
  // ran).
  double Barrier(const Done& d, const Action& a, ActionKind kind) const {
    const size_t u = static_cast<size_t>(a.mb) * l_.k + a.seq;
    return d.count[u] == l_.p ? d.last[u] + CommSeconds(l_, c_.in, kind, a.seq) : kInf;
  }
  // Records an output-layer pass; true when it was the unit's last one (its barrier is up).
  static bool Count(Done& d, size_t u, double end, int p) {
    d.last[u] = std::max(d.last[u], end);
    return ++d.count[u] == p;
  }

  const Ctx& c_;
  const Layout& l_;
  std::vector<double> fend_, bend_;
  bool output_ = false;  // the orders hold S and T
  Done s_, t_;
};

// Warm-up forwards, then one forward and one backward alternately, then the remaining
// backwards.
std::vector<Action> WarmupThenAlternate(const std::vector<Action>& fwd,
                                        const std::vector<Action>& bwd, int warmup);

// Compute orders, one function per schedule family (schedule_*.cc).
std::vector<RankGen> OneFOneBFamilyOrders(const Ctx& c,
                                          int extra_warmup);  // 1F1B, interleaved, Seq1F1B(-I)
absl::StatusOr<Timeline> VShapeBuildingBlockSchedule(const Ctx& c);  // V-Half, V-Min
std::vector<RankGen> ZBH1Orders(const Ctx& c);
std::vector<RankGen> ZBVOrders(const Ctx& c);
// Interlaced 1F1B, the aligned block: S and T are in the orders (schedule_interlaced.cc).
std::vector<RankGen> InterlacedOrders(const Ctx& c);
inline bool AlignedInterlaced(const Ctx& c) {
  return c.in.vocab == VocabMethod::kInterlaced && c.in.schedule == Schedule::k1F1B;
}

// S, T (unless the timeline has them already), IF, IB placed by the transformer timeline; OPT
// last (vocab_passes.cc).
std::vector<std::vector<Action>> AddVocabularyPasses(const Ctx& c, const Timeline& base);

// Compute orders -> per-rank plans with every transfer and collective (lower.cc).
absl::StatusOr<std::vector<RankPlan>> Lower(const Ctx& c,
                                            const std::vector<std::vector<Action>>& orders);

}  // namespace vp::planner::internal
