// Golden plan texts: a few small plans, lowered, in their text form (the wire form). A change
// to a generator, the vocabulary-pass placement or lowering shows up here as a readable diff.
//
// Regenerate after an intended change:
//   VOCABPIPE_REGENERATE_GOLDEN=1 build/tests/unit/planner/plan_golden_test
// then review `git diff tests/unit/planner/golden`.
//
// Letters: p pipeline ranks, m microbatches.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "coordinator/planner/planner.h"
#include "gtest/gtest.h"
#include "proto/plan/plan.h"

namespace vp::planner {
namespace {

struct Golden {
  const char* file;
  Schedule schedule;
  VocabMethod vocab;
  int p, m;
  int data = 1;  // replicas: d > 1 adds each chunk's GRAD_SYNC after its last W
};

constexpr Golden kGolden[] = {
    {"1f1b-vocab2-p2-m3.txt", Schedule::k1F1B, VocabMethod::kVocab2, 2, 3},
    {"zbh1-baseline-p3-m4.txt", Schedule::kZBH1, VocabMethod::kBaseline, 3, 4},
    {"vhalf-vocab1-p2-m3.txt", Schedule::kVHalf, VocabMethod::kVocab1, 2, 3},
    {"vmin-vocab2-p3-m3.txt", Schedule::kVMin, VocabMethod::kVocab2, 3, 3},
    {"1f1b-interlaced-p2-m5.txt", Schedule::k1F1B, VocabMethod::kInterlaced, 2, 5},
    {"zbv-vocab2-p2-m3-d2.txt", Schedule::kZBV, VocabMethod::kVocab2, 2, 3, 2},
};

std::string GoldenPath(const char* file) {
  return std::string(VP_SOURCE_DIR) + "/tests/unit/planner/golden/" + file;
}

TEST(PlanGolden, TextFormsMatch) {
  const bool regenerate = std::getenv("VOCABPIPE_REGENERATE_GOLDEN") != nullptr;
  for (const Golden& g : kGolden) {
    PlannerInput in;
    in.pipeline = g.p;
    in.microbatches = g.m;
    in.layers = 4 * g.p;
    in.schedule = g.schedule;
    in.vocab = g.vocab;
    in.model.data_parallel = g.data;
    in.costs.f = 1;
    in.costs.b = 2;
    in.costs.w = 1;
    in.costs.s = 0.5;
    in.costs.t = 0.5;
    absl::StatusOr<Plan> plan = BuildPlan(in);
    ASSERT_TRUE(plan.ok()) << g.file << ": " << plan.status();
    const std::string text = PlanToText(*plan);
    if (regenerate) {
      std::ofstream(GoldenPath(g.file)) << text;
      continue;
    }
    std::ifstream f(GoldenPath(g.file));
    ASSERT_TRUE(f.good()) << GoldenPath(g.file) << " missing (regenerate: see the file header)";
    std::stringstream want;
    want << f.rdbuf();
    EXPECT_EQ(text, want.str()) << g.file
                                << " changed; if intended, regenerate (see the file header)";
    // The golden text is a valid plan on its own.
    absl::StatusOr<Plan> back = PlanFromText(want.str());
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(ValidatePlan(*back).ok()) << g.file;
  }
}

}  // namespace
}  // namespace vp::planner
