#include "client/svg_charts.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vp::cli {
namespace {

constexpr const char* kColors[] = {"#4f81bd", "#c0504d", "#9bbb59", "#8064a2",
                                   "#f79646", "#4bacc6", "#a5a5a5"};
// The plot area of a chart `height` tall at y: the title's row, then the legend's row (outside
// the data), then the plot; the x labels below it.
constexpr double kLeft = 80, kRight = 20, kTop = 44, kBottom = 44;
// Estimated advance of one character at the default 10 px sans-serif (labels are laid out
// from it: wrapped, rotated or thinned before they could overlap).
constexpr double kCharWidth = 6.2;

const char* Color(size_t i) { return kColors[i % (sizeof(kColors) / sizeof(kColors[0]))]; }

double TextWidth(const std::string& text, double font_size = 10) {
  return kCharWidth * font_size / 10 * static_cast<double>(text.size());
}

// A round tick spacing (1, 2 or 5 times a power of ten) giving at most `max_ticks` intervals
// over `range`; at least 1 when `whole` (whole steps).
double NiceStep(double range, int max_ticks, bool whole) {
  if (!(range > 0)) return 1;
  const double raw = range / max_ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  double step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  if (whole) step = std::max(1.0, std::round(step));
  return step;
}

// An axis over [lo, hi]: its ends widened to whole ticks and the ticks.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
};

Axis NiceAxis(double lo, double hi, int max_ticks, bool whole, bool from_zero) {
  if (from_zero) lo = std::min(lo, 0.0);
  if (!(hi > lo)) {
    const double d = whole ? 1 : (lo == 0 ? 1 : std::abs(lo) * 0.1);
    lo -= from_zero && lo == 0 ? 0 : d;
    hi += d;
  }
  Axis a;
  a.step = NiceStep(hi - lo, max_ticks, whole);
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  for (int i = 0;; ++i) {
    const double v = a.lo + i * a.step;
    if (v > a.hi + a.step * 1e-6) break;
    a.ticks.push_back(std::abs(v) < a.step * 1e-9 ? 0.0 : v);
  }
  return a;
}

std::string Title(double y, const std::string& title) {
  return absl::StrFormat("<text x=\"%.0f\" y=\"%.1f\" font-size=\"13\">%s</text>\n", kLeft, y + 18,
                         XmlEscape(title));
}

// The legend in its own row between the title and the plot, right-aligned: never on the data.
std::string Legend(double y, const std::vector<std::string>& names) {
  double width = 0;
  for (const std::string& n : names) width += 16 + TextWidth(n) + 14;
  double x = std::max(kLeft, kChartWidth - kRight - width);
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppendFormat(&s,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                          x, y + 24, Color(i), x + 14, y + 33, XmlEscape(names[i]));
    x += 16 + TextWidth(names[i]) + 14;
  }
  return s;
}

// The y axis with round ticks, grid lines and their labels.
std::string Axes(double y, double height, const Axis& ya) {
  const double x0 = kLeft, x1 = kChartWidth - kRight, y0 = y + height - kBottom, y1 = y + kTop;
  std::string s = absl::StrFormat(
      "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n"
      "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
      x0, y0, x1, y0, x0, y0, x0, y1);
  for (double v : ya.ticks) {
    const double py = y0 - (y0 - y1) * (v - ya.lo) / (ya.hi - ya.lo);
    absl::StrAppendFormat(&s,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                          "stroke=\"#ddd\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
                          "text-anchor=\"end\">%s</text>\n",
                          x0 + 1, py, x1, py, x0 - 4, py + 3, FormatNumber(v));
  }
  return s;
}

}  // namespace

std::string FormatNumber(double v) {
  if (!std::isfinite(v)) return "-";
  const double a = std::abs(v);
  // Three significant digits: 1080 -> 1.08k, 8600 -> 8.6k, 0.25 -> 0.25.
  auto g = [](double x) { return absl::StrFormat("%.3g", x); };
  if (a >= 999.5e6) return g(v / 1e9) + "G";
  if (a >= 999.5e3) return g(v / 1e6) + "M";
  if (a >= 999.5) return g(v / 1e3) + "k";
  if (a != 0 && a < 1e-3) return absl::StrFormat("%.1e", v);
  return g(v);
}

std::string XmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        out += (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') ? '?' : c;
    }
  }
  return out;
}

std::string LineChart(double y, double height, const std::string& title, const std::string& x_label,
                      const std::vector<Series>& series) {
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  bool whole_x = true;  // every x a whole number (steps): ticks on whole numbers only
  for (const Series& s : series) {
    for (auto [px, py] : s.points) {
      if (!std::isfinite(px) || !std::isfinite(py)) continue;
      xlo = std::min(xlo, px), xhi = std::max(xhi, px);
      ylo = std::min(ylo, py), yhi = std::max(yhi, py);
      whole_x &= px == std::round(px);
    }
  }
  std::string out = Title(y, title);
  if (!std::isfinite(xlo)) {
    absl::StrAppendFormat(&out, "<text x=\"%.0f\" y=\"%.1f\">no data</text>\n", kLeft, y + 60);
    return out;
  }
  std::vector<std::string> names;
  for (const Series& s : series) names.push_back(s.name);
  out += Legend(y, names);
  const double px0 = kLeft, px1 = kChartWidth - kRight, py0 = y + height - kBottom, py1 = y + kTop;
  // x: the data's own range (no padding: the first and last step sit on the axis ends), ticks
  // on round values inside it, as many as fit without their labels touching.
  const double widest = std::max(TextWidth(FormatNumber(xlo)), TextWidth(FormatNumber(xhi)));
  const int max_x_ticks = std::clamp(static_cast<int>((px1 - px0) / (widest + 24)), 2, 12);
  double x0v = xlo, x1v = xhi;
  if (!(x1v > x0v)) x0v -= 1, x1v += 1;
  const double xstep = NiceStep(x1v - x0v, max_x_ticks, whole_x);
  const Axis ya = NiceAxis(ylo, yhi, 5, false, false);
  out += Axes(y, height, ya);
  auto X = [&](double v) { return px0 + (px1 - px0) * (v - x0v) / (x1v - x0v); };
  auto Y = [&](double v) { return py0 - (py0 - py1) * (v - ya.lo) / (ya.hi - ya.lo); };
  for (double v = std::ceil(x0v / xstep - 1e-9) * xstep; v <= x1v + xstep * 1e-9; v += xstep) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                          "stroke=\"black\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
                          "text-anchor=\"middle\">%s</text>\n",
                          X(v), py0, X(v), py0 + 4, X(v), py0 + 15,
                          FormatNumber(std::abs(v) < xstep * 1e-9 ? 0.0 : v));
  }
  absl::StrAppendFormat(&out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                        (px0 + px1) / 2, py0 + 32, XmlEscape(x_label));
  for (size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    std::string pts;
    for (auto [px, py] : s.points) {
      if (!std::isfinite(px) || !std::isfinite(py)) continue;
      if (s.markers) {
        absl::StrAppendFormat(&out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                              X(px), Y(py), Color(i));
      } else {
        absl::StrAppendFormat(&pts, "%.1f,%.1f ", X(px), Y(py));
      }
    }
    if (!pts.empty()) {
      absl::StrAppendFormat(
          &out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"%s\"/>\n",
          Color(i), pts);
    }
  }
  return out;
}

namespace {

// Splits `label` at spaces into lines of at most `width` pixels (a longer word stays whole).
std::vector<std::string> Wrap(const std::string& label, double width) {
  std::vector<std::string> lines;
  std::string line;
  size_t start = 0;
  while (start <= label.size()) {
    size_t end = label.find(' ', start);
    if (end == std::string::npos) end = label.size();
    const std::string word = label.substr(start, end - start);
    if (!line.empty() && TextWidth(line + " " + word) > width) {
      lines.push_back(line);
      line = word;
    } else {
      line = line.empty() ? word : line + " " + word;
    }
    start = end + 1;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

}  // namespace

std::string BarChart(double y, double height, const std::string& title,
                     const std::vector<std::string>& legend, const std::vector<BarGroup>& groups,
                     const std::string& unit) {
  const double px0 = kLeft, px1 = kChartWidth - kRight, py0 = y + height - kBottom, py1 = y + kTop;
  const double group_w = groups.empty() ? 0 : (px1 - px0) / groups.size();
  const double bar_w = legend.empty() ? 0 : std::min(60.0, 0.8 * group_w / legend.size());
  // A value that does not fit across its bar is written up the bar instead (rotated), which
  // needs room above the tallest bar for the longest value.
  double hi = 0, longest = 0;
  for (const BarGroup& g : groups) {
    for (double v : g.values) {
      if (!std::isfinite(v) || v < 0) continue;
      hi = std::max(hi, v);
      longest = std::max(longest, TextWidth(FormatNumber(v) + unit, 9));
    }
  }
  const bool vertical_values = longest > bar_w + 4;
  const double plot_h = py0 - py1;
  const double label_h = vertical_values ? longest + 6 : 14;
  const double room = label_h / std::max(1.0, plot_h - label_h);
  const Axis ya = NiceAxis(0, hi * (1 + room), 5, false, true);
  std::string out = Title(y, title) + Legend(y, legend) + Axes(y, height, ya);
  auto Y = [&](double v) { return py0 - (py0 - py1) * (v - ya.lo) / (ya.hi - ya.lo); };
  // Group labels: on one line if they fit, else wrapped onto two, else every label rotated.
  bool rotate = false;
  std::vector<std::vector<std::string>> label_lines;
  for (const BarGroup& g : groups) {
    std::vector<std::string> lines = Wrap(g.label, group_w - 6);
    for (const std::string& l : lines) rotate |= TextWidth(l) > group_w - 6;
    rotate |= lines.size() > 2;
    label_lines.push_back(std::move(lines));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const double gx = px0 + group_w * g + (group_w - bar_w * legend.size()) / 2;
    for (size_t k = 0; k < legend.size() && k < groups[g].values.size(); ++k) {
      const double v = groups[g].values[k];
      if (!std::isfinite(v) || v < 0) continue;
      const double bx = gx + bar_w * k, top = Y(v);
      absl::StrAppendFormat(
          &out, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"/>\n", bx,
          top, std::max(1.0, bar_w - 2), py0 - top, Color(k));
      const std::string value = XmlEscape(FormatNumber(v) + unit);
      if (vertical_values) {
        absl::StrAppendFormat(&out,
                              "<text transform=\"translate(%.1f,%.1f) rotate(-90)\" "
                              "font-size=\"9\">%s</text>\n",
                              bx + bar_w / 2 + 2, top - 3, value);
      } else {
        absl::StrAppendFormat(
            &out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"9\">%s</text>\n",
            bx + bar_w / 2, top - 3, value);
      }
    }
    const double cx = px0 + group_w * (g + 0.5);
    if (rotate) {
      // Slanted just enough that neighbouring labels (9 px text) keep 11 px apart.
      const int angle = group_w * 0.5 >= 11 ? 30 : group_w * 0.87 >= 11 ? 60 : 90;
      absl::StrAppendFormat(&out,
                            "<text transform=\"translate(%.1f,%.1f) rotate(-%d)\" "
                            "text-anchor=\"end\" font-size=\"9\">%s</text>\n",
                            cx + 3, py0 + 12, angle, XmlEscape(groups[g].label));
    } else {
      for (size_t i = 0; i < label_lines[g].size(); ++i) {
        absl::StrAppendFormat(&out,
                              "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", cx,
                              py0 + 14 + 12 * i, XmlEscape(label_lines[g][i]));
      }
    }
  }
  return out;
}

std::string SvgDocument(double height, const std::string& title, const std::string& body) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"10\">\n<title>%s</title>\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n%s</svg>\n",
      kChartWidth, height, XmlEscape(title), body);
}

std::string EmbedSvg(double y, const std::string& svg) {
  // A nested <svg> takes x/y attributes; insert them after the tag name.
  std::string s = svg;
  if (s.rfind("<svg", 0) == 0) s.insert(4, absl::StrFormat(" x=\"0\" y=\"%.1f\"", y));
  return s;
}

std::string HtmlPage(const std::string& title, const std::string& svg) {
  return absl::StrCat("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>",
                      XmlEscape(title), "</title></head>\n<body>\n", svg, "</body></html>\n");
}

}  // namespace vp::cli
