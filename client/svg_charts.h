// Small self-contained SVG charts (no scripts, no external fonts or styles) for
// `vocabpipe report`: a line chart of series over x, and grouped bars (measured beside
// predicted). Every chart is a <g> fragment placed at a y offset, so a caller stacks several
// into one <svg> document (SvgDocument).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace vp::cli {

// A number as a chart labels it: three significant digits, thousands as k, M, G (1080 ->
// "1.08k", 8600 -> "8.6k", 190 -> "190", 0.25 -> "0.25").
std::string FormatNumber(double v);

// & < > " escaped, so any label (a run directory's name) is safe inside XML text/attributes.
std::string XmlEscape(const std::string& text);

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points{};  // (x, y); non-finite points are skipped
  bool markers = false;                             // dots instead of a line (sparse series)
};

// A line chart `height` tall at vertical offset y; x and y ranges fit the data, ticks fall on
// round numbers (whole numbers when every x is whole, e.g. steps), the legend sits in its own
// row above the plot.
std::string LineChart(double y, double height, const std::string& title, const std::string& x_label,
                      const std::vector<Series>& series);

struct BarGroup {
  std::string label;           // e.g. "rank 0", "V=32k vocab1"
  std::vector<double> values;  // one per BarChart legend entry; negative: not available
};

// Grouped bars: for each group, one bar per legend entry (e.g. {"measured", "predicted"}).
// Values are printed on the bars with `unit` (FormatNumber; written up the bar when too wide
// for it); group labels wrap onto two lines or, failing that, are rotated, so none overlap.
std::string BarChart(double y, double height, const std::string& title,
                     const std::vector<std::string>& legend, const std::vector<BarGroup>& groups,
                     const std::string& unit);

// Wraps fragments (each laid out by its caller at increasing y) into an <svg> `width` wide.
constexpr double kChartWidth = 1200;
std::string SvgDocument(double height, const std::string& title, const std::string& body);

// A nested, already complete <svg> element (e.g. planner::RenderSvg) placed at offset y.
std::string EmbedSvg(double y, const std::string& svg);

// A minimal HTML page around an SVG document.
std::string HtmlPage(const std::string& title, const std::string& svg);

}  // namespace vp::cli
