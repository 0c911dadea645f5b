// BuildPlan: context and placement, the dispatch to one schedule family's generator, the
// vocabulary passes, lowering and validation (docs/planner.md). Each stage is its own file;
// generator.h lists them.
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"
#include "coordinator/planner/internal.h"
#include "coordinator/planner/planner.h"

namespace vp::planner {
namespace internal {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", rule));
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

}  // namespace

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
  for (const LinkCost* link : {&k.p2p, &k.broadcast, &k.allreduce}) {
    if (!(link->latency >= 0) || !(link->bandwidth >= 0))
      return Invalid("costs", "link latency and bandwidth must be >= 0 (bandwidth 0: free)");
  }
  if (in.comm_lanes != 1 && in.comm_lanes != 2)
    return Invalid("comm_lanes", "must be 1 (one communication thread per rank) or 2");
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
  // Its communication: one transfer and the two barriers (C1, and C2 or C1's share again).
  c.delay =
      c.d * ((k.f + k.b + k.w) / l.k + vs * (k.s + k.t) / l.k +
             CommSeconds(l, in, ActionKind::kSendAct, 0) + CommSeconds(l, in, ActionKind::kC1, 0) +
             CommSeconds(l, in, l.barrier == 2 ? ActionKind::kC2 : ActionKind::kC1, 0));
  return c;
}

namespace {

// The transformer timeline of the requested schedule.
absl::StatusOr<Timeline> TransformerSchedule(const Ctx& c, int extra_warmup) {
  std::vector<RankGen> gens;
  if (AlignedInterlaced(c)) {
    ListScheduler scheduler(c);
    return scheduler.Run(InterlacedOrders(c));
  }
  switch (c.in.schedule) {
    case Schedule::k1F1B:
    case Schedule::kInterleaved:
    case Schedule::kSeq1F1B:
    case Schedule::kSeq1F1BInterleaved:
      gens = OneFOneBFamilyOrders(c, extra_warmup);
      break;
    case Schedule::kVHalf:
    case Schedule::kVMin:
      return VShapeBuildingBlockSchedule(c);
    case Schedule::kZBH1:
      gens = ZBH1Orders(c);
      break;
    case Schedule::kZBV:
      gens = ZBVOrders(c);
      break;
  }
  ListScheduler scheduler(c);
  return scheduler.Run(std::move(gens));
}

}  // namespace
}  // namespace internal

namespace {

using internal::Ctx;
using internal::Interleaved;
using internal::Timeline;

// Builds and lowers; the caller validates (BuildPlan) or validates while timing
// (BuildAndSimulate), so that a plan runs through the abstract machine once.
absl::StatusOr<Plan> BuildUnvalidated(const PlannerInput& in) {
  absl::StatusOr<Ctx> c = internal::MakeContext(in);
  if (!c.ok()) return c.status();
  absl::StatusOr<Timeline> base = internal::TransformerSchedule(*c, 0);
  // Interleaved orders with a partial last block of microbatches (m % p != 0) may need more
  // warm-up forwards than Megatron's formula (which assumes full blocks): take the smallest
  // extra warm-up that gives a runnable order.
  for (int extra = 1;
       !base.ok() && Interleaved(in.schedule) && extra <= in.microbatches * c->v * in.seq_chunks;
       ++extra)
    base = internal::TransformerSchedule(*c, extra);
  if (!base.ok()) return base.status();
  std::vector<std::vector<Action>> orders = internal::AddVocabularyPasses(*c, *base);
  absl::StatusOr<std::vector<RankPlan>> ranks = internal::Lower(*c, orders);
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

absl::Status CheckCancelled(const PlannerInput& in) {
  if (in.cancel != nullptr && in.cancel->load(std::memory_order_relaxed)) {
    return absl::CancelledError("planner: stopped before it finished (its deadline passed)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> BuildPlan(const PlannerInput& in) {
  if (absl::Status st = CheckCancelled(in); !st.ok()) return st;
  absl::StatusOr<Plan> plan = BuildUnvalidated(in);
  if (!plan.ok()) return plan.status();
  if (absl::Status s = ValidatePlan(*plan); !s.ok())
    return absl::InternalError(absl::StrCat("generated plan failed validation: ", s.message()));
  return plan;
}

absl::StatusOr<SimulatedPlan> BuildAndSimulate(const PlannerInput& in) {
  if (absl::Status st = CheckCancelled(in); !st.ok()) return st;
  absl::StatusOr<Plan> plan = BuildUnvalidated(in);
  if (!plan.ok()) return plan.status();
  if (absl::Status st = CheckCancelled(in); !st.ok()) return st;
  absl::StatusOr<SimResult> sim = Simulate(*plan, in);
  if (!sim.ok())
    return absl::InternalError(
        absl::StrCat("generated plan failed validation: ", sim.status().message()));
  return SimulatedPlan{std::move(*plan), std::move(*sim)};
}

}  // namespace vp::planner
