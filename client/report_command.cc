// vocabpipe report RUN_DIR [--out PREFIX]: one self-contained SVG (and an HTML page around it)
// of a pipeline run from its run directory alone (worker/launch/run_dir.h): the loss curve
// (validation loss where metrics.jsonl has it), tokens/s, per-rank busy share and peak memory
// beside the planner's prediction, and the plan's timeline (planner::RenderSvg).
//
// Predictions: memory is the `predicted_memory_total` the run recorded per stage. Busy is a
// share of the step (busy / step time), so the planner's FLOP-proportional simulation of the
// run's own plan.txt is comparable with measured seconds without knowing the machine's speed.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/commands.h"
#include "client/svg_charts.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/spec_input.h"
#include "worker/launch/run_dir.h"

namespace vp::cli {
namespace {

namespace fs = std::filesystem;

constexpr char kUsage[] = "usage: vocabpipe report RUN_DIR [--out PREFIX]\n";

struct StepLine {
  double step = 0, loss = NAN, val_loss = NAN, tokens_per_s = NAN, step_seconds = NAN;
  std::vector<double> busy, seconds, memory, predicted_memory;  // per rank
};

// Numeric field `key` of `j`, NaN when absent; an error (naming the line and the field, never
// the value) when present but not a number.
absl::StatusOr<double> Number(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return NAN;
  if (!it->is_number())
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": must be a number"));
  return it->get<double>();
}

absl::StatusOr<std::vector<StepLine>> ReadMetrics(const std::string& path, int ranks) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": missing (no step has been reported)"));
  std::vector<StepLine> steps;
  int n = 0;
  for (std::string text; std::getline(f, text);) {
    ++n;
    if (text.empty()) continue;
    const std::string where = absl::StrCat(path, ": line ", n);
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    }
    StepLine s;
    double* fields[] = {&s.step, &s.loss, &s.val_loss, &s.tokens_per_s, &s.step_seconds};
    const char* keys[] = {"step", "loss", "val_loss", "tokens_per_s", "step_seconds"};
    for (int k = 0; k < 5; ++k) {
      auto v = Number(j, keys[k], where);
      if (!v.ok()) return v.status();
      *fields[k] = *v;
    }
    if (std::isnan(s.step)) return absl::InvalidArgumentError(absl::StrCat(where, ": no step"));
    auto stages = j.find("stages");
    if (stages != j.end()) {
      if (!stages->is_array() || static_cast<int>(stages->size()) != ranks) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".stages: must be an array of ", ranks,
                         " ranks (the plan's p times parallel.data)"));
      }
      for (int r = 0; r < ranks; ++r) {
        const nlohmann::json& st = (*stages)[r];
        const std::string sw = absl::StrCat(where, ".stages[", r, "]");
        if (!st.is_object()) return absl::InvalidArgumentError(sw + ": must be an object");
        auto busy = Number(st, "busy_seconds", sw);
        auto secs = Number(st, "seconds", sw);
        auto pred = Number(st, "predicted_memory_total", sw);
        if (!busy.ok()) return busy.status();
        if (!secs.ok()) return secs.status();
        if (!pred.ok()) return pred.status();
        double mem = NAN;
        if (auto m = st.find("memory"); m != st.end()) {
          if (!m->is_object()) return absl::InvalidArgumentError(sw + ".memory: must be an object");
          auto total = Number(*m, "total", sw + ".memory");
          if (!total.ok()) return total.status();
          mem = *total;
        }
        s.busy.push_back(*busy);
        s.seconds.push_back(*secs);
        s.memory.push_back(mem);
        s.predicted_memory.push_back(*pred);
      }
    }
    steps.push_back(std::move(s));
  }
  if (steps.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no step lines"));
  return steps;
}

double MiB(double bytes) { return bytes / (1024.0 * 1024.0); }

// Where a measurement and the planner's prediction differ by more than 20%: one line per
// rank and quantity, then the likely reasons read off the run itself. Empty when all agree.
std::vector<std::string> Disagreements(const std::vector<StepLine>& steps,
                                       const std::vector<BarGroup>& busy,
                                       const std::vector<BarGroup>& memory) {
  std::vector<std::string> lines;
  bool busy_low = false, busy_high = false, mem_high = false, mem_low = false;
  auto check = [&](const std::vector<BarGroup>& bars, const char* what, const char* unit, bool* low,
                   bool* high) {
    for (const BarGroup& g : bars) {
      const double m = g.values[0], q = g.values[1];
      if (!(m >= 0) || !(q > 0) || std::abs(m - q) <= 0.2 * q) continue;
      lines.push_back(absl::StrFormat("%s %s: measured %s%s, predicted %s%s (%+.0f%%)", g.label,
                                      what, FormatNumber(m), unit, FormatNumber(q), unit,
                                      100 * (m - q) / q));
      (m < q ? *low : *high) = true;
    }
  };
  check(busy, "busy share", "%", &busy_low, &busy_high);
  check(memory, "peak memory", " MiB", &mem_low, &mem_high);
  if (lines.empty()) return lines;
  lines.insert(lines.begin(), "Measured and predicted differ by more than 20%:");
  const int timed = std::max(0, static_cast<int>(steps.size()) - 1);
  double lo = INFINITY, hi = 0;
  for (size_t i = 1; i < steps.size(); ++i) {
    if (!(steps[i].tokens_per_s > 0)) continue;
    lo = std::min(lo, steps[i].tokens_per_s);
    hi = std::max(hi, steps[i].tokens_per_s);
  }
  if (timed < 20) {
    lines.push_back(absl::StrFormat(
        "why: the run is short (%d timed steps after the first): start-up still weighs on the "
        "steps and the timing has not settled",
        timed));
  }
  if (hi > 0 && hi / lo > 1.5) {
    lines.push_back(absl::StrFormat(
        "why: tokens/s varied %.1fx between steps: other work on the machine slowed some steps",
        hi / lo));
  }
  if (busy_low) {
    lines.push_back(
        "why: ranks computed for less of the step than the plan expects: they waited on "
        "communication, on each other or on the machine; with a small model fixed costs per pass "
        "outweigh the FLOPs the planner's costs are proportional to");
  }
  if (busy_high) {
    lines.push_back(
        "why: some passes cost more than their share of FLOPs (memory-bound kernels on a small "
        "model), so their rank is busier than the FLOP-proportional plan predicts");
  }
  if (mem_high) {
    lines.push_back(
        "why: the measured peak counts the whole process (program, libraries, allocator slack), "
        "the prediction only the training tensors");
  }
  if (mem_low) lines.push_back("why: the planner's memory estimate is conservative for this run");
  return lines;
}

}  // namespace

int RunReportCommand(const Args& args, std::ostream& out, std::ostream& err) {
  std::string dir, prefix;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out << kUsage;
      return 0;
    }
    if (a == "--out") {
      if (i + 1 >= args.size() || args[i + 1].empty()) {
        err << "vocabpipe report: --out needs a path prefix\n" << kUsage;
        return 2;
      }
      prefix = args[++i];
    } else if (!a.empty() && a[0] == '-') {
      err << "vocabpipe report: unknown flag " << a << "\n" << kUsage;
      return 2;
    } else if (dir.empty()) {
      dir = a;
    } else {
      err << "vocabpipe report: more than one run directory given\n" << kUsage;
      return 2;
    }
  }
  if (dir.empty()) {
    err << "vocabpipe report: missing RUN_DIR\n" << kUsage;
    return 2;
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    err << "vocabpipe report: " << dir << ": not a directory\n";
    return 2;
  }
  auto files = launch::ReadRunFiles(dir);
  if (!files.ok()) {
    err << "vocabpipe report: " << dir
        << " is not a pipeline run directory: " << files.status().message() << "\n";
    return 2;
  }
  const planner::Plan& plan = files->plan;
  const int p = plan.pipeline;
  // With d data-parallel replicas the step lines hold d·p ranks (rank = replica + d · stage);
  // the bars show each stage through its replica 0, the rank the plan's rank describes.
  const int d = std::max(1, files->spec.parallel().data());
  auto steps = ReadMetrics(launch::MetricsPath(dir), p * d);
  if (!steps.ok()) {
    err << "vocabpipe report: " << steps.status().message() << "\n";
    return 2;
  }
  // The planner's view of this plan: FLOP-proportional costs for the spec's model.
  auto spec_plan = planner::BuildPlanFromSpec(files->spec);
  absl::StatusOr<planner::SimResult> sim =
      spec_plan.ok() ? planner::Simulate(plan, spec_plan->input)
                     : absl::StatusOr<planner::SimResult>(spec_plan.status());
  if (!sim.ok()) {
    err << "vocabpipe report: " << launch::PlanPath(dir)
        << ": cannot simulate: " << sim.status().message() << "\n";
    return 2;
  }

  // Series over steps.
  Series loss{"loss"}, val{"validation loss", {}, true}, tps{"tokens/s"};
  for (const StepLine& s : *steps) {
    loss.points.push_back({s.step, s.loss});
    if (!std::isnan(s.val_loss)) val.points.push_back({s.step, s.val_loss});
    tps.points.push_back({s.step, s.tokens_per_s});
  }
  // Per-rank bars: the busy share averaged over the steps after the first (warm-up), peak
  // memory as the maximum over steps.
  std::vector<BarGroup> busy_bars, memory_bars;
  const size_t first = steps->size() > 1 ? 1 : 0;
  for (int r = 0; r < p; ++r) {
    const int rank = r * d;  // stage r's replica 0
    double share = 0;
    int counted = 0;
    double mem = -1, pred_mem = -1;
    for (size_t i = 0; i < steps->size(); ++i) {
      const StepLine& s = (*steps)[i];
      if (s.busy.empty()) continue;
      if (std::isfinite(s.memory[rank])) mem = std::max(mem, s.memory[rank]);
      if (std::isfinite(s.predicted_memory[rank]) && s.predicted_memory[rank] > 0)
        pred_mem = std::max(pred_mem, s.predicted_memory[rank]);
      if (i < first || !(s.step_seconds > 0) || !std::isfinite(s.busy[rank])) continue;
      share += s.busy[rank] / s.step_seconds;
      ++counted;
    }
    const double predicted_share = sim->step_time > 0 ? sim->ranks[r].busy / sim->step_time : -1;
    const std::string label = d > 1 ? absl::StrCat("stage ", r) : absl::StrCat("rank ", r);
    busy_bars.push_back({label, {counted ? 100 * share / counted : -1, 100 * predicted_share}});
    memory_bars.push_back({label, {mem >= 0 ? MiB(mem) : -1, pred_mem >= 0 ? MiB(pred_mem) : -1}});
  }

  const std::string title =
      absl::StrFormat("%s: %s x %s, p=%d, m=%d, k=%d, %d steps",
                      fs::path(dir).lexically_normal().filename().string().empty()
                          ? dir
                          : fs::path(dir).lexically_normal().filename().string(),
                      plan.schedule, plan.vocab, p, plan.microbatches, plan.seq_chunks,
                      static_cast<int>(steps->size()));
  std::string body =
      absl::StrFormat("<text x=\"20\" y=\"24\" font-size=\"16\">%s</text>\n", XmlEscape(title));
  double y = 36;
  // The report says itself where its measurements and predictions part, and why.
  const std::vector<std::string> notes = Disagreements(*steps, busy_bars, memory_bars);
  for (size_t i = 0; i < notes.size(); ++i) {
    out << "vocabpipe report: " << notes[i] << "\n";
    // Wrapped at about 150 characters (12 px text on the 1200 px page).
    std::string line;
    std::vector<std::string> rows;
    for (absl::string_view word : absl::StrSplit(notes[i], ' ')) {
      if (!line.empty() && line.size() + 1 + word.size() > 150) {
        rows.push_back(line);
        line = "    ";
      }
      absl::StrAppend(&line, line.empty() || line == "    " ? "" : " ", word);
    }
    rows.push_back(line);
    for (const std::string& row : rows) {
      absl::StrAppendFormat(&body,
                            "<text x=\"20\" y=\"%.0f\" font-size=\"12\" fill=\"%s\" "
                            "xml:space=\"preserve\">%s</text>\n",
                            y + 10, i == 0 ? "#a33" : "#333", XmlEscape(row));
      y += 16;
    }
  }
  if (!notes.empty()) y += 8;
  std::vector<Series> losses = {loss};
  if (!val.points.empty()) losses.push_back(val);
  body += LineChart(y, 260, "Loss", "step", losses);
  y += 270;
  body += LineChart(y, 220, "Throughput (tokens/s)", "step", {tps});
  y += 230;
  body +=
      BarChart(y, 220, "Busy share of the step per rank (%; predicted: the planner's simulation)",
               {"measured", "predicted"}, busy_bars, "%");
  y += 230;
  body += BarChart(y, 220, "Peak memory per rank (MiB; predicted: recorded by the run)",
                   {"measured", "predicted"}, memory_bars, "");
  y += 230;
  body +=
      absl::StrFormat("<text x=\"80\" y=\"%.0f\" font-size=\"13\">Plan timeline</text>\n", y + 14);
  const std::string timeline = planner::RenderSvg(plan, *sim);
  body += EmbedSvg(y + 20, timeline);
  // The timeline's own height attribute.
  double timeline_height = 0;
  if (const size_t at = timeline.find("height=\""); at != std::string::npos)
    timeline_height = std::atof(timeline.c_str() + at + 8);
  y += 20 + timeline_height + 10;
  const std::string svg = SvgDocument(y, title, body);

  if (prefix.empty()) prefix = (fs::path(dir) / "report").string();
  const std::string svg_path = prefix + ".svg", html_path = prefix + ".html";
  for (const auto& [path, text] :
       {std::pair{svg_path, svg}, std::pair{html_path, HtmlPage(title, svg)}}) {
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << text;
      if (!f) {
        err << "vocabpipe report: cannot write " << tmp << "\n";
        return 1;
      }
    }
    fs::rename(tmp, path, ec);
    if (ec) {
      err << "vocabpipe report: cannot write " << path << ": " << ec.message() << "\n";
      return 1;
    }
  }
  out << "wrote " << svg_path << " and " << html_path << "\n";
  return 0;
}

}  // namespace vp::cli
