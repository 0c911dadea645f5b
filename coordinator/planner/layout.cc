#include "coordinator/planner/layout.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/spec/job_spec.h"

namespace vp::planner {

namespace {

std::vector<int> Divisors(int n) {
  std::vector<int> out;
  for (int i = 1; i <= n; ++i) {
    if (n % i == 0) out.push_back(i);
  }
  return out;
}

// The whole-model profile's costs for a stage of L/p layers and a V/p-row shard.
Costs StageCosts(const Costs& whole, int p) {
  Costs c = whole;
  for (double* v : {&c.f, &c.b, &c.w, &c.s, &c.t, &c.opt, &c.recompute}) *v /= p;
  return c;
}

std::string FirstLine(absl::string_view text) {
  return std::string(text.substr(0, std::min(text.find('\n'), text.size())));
}

// The plain spec of one layout of `spec`'s world: the axes and mode set, world 0, the step's
// microbatches split over the d replicas (the caller checked they split), and Vocab-2 for a
// tensor group unless Vocab-1 was named (tensor parallelism takes only those two; an auto
// method included).
vocabpipe::v1::JobSpec CandidateSpec(const vocabpipe::v1::JobSpec& spec, int d, int t, int p,
                                     Recompute mode) {
  vocabpipe::v1::JobSpec cand = spec;
  auto* cp = cand.mutable_parallel();
  cp->set_world(0);
  cp->set_data(d);
  cp->set_tensor(t);
  cp->set_pipeline(p);
  cp->set_recompute(std::string(RecomputeName(mode)));
  cp->set_microbatches(spec.parallel().microbatches() / d);
  if (t > 1 && cp->vocab() != "vocab1") cp->set_vocab("vocab2");
  return cand;
}

}  // namespace

LinkCost DefaultLink(const std::string& device) {
  if (device.rfind("cuda", 0) == 0) return {.latency = 20e-6, .bandwidth = 50e9};
  return {.latency = 100e-6, .bandwidth = 1e9};
}

bool NeedsLayoutChoice(const vocabpipe::v1::JobSpec& spec) { return spec.parallel().world() > 0; }

std::string LayoutName(const LayoutCandidate& c) {
  return absl::StrCat("d ", c.data, " x t ", c.tensor, " x p ", c.pipeline, ", ", c.schedule, "/",
                      c.vocab, " k ", c.seq_chunks, ", recompute ", RecomputeName(c.recompute));
}

absl::StatusOr<ResolvedLayout> ResolveLayout(const vocabpipe::v1::JobSpec& spec,
                                             const LayoutOptions& options) {
  const auto& par = spec.parallel();
  const int world = par.world();
  if (world < 1) {
    return absl::InvalidArgumentError("parallel.world: a layout choice needs world >= 1");
  }
  const bool cuda = spec.device().rfind("cuda", 0) == 0;
  std::vector<Recompute> modes;
  if (par.recompute() == "auto") {
    modes = cuda ? std::vector{Recompute::kNone}  // the CUDA engine recomputes nothing yet
                 : std::vector{Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  } else {
    absl::StatusOr<Recompute> r = ParseRecompute(par.recompute());
    if (!r.ok()) return r.status();
    modes = {*r};
  }
  const int64_t budget = par.memory_budget_bytes();
  const int64_t step_tokens =
      static_cast<int64_t>(par.microbatches()) * par.microbatch_size() * spec.model().seq_len();
  ResolvedLayout out;
  for (const int d : Divisors(world)) {
    if (par.data() != 0 && par.data() != d) continue;
    for (const int t : Divisors(world / d)) {
      if (par.tensor() != 0 && par.tensor() != t) continue;
      const int p = world / d / t;
      if (par.pipeline() != 0 && par.pipeline() != p) continue;
      for (const Recompute mode : modes) {
        if (options.cancel != nullptr && options.cancel->load()) {
          return absl::CancelledError("layout choice: cancelled (the planner's deadline passed)");
        }
        LayoutCandidate c{.data = d, .tensor = t, .pipeline = p, .recompute = mode};
        c.schedule = par.schedule();
        c.vocab = par.vocab();
        c.seq_chunks = par.seq_chunks();
        const vocabpipe::v1::JobSpec cand = CandidateSpec(spec, d, t, p, mode);
        if (par.microbatches() % d != 0) {
          c.why = absl::StrCat("the step's ", par.microbatches(),
                               " microbatches do not split over ", d, " replicas");
        } else {
          c.microbatches = par.microbatches() / d;
          if (absl::Status valid = spec::ValidateJobSpec(cand); !valid.ok()) {
            c.why = FirstLine(valid.message());
          }
        }
        if (c.why.empty()) {
          SpecPlanOptions po;
          po.flops_per_second = options.flops_per_second;
          po.activations = options.activations[static_cast<int>(mode)];
          po.cancel = options.cancel;
          Costs stage;
          if (options.whole_model_costs != nullptr) {
            stage = StageCosts(*options.whole_model_costs, p);
            po.measured_costs = &stage;
          } else if (options.link.latency > 0 || options.link.bandwidth > 0) {
            // The passes stay FLOP-proportional (zero entries keep the estimate); the links are
            // the default's.
            stage.f = stage.b = stage.w = 0;
            stage.p2p = stage.broadcast = stage.allreduce = stage.tensor = options.link;
            po.measured_costs = &stage;
          }
          absl::StatusOr<SpecPlan> built = BuildPlanFromSpec(cand, po);
          absl::StatusOr<SimResult> sim =
              built.ok() ? Simulate(built->plan, built->input) : built.status();
          if (!sim.ok()) {
            if (sim.status().code() == absl::StatusCode::kCancelled) return sim.status();
            c.why = FirstLine(sim.status().message());
          } else {
            c.planned = true;
            c.schedule = std::string(ScheduleName(built->input.schedule));
            c.vocab = std::string(VocabName(built->input.vocab));
            c.seq_chunks = built->input.seq_chunks;
            c.step_seconds = sim->step_time;
            c.tokens_per_second = sim->step_time > 0 ? step_tokens / sim->step_time : 0;
            for (const RankStats& r : sim->ranks) {
              c.peak_bytes = std::max(c.peak_bytes, r.state_bytes + r.peak_activation_bytes);
            }
            c.fits = budget <= 0 || c.peak_bytes <= budget;
            if (!c.fits) {
              c.why = absl::StrCat("predicted peak ", c.peak_bytes, " bytes > budget ", budget);
            }
          }
        }
        out.candidates.push_back(std::move(c));
      }
    }
  }
  if (out.candidates.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallel.world: no layout of ", world, " ranks matches the axes given (pipeline ",
        par.pipeline(), ", data ", par.data(), ", tensor ", par.tensor(), "; 0 = auto)"));
  }
  // Rank: fitting by step time, then planned but too big by peak, then refused.
  auto rank_key = [](const LayoutCandidate& c) {
    const int group = c.fits ? 0 : (c.planned ? 1 : 2);
    const double value =
        group == 0 ? c.step_seconds : (group == 1 ? static_cast<double>(c.peak_bytes) : 0);
    return std::pair(group, value);
  };
  std::stable_sort(out.candidates.begin(), out.candidates.end(),
                   [&](const LayoutCandidate& a, const LayoutCandidate& b) {
                     return rank_key(a) < rank_key(b);
                   });
  const LayoutCandidate& top = out.candidates[0];
  if (!top.fits) {
    if (!top.planned) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.world: no layout of ", world,
                                                     " ranks can be planned\n", LayoutTable(out)));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("parallel.memory_budget_bytes: no layout of ", world, " ranks fits ", budget,
                     " bytes per rank; the smallest predicted peak is ", top.peak_bytes, " bytes (",
                     LayoutName(top), ")\n", LayoutTable(out)));
  }
  out.chosen = top;
  out.spec = CandidateSpec(spec, top.data, top.tensor, top.pipeline, top.recompute);
  return out;
}

std::string LayoutTable(const ResolvedLayout& resolved) {
  std::string s = absl::StrFormat("%-4s %3s %3s %3s %-10s %-20s %-7s %2s %12s %12s %14s %s\n",
                                  "rank", "d", "t", "p", "recompute", "schedule", "vocab", "k",
                                  "step_s", "tokens/s", "peak_bytes", "fits");
  int i = 0;
  for (const LayoutCandidate& c : resolved.candidates) {
    ++i;
    if (!c.planned) {
      absl::StrAppendFormat(&s, "%-4s %3d %3d %3d %-10s %-20s %-7s %2d %12s %12s %14s no: %s\n",
                            "-", c.data, c.tensor, c.pipeline, RecomputeName(c.recompute),
                            c.schedule, c.vocab, c.seq_chunks, "-", "-", "-", c.why);
      continue;
    }
    const std::string fits = c.fits ? (i == 1 ? "yes <- chosen" : "yes") : "no: " + c.why;
    absl::StrAppendFormat(&s, "%-4d %3d %3d %3d %-10s %-20s %-7s %2d %12.6g %12.6g %14d %s\n", i,
                          c.data, c.tensor, c.pipeline, RecomputeName(c.recompute), c.schedule,
                          c.vocab, c.seq_chunks, c.step_seconds, c.tokens_per_second, c.peak_bytes,
                          fits);
  }
  return s;
}

}  // namespace vp::planner
