// The plan timeline (RenderSvg) reads at a glance: a time axis with round ticks inside the
// makespan, numbers never written with an exponent, a legend of only the passes the plan has,
// and a height attribute that holds everything drawn.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include "coordinator/planner/planner.h"

namespace vp::planner {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

PlannerInput Input(Schedule s, VocabMethod v, double unit) {
  PlannerInput in;
  in.pipeline = 4;
  in.microbatches = 8;
  in.layers = 16;
  in.schedule = s;
  in.vocab = v;
  in.costs.f = unit;
  in.costs.b = unit;
  in.costs.w = unit;
  in.costs.s = unit;
  in.costs.t = unit;
  return in;
}

struct Drawn {
  std::string svg;
  double makespan = 0;
};

Drawn Draw(const PlannerInput& in) {
  absl::StatusOr<Plan> plan = BuildPlan(in);
  EXPECT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<SimResult> sim = Simulate(*plan, in);
  EXPECT_TRUE(sim.ok()) << sim.status();
  return {RenderSvg(*plan, *sim), sim->makespan};
}

// The labels of the time axis: the middle-anchored texts that are not microbatch numbers
// (those are white).
std::vector<std::string> TimeTicks(const std::string& svg) {
  std::vector<std::string> out;
  const std::regex tick("text-anchor=\"middle\">([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), tick), end; it != end; ++it)
    out.push_back((*it)[1]);
  return out;
}

TEST(RenderSvg, TimeAxisTicksAreRoundAndInsideTheMakespan) {
  const Drawn d = Draw(Input(Schedule::k1F1B, VocabMethod::kVocab2, 1));
  const std::vector<std::string> ticks = TimeTicks(d.svg);
  ASSERT_GE(ticks.size(), 3u) << d.svg;
  // (m + p - 1) x (F + B) + the output layer's S and T: a whole number, written as one.
  EXPECT_THAT(d.svg, HasSubstr("makespan 52,"));
  EXPECT_EQ(ticks.front(), "0");
  const double step = std::stod(ticks[1]);
  // 1, 2 or 5 times a power of ten.
  const double norm = step / std::pow(10.0, std::floor(std::log10(step)));
  EXPECT_TRUE(norm == 1 || norm == 2 || norm == 5) << step;
  for (size_t i = 0; i < ticks.size(); ++i) {
    EXPECT_DOUBLE_EQ(std::stod(ticks[i]), i * step) << ticks[i];
    EXPECT_LE(std::stod(ticks[i]), d.makespan);
  }
}

TEST(RenderSvg, SecondsCostsAreWrittenWithoutExponents) {
  // Costs of ~20 microseconds a pass: a makespan near 0.0005 (the report's FLOP-proportional
  // seconds), which %g writes as 5e-04.
  const Drawn d = Draw(Input(Schedule::k1F1B, VocabMethod::kVocab2, 2e-5));
  EXPECT_THAT(d.svg, Not(HasSubstr("e-0")));
  EXPECT_THAT(d.svg, Not(HasSubstr("e+")));
  const std::vector<std::string> ticks = TimeTicks(d.svg);
  ASSERT_GE(ticks.size(), 3u);
  EXPECT_EQ(ticks.front(), "0");
  EXPECT_THAT(ticks[1], HasSubstr("0.0"));
  EXPECT_THAT(d.svg, HasSubstr("makespan 0.00"));
  EXPECT_EQ(TimeLabel(0.0003, 0.0001), "0.0003");
  EXPECT_EQ(TimeLabel(40, 10), "40");
  EXPECT_EQ(TimeLabel(1.5, 0.5), "1.5");
  EXPECT_EQ(TimeLabel(1e-12, 0.5), "0");
}

TEST(RenderSvg, LegendNamesOnlyThePassesThePlanHas) {
  // S and T cost nothing here, nor do the input layer and the optimizer: their passes take no
  // time, so the legend has F and B/BW only (no S, T, W, second chunk, IF/IB or optimizer).
  PlannerInput in = Input(Schedule::k1F1B, VocabMethod::kBaseline, 1);
  in.costs.s = in.costs.t = 0;
  const std::string base = Draw(in).svg;
  EXPECT_THAT(base, HasSubstr(">F<"));
  EXPECT_THAT(base, HasSubstr(">B/BW<"));
  for (const char* absent : {">S<", ">T<", ">W<", ">F chunk 1<", ">IF/IB<", ">optimizer<"})
    EXPECT_THAT(base, Not(HasSubstr(absent)));
  // Vocab-2 adds S and T.
  const std::string v2 = Draw(Input(Schedule::k1F1B, VocabMethod::kVocab2, 1)).svg;
  EXPECT_THAT(v2, HasSubstr(">S<"));
  EXPECT_THAT(v2, HasSubstr(">T<"));
}

TEST(RenderSvg, EverythingDrawnIsInsideTheHeight) {
  const std::string svg = Draw(Input(Schedule::kVHalf, VocabMethod::kVocab1, 1)).svg;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(svg, m, std::regex("height=\"([0-9.]+)\"")));
  const double height = std::stod(m[1]);
  const std::regex y("\\by=\"([0-9.]+)\"");
  double lowest = 0;
  for (std::sregex_iterator it(svg.begin(), svg.end(), y), end; it != end; ++it)
    lowest = std::max(lowest, std::stod((*it)[1]));
  EXPECT_LT(lowest, height);
  EXPECT_GT(lowest, height - 30);  // the legend is the last row, not far above the bottom
}

}  // namespace
}  // namespace vp::planner
