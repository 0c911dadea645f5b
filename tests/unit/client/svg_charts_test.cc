// The charts of `vocabpipe report` read at a glance: numbers as 1.08k (never
// 1.08e+03), whole-step ticks on a step axis, and group labels that cannot overlap.
#include "client/svg_charts.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

namespace vp::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(FormatNumber, ThousandsAsKNeverExponents) {
  EXPECT_EQ(FormatNumber(1080), "1.08k");
  EXPECT_EQ(FormatNumber(8600), "8.6k");
  EXPECT_EQ(FormatNumber(190), "190");
  EXPECT_EQ(FormatNumber(0.25), "0.25");
  EXPECT_EQ(FormatNumber(0), "0");
  EXPECT_EQ(FormatNumber(2.5e6), "2.5M");
  EXPECT_EQ(FormatNumber(999.7), "1k");
}

// Every x tick label of the chart (the text under the axis: y = the axis' y + 15).
std::vector<std::string> TickLabels(const std::string& svg) {
  std::vector<std::string> labels;
  const std::regex tick("text-anchor=\"middle\">([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), tick), end; it != end; ++it) {
    labels.push_back((*it)[1]);
  }
  return labels;
}

TEST(LineChart, AStepAxisHasWholeRoundTicksInsideTheSteps) {
  Series s{"loss"};
  for (int step = 0; step < 20; ++step) s.points.push_back({step, 5.0 - 0.1 * step});
  const std::string svg = LineChart(0, 260, "Loss", "step", {s});
  const std::vector<std::string> ticks = TickLabels(svg);
  ASSERT_GE(ticks.size(), 3u);
  for (const std::string& t : ticks) {
    if (t == "step") continue;
    EXPECT_THAT(t, Not(HasSubstr("."))) << "a fractional step tick: " << t;
    EXPECT_THAT(t, Not(HasSubstr("-"))) << "a tick before the first step: " << t;
    EXPECT_LE(std::stoi(t), 19);
  }
  EXPECT_THAT(svg, Not(HasSubstr("e+")));
}

TEST(BarChart, ValuesAreReadableAndLongLabelsNeverShareARow) {
  std::vector<BarGroup> groups;
  for (int i = 0; i < 12; ++i) {
    groups.push_back(
        {"p=2 V=" + std::to_string(32 << (i % 4)) + "k vocab1 interlaced", {1080.0 + i, 1010.0}});
  }
  const std::string svg = BarChart(0, 300, "Step seconds", {"measured", "predicted"}, groups, "");
  EXPECT_THAT(svg, HasSubstr(">1.08k<"));
  EXPECT_THAT(svg, HasSubstr(">1.01k<"));
  EXPECT_THAT(svg, Not(HasSubstr("e+")));
  // Too long for their groups: rotated, not written over each other on one line.
  EXPECT_THAT(svg, HasSubstr("rotate(-"));
}

TEST(BarChart, ShortLabelsStayHorizontal) {
  const std::string svg = BarChart(0, 220, "Busy", {"measured", "predicted"},
                                   {{"rank 0", {40, 50}}, {"rank 1", {45, 50}}}, "%");
  EXPECT_THAT(svg, Not(HasSubstr("rotate(-3")));
  EXPECT_THAT(svg, Not(HasSubstr("rotate(-6")));
  EXPECT_THAT(svg, HasSubstr(">rank 0<"));
  EXPECT_THAT(svg, HasSubstr(">40%<"));
}

}  // namespace
}  // namespace vp::cli
