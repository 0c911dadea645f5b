// V-Half and V-Min by the building-block method (controllable-memory zero-bubble paper).
//
// Legend: p stages (ranks), m microbatches, s a stage, i a microbatch, d vocabulary barrier
// intervals, M (`cap`) the activation cap in chunk units (one chunk's activations for one
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
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"

namespace vp::planner::internal {
namespace {

// Index of a pass in SlotGrid::slot[s]: F (kF0), f (kF1), B (kB1), b (kB0), then the W of
// chunk 0 and of chunk 1. Plain enum: it indexes arrays.
enum Pass : int { kF0 = 0, kF1 = 1, kB1 = 2, kB0 = 3, kW0 = 4, kW1 = 5 };

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
    if (sl[kW1].empty() || sl[kW1][i] > after) backs.push_back({sl[kB1][i], kW1, i});  // B -> W1
    if (sl[kW0].empty() || sl[kW0][i] > after) backs.push_back({sl[kB0][i], kW0, i});  // b -> W0
  }
  std::sort(backs.begin(), backs.end(), [](const Done& a, const Done& b) { return a.t < b.t; });
  sl[kW0].resize(g.m, 0);
  sl[kW1].resize(g.m, 0);
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
  for (int pass : {kF0, kF1, kW0, kW1})
    for (int64_t t : g.slot[s][pass]) mem[t] += pass <= kF1 ? 1 : -1;
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
      if (x >= 0) orders[s].push_back(MakeAction(kKind[x / g.m], x % g.m, kChunk[x / g.m]));
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
    for (int pass = kF0; pass <= kB0; ++pass)
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
  const int64_t warm_end = g.slot[0][kB0][0];
  const int64_t cool_begin = g.slot[0][kF0][m - 1];
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
      case kF0:
        if (s > 0) dep = g.slot[s - 1][kF0][i];
        break;
      case kF1:
        dep = s + 1 < p ? g.slot[s + 1][kF1][i] : sl[kF0][i];
        break;
      case kB1:  // the loss (and d barrier blocks) sits between f and B on stage 0
        dep = s > 0 ? g.slot[s - 1][kB1][i] : sl[kF1][i] + 6LL * d;
        break;
      case kB0:
        dep = s + 1 < p ? g.slot[s + 1][kB0][i] : sl[kB1][i];
        dep = std::max(dep, sl[kB1][i]);
        break;
      case kW0:
        dep = sl[kB0][i];
        break;
      case kW1:
        dep = sl[kB1][i];
        break;
    }
    if (i > 0) dep = std::max(dep, sl[it.pass][i - 1]);
    const int64_t now = sl[it.pass][i];
    const bool adds = it.pass <= kF1;
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
    const int delta = adds ? 1 : (it.pass >= kW0 ? -1 : 0);
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
      for (int pass : {kW0, kW1})
        for (int64_t t : h.slot[s][pass])
          if (t > lift_after) h.Free(s, t);
    std::vector<Item> backs;
    for (int s = 0; s < p; ++s)
      for (int pass : {kB1, kB0})
        for (int i = 0; i < m; ++i)
          if (h.slot[s][pass][i] > cool_begin) backs.push_back({h.slot[s][pass][i], s, pass, i});
    std::sort(backs.begin(), backs.end(), [](const Item& a, const Item& b) {
      return std::tie(a.t, a.s, a.pass, a.i) < std::tie(b.t, b.s, b.pass, b.i);
    });
    for (const Item& it : backs) {
      auto& sl = h.slot[it.s];
      const int s = it.s, i = it.i;
      int64_t dep;
      if (it.pass == kB1) {
        dep = s > 0 ? h.slot[s - 1][kB1][i] : sl[kF1][i] + 6LL * d;
      } else {
        dep = std::max(s + 1 < p ? h.slot[s + 1][kB0][i] : sl[kB1][i], sl[kB1][i]);
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

}  // namespace

absl::StatusOr<Timeline> VShapeBuildingBlockSchedule(const Ctx& c) {
  const int p = c.l.p;
  // Time every squeezed candidate with the real costs; keep the shortest.
  absl::StatusOr<Timeline> best;
  double best_span = kInf;
  for (std::vector<std::vector<Action>>& orders : BuildingBlockOrders(c)) {
    std::vector<RankGen> one(p);
    for (int r = 0; r < p; ++r) one[r].streams.push_back({std::move(orders[r]), 0, false});
    ListScheduler scheduler(c);
    absl::StatusOr<Timeline> run = scheduler.Run(std::move(one));
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
}

}  // namespace vp::planner::internal
