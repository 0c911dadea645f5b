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
constexpr double kLeft = 80, kRight = 20, kTop = 28, kBottom = 36;

const char* Color(size_t i) { return kColors[i % (sizeof(kColors) / sizeof(kColors[0]))]; }

// Range [lo, hi] with some room; a flat range becomes a unit-wide one.
std::pair<double, double> Pad(double lo, double hi, bool from_zero) {
  if (from_zero) lo = std::min(lo, 0.0);
  if (!(hi > lo)) {
    hi = lo + (lo == 0 ? 1 : std::abs(lo) * 0.1);
  }
  const double room = from_zero ? 0.05 * (hi - lo) : 0.05 * (hi - lo);
  return {from_zero ? lo : lo - room, hi + room};
}

std::string Title(double y, const std::string& title) {
  return absl::StrFormat("<text x=\"%.0f\" y=\"%.1f\" font-size=\"13\">%s</text>\n", kLeft, y + 18,
                         XmlEscape(title));
}

std::string Axes(double y, double height, double ylo, double yhi) {
  const double x0 = kLeft, x1 = kChartWidth - kRight, y0 = y + height - kBottom, y1 = y + kTop;
  std::string s = absl::StrFormat(
      "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n"
      "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
      x0, y0, x1, y0, x0, y0, x0, y1);
  for (int i = 0; i <= 4; ++i) {
    const double v = ylo + (yhi - ylo) * i / 4, py = y0 - (y0 - y1) * i / 4;
    absl::StrAppendFormat(&s,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                          "stroke=\"#ddd\"/>\n<text x=\"%.1f\" y=\"%.1f\" "
                          "text-anchor=\"end\">%.4g</text>\n",
                          x0 + 1, py, x1, py, x0 - 4, py + 3, v);
  }
  return s;
}

}  // namespace

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
  for (const Series& s : series) {
    for (auto [px, py] : s.points) {
      if (!std::isfinite(px) || !std::isfinite(py)) continue;
      xlo = std::min(xlo, px), xhi = std::max(xhi, px);
      ylo = std::min(ylo, py), yhi = std::max(yhi, py);
    }
  }
  std::string out = Title(y, title);
  if (!std::isfinite(xlo)) {
    absl::StrAppendFormat(&out, "<text x=\"%.0f\" y=\"%.1f\">no data</text>\n", kLeft, y + 50);
    return out;
  }
  auto [x0v, x1v] = Pad(xlo, xhi, false);
  auto [y0v, y1v] = Pad(ylo, yhi, false);
  out += Axes(y, height, y0v, y1v);
  const double px0 = kLeft, px1 = kChartWidth - kRight, py0 = y + height - kBottom, py1 = y + kTop;
  auto X = [&](double v) { return px0 + (px1 - px0) * (v - x0v) / (x1v - x0v); };
  auto Y = [&](double v) { return py0 - (py0 - py1) * (v - y0v) / (y1v - y0v); };
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\">%.4g</text>\n"
                        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.4g</text>\n",
                        (px0 + px1) / 2, py0 + 28, XmlEscape(x_label), px0, py0 + 14, x0v, px1,
                        py0 + 14, x1v);
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
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                          px1 - 200, py1 + 4 + 14 * i, Color(i), px1 - 186, py1 + 13 + 14 * i,
                          XmlEscape(s.name));
  }
  return out;
}

std::string BarChart(double y, double height, const std::string& title,
                     const std::vector<std::string>& legend, const std::vector<BarGroup>& groups,
                     const std::string& unit) {
  double hi = 0;
  for (const BarGroup& g : groups)
    for (double v : g.values)
      if (std::isfinite(v)) hi = std::max(hi, v);
  auto [lo_v, hi_v] = Pad(0, hi, true);
  std::string out = Title(y, title) + Axes(y, height, lo_v, hi_v);
  const double px0 = kLeft, px1 = kChartWidth - kRight, py0 = y + height - kBottom, py1 = y + kTop;
  const double group_w = groups.empty() ? 0 : (px1 - px0) / groups.size();
  const double bar_w = legend.empty() ? 0 : std::min(60.0, 0.8 * group_w / legend.size());
  auto Y = [&](double v) { return py0 - (py0 - py1) * (v - lo_v) / (hi_v - lo_v); };
  for (size_t g = 0; g < groups.size(); ++g) {
    const double gx = px0 + group_w * g + (group_w - bar_w * legend.size()) / 2;
    for (size_t k = 0; k < legend.size() && k < groups[g].values.size(); ++k) {
      const double v = groups[g].values[k];
      if (!std::isfinite(v) || v < 0) continue;
      const double bx = gx + bar_w * k, top = Y(v);
      absl::StrAppendFormat(&out,
                            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                            "fill=\"%s\"/>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
                            "font-size=\"9\">%.3g%s</text>\n",
                            bx, top, std::max(1.0, bar_w - 2), py0 - top, Color(k), bx + bar_w / 2,
                            top - 3, v, XmlEscape(unit));
    }
    absl::StrAppendFormat(&out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                          px0 + group_w * (g + 0.5), py0 + 14, XmlEscape(groups[g].label));
  }
  for (size_t k = 0; k < legend.size(); ++k) {
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                          px1 - 200, py1 + 4 + 14 * k, Color(k), px1 - 186, py1 + 13 + 14 * k,
                          XmlEscape(legend[k]));
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
