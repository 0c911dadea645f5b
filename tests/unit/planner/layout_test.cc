// The layout choice (parallel.world): which (d, t, p) × recompute candidates it weighs, that it
// picks the fastest one within the memory budget, refuses what the rules refuse with the rule,
// and names the smallest predicted peak when nothing fits.
#include "coordinator/planner/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "proto/spec/job_spec.h"

namespace vp::planner {
namespace {

using ::testing::HasSubstr;

vocabpipe::v1::JobSpec Spec(const std::string& parallel) {
  const std::string text = absl::StrCat(R"(name: layout
model: {layers: 8, hidden: 64, heads: 4, vocab_size: 4096, seq_len: 64}
parallel: {)",
                                        parallel, R"(}
train: {steps: 2}
data: {path: data.bin}
checkpoint: {dir: runs/layout}
device: cpu
)");
  absl::StatusOr<vocabpipe::v1::JobSpec> spec = spec::ParseJobSpec(text, "/base");
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : vocabpipe::v1::JobSpec();
}

TEST(Layout, WeighsEveryFactorisationAndModeAndPicksTheFastestThatFits) {
  const vocabpipe::v1::JobSpec spec = Spec(
      "world: 4, pipeline: auto, data: auto, tensor: auto, recompute: auto, "
      "microbatches: 8, schedule: 1f1b, vocab: vocab2");
  absl::StatusOr<ResolvedLayout> r = ResolveLayout(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  // (d, t, p) with d·t·p = 4: (1,1,4) (1,2,2) (1,4,1) (2,1,2) (2,2,1) (4,1,1), each × 3 modes.
  EXPECT_EQ(r->candidates.size(), 18u);
  std::set<std::tuple<int, int, int>> layouts;
  for (const LayoutCandidate& c : r->candidates) {
    EXPECT_EQ(c.data * c.tensor * c.pipeline, 4);
    layouts.insert({c.data, c.tensor, c.pipeline});
    if (c.planned) {
      EXPECT_EQ(c.microbatches, 8 / c.data);
    }
  }
  EXPECT_EQ(layouts.size(), 6u);
  // The chosen one is the fastest of those planned (no budget: all fit).
  ASSERT_TRUE(r->chosen.fits);
  for (const LayoutCandidate& c : r->candidates) {
    if (c.fits) {
      EXPECT_LE(r->chosen.step_seconds, c.step_seconds) << LayoutName(c);
    }
  }
  // The resolved spec is a plain one: world cleared, axes and recompute set, microbatches per
  // replica, and valid.
  const auto& par = r->spec.parallel();
  EXPECT_EQ(par.world(), 0);
  EXPECT_EQ(par.data() * par.tensor() * par.pipeline(), 4);
  EXPECT_EQ(par.microbatches() * par.data(), 8);
  EXPECT_EQ(par.recompute(), RecomputeName(r->chosen.recompute));
  EXPECT_TRUE(spec::ValidateJobSpec(r->spec).ok()) << spec::ValidateJobSpec(r->spec);
  const std::string table = LayoutTable(*r);
  std::printf("%s", table.c_str());
  EXPECT_THAT(table, HasSubstr("<- chosen"));
  EXPECT_THAT(table, HasSubstr("tokens/s"));
}

TEST(Layout, ABudgetTurnsTheChoiceToRecomputationAndNoFitNamesTheSmallestPeak) {
  const std::string base =
      "world: 2, pipeline: 2, data: 1, tensor: 1, recompute: auto, microbatches: 4, "
      "schedule: 1f1b, vocab: vocab2, microbatch_size: 4";
  absl::StatusOr<ResolvedLayout> free = ResolveLayout(Spec(base));
  ASSERT_TRUE(free.ok()) << free.status();
  ASSERT_EQ(free->candidates.size(), 3u);
  // Unlimited memory: no recomputation (it only adds work).
  EXPECT_EQ(free->chosen.recompute, Recompute::kNone);
  int64_t none_peak = 0, full_peak = 0;
  for (const LayoutCandidate& c : free->candidates) {
    if (c.recompute == Recompute::kNone) none_peak = c.peak_bytes;
    if (c.recompute == Recompute::kFull) full_peak = c.peak_bytes;
  }
  ASSERT_LT(full_peak, none_peak);
  // A budget between the two: full recomputation is the one that fits.
  absl::StatusOr<ResolvedLayout> tight = ResolveLayout(
      Spec(absl::StrCat(base, ", memory_budget_bytes: ", (full_peak + none_peak) / 2)));
  ASSERT_TRUE(tight.ok()) << tight.status();
  EXPECT_EQ(tight->chosen.recompute, Recompute::kFull);
  EXPECT_LE(tight->chosen.peak_bytes, (full_peak + none_peak) / 2);
  // Below every peak: refused, naming the smallest one.
  absl::StatusOr<ResolvedLayout> none =
      ResolveLayout(Spec(absl::StrCat(base, ", memory_budget_bytes: ", full_peak - 1)));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(),
              HasSubstr(absl::StrCat("the smallest predicted peak is ", full_peak, " bytes")));
  EXPECT_THAT(none.status().message(), HasSubstr("recompute full"));
}

TEST(Layout, RefusedLayoutsSayWhy) {
  // 2 heads: t = 4 cannot split them; 6 microbatches: d = 4 cannot split them.
  vocabpipe::v1::JobSpec spec = Spec(
      "world: 4, pipeline: auto, data: auto, tensor: auto, microbatches: 6, schedule: 1f1b, "
      "vocab: vocab2");
  spec.mutable_model()->set_heads(2);
  spec.mutable_model()->set_kv_heads(2);  // the default the spec gave GPT-2 (inert)
  absl::StatusOr<ResolvedLayout> r = ResolveLayout(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  bool saw_heads = false, saw_batch = false;
  for (const LayoutCandidate& c : r->candidates) {
    if (c.tensor == 4) {
      EXPECT_FALSE(c.planned);
      EXPECT_THAT(c.why, HasSubstr("model.heads: must be divisible by parallel.tensor"));
      saw_heads = true;
    }
    if (c.data == 4) {
      EXPECT_FALSE(c.planned);
      EXPECT_THAT(c.why, HasSubstr("microbatches do not split over 4 replicas"));
      saw_batch = true;
    }
  }
  EXPECT_TRUE(saw_heads && saw_batch);
  EXPECT_NE(r->chosen.tensor, 4);
  EXPECT_NE(r->chosen.data, 4);
  // An auto vocabulary method: tensor groups are planned with Vocab-2.
  vocabpipe::v1::JobSpec any_vocab = Spec(
      "world: 2, pipeline: 1, data: 1, tensor: auto, microbatches: 4, schedule: 1f1b, "
      "vocab: auto");
  absl::StatusOr<ResolvedLayout> v = ResolveLayout(any_vocab);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->candidates.size(), 1u);
  EXPECT_TRUE(v->candidates[0].planned) << v->candidates[0].why;
  EXPECT_EQ(v->candidates[0].vocab, "vocab2");
  // Axes given are kept.
  absl::StatusOr<ResolvedLayout> fixed = ResolveLayout(
      Spec("world: 4, pipeline: 2, data: auto, tensor: 1, microbatches: 8, schedule: 1f1b, "
           "vocab: vocab2"));
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  ASSERT_EQ(fixed->candidates.size(), 1u);
  EXPECT_EQ(fixed->chosen.data, 2);
}

TEST(Layout, SpecRules) {
  auto message = [](const std::string& parallel) {
    const std::string text = absl::StrCat(R"(name: layout
model: {layers: 8, hidden: 64, heads: 4, vocab_size: 4096, seq_len: 64}
parallel: {)",
                                          parallel, R"(}
data: {path: data.bin}
checkpoint: {dir: runs/layout}
)");
    return std::string(spec::ParseJobSpec(text, "/base").status().message());
  };
  EXPECT_THAT(message("pipeline: auto"),
              HasSubstr("parallel.pipeline: must be >= 1 (got 0); auto needs parallel.world"));
  EXPECT_THAT(message("world: 6, pipeline: 4, data: auto"),
              HasSubstr("parallel.world: must be a multiple of the axes given (6 % 4 != 0)"));
  EXPECT_THAT(message("world: 4, pipeline: 2, data: 1, tensor: 1"),
              HasSubstr("parallel.world: must equal data x tensor x pipeline when none is auto"));
  EXPECT_THAT(message("world: 4, data: 2, pipeline: auto, microbatches: 3"),
              HasSubstr("parallel.microbatches: must be divisible by parallel.data"));
  EXPECT_THAT(message("recompute: auto"), HasSubstr("(auto needs parallel.world)"));
  EXPECT_EQ(message("world: 4, pipeline: auto, recompute: auto, microbatches: 4"), "");
  EXPECT_THAT(message("seq_chunks: auto"),
              HasSubstr("parallel.seq_chunks: auto requires schedule seq1f1b, "
                        "seq1f1b-interleaved or auto (got schedule 1f1b)"));
  EXPECT_EQ(message("seq_chunks: auto, schedule: seq1f1b"), "");
}

// seq_chunks: auto with a Seq1F1B schedule: the auto choice weighs k = 2 and 4 and plans one.
TEST(Layout, SeqChunksAuto) {
  const vocabpipe::v1::JobSpec spec =
      Spec("pipeline: 2, microbatches: 4, schedule: seq1f1b, vocab: vocab2, seq_chunks: auto");
  EXPECT_EQ(spec.parallel().seq_chunks(), 0);
  absl::StatusOr<SpecPlan> built = BuildPlanFromSpec(spec);
  ASSERT_TRUE(built.ok()) << built.status();
  std::set<int> ks;
  for (const Candidate& c : built->candidates) ks.insert(c.seq_chunks);
  EXPECT_EQ(ks, (std::set<int>{2, 4}));
  EXPECT_TRUE(built->input.seq_chunks == 2 || built->input.seq_chunks == 4);
  EXPECT_EQ(built->plan.seq_bounds.size(), static_cast<size_t>(built->input.seq_chunks) + 1);
}

}  // namespace
}  // namespace vp::planner
