// Renderers: a text table, JSON, and an SVG timeline like the papers' figures.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/planner/planner.h"

namespace vp::planner {

std::string RenderTable(const Plan& plan, const SimResult& sim) {
  std::string s = absl::StrFormat(
      "schedule %s  vocab %s  pipeline %d  microbatches %d  seq_chunks %d\n"
      "makespan %.6g  bubble_ratio %.2f%%  step_time %.6g  mfu %.2f%%\n",
      plan.schedule, plan.vocab, plan.pipeline, plan.microbatches, plan.seq_chunks, sim.makespan,
      100 * sim.bubble_ratio, sim.step_time, 100 * sim.mfu);
  if (sim.tensor_parallel > 1) {  // the tensor axis: every rank below is t ranks of one stage
    absl::StrAppendFormat(&s,
                          "ranks (d, t, p) = (%d, %d, %d): tensor_parallel %d ranks of every stage "
                          "(bytes per tensor rank)\n",
                          sim.data_parallel, sim.tensor_parallel, plan.pipeline,
                          sim.tensor_parallel);
  }
  if (sim.data_parallel > 1) {  // the data axis: every rank below is one of d replicas
    absl::StrAppendFormat(
        &s, "data_parallel %d replicas of every rank%s  reduction %.6g (in step_time)\n",
        sim.data_parallel, sim.zero ? ", ZeRO-1 (state_bytes per replica)" : "",
        sim.data_parallel_seconds);
  }
  absl::StrAppendFormat(&s, "%4s %6s %8s %12s %10s %16s %16s %16s\n", "rank", "layers", "actions",
                        "busy", "peak_act", "peak_act_bytes", "parameter_bytes", "state_bytes");
  for (const RankStats& r : sim.ranks)
    absl::StrAppendFormat(&s, "%4d %6d %8d %12.6g %10.3g %16d %16d %16d\n", r.rank, r.layers,
                          plan.ranks[r.rank].actions.size(), r.busy, r.peak_activation_microbatches,
                          r.peak_activation_bytes, r.parameter_bytes, r.state_bytes);
  return s;
}

std::string RenderJson(const Plan& plan, const SimResult& sim) {
  auto num = [](double v) { return absl::StrFormat("%.9g", v); };
  std::string s = absl::StrCat(
      "{\"schedule\":\"", plan.schedule, "\",\"vocab\":\"", plan.vocab,
      "\",\"pipeline\":", plan.pipeline, ",\"microbatches\":", plan.microbatches,
      ",\"seq_chunks\":", plan.seq_chunks, ",\"layers\":", plan.layers,
      ",\"x_owner\":", plan.x_owner, ",\"makespan\":", num(sim.makespan),
      ",\"bubble_ratio\":", num(sim.bubble_ratio), ",\"step_time\":", num(sim.step_time),
      ",\"model_flops\":", num(sim.model_flops), ",\"mfu\":", num(sim.mfu));
  if (sim.tensor_parallel > 1) absl::StrAppend(&s, ",\"tensor_parallel\":", sim.tensor_parallel);
  if (sim.data_parallel > 1) {
    absl::StrAppend(&s, ",\"data_parallel\":", sim.data_parallel,
                    ",\"zero\":", sim.zero ? "true" : "false",
                    ",\"data_parallel_seconds\":", num(sim.data_parallel_seconds));
  }
  absl::StrAppend(&s, ",\"seq_bounds\":[");
  for (size_t i = 0; i < plan.seq_bounds.size(); ++i)
    absl::StrAppend(&s, i ? "," : "", plan.seq_bounds[i]);
  s += "],\"ranks\":[";
  for (size_t i = 0; i < sim.ranks.size(); ++i) {
    const RankStats& r = sim.ranks[i];
    absl::StrAppend(&s, i ? "," : "", "{\"rank\":", r.rank, ",\"layers\":", r.layers,
                    ",\"chunks\":[");
    const auto& chunks = plan.ranks[r.rank].chunks;
    for (size_t c = 0; c < chunks.size(); ++c)
      absl::StrAppend(&s, c ? "," : "", "{\"group\":", chunks[c].group,
                      ",\"first_layer\":", chunks[c].first_layer,
                      ",\"num_layers\":", chunks[c].num_layers, "}");
    absl::StrAppend(&s, "],\"busy\":", num(r.busy), ",\"comm\":", num(r.comm),
                    ",\"peak_activation_microbatches\":", num(r.peak_activation_microbatches),
                    ",\"peak_activation_bytes\":", r.peak_activation_bytes,
                    ",\"parameter_bytes\":", r.parameter_bytes, ",\"state_bytes\":", r.state_bytes,
                    ",\"actions\":[");
    const auto& acts = plan.ranks[r.rank].actions;
    for (size_t a = 0; a < acts.size(); ++a)
      absl::StrAppend(&s, a ? "," : "", "\"", ToString(acts[a]), "\"");
    s += "]}";
  }
  s += "]}\n";
  return s;
}

namespace {

// A round tick spacing (1, 2 or 5 times a power of ten) giving at most `max_ticks` intervals
// over `range`.
double TimeTickStep(double range, int max_ticks) {
  if (!(range > 0)) return 1;
  const double raw = range / max_ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
}

}  // namespace

std::string TimeLabel(double v, double step) {
  // As many decimals as the step needs (0.0002 -> 4), never an exponent; whole numbers as such.
  int decimals = 0;
  if (step > 0 && step < 1) decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  if (std::abs(v) < step * 1e-9) return "0";
  return absl::StrFormat("%.*f", std::min(decimals, 12), v);
}

std::string RenderSvg(const Plan& plan, const SimResult& sim) {
  const int p = plan.pipeline;
  const double width = 1200, row = 28, left = 60, right = 20, top = 30;
  const double scale = sim.makespan > 0 ? (width - left - right) / sim.makespan : 1;
  // Rows, then the time axis (ticks and their labels), then the legend.
  const double axis_y = top + row * p + 2, legend_y = axis_y + 38;
  const double height = legend_y + 12;
  // The makespan to three significant digits, written without an exponent or trailing zeros
  // (0.00051, 46.5, 97).
  const double mag =
      sim.makespan > 0 ? std::pow(10.0, std::floor(std::log10(sim.makespan)) - 2) : 1;
  std::string makespan = TimeLabel(std::round(sim.makespan / mag) * mag, mag);
  if (makespan.find('.') != std::string::npos) {
    makespan.erase(makespan.find_last_not_of('0') + 1);
    if (makespan.back() == '.') makespan.pop_back();
  }
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"10\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"18\" font-size=\"13\">%s x %s, p=%d, m=%d, k=%d: makespan %s, "
      "bubble %.1f%%</text>\n",
      width, height, left, plan.schedule, plan.vocab, p, plan.microbatches, plan.seq_chunks,
      makespan, 100 * sim.bubble_ratio);
  struct Kind {
    const char* name;
    const char* color;
  };
  // The legend's entries in order; an entry is drawn only when the plan has such an action.
  const Kind kinds[] = {
      {"F", "#4f81bd"},         {"F chunk 1", "#9bbb59"}, {"B/BW", "#c0504d"},
      {"B chunk 1", "#e6a23c"}, {"W", "#8064a2"},         {"S", "#f2c80f"},
      {"T", "#f79646"},         {"IF/IB", "#a5a5a5"},     {"optimizer", "#333333"}};
  auto kind_of = [](const Action& a) -> int {
    switch (a.kind) {
      case ActionKind::kF:
        return a.chunk == 0 ? 0 : 1;
      case ActionKind::kB:
        return a.chunk == 0 ? 2 : 3;
      case ActionKind::kBW:
        return 2;
      case ActionKind::kW:
        return 4;
      case ActionKind::kS:
        return 5;
      case ActionKind::kT:
        return 6;
      case ActionKind::kIF:
      case ActionKind::kIB:
        return 7;
      case ActionKind::kOpt:
        return 8;
      default:
        return -1;
    }
  };
  bool present[std::size(kinds)] = {};
  for (int r = 0; r < p; ++r) {
    const double y = top + r * row;
    absl::StrAppendFormat(&s, "<text x=\"4\" y=\"%.1f\">rank %d</text>\n", y + row / 2 + 4, r);
    const auto& acts = plan.ranks[r].actions;
    for (size_t i = 0; i < acts.size(); ++i) {
      const Action& a = acts[i];
      if (!IsCompute(a.kind)) continue;
      const int k = kind_of(a);
      const TimedAction& t = sim.times[r][i];
      // A pass that takes no time (a zero cost) is a sliver, not worth a legend entry.
      if (k >= 0 && t.end > t.start) present[k] = true;
      const double x = left + t.start * scale, w = std::max(0.5, (t.end - t.start) * scale);
      absl::StrAppendFormat(&s,
                            "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                            "fill=\"%s\" stroke=\"white\" stroke-width=\"0.5\"><title>%s</title>"
                            "</rect>\n",
                            x, y + 2, w, row - 4, k >= 0 ? kinds[k].color : "#000000", ToString(a));
      // The microbatch number where it fits inside its box (9 px for one digit, 6 more a digit).
      const std::string mb = absl::StrCat(a.mb);
      if (w >= 9 + 6.2 * (mb.size() - 1) && a.kind != ActionKind::kOpt)
        absl::StrAppendFormat(&s,
                              "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\" "
                              "fill=\"white\">%s</text>\n",
                              x + w / 2, y + row / 2 + 4, mb);
    }
  }
  // The time axis: round ticks inside the makespan, as many as fit with their labels apart.
  if (sim.makespan > 0) {
    const double probe = TimeTickStep(sim.makespan, 10);
    const double widest = 6.2 * TimeLabel(sim.makespan, probe).size();
    const int max_ticks =
        std::clamp(static_cast<int>((width - left - right) / (widest + 30)), 2, 10);
    const double step = TimeTickStep(sim.makespan, max_ticks);
    absl::StrAppendFormat(&s,
                          "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
                          "stroke=\"black\"/>\n",
                          left, axis_y, left + sim.makespan * scale, axis_y);
    for (int i = 0;; ++i) {
      const double v = i * step;
      if (v > sim.makespan * (1 + 1e-9)) break;
      absl::StrAppendFormat(&s,
                            "<line x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
                            "stroke=\"black\"/>\n<text x=\"%.2f\" y=\"%.1f\" "
                            "text-anchor=\"middle\">%s</text>\n",
                            left + v * scale, axis_y, left + v * scale, axis_y + 4,
                            left + v * scale, axis_y + 15, TimeLabel(v, step));
    }
    absl::StrAppendFormat(&s, "<text x=\"4\" y=\"%.1f\">time</text>\n", axis_y + 15);
  }
  double lx = left;
  for (size_t k = 0; k < std::size(kinds); ++k) {
    if (!present[k]) continue;
    absl::StrAppendFormat(&s,
                          "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                          "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                          lx, legend_y - 10, kinds[k].color, lx + 16, legend_y, kinds[k].name);
    lx += 16 + 6.2 * std::string(kinds[k].name).size() + 24;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace vp::planner
