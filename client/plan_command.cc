// `vocabpipe plan job.yaml [overrides] [--format table|json|text|svg]`: builds, validates and
// simulates a plan offline (no daemon). See docs/planner.md.
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/commands.h"
#include "coordinator/planner/layout.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/spec_input.h"
#include "proto/spec/job_spec.h"

namespace vp::cli {
namespace {

constexpr char kUsage[] =
    "usage: vocabpipe plan job.yaml [--pipeline P] [--microbatches M] [--schedule S|auto]\n"
    "         [--vocab V|auto] [--seq-chunks K] [--chunks-per-rank V] [--budget BYTES]\n"
    "         [--costs F=1,B=2,W=1,S=0,T=0,IF=0,IB=0,comm=0,coll=0,opt=0,\n"
    "                  p2p_lat=0,p2p_bw=0,bcast_lat=0,bcast_bw=0,ar_lat=0,ar_bw=0]\n"
    "         [--plan PLAN.txt] [--format table|json|text|svg] [--explain]\n"
    "  --costs: seconds per pass (F B W S T IF IB opt), fixed seconds per transfer (comm) and\n"
    "           per collective (coll), and the link model of one call: latency seconds (*_lat)\n"
    "           and bytes per second (*_bw, 0 = size is free) of a send/recv (p2p), a\n"
    "           broadcast (bcast) and an all-reduce (ar) between the job's ranks.\n"
    "  --plan:  simulate this plan (text form, e.g. a run's plan.txt) instead of building one.\n"
    "  --explain: with parallel.world, every layout the planner weighed (d, t, p, recompute,\n"
    "           schedule, predicted step time, tokens/s, peak bytes a rank, why refused).\n";

int Usage(std::ostream& err, absl::string_view why) {
  err << "vocabpipe plan: " << why << "\n" << kUsage;
  return 2;
}

// Parses "F=1,B=2,..." onto costs; keys not given keep their value.
bool ParseCosts(absl::string_view text, planner::Costs* c, std::string* error) {
  std::map<std::string, double*> keys = {{"F", &c->f},
                                         {"B", &c->b},
                                         {"W", &c->w},
                                         {"S", &c->s},
                                         {"T", &c->t},
                                         {"IF", &c->input_f},
                                         {"IB", &c->input_b},
                                         {"comm", &c->comm},
                                         {"coll", &c->collective},
                                         {"opt", &c->opt},
                                         {"p2p_lat", &c->p2p.latency},
                                         {"p2p_bw", &c->p2p.bandwidth},
                                         {"bcast_lat", &c->broadcast.latency},
                                         {"bcast_bw", &c->broadcast.bandwidth},
                                         {"ar_lat", &c->allreduce.latency},
                                         {"ar_bw", &c->allreduce.bandwidth}};
  bool comm_set = false, coll_set = false;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, '=');
    double v = 0;
    auto it = kv.size() == 2 ? keys.find(std::string(kv[0])) : keys.end();
    if (it == keys.end() || !absl::SimpleAtod(kv[1], &v) || v < 0) {
      *error = absl::StrCat(
          "--costs: bad item '", item,
          "' (KEY=non-negative number; keys F B W S T IF IB comm coll opt p2p_lat p2p_bw "
          "bcast_lat bcast_bw ar_lat ar_bw)");
      return false;
    }
    *it->second = v;
    comm_set |= kv[0] == "comm";
    coll_set |= kv[0] == "coll";
  }
  if (comm_set && !coll_set) c->collective = c->comm;
  return true;
}

// The plan and its simulation in `format` (table|json|text|svg); the table starts with the
// automatic choice's candidates when there were any.
void WritePlan(const std::string& format, const planner::Plan& plan, const planner::SimResult& sim,
               const std::string& candidates, std::ostream& out) {
  if (format == "json") {
    out << planner::RenderJson(plan, sim);
  } else if (format == "text") {
    out << planner::PlanToText(plan);
  } else if (format == "svg") {
    out << planner::RenderSvg(plan, sim);
  } else {
    if (!candidates.empty())
      out << "candidates (fitting first, by predicted step time):\n" << candidates << "\n";
    out << planner::RenderTable(plan, sim);
  }
}

// --plan: times a plan that was built before (a run's plan.txt) with the job's shape and the
// given costs; it must be a plan of this job (same pipeline, microbatches, layers).
int SimulateGivenPlan(const std::string& plan_path, const planner::PlannerInput& in,
                      const std::string& format, std::ostream& out, std::ostream& err) {
  std::ifstream f(plan_path);
  if (!f) return Usage(err, absl::StrCat("--plan: cannot read ", plan_path));
  std::stringstream text;
  text << f.rdbuf();
  absl::StatusOr<planner::Plan> plan = planner::PlanFromText(text.str());
  if (!plan.ok()) {
    err << "vocabpipe plan: --plan: " << plan.status().message() << "\n";
    return 2;
  }
  if (plan->pipeline != in.pipeline || plan->microbatches != in.microbatches ||
      plan->layers != in.layers) {
    err << "vocabpipe plan: --plan: the plan is for pipeline " << plan->pipeline << ", "
        << plan->microbatches << " microbatches, " << plan->layers << " layers; the job has "
        << in.pipeline << ", " << in.microbatches << ", " << in.layers
        << " (rule: a plan of this job)\n";
    return 2;
  }
  planner::PlannerInput sim_in = in;
  sim_in.seq_chunks = plan->seq_chunks;
  absl::StatusOr<planner::SimResult> sim = planner::Simulate(*plan, sim_in);
  if (!sim.ok()) {
    err << "vocabpipe plan: --plan: " << sim.status().message() << "\n";
    return 1;
  }
  WritePlan(format, *plan, *sim, "", out);
  return 0;
}

}  // namespace

int RunPlanCommand(const Args& args, std::ostream& out, std::ostream& err) {
  std::string path, format = "table", costs_text, plan_path;
  std::map<std::string, std::string> flags;
  bool explain = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out << kUsage;
      return 0;
    }
    if (a == "--explain") {
      explain = true;
      continue;
    }
    if (a.rfind("--", 0) == 0) {
      if (i + 1 >= args.size()) return Usage(err, absl::StrCat(a, " needs a value"));
      flags[a] = args[++i];
    } else if (path.empty()) {
      path = a;
    } else {
      return Usage(err, absl::StrCat("unexpected argument '", a, "'"));
    }
  }
  if (path.empty()) return Usage(err, "missing job file");
  absl::StatusOr<vocabpipe::v1::JobSpec> spec = spec::LoadJobSpecFile(path);
  if (!spec.ok()) {
    err << "vocabpipe plan: " << spec.status().message() << "\n";
    return 2;
  }
  std::string layout_text;
  if (planner::NeedsLayoutChoice(*spec)) {
    // parallel.world: the layout first (FLOP-proportional costs at 1e12 FLOP/s, the device's
    // default link, the planner's activation estimates), then the chosen one is planned below.
    if (auto it = flags.find("--budget"); it != flags.end()) {
      int64_t b = 0;
      if (!absl::SimpleAtoi(it->second, &b) || b < 0)
        return Usage(err, "--budget: need bytes >= 0");
      spec->mutable_parallel()->set_memory_budget_bytes(b);
    }
    planner::LayoutOptions lo;
    lo.link = planner::DefaultLink(spec->device());
    absl::StatusOr<planner::ResolvedLayout> layout = planner::ResolveLayout(*spec, lo);
    if (!layout.ok()) {
      err << "vocabpipe plan: " << layout.status().message() << "\n";
      return 2;
    }
    layout_text = absl::StrCat("layout: ", planner::LayoutName(layout->chosen), " of ",
                               layout->candidates.size(), " candidates for ",
                               spec->parallel().world(), " ranks\n");
    if (explain) absl::StrAppend(&layout_text, planner::LayoutTable(*layout), "\n");
    *spec = layout->spec;
  }
  planner::PlannerInput in = planner::PlannerInputFromSpec(*spec);
  const auto& par = spec->parallel();
  std::string schedule = par.schedule(), vocab = par.vocab();
  int64_t budget = par.memory_budget_bytes();
  for (const auto& [flag, value] : flags) {
    int v = 0;
    auto need_int = [&](int* dst, int lo) {
      if (!absl::SimpleAtoi(value, &v) || v < lo) return false;
      *dst = v;
      return true;
    };
    if (flag == "--pipeline") {
      if (!need_int(&in.pipeline, 1)) return Usage(err, "--pipeline: need an integer >= 1");
    } else if (flag == "--microbatches") {
      if (!need_int(&in.microbatches, 1)) return Usage(err, "--microbatches: need an integer >= 1");
    } else if (flag == "--seq-chunks") {
      if (!need_int(&in.seq_chunks, 1)) return Usage(err, "--seq-chunks: need an integer >= 1");
    } else if (flag == "--chunks-per-rank") {
      if (!need_int(&in.chunks_per_rank, 1))
        return Usage(err, "--chunks-per-rank: need an integer >= 1");
    } else if (flag == "--schedule") {
      schedule = value;
    } else if (flag == "--vocab") {
      vocab = value;
    } else if (flag == "--costs") {
      costs_text = value;
    } else if (flag == "--plan") {
      plan_path = value;
    } else if (flag == "--format") {
      format = value;
    } else if (flag == "--budget") {
      if (!absl::SimpleAtoi(value, &budget) || budget < 0)
        return Usage(err, "--budget: need bytes >= 0");
    } else {
      return Usage(err, absl::StrCat("unknown flag ", flag));
    }
  }
  if (format != "table" && format != "json" && format != "text" && format != "svg")
    return Usage(err, "--format: expected table|json|text|svg");
  // Default costs: FLOP-proportional seconds at a 1e12 FLOP/s peak, so the predicted MFU is
  // the plan's (bubble-limited) MFU at peak speed; with --costs the units are the user's and
  // MFU is left out.
  in.costs = planner::FlopProportionalCosts(in.pipeline, in.layers, in.model, 1e12);
  if (!layout_text.empty()) {
    // The chosen layout is timed as the choice timed it: with the device's default link.
    const planner::LinkCost link = planner::DefaultLink(spec->device());
    in.costs = planner::FlopProportionalCosts(in.pipeline, in.layers, in.model, 1e12, link);
    in.costs.p2p = in.costs.broadcast = in.costs.allreduce = link;
  }
  if (costs_text.empty()) in.model.peak_flops = 1e12;
  std::string cost_error;
  if (!costs_text.empty() && !ParseCosts(costs_text, &in.costs, &cost_error))
    return Usage(err, cost_error);
  if (!plan_path.empty()) return SimulateGivenPlan(plan_path, in, format, out, err);
  const bool schedule_auto = schedule == "auto", vocab_auto = vocab == "auto";
  if (!schedule_auto) {
    absl::StatusOr<planner::Schedule> s = planner::ParseSchedule(schedule);
    if (!s.ok()) return Usage(err, s.status().message());
    in.schedule = *s;
  }
  if (!vocab_auto) {
    absl::StatusOr<planner::VocabMethod> v = planner::ParseVocab(vocab);
    if (!v.ok()) return Usage(err, v.status().message());
    in.vocab = *v;
  }
  std::string explanation;
  const bool seq_chunks_auto = in.seq_chunks == 0;  // parallel.seq_chunks: auto
  if (schedule_auto || vocab_auto || seq_chunks_auto) {
    absl::StatusOr<planner::AutoChoice> choice =
        planner::ChoosePlan(in, schedule_auto, vocab_auto, budget, seq_chunks_auto);
    if (!choice.ok()) {
      err << "vocabpipe plan: " << choice.status().message() << "\n";
      return 2;
    }
    in = choice->chosen;
    explanation = planner::CandidatesTable(*choice);
  }
  absl::StatusOr<planner::SimulatedPlan> built = planner::BuildAndSimulate(in);
  if (!built.ok()) {
    err << "vocabpipe plan: " << built.status().message() << "\n";
    return built.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (format == "table") out << layout_text;
  WritePlan(format, built->plan, built->sim, explanation, out);
  return 0;
}

}  // namespace vp::cli
