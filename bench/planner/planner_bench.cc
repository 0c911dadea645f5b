// planner_bench: (1) time to build + validate + simulate a p=64, m=1024 plan; (2) the paper's
// 8-GPU model (Table 5 setup) simulated with FLOP-proportional A100 costs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "coordinator/planner/planner.h"
#include "tests/support/planner_fixtures.h"

using namespace vp::planner;

// --svg DIR: writes some docs/img pictures (the renderer behind `vocabpipe plan --format svg`);
// vhalf-vocab1 and vmin-vocab2 are made by the CLI itself (docs/planner.md, "Pictures").
static int WriteSvgs(const std::string& dir) {
  struct Pic {
    const char* name;
    Schedule s;
    VocabMethod v;
    int k;
  };
  for (Pic pic : {Pic{"1f1b-vocab2", Schedule::k1F1B, VocabMethod::kVocab2, 1},
                  Pic{"1f1b-baseline", Schedule::k1F1B, VocabMethod::kBaseline, 1},
                  Pic{"zbv-vocab2", Schedule::kZBV, VocabMethod::kVocab2, 1},
                  Pic{"seq1f1b-vocab2", Schedule::kSeq1F1B, VocabMethod::kVocab2, 2}}) {
    const PlannerInput in = fixtures::ShapeInput(4, 8, 16, pic.s, pic.v, pic.k);
    auto plan = BuildPlan(in);
    if (!plan.ok()) return 1;
    auto sim = Simulate(*plan, in);
    std::ofstream(dir + "/" + pic.name + ".svg") << RenderSvg(*plan, *sim);
  }
  return 0;
}

int main(int argc, char** argv) {
  // --svg DIR: pictures; --only SCHEDULE: time that schedule only (and skip the paper table);
  // --repeat N: time each plan N times and report the fastest and the median run (wall clock
  // and CPU), so a run on a machine shared with other jobs still shows what the planner costs.
  std::string only;
  int repeat = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--svg") return WriteSvgs(argv[i + 1]);
    if (flag == "--only") {
      only = argv[i + 1];
    } else if (flag == "--repeat") {
      repeat = std::max(1, std::atoi(argv[i + 1]));
    } else {
      return std::printf("unknown flag %s (use --svg DIR, --only SCHEDULE, --repeat N)\n",
                         flag.c_str()),
             2;
    }
  }
  for (Schedule s : {Schedule::k1F1B, Schedule::kVHalf, Schedule::kVMin, Schedule::kZBH1})
    for (VocabMethod v : {VocabMethod::kBaseline, VocabMethod::kVocab2, VocabMethod::kVocab1}) {
      if (!only.empty() && ScheduleName(s) != only) continue;
      PlannerInput in = fixtures::ShapeInput(64, 1024, 128, s, v);
      in.costs = fixtures::UnitCosts(/*vocab_pass=*/0.3, /*input_pass=*/0.05, /*comm=*/0.01);
      std::vector<double> walls, cpus;
      size_t n = 0;
      double bubble = 0;
      for (int rep = 0; rep < repeat; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::clock_t c0 = std::clock();
        // Builds, lowers, then validates and times in one run of the abstract machine.
        auto built = BuildAndSimulate(in);
        if (!built.ok())
          return std::printf("%s\n", std::string(built.status().message()).c_str()), 1;
        walls.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        // CPU time as well: on a shared machine the wall clock includes other jobs.
        cpus.push_back(static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC);
        n = 0;
        for (auto& r : built->plan.ranks) n += r.actions.size();
        bubble = built->sim.bubble_ratio;
      }
      std::sort(walls.begin(), walls.end());
      std::sort(cpus.begin(), cpus.end());
      std::printf(
          "p=64 m=1024 %-6s %-8s actions=%zu build+validate+simulate wall %.3f s (median %.3f) "
          "cpu %.3f s (median %.3f), %d run%s, bubble %.3f\n",
          std::string(ScheduleName(s)).c_str(), std::string(VocabName(v)).c_str(), n, walls[0],
          walls[walls.size() / 2], cpus[0], cpus[cpus.size() / 2], repeat, repeat > 1 ? "s" : "",
          bubble);
    }
  if (!only.empty()) return 0;
  std::printf(
      "\nPaper 8-GPU model: 32 layers, h=3072, s=4096, 128 microbatches, 1F1B, A100 312 TFLOPS\n");
  std::printf("%-10s %8s %8s %8s %8s   peak act+state GB on worst rank (32k..256k)\n", "method",
              "32k", "64k", "128k", "256k");
  for (VocabMethod v : {VocabMethod::kBaseline, VocabMethod::kRedis, VocabMethod::kVocab1,
                        VocabMethod::kVocab2, VocabMethod::kInterlaced}) {
    std::printf("%-10s", std::string(VocabName(v)).c_str());
    std::string mem;
    for (int64_t vocab : {32768, 65536, 131072, 262144}) {
      const PlannerInput in = fixtures::PaperEightGpuModel(vocab, v);
      auto plan = BuildPlan(in);
      if (!plan.ok()) return std::printf("%s\n", std::string(plan.status().message()).c_str()), 1;
      auto sim = Simulate(*plan, in);
      double peak = 0;
      for (auto& r : sim->ranks)
        peak = std::max(peak, double(r.peak_activation_bytes + r.state_bytes) / 1e9);
      std::printf(" %7.2f%%", 100 * sim->mfu);
      char buf[32];
      std::snprintf(buf, sizeof buf, " %6.1f", peak);
      mem += buf;
    }
    std::printf("  %s\n", mem.c_str());
  }
  return 0;
}
