// Renderers: a text table, JSON, and an SVG timeline like the papers' figures.
#include <algorithm>

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

std::string RenderSvg(const Plan& plan, const SimResult& sim) {
  const int p = plan.pipeline;
  const double width = 1200, row = 28, left = 60, top = 30;
  const double scale = sim.makespan > 0 ? (width - left - 10) / sim.makespan : 1;
  const double height = top + row * p + 40;
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"10\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"18\" font-size=\"13\">%s x %s, p=%d, m=%d, k=%d: makespan %.4g, "
      "bubble %.1f%%</text>\n",
      width, height, left, plan.schedule, plan.vocab, p, plan.microbatches, plan.seq_chunks,
      sim.makespan, 100 * sim.bubble_ratio);
  auto color = [](const Action& a) -> absl::string_view {
    switch (a.kind) {
      case ActionKind::kF:
        return a.chunk == 0 ? "#4f81bd" : "#9bbb59";
      case ActionKind::kB:
        return a.chunk == 0 ? "#c0504d" : "#e6a23c";
      case ActionKind::kBW:
        return "#c0504d";
      case ActionKind::kW:
        return "#8064a2";
      case ActionKind::kS:
        return "#f2c80f";
      case ActionKind::kT:
        return "#f79646";
      case ActionKind::kIF:
      case ActionKind::kIB:
        return "#a5a5a5";
      case ActionKind::kOpt:
        return "#333333";
      default:
        return "#000000";
    }
  };
  for (int r = 0; r < p; ++r) {
    const double y = top + r * row;
    absl::StrAppendFormat(&s, "<text x=\"4\" y=\"%.1f\">rank %d</text>\n", y + row / 2 + 4, r);
    const auto& acts = plan.ranks[r].actions;
    for (size_t i = 0; i < acts.size(); ++i) {
      const Action& a = acts[i];
      if (!IsCompute(a.kind)) continue;
      const TimedAction& t = sim.times[r][i];
      const double x = left + t.start * scale, w = std::max(0.5, (t.end - t.start) * scale);
      absl::StrAppendFormat(&s,
                            "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" "
                            "fill=\"%s\" stroke=\"white\" stroke-width=\"0.5\"><title>%s</title>"
                            "</rect>\n",
                            x, y + 2, w, row - 4, color(a), ToString(a));
      if (w >= 9 && a.kind != ActionKind::kOpt)
        absl::StrAppendFormat(&s,
                              "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\" "
                              "fill=\"white\">%d</text>\n",
                              x + w / 2, y + row / 2 + 4, a.mb);
    }
  }
  const double ly = top + row * p + 20;
  double lx = left;
  for (auto [name, col] :
       std::initializer_list<std::pair<const char*, const char*>>{{"F", "#4f81bd"},
                                                                  {"F chunk 1", "#9bbb59"},
                                                                  {"B/BW", "#c0504d"},
                                                                  {"B chunk 1", "#e6a23c"},
                                                                  {"W", "#8064a2"},
                                                                  {"S", "#f2c80f"},
                                                                  {"T", "#f79646"},
                                                                  {"IF/IB", "#a5a5a5"}}) {
    absl::StrAppendFormat(&s,
                          "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                          "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                          lx, ly - 10, col, lx + 16, ly, name);
    lx += 100;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace vp::planner
