// paper_charts RESULTS.json IMG_DIR: renders bench/paper/paper_bench.py's results as SVG charts
// (client/svg_charts, the code `vocabpipe report` draws with) and prints the markdown tables of
// docs/benchmarks.md. Writes IMG_DIR/paper_vocab.svg, paper_vshape.svg, paper_seq.svg (and
// paper_flat.svg) for the tables that have rows.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/svg_charts.h"

namespace {

using nlohmann::json;
using vp::cli::BarChart;
using vp::cli::BarGroup;

// Model GFLOP/s of a row against the same p and method at the table's smallest V ("-" for rows
// from before the field, or with no such row): the paper's "consistent MFU as V grows".
using Baselines = std::map<std::pair<int, std::string>, double>;

Baselines SmallestVocabRate(const std::vector<json>& rows) {
  Baselines rate;
  std::map<std::pair<int, std::string>, int> smallest;
  for (const json& r : rows) {
    if (!r.contains("model_gflops_per_s")) continue;
    const auto key = std::make_pair(r["p"].get<int>(), r["vocab"].get<std::string>());
    auto it = smallest.find(key);
    if (it == smallest.end() || r["V"].get<int>() < it->second) {
      smallest[key] = r["V"].get<int>();
      rate[key] = r["model_gflops_per_s"].get<double>();
    }
  }
  return rate;
}

std::string RateColumn(const json& r, const Baselines& base) {
  if (!r.contains("model_gflops_per_s")) return "-";
  const double rate = r["model_gflops_per_s"].get<double>();
  auto it = base.find({r["p"].get<int>(), r["vocab"].get<std::string>()});
  if (it == base.end()) return absl::StrFormat("%.1f", rate);
  return absl::StrFormat("%.1f (%.2f)", rate, rate / it->second);
}

std::string Row(const json& r, const Baselines& base) {
  std::string peaks;
  for (const auto& v : r["peak_mib_per_rank"]) peaks += absl::StrFormat("%.0f/", v.get<double>());
  if (!peaks.empty()) peaks.pop_back();
  // The modelled communication (the busiest rank's lanes) and how far the timed steps spread
  // ((max - min) / mean): rows from before the link model have neither.
  std::string comm = "-", spread = "-";
  if (r.contains("predicted_comm_s_per_rank")) {
    double c = 0;
    for (const auto& v : r["predicted_comm_s_per_rank"]) c = std::max(c, v.get<double>());
    comm = absl::StrFormat("%.3f", c);
  }
  if (r.contains("step_s_each") && r["step_s_each"].size() > 1) {
    double lo = 1e300, hi = 0;
    for (const auto& v : r["step_s_each"]) {
      lo = std::min(lo, v.get<double>());
      hi = std::max(hi, v.get<double>());
    }
    spread = absl::StrFormat("%.0f%%", 100 * (hi - lo) / r["step_s"].get<double>());
  }
  return absl::StrFormat(
      "| %d | %s | %s | %s | %d | %.3f | %.3f | **%+.0f%%** | %s | %s | %.0f | %.2f%% | %s | %s | "
      "%.2f | %.2f | %s |",
      r["p"].get<int>(), r["schedule"].get<std::string>(),
      r["k"].get<int>() > 1 ? absl::StrCat("k=", r["k"].get<int>()) : std::string("-"),
      r["vocab"].get<std::string>(), r["V"].get<int>(), r["step_s"].get<double>(),
      r["predicted_step_s"].get<double>(), 100 * r["gap"].get<double>(), comm, spread,
      r["tokens_per_s"].get<double>(), 100 * r["mfu"].get<double>(), RateColumn(r, base),
      r.contains("busy_share") ? absl::StrFormat("%.2f", r["busy_share"].get<double>())
                               : std::string("-"),
      r["busy_max_over_mean"].get<double>(), r["predicted_busy_max_over_mean"].get<double>(),
      peaks);
}

bool Write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  if (!f) std::cerr << "paper_charts: cannot write " << path << "\n";
  return static_cast<bool>(f);
}

// Measured tokens/s per (group label, series) plus measured-vs-predicted step seconds per row.
std::string TableCharts(const std::vector<json>& rows, const std::string& title,
                        const std::function<std::string(const json&)>& group_of,
                        const std::function<std::string(const json&)>& series_of, double* height) {
  std::vector<std::string> groups, series;
  std::map<std::pair<std::string, std::string>, double> tps;
  for (const json& r : rows) {
    const std::string g = group_of(r), s = series_of(r);
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    if (std::find(series.begin(), series.end(), s) == series.end()) series.push_back(s);
    tps[{g, s}] = r["tokens_per_s"].get<double>();
  }
  std::vector<BarGroup> bars;
  for (const std::string& g : groups) {
    BarGroup b{g, {}};
    for (const std::string& s : series) {
      auto it = tps.find({g, s});
      b.values.push_back(it == tps.end() ? -1 : it->second);
    }
    bars.push_back(b);
  }
  double y = 36;
  std::string body = absl::StrFormat("<text x=\"20\" y=\"24\" font-size=\"16\">%s</text>\n",
                                     vp::cli::XmlEscape(title));
  body += BarChart(y, 300, "Measured tokens/s", series, bars, "");
  y += 310;
  // Measured over predicted step time, grouped as the chart above (one bar per row: 1 is the
  // planner's prediction exactly), rather than one labelled pair per row, which no page fits.
  std::map<std::pair<std::string, std::string>, double> ratio;
  for (const json& r : rows) {
    ratio[{group_of(r), series_of(r)}] =
        r["step_s"].get<double>() / r["predicted_step_s"].get<double>();
  }
  std::vector<BarGroup> gap;
  for (const std::string& g : groups) {
    BarGroup b{g, {}};
    for (const std::string& s : series) {
      auto it = ratio.find({g, s});
      b.values.push_back(it == ratio.end() ? -1 : it->second);
    }
    gap.push_back(b);
  }
  body += BarChart(y, 300,
                   "Measured / predicted step time (1 = the planner's prediction from profiled "
                   "pass costs)",
                   series, gap, "");
  y += 310;
  *height = y;
  return body;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: paper_charts RESULTS.json IMG_DIR\n";
    return 2;
  }
  std::ifstream f(argv[1]);
  json doc = json::parse(f, nullptr, false);
  if (doc.is_discarded() || !doc.contains("rows") || !doc["rows"].is_array()) {
    std::cerr << "paper_charts: " << argv[1] << ": not a paper_bench.py results file\n";
    return 2;
  }
  const std::string img = argv[2];
  std::map<std::string, std::vector<json>> tables;
  for (const json& r : doc["rows"]) tables[r["table"].get<std::string>()].push_back(r);
  auto p_of = [](const json& r) { return absl::StrCat("p=", r["p"].get<int>()); };
  for (const auto& [name, rows] : tables) {
    double height = 0;
    std::string body, title;
    // The vocabulary tables (m = 8, and m = 16p): charts and trends against V = 32k.
    const bool by_vocab = name == "vocab" || name == "flat";
    if (by_vocab) {
      title = name == "vocab"
                  ? "Vocabulary methods on 1F1B as V grows (real workers)"
                  : "Vocabulary methods as V grows at m = 16p microbatches (real workers)";
      body = TableCharts(
          rows, title,
          [&](const json& r) {
            return absl::StrCat(p_of(r), " V=", r["V"].get<int>() / 1024, "k");
          },
          [](const json& r) { return r["vocab"].get<std::string>(); }, &height);
      // Model GFLOP/s against the method's own V = 32k row: 1.0 is the paper's flat MFU.
      const Baselines base = SmallestVocabRate(rows);
      std::vector<std::string> methods;
      std::map<std::string, BarGroup> by_group;
      std::vector<std::string> groups;
      for (const json& r : rows) {
        const std::string m = r["vocab"].get<std::string>();
        if (std::find(methods.begin(), methods.end(), m) == methods.end()) methods.push_back(m);
      }
      for (const json& r : rows) {
        auto it = base.find({r["p"].get<int>(), r["vocab"].get<std::string>()});
        if (it == base.end()) continue;
        const std::string g = absl::StrCat(p_of(r), " V=", r["V"].get<int>() / 1024, "k");
        if (!by_group.count(g)) {
          groups.push_back(g);
          by_group[g] = BarGroup{g, std::vector<double>(methods.size(), -1)};
        }
        const size_t i = std::find(methods.begin(), methods.end(), r["vocab"]) - methods.begin();
        by_group[g].values[i] = r["model_gflops_per_s"].get<double>() / it->second;
      }
      if (!groups.empty()) {
        std::vector<BarGroup> rel;
        for (const std::string& g : groups) rel.push_back(by_group[g]);
        body +=
            BarChart(height, 300, "Model FLOP/s relative to the method's V = 32k row (MFU trend)",
                     methods, rel, "");
        height += 310;
      }
    } else if (name == "vshape") {
      title = "V-Half / V-Min against 1F1B (real workers)";
      body = TableCharts(
          rows, title,
          [&](const json& r) { return absl::StrCat(p_of(r), " ", r["vocab"].get<std::string>()); },
          [](const json& r) { return r["schedule"].get<std::string>(); }, &height);
    } else {
      title = "Seq1F1B at a long sequence against 1F1B (real workers)";
      auto label = [](const json& r) {
        return r["schedule"] == "1f1b" ? std::string("1f1b")
                                       : absl::StrCat("seq1f1b k=", r["k"].get<int>());
      };
      body = TableCharts(rows, title, p_of, label, &height);
      std::vector<BarGroup> act;
      for (const json& r : rows)
        act.push_back(
            {absl::StrCat(p_of(r), " ", label(r)), {r["activation_mib_max"].get<double>()}});
      body += BarChart(height, 300, "Peak activation memory (MiB, max over ranks)", {"activations"},
                       act, "");
      height += 310;
    }
    const std::string path = absl::StrCat(img, "/paper_", name, ".svg");
    if (!Write(path, vp::cli::SvgDocument(height, title, body))) return 1;
    std::cout << "\n"
              << title << " (" << path << ")\n\n"
              << "| p | schedule | k | vocab | V | step s | predicted s | gap | comm s | spread | "
                 "tokens/s | MFU | GFLOP/s (vs V=32k) | busy share | busy max/mean | predicted | "
                 "peak MiB per rank |\n"
              << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    const Baselines base = by_vocab ? SmallestVocabRate(rows) : Baselines{};
    for (const json& r : rows) std::cout << Row(r, base) << "\n";
  }
  return 0;
}
