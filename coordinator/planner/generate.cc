// Generators: placement, compute orders per schedule, vocabulary passes, lowering into
// compute + communication (docs/planner.md).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/internal.h"
#include "coordinator/planner/planner.h"

namespace vp::planner {
namespace {

using internal::Layout;
constexpr double kInf = std::numeric_limits<double>::infinity();

absl::Status Invalid(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", rule));
}

struct Ctx {
  PlannerInput in;
  Layout l;
  int v = 1;         // chunks per rank
  int d = 0;         // barrier intervals inserted between the last group's F and B
  double delay = 0;  // the same in time, for timed generators
  bool split_w = false;
};

bool VShape(Schedule s) {
  return s == Schedule::kVHalf || s == Schedule::kVMin || s == Schedule::kZBV;
}
bool Interleaved(Schedule s) {
  return s == Schedule::kInterleaved || s == Schedule::kSeq1F1BInterleaved;
}
bool SeqSchedule(Schedule s) {
  return s == Schedule::kSeq1F1B || s == Schedule::kSeq1F1BInterleaved;
}

// Redis: layers per rank minimising the slowest stage (input layer on the owner of group 0,
// the whole output layer on the last rank), at least `v` layers per rank.
std::vector<int> RedisLayers(const PlannerInput& in, int v) {
  const int p = in.pipeline;
  const double per_layer = (in.costs.f + in.costs.b + in.costs.w) * p / in.layers;
  std::vector<double> extra(p, 0);
  extra[0] += in.costs.input_f + in.costs.input_b;
  extra[p - 1] += p * (in.costs.s + in.costs.t);
  std::vector<int> n(p, v);
  for (int left = in.layers - p * v; left > 0; --left) {
    int best = 0;
    for (int r = 1; r < p; ++r)
      if ((n[r] + 1) * per_layer + extra[r] < (n[best] + 1) * per_layer + extra[best]) best = r;
    ++n[best];
  }
  return n;
}

absl::StatusOr<Ctx> MakeContext(const PlannerInput& in) {
  Ctx c;
  c.in = in;
  Layout& l = c.l;
  const int p = in.pipeline, m = in.microbatches;
  if (p < 1) return Invalid("parallel.pipeline", "must be >= 1");
  if (m < 1) return Invalid("parallel.microbatches", "must be >= 1");
  if (in.layers < 1) return Invalid("model.layers", "must be >= 1");
  if (in.seq_chunks < 1) return Invalid("parallel.seq_chunks", "must be >= 1");
  if (in.seq_chunks > 1 && !SeqSchedule(in.schedule))
    return Invalid("parallel.seq_chunks",
                   "k > 1 needs schedule seq1f1b or seq1f1b-interleaved (rule: only Seq1F1B "
                   "schedules pipeline sequence chunks)");
  if (in.max_pending_t < 1) return Invalid("parallel.max_pending_t", "must be >= 1");
  const Costs& k = in.costs;
  if (!(k.f > 0) || !(k.b > 0) || k.w < 0 || k.s < 0 || k.t < 0 || k.input_f < 0 || k.input_b < 0 ||
      k.comm < 0 || k.collective < 0 || k.opt < 0)
    return Invalid("costs", "F and B must be > 0, every other cost >= 0");
  c.v = VShape(in.schedule) ? 2 : Interleaved(in.schedule) ? in.chunks_per_rank : 1;
  if (c.v < 1 || c.v > 64) return Invalid("parallel.chunks_per_rank", "must be in [1, 64]");
  const int groups = p * c.v;
  if (in.layers < groups)
    return Invalid("model.layers", absl::StrCat(in.layers, " layers cannot fill ", groups,
                                                " layer groups (pipeline ", p, " x ", c.v,
                                                " chunks per rank); every group needs >= 1 layer"));
  c.split_w = in.schedule == Schedule::kVHalf || in.schedule == Schedule::kVMin ||
              in.schedule == Schedule::kZBH1 || in.schedule == Schedule::kZBV;
  l.p = p;
  l.m = m;
  l.k = in.seq_chunks;
  l.layers = in.layers;
  l.groups = groups;
  switch (in.vocab) {
    case VocabMethod::kBaseline:
    case VocabMethod::kRedis:
      l.sharded = false;
      l.barrier = 0;
      c.d = 0;
      break;
    case VocabMethod::kVocab2:
      l.sharded = true;
      l.barrier = 1;
      c.d = 1;
      break;
    case VocabMethod::kVocab1:
      l.sharded = true;
      l.barrier = 2;
      c.d = 2;
      break;
    case VocabMethod::kInterlaced:
      l.sharded = true;
      l.barrier = 2;
      c.d = p / 2 + 1;
      break;
  }
  // Placement: group of (rank, chunk).
  l.group_of.assign(p, std::vector<int>(c.v));
  for (int r = 0; r < p; ++r)
    for (int ch = 0; ch < c.v; ++ch)
      l.group_of[r][ch] = VShape(in.schedule) ? (ch == 0 ? r : 2 * p - 1 - r) : ch * p + r;
  l.owner_rank.assign(groups, 0);
  l.owner_chunk.assign(groups, 0);
  for (int r = 0; r < p; ++r)
    for (int ch = 0; ch < c.v; ++ch) {
      l.owner_rank[l.group_of[r][ch]] = r;
      l.owner_chunk[l.group_of[r][ch]] = ch;
    }
  l.group_layers.assign(groups, 0);
  if (in.vocab == VocabMethod::kRedis) {
    const std::vector<int> per_rank = RedisLayers(in, c.v);
    for (int r = 0; r < p; ++r)
      for (int ch = 0; ch < c.v; ++ch)
        l.group_layers[l.group_of[r][ch]] = per_rank[r] / c.v + (ch < per_rank[r] % c.v ? 1 : 0);
  } else {
    if (in.layers % groups != 0)
      return Invalid("model.layers",
                     absl::StrCat(in.layers, " layers do not split evenly into ", groups,
                                  " layer groups (pipeline x chunks per rank); use vocab redis "
                                  "or a divisible layer count"));
    l.group_layers.assign(groups, in.layers / groups);
  }
  absl::StatusOr<std::vector<int>> bounds = PartitionSequence(in.model, in.layers, l.k);
  if (!bounds.ok()) return bounds.status();
  const double total = bounds->back();
  for (int q = 0; q < l.k; ++q) {
    l.seq_mem_share.push_back(((*bounds)[q + 1] - (*bounds)[q]) / total);
    l.seq_cost_share.push_back(1.0 / l.k);
  }
  // One barrier interval: what a rank does for one microbatch (transformer + vocabulary).
  const double vs = l.sharded ? 1.0 : p;
  c.delay = c.d * ((k.f + k.b + k.w) / l.k + vs * (k.s + k.t) / l.k + k.comm + 2 * k.collective);
  return c;
}

Action Make(ActionKind kind, int mb, int chunk = 0, int seq = 0) {
  Action a;
  a.kind = kind;
  a.mb = mb;
  a.chunk = static_cast<int16_t>(chunk);
  a.seq = static_cast<int16_t>(seq);
  return a;
}

// ---------------------------------------------------------------------------------------------
// Timed engine: list-schedules per-rank streams of transformer passes. Static schedules give
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

class Engine {
 public:
  explicit Engine(const Ctx& c) : c_(c), l_(c.l) {
    const size_t n = static_cast<size_t>(l_.groups) * l_.m * l_.k;
    fend_.assign(n, kInf);
    bend_.assign(n, kInf);
  }
  absl::StatusOr<std::vector<std::vector<Timed>>> Run(std::vector<RankGen> gens);

 private:
  absl::StatusOr<std::vector<std::vector<Timed>>> RunFixed(std::vector<RankGen> gens);
  size_t Idx(int g, int mb, int q) const { return (static_cast<size_t>(g) * l_.m + mb) * l_.k + q; }
  double Comm(int r, int g) const { return l_.owner_rank[g] != r ? c_.in.costs.comm : 0; }
  double Ready(int r, const Action& a) const {
    const int g = l_.group_of[r][a.chunk];
    double t = 0;
    if (a.kind == ActionKind::kF) {
      if (g > 0) t = fend_[Idx(g - 1, a.mb, a.seq)] + Comm(r, g - 1);
      if (a.seq > 0) t = std::max(t, fend_[Idx(g, a.mb, a.seq - 1)]);
    } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
      t = fend_[Idx(g, a.mb, a.seq)];
      if (g == l_.groups - 1) {
        t += c_.delay;
      } else {
        t = std::max(t, bend_[Idx(g + 1, a.mb, a.seq)] + Comm(r, g + 1));
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

  const Ctx& c_;
  const Layout& l_;
  std::vector<double> fend_, bend_;
};

// Fixed orders (one stream per rank, nothing greedy): a pass starts at max(rank free, inputs
// ready), whatever order the ranks are visited in, so a worklist that wakes the ranks waiting
// on a finished pass gives the same times as the global scan below in O(passes).
absl::StatusOr<std::vector<std::vector<Timed>>> Engine::RunFixed(std::vector<RankGen> gens) {
  const int p = l_.p;
  std::vector<std::vector<Timed>> out(p);
  std::vector<double> free(p, 0);
  std::vector<int> work;
  std::vector<char> queued(p, 1);
  for (int r = p - 1; r >= 0; --r) work.push_back(r);
  auto wake = [&](int r) {
    if (!queued[r]) {
      queued[r] = 1;
      work.push_back(r);
    }
  };
  while (!work.empty()) {
    const int r = work.back();
    work.pop_back();
    queued[r] = 0;
    Stream& st = gens[r].streams[0];
    while (st.next < st.acts.size()) {
      const Action& a = st.acts[st.next];
      const double ready = Ready(r, a);
      if (ready == kInf) break;
      const double start = std::max(free[r], ready);
      const double end = start + internal::ActionCost(l_, c_.in.costs, r, a);
      free[r] = end;
      const int g = l_.group_of[r][a.chunk];
      if (a.kind == ActionKind::kF) {
        fend_[Idx(g, a.mb, a.seq)] = end;
        if (g + 1 < l_.groups) wake(l_.owner_rank[g + 1]);
      } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
        bend_[Idx(g, a.mb, a.seq)] = end;
        if (g > 0) wake(l_.owner_rank[g - 1]);
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

absl::StatusOr<std::vector<std::vector<Timed>>> Engine::Run(std::vector<RankGen> gens) {
  const int p = l_.p;
  bool fixed = true;
  for (const RankGen& g : gens) fixed = fixed && !g.greedy && g.streams.size() == 1;
  if (fixed) return RunFixed(std::move(gens));
  std::vector<std::vector<Timed>> out(p);
  std::vector<double> free(p, 0);
  const Costs& costs = c_.in.costs;
  for (;;) {
    int best_r = -1;
    double best_t = kInf;
    Action best_a;
    int best_stream = -1;  // -1 = W queue
    bool any_left = false;
    for (int r = 0; r < p; ++r) {
      RankGen& rg = gens[r];
      double t0 = free[r];
      int pick = -2;
      double pick_t = kInf;
      double early_t = kInf;
      int early = -2;
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
      if (pick == -2) {
        if (!rg.wq.empty() && (rg.greedy || mem_blocked)) {
          pick = -1;
          pick_t = t0;
        } else if (early >= 0) {
          pick = early;
          pick_t = early_t;
        } else if (!rg.wq.empty()) {
          pick = -1;
          pick_t = t0;
        }
      }
      if (pick == -2) continue;
      if (pick_t < best_t) {
        best_t = pick_t;
        best_r = r;
        best_stream = pick;
        best_a = pick == -1 ? rg.wq.front() : rg.streams[pick].acts[rg.streams[pick].next];
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
    if (best_stream == -1) {
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

// Warm-up forwards, then one forward and one backward alternately, then the remaining
// backwards (1F1B, interleaved, Seq1F1B, Seq1F1B-I).
std::vector<Action> WarmupThenAlternate(const std::vector<Action>& fwd,
                                        const std::vector<Action>& bwd, int warmup) {
  std::vector<Action> out;
  const size_t w = std::min<size_t>(std::max(warmup, 0), fwd.size());
  size_t i = 0, j = 0;
  while (i < w) out.push_back(fwd[i++]);
  while (i < fwd.size()) {
    out.push_back(fwd[i++]);
    if (j < bwd.size()) out.push_back(bwd[j++]);
  }
  while (j < bwd.size()) out.push_back(bwd[j++]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// V-Half and V-Min by the building-block method (controllable-memory zero-bubble paper).
//
// Legend: p stages (ranks), m microbatches, s a stage, i a microbatch, d vocabulary barrier
// intervals, M the activation cap in chunk units (one chunk's activations for one
// microbatch = 1). Pass letters on one stage: F chunk-0 forward, f chunk-1 forward,
// B chunk-1 backward (it runs first: chunk 1 holds the last layer group), b chunk-0 backward,
// W a weight pass.
//
// Every microbatch repeats one block: on stage s its F, f, B, b sit at fixed offsets, and
// microbatch i adds 6i (one block holds F f B b and the two W). The offsets set the memory:
// a microbatch's chunks live from F to W, so peak ≈ lifespan / 6 blocks (V-Half (p+2)/2
// microbatches, V-Min (p+4)/3). Repeating the block leaves idle slots in the warm-up and the
// cool-down; squeezing moves each of those passes to the earliest free slot its dependencies
// allow, as long as the stage never holds more than M. The steady state keeps the block.
// All slots are unit time; the real costs are applied afterwards by the list scheduler that
// runs the per-stage slot orders.

enum class Pass : uint8_t { kF, kf, kB, kb, kW0, kW1 };  // kW0: W of chunk 0, kW1: of chunk 1

struct SlotGrid {
  int p = 1, m = 1, d = 0;
  // slot[s][pass][i] for pass in F f B b W0 W1.
  std::vector<std::array<std::vector<int64_t>, 6>> slot;
  std::vector<std::vector<char>> used;  // [s][slot]
  std::vector<std::vector<int>> mem;    // [s][slot]: chunks held after the slot's pass

  void Take(int s, int64_t t) {
    if (t >= static_cast<int64_t>(used[s].size())) used[s].resize(t + 64, 0);
    used[s][t] = 1;
  }
  void Free(int s, int64_t t) { used[s][t] = 0; }
  bool IsFree(int s, int64_t t) const {
    return t >= static_cast<int64_t>(used[s].size()) || !used[s][t];
  }
  int64_t NextFree(int s, int64_t t) const {
    while (!IsFree(s, t)) ++t;
    return t;
  }
};

// Block offsets of stage s (F, f, B, b). The extra gap keeps the four passes of different
// microbatches off each other's slots modulo 6 (p even for V-Half, p divisible by 3 for
// V-Min); every barrier interval moves the backward passes one block later.
std::array<int64_t, 4> BlockOffsets(Schedule sched, int p, int s, int d) {
  if (sched == Schedule::kVMin) {
    const int gap = (p % 3 == 0 ? 2 : 0) + 6 * d;
    return {s, 2 * p - 1 - s, 2 * p + gap + s, 4 * p + gap - 1 - s};
  }
  const int gap = (p % 2 == 0 ? 3 : 0) + 6 * d;
  return {2 * s, 3 * p - 2 - s, 3 * p - 1 + 2 * s + gap, 6 * p - 2 - s + gap};
}

// W passes into the first free slots after their backward, oldest first. Only the W passes
// now later than `after` move (all of them for after = -1); their slots must be free.
void PlaceWeightPasses(SlotGrid& g, int s, int64_t after = -1) {
  auto& sl = g.slot[s];
  struct Done {
    int64_t t;
    int pass;
    int i;
  };
  std::vector<Done> backs;
  for (int i = 0; i < g.m; ++i) {
    if (sl[5].empty() || sl[5][i] > after) backs.push_back({sl[2][i], 5, i});  // B -> W1
    if (sl[4].empty() || sl[4][i] > after) backs.push_back({sl[3][i], 4, i});  // b -> W0
  }
  std::sort(backs.begin(), backs.end(), [](const Done& a, const Done& b) { return a.t < b.t; });
  sl[4].resize(g.m, 0);
  sl[5].resize(g.m, 0);
  int64_t t = 0;
  for (const Done& x : backs) {
    t = g.NextFree(s, std::max(t, x.t + 1));
    sl[x.pass][x.i] = t;
    g.Take(s, t);
  }
}

// Chunks held after each slot (F and f add one, W0 and W1 free one).
void ComputeMemory(SlotGrid& g, int s) {
  std::vector<int>& mem = g.mem[s];
  mem.assign(g.used[s].size() + 1, 0);
  for (int pass : {0, 1, 4, 5})
    for (int64_t t : g.slot[s][pass]) mem[t] += pass < 2 ? 1 : -1;
  for (size_t t = 1; t < mem.size(); ++t) mem[t] += mem[t - 1];
}

// Per-stage pass order: the passes by slot (slots are distinct on a stage).
std::vector<std::vector<Action>> SlotOrders(const SlotGrid& g) {
  std::vector<std::vector<Action>> orders(g.p);
  constexpr ActionKind kKind[6] = {ActionKind::kF, ActionKind::kF, ActionKind::kB,
                                   ActionKind::kB, ActionKind::kW, ActionKind::kW};
  constexpr int kChunk[6] = {0, 1, 1, 0, 0, 1};
  for (int s = 0; s < g.p; ++s) {
    std::vector<int> at(g.used[s].size(), -1);  // pass * m + i at each slot
    for (int pass = 0; pass < 6; ++pass)
      for (int i = 0; i < g.m; ++i) at[g.slot[s][pass][i]] = pass * g.m + i;
    orders[s].reserve(6 * g.m);
    for (int x : at)
      if (x >= 0) orders[s].push_back(Make(kKind[x / g.m], x % g.m, kChunk[x / g.m]));
  }
  return orders;
}

std::vector<std::vector<std::vector<Action>>> BuildingBlockOrders(const Ctx& c) {
  const int p = c.l.p, m = c.l.m, d = c.d;
  const Schedule sched = c.in.schedule;
  SlotGrid g;
  g.p = p;
  g.m = m;
  g.d = d;
  g.slot.resize(p);
  g.used.resize(p);
  g.mem.resize(p);
  for (int s = 0; s < p; ++s) {
    const std::array<int64_t, 4> off = BlockOffsets(sched, p, s, d);
    for (int pass = 0; pass < 4; ++pass)
      for (int i = 0; i < m; ++i) {
        const int64_t t = g.NextFree(s, off[pass] + 6LL * i);
        g.slot[s][pass].push_back(t);
        g.Take(s, t);
      }
    PlaceWeightPasses(g, s);
    ComputeMemory(g, s);
  }
  int cap = 0;
  for (int s = 0; s < p; ++s)
    cap = std::max(cap, *std::max_element(g.mem[s].begin(), g.mem[s].end()));

  // Squeeze, in global slot order so that every dependency is already final. Warm-up: before
  // stage 0 finishes microbatch 0 (its b); cool-down: after stage 0 starts the last F.
  const int64_t warm_end = g.slot[0][3][0];
  const int64_t cool_begin = g.slot[0][0][m - 1];
  struct Item {
    int64_t t;
    int s, pass, i;
  };
  std::vector<Item> items;
  // Only warm-up and cool-down passes move (the steady state is most of a long plan).
  for (int s = 0; s < p; ++s)
    for (int pass = 0; pass < 6; ++pass)
      for (int i = 0; i < m; ++i)
        if (const int64_t t = g.slot[s][pass][i]; t < warm_end || t > cool_begin)
          items.push_back({t, s, pass, i});
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return std::tie(a.t, a.s, a.pass, a.i) < std::tie(b.t, b.s, b.pass, b.i);
  });
  for (const Item& it : items) {
    auto& sl = g.slot[it.s];
    const int s = it.s, i = it.i;
    int64_t dep = -1;  // the pass must start after this slot
    switch (it.pass) {
      case 0:
        if (s > 0) dep = g.slot[s - 1][0][i];
        break;
      case 1:
        dep = s + 1 < p ? g.slot[s + 1][1][i] : sl[0][i];
        break;
      case 2:  // the loss (and d barrier blocks) sits between f and B on stage 0
        dep = s > 0 ? g.slot[s - 1][2][i] : sl[1][i] + 6LL * d;
        break;
      case 3:
        dep = s + 1 < p ? g.slot[s + 1][3][i] : sl[2][i];
        dep = std::max(dep, sl[2][i]);
        break;
      case 4:
        dep = sl[3][i];
        break;
      case 5:
        dep = sl[2][i];
        break;
    }
    if (i > 0) dep = std::max(dep, sl[it.pass][i - 1]);
    const int64_t now = sl[it.pass][i];
    const bool adds = it.pass < 2;
    int64_t best = now;
    int running_max = 0;  // max memory over [t, now) while scanning t downwards
    // Scan downwards to know the memory maximum of every candidate range, keep the earliest.
    for (int64_t t = now - 1; t > dep; --t) {
      running_max = std::max(running_max, g.mem[s][t]);
      if (adds && running_max + 1 > cap) break;
      if (g.IsFree(s, t)) best = t;
    }
    if (best == now) continue;
    g.Free(s, now);
    g.Take(s, best);
    sl[it.pass][i] = best;
    const int delta = adds ? 1 : (it.pass >= 4 ? -1 : 0);
    if (delta != 0)
      for (int64_t t = best; t < now; ++t) g.mem[s][t] += delta;
  }

  // Second squeeze of the cool-down with W passes lifted out: there the backward passes are
  // on the critical path and W can wait, so B and b may take the slots W held; the lifted W
  // passes are then placed again. Two variants (lift the cool-down's W, or every W), kept
  // when no stage rises above the cap; the caller times every candidate and keeps the best.
  std::vector<SlotGrid> candidates = {g};
  for (int64_t lift_after : {cool_begin, int64_t{-1}}) {
    SlotGrid h = g;
    for (int s = 0; s < p; ++s)
      for (int pass : {4, 5})
        for (int64_t t : h.slot[s][pass])
          if (t > lift_after) h.Free(s, t);
    std::vector<Item> backs;
    for (int s = 0; s < p; ++s)
      for (int pass : {2, 3})
        for (int i = 0; i < m; ++i)
          if (h.slot[s][pass][i] > cool_begin) backs.push_back({h.slot[s][pass][i], s, pass, i});
    std::sort(backs.begin(), backs.end(), [](const Item& a, const Item& b) {
      return std::tie(a.t, a.s, a.pass, a.i) < std::tie(b.t, b.s, b.pass, b.i);
    });
    for (const Item& it : backs) {
      auto& sl = h.slot[it.s];
      const int s = it.s, i = it.i;
      int64_t dep;
      if (it.pass == 2) {
        dep = s > 0 ? h.slot[s - 1][2][i] : sl[1][i] + 6LL * d;
      } else {
        dep = std::max(s + 1 < p ? h.slot[s + 1][3][i] : sl[2][i], sl[2][i]);
      }
      if (i > 0) dep = std::max(dep, sl[it.pass][i - 1]);
      const int64_t now = sl[it.pass][i];
      int64_t best = now;
      for (int64_t t = now - 1; t > dep; --t)
        if (h.IsFree(s, t)) best = t;
      if (best == now) continue;
      h.Free(s, now);
      h.Take(s, best);
      sl[it.pass][i] = best;
    }
    bool fits = true;
    for (int s = 0; s < p && fits; ++s) {
      PlaceWeightPasses(h, s, lift_after);
      ComputeMemory(h, s);
      fits = *std::max_element(h.mem[s].begin(), h.mem[s].end()) <= cap;
    }
    if (fits) candidates.push_back(std::move(h));
  }

  std::vector<std::vector<std::vector<Action>>> result;
  for (const SlotGrid& cand : candidates) result.push_back(SlotOrders(cand));
  return result;
}

absl::StatusOr<std::vector<std::vector<Timed>>> TransformerSchedule(const Ctx& c,
                                                                    int extra_warmup) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, k = l.k, v = c.v, d = c.d;
  std::vector<RankGen> gens(p);
  const Schedule s = c.in.schedule;
  if (s == Schedule::k1F1B || s == Schedule::kSeq1F1B || Interleaved(s)) {
    for (int r = 0; r < p; ++r) {
      std::vector<Action> fwd, bwd;
      for (int start = 0; start < m; start += p) {  // blocks of p microbatches
        const int end = std::min(m, start + p);
        for (int ch = 0; ch < v; ++ch)
          for (int mb = start; mb < end; ++mb)
            for (int q = 0; q < k; ++q) fwd.push_back(Make(ActionKind::kF, mb, ch, q));
        for (int ch = v - 1; ch >= 0; --ch)
          for (int mb = start; mb < end; ++mb)
            for (int q = k - 1; q >= 0; --q) bwd.push_back(Make(ActionKind::kBW, mb, ch, q));
      }
      // Seq1F1B warm-up p-r-2+k (0-based r) is 1F1B's p-r-1 for k = 1; interleaving adds
      // (v-1) blocks of chunk-0 units and one more forward per rank of distance.
      const int b0 = std::min(p, m);
      int w = (v - 1) * b0 * k + (v > 1 ? 2 : 1) * (p - r - 1) + k - 1 + d + extra_warmup;
      gens[r].streams.push_back({WarmupThenAlternate(fwd, bwd, w), 0, false});
    }
  } else if (s == Schedule::kVHalf || s == Schedule::kVMin) {
    // Time every squeezed candidate with the real costs; keep the shortest.
    absl::StatusOr<std::vector<std::vector<Timed>>> best;
    double best_span = kInf;
    for (std::vector<std::vector<Action>>& orders : BuildingBlockOrders(c)) {
      std::vector<RankGen> one(p);
      for (int r = 0; r < p; ++r) one[r].streams.push_back({std::move(orders[r]), 0, false});
      Engine engine(c);
      absl::StatusOr<std::vector<std::vector<Timed>>> run = engine.Run(std::move(one));
      if (!run.ok()) return run.status();
      double span = 0;
      for (const auto& rank : *run)
        if (!rank.empty()) span = std::max(span, rank.back().end);
      if (span < best_span) {
        best_span = span;
        best = std::move(run);
      }
    }
    return best;
  } else if (s == Schedule::kZBH1) {
    // ZB-H1 (zero-bubble paper, handcrafted): 1F1B's F/B order, and rank r runs W(i) right
    // after B(i + r). Deferring r weight passes fills the cool-down bubble that 1F1B leaves
    // on early ranks, while the activations held stay at p (+ barriers): rank r holds
    // p - r (+ d) forwards like 1F1B plus the r whose W waits.
    for (int r = 0; r < p; ++r) {
      std::vector<Action> fwd, bwd;
      for (int mb = 0; mb < m; ++mb) {
        fwd.push_back(Make(ActionKind::kF, mb));
        bwd.push_back(Make(ActionKind::kB, mb));
      }
      Stream st;
      for (const Action& a : WarmupThenAlternate(fwd, bwd, p - r - 1 + d)) {
        st.acts.push_back(a);
        if (a.kind == ActionKind::kB && a.mb - r >= 0)
          st.acts.push_back(Make(ActionKind::kW, a.mb - r));
      }
      for (int mb = std::max(0, m - r); mb < m; ++mb) st.acts.push_back(Make(ActionKind::kW, mb));
      gens[r].streams.push_back(std::move(st));
    }
  } else {  // ZB-V
    for (int r = 0; r < p; ++r) {
      RankGen& g = gens[r];
      g.greedy = true;
      g.cap =
          (p + d) * std::max(1e-9, internal::ActivationUnits(l, r, Make(ActionKind::kF, 0)) +
                                       internal::ActivationUnits(l, r, Make(ActionKind::kF, 0, 1)));
      Stream b1, b0, f1, f0;
      f1.forward = f0.forward = true;
      for (int mb = 0; mb < m; ++mb) {
        b1.acts.push_back(Make(ActionKind::kB, mb, 1));
        b0.acts.push_back(Make(ActionKind::kB, mb, 0));
        f1.acts.push_back(Make(ActionKind::kF, mb, 1));
        f0.acts.push_back(Make(ActionKind::kF, mb, 0));
      }
      g.streams = {std::move(b1), std::move(b0), std::move(f1), std::move(f0)};
    }
  }
  Engine engine(c);
  return engine.Run(std::move(gens));
}

// ---------------------------------------------------------------------------------------------
// Vocabulary passes: S, T, IF, IB placed by the base timeline; OPT last.

std::vector<std::vector<Action>> AddVocabularyPasses(const Ctx& c,
                                                     const std::vector<std::vector<Timed>>& base) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, k = l.k, units = m * k;
  const int G = l.groups;
  std::vector<const Timed*> fl(units), bl(units), ff(m), bf(m);
  for (int r = 0; r < p; ++r)
    for (const Timed& t : base[r]) {
      const int g = l.group_of[r][t.a.chunk];
      const int u = t.a.mb * k + t.a.seq;
      if (g == G - 1 && t.a.kind == ActionKind::kF) fl[u] = &t;
      if (g == G - 1 && (t.a.kind == ActionKind::kB || t.a.kind == ActionKind::kBW)) bl[u] = &t;
      if (g == 0 && t.a.kind == ActionKind::kF && t.a.seq == 0) ff[t.a.mb] = &t;
      if (g == 0 && (t.a.kind == ActionKind::kB || t.a.kind == ActionKind::kBW) && t.a.seq == 0)
        bf[t.a.mb] = &t;
    }
  struct Extra {
    double target;
    int family;
    int64_t key;
    Action a;
  };
  std::vector<Extra> extras;  // the same for every rank (sharded) or for one rank
  const bool interlaced = c.in.vocab == VocabMethod::kInterlaced;
  const int mp = c.in.max_pending_t;
  for (int u = 0; u < units; ++u) {
    const int mb = u / k, q = u % k;
    const double s_t = fl[u]->end;
    extras.push_back({s_t, 1, 2LL * u + 1, Make(ActionKind::kS, mb, 0, q)});
    double t_t;
    int64_t t_key;
    if (!l.sharded || interlaced) {
      t_t = s_t;
      t_key = 2LL * u + 2;
    } else {
      t_t = u + mp < units ? fl[u + mp]->end : kInf;
      t_key = 2LL * (u + mp);
      if (l.barrier == 2) t_t = std::min(t_t, bl[u]->start);
    }
    extras.push_back({t_t, 1, t_key, Make(ActionKind::kT, mb, 0, q)});
  }
  std::vector<Extra> input;
  for (int mb = 0; mb < m; ++mb) {
    input.push_back({ff[std::max(mb - 1, 0)]->start, 0, mb, Make(ActionKind::kIF, mb)});
    input.push_back({bf[mb]->end, 2, mb, Make(ActionKind::kIB, mb)});
  }
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    std::vector<std::pair<size_t, const Extra*>> mine;
    auto add = [&](const std::vector<Extra>& xs) {
      for (const Extra& e : xs) {
        auto it = std::lower_bound(base[r].begin(), base[r].end(), e.target,
                                   [](const Timed& t, double v) { return t.start < v; });
        mine.push_back({static_cast<size_t>(it - base[r].begin()), &e});
      }
    };
    if (l.sharded || r == l.x_owner()) add(extras);
    if (l.sharded || r == l.owner_rank[0]) add(input);
    std::stable_sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first < b.first;
      if (a.second->target != b.second->target) return a.second->target < b.second->target;
      if (a.second->family != b.second->family) return a.second->family < b.second->family;
      return a.second->key < b.second->key;
    });
    size_t e = 0;
    for (size_t i = 0; i <= base[r].size(); ++i) {
      while (e < mine.size() && mine[e].first == i) out[r].push_back(mine[e++].second->a);
      if (i < base[r].size()) out[r].push_back(base[r][i].a);
    }
    out[r].push_back(Make(ActionKind::kOpt, -1));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Lowering: an event simulation of the compute orders places every transfer and collective.
// Events are emitted in one global order (time, then creation); each transfer or collective
// is appended to all participants' lists at the same point of that order, so every rank's
// list is a projection of one global sequence: no deadlock under blocking sends, and one
// collective sequence for all ranks.

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

  struct Ev {
    double t;
    int64_t seq;
    int type;  // 0 compute, 1 transfer, 2 collective
    int r;     // compute rank / sender
    Action a;  // compute action / sender's SEND / collective
    int peer;
    Action recv;
    bool operator>(const Ev& o) const { return t != o.t ? t > o.t : seq > o.seq; }
  };
  std::priority_queue<Ev, std::vector<Ev>, std::greater<Ev>> q;
  int64_t seq = 0;

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
    q.push({t, seq++, 0, r, a, -1, {}});
  };
  auto collective = [&](double t, ActionKind kind, int mb, int qq) {
    q.push({t, seq++, 2, -1, Make(kind, mb, 0, qq), -1, {}});
  };
  for (int r = 0; r < p; ++r) try_rank(r);
  while (!q.empty()) {
    Ev ev = q.top();
    q.pop();
    if (ev.type == 0) {
      const int r = ev.r;
      const Action& a = ev.a;
      const double end = ev.t + internal::ActionCost(l, costs, r, a);
      lane[r] = end;
      out[r].actions.push_back(a);
      ++next[r];
      pending[r] = 0;
      const int u = a.mb * k + a.seq;
      if (a.kind == ActionKind::kF) {
        const int g = l.group_of[r][a.chunk];
        if (g + 1 < G && l.owner_rank[g + 1] != r) {
          Action s = Make(ActionKind::kSendAct, a.mb, a.chunk, a.seq);
          s.peer = static_cast<int16_t>(l.owner_rank[g + 1]);
          Action rv = Make(ActionKind::kRecvAct, a.mb, l.owner_chunk[g + 1], a.seq);
          rv.peer = static_cast<int16_t>(r);
          q.push({end, seq++, 1, r, s, l.owner_rank[g + 1], rv});
        }
        if (g == G - 1 && l.sharded) collective(end, ActionKind::kBcastX, a.mb, a.seq);
      } else if (a.kind == ActionKind::kB || a.kind == ActionKind::kBW) {
        const int g = l.group_of[r][a.chunk];
        if (g > 0 && l.owner_rank[g - 1] != r) {
          Action s = Make(ActionKind::kSendGrad, a.mb, a.chunk, a.seq);
          s.peer = static_cast<int16_t>(l.owner_rank[g - 1]);
          Action rv = Make(ActionKind::kRecvGrad, a.mb, l.owner_chunk[g - 1], a.seq);
          rv.peer = static_cast<int16_t>(r);
          q.push({end, seq++, 1, r, s, l.owner_rank[g - 1], rv});
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
    } else if (ev.type == 1) {
      out[ev.r].actions.push_back(ev.a);
      out[ev.peer].actions.push_back(ev.recv);
      const int g = l.group_of[ev.peer][ev.recv.chunk];
      (ev.a.kind == ActionKind::kSendAct ? act_in : grad_in)[idx(g, ev.a.mb, ev.a.seq)] =
          ev.t + costs.comm;
      try_rank(ev.peer);
    } else {
      const double start = std::max(ev.t, coll_free);
      const double end = start + costs.collective;
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

}  // namespace

namespace {

// Builds and lowers; the caller validates (BuildPlan) or validates while timing
// (BuildAndSimulate), so that a plan runs through the abstract machine once.
absl::StatusOr<Plan> BuildUnvalidated(const PlannerInput& in) {
  absl::StatusOr<Ctx> c = MakeContext(in);
  if (!c.ok()) return c.status();
  absl::StatusOr<std::vector<std::vector<Timed>>> base = TransformerSchedule(*c, 0);
  // Interleaved orders with a partial last block of microbatches (m % p != 0) may need more
  // warm-up forwards than Megatron's formula (which assumes full blocks): take the smallest
  // extra warm-up that gives a runnable order.
  for (int extra = 1;
       !base.ok() && Interleaved(in.schedule) && extra <= in.microbatches * c->v * in.seq_chunks;
       ++extra)
    base = TransformerSchedule(*c, extra);
  if (!base.ok()) return base.status();
  std::vector<std::vector<Action>> orders = AddVocabularyPasses(*c, *base);
  absl::StatusOr<std::vector<RankPlan>> ranks = Lower(*c, orders);
  if (!ranks.ok()) return ranks.status();
  Plan plan;
  plan.schedule = std::string(ScheduleName(in.schedule));
  plan.vocab = std::string(VocabName(in.vocab));
  plan.pipeline = in.pipeline;
  plan.microbatches = in.microbatches;
  plan.seq_chunks = in.seq_chunks;
  plan.layers = in.layers;
  absl::StatusOr<std::vector<int>> bounds = PartitionSequence(in.model, in.layers, in.seq_chunks);
  if (!bounds.ok()) return bounds.status();
  plan.seq_bounds = *bounds;
  plan.x_owner = c->l.x_owner();
  plan.vocab_sharded = c->l.sharded;
  plan.barrier = c->l.barrier;
  plan.ranks = std::move(*ranks);
  int first = 0;
  std::vector<int> first_of(c->l.groups);
  for (int g = 0; g < c->l.groups; ++g) {
    first_of[g] = first;
    first += c->l.group_layers[g];
  }
  for (int r = 0; r < in.pipeline; ++r)
    for (int g : c->l.group_of[r])
      plan.ranks[r].chunks.push_back({g, first_of[g], c->l.group_layers[g]});
  return plan;
}

}  // namespace

absl::StatusOr<Plan> BuildPlan(const PlannerInput& in) {
  absl::StatusOr<Plan> plan = BuildUnvalidated(in);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = ValidatePlan(*plan); !s.ok())
    return absl::InternalError(absl::StrCat("generated plan failed validation: ", s.message()));
  return plan;
}

absl::StatusOr<SimulatedPlan> BuildAndSimulate(const PlannerInput& in) {
  absl::StatusOr<Plan> plan = BuildUnvalidated(in);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<SimResult> sim = Simulate(*plan, in);
  if (!sim.ok())
    return absl::InternalError(
        absl::StrCat("generated plan failed validation: ", sim.status().message()));
  return SimulatedPlan{std::move(*plan), std::move(*sim)};
}

}  // namespace vp::planner
