#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "client/commands.h"
#include "gtest/gtest.h"

namespace {

// Each test writes its own folder: ctest runs the test cases as parallel processes.
std::string WriteJob(const std::string& name = "plan_cmd") {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/job.yaml";
  std::ofstream(path) << "model: {layers: 8, hidden: 64, heads: 4, vocab_size: 1000, seq_len: 64}\n"
                         "parallel: {pipeline: 4, microbatches: 8, schedule: 1f1b, vocab: vocab2}\n"
                         "data: {path: train.bin}\n";
  return path;
}

int RunPlan(const vp::cli::Args& args, std::string* out, std::string* err) {
  std::ostringstream o, e;
  const int rc = vp::cli::RunPlanCommand(args, o, e);
  *out = o.str();
  *err = e.str();
  return rc;
}

TEST(PlanCommand, JsonHasTheContractFields) {
  std::string out, err;
  ASSERT_EQ(RunPlan({WriteJob(), "--costs", "F=1,B=1,W=1,comm=0", "--vocab", "baseline", "--format",
                     "json"},
                    &out, &err),
            0)
      << err;
  for (const char* key :
       {"\"schedule\":\"1f1b\"", "\"vocab\":\"baseline\"", "\"pipeline\":4", "\"microbatches\":8",
        "\"makespan\":33", "\"bubble_ratio\"", "\"rank\":3", "\"actions\":[", "\"busy\":24",
        "\"peak_activation_microbatches\":4", "\"parameter_bytes\""})
    EXPECT_NE(out.find(key), std::string::npos) << key << "\n" << out.substr(0, 400);
}

TEST(PlanCommand, OverridesFormatsAndErrors) {
  const std::string job = WriteJob("plan_cmd_overrides");
  std::string out, err;
  EXPECT_EQ(RunPlan({job, "--schedule", "vhalf", "--format", "svg"}, &out, &err), 0) << err;
  EXPECT_EQ(out.rfind("<svg", 0), 0u);
  EXPECT_EQ(RunPlan({job, "--pipeline", "2", "--format", "text"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("pipeline 2"), std::string::npos);
  EXPECT_EQ(RunPlan({job, "--schedule", "seq1f1b", "--seq-chunks", "2"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("seq_chunks 2"), std::string::npos);
  EXPECT_EQ(RunPlan({job, "--schedule", "auto", "--vocab", "auto"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("chosen"), std::string::npos);
  EXPECT_EQ(RunPlan({job, "--pipeline", "16"}, &out, &err), 2);
  EXPECT_NE(err.find("model.layers"), std::string::npos);
  EXPECT_EQ(RunPlan({job, "--schedule", "gpipe"}, &out, &err), 2);
  EXPECT_EQ(RunPlan({job, "--costs", "F=x"}, &out, &err), 2);
  EXPECT_EQ(RunPlan({job, "--format", "pdf"}, &out, &err), 2);
  EXPECT_EQ(RunPlan({}, &out, &err), 2);
}

// A job with parallel.tensor: the plan shows (d, t, p), and every rank's bytes are a tensor
// rank's (about half of t = 1's at t = 2).
TEST(PlanCommand, ShowsTheTensorAxis) {
  const std::string dir = ::testing::TempDir() + "/plan_cmd_tensor";
  std::filesystem::create_directories(dir);
  for (const int t : {1, 2}) {
    std::ofstream(dir + "/job" + std::to_string(t) + ".yaml")
        << "model: {layers: 8, hidden: 64, heads: 4, vocab_size: 1000, seq_len: 64}\n"
           "parallel: {pipeline: 4, microbatches: 8, schedule: 1f1b, vocab: vocab2, tensor: "
        << t << "}\ndata: {path: train.bin}\n";
  }
  std::string out1, out2, err;
  ASSERT_EQ(RunPlan({dir + "/job2.yaml"}, &out2, &err), 0) << err;
  EXPECT_NE(out2.find("ranks (d, t, p) = (1, 2, 4)"), std::string::npos) << out2;
  ASSERT_EQ(RunPlan({dir + "/job1.yaml", "--format", "json"}, &out1, &err), 0) << err;
  ASSERT_EQ(RunPlan({dir + "/job2.yaml", "--format", "json"}, &out2, &err), 0) << err;
  EXPECT_NE(out2.find("\"tensor_parallel\":2"), std::string::npos);
  EXPECT_EQ(out1.find("\"tensor_parallel\""), std::string::npos);
  const auto bytes = [](const std::string& out) {
    const size_t at = out.find("\"parameter_bytes\":");
    return std::stod(out.substr(at + 18));
  };
  EXPECT_LT(bytes(out2), 0.6 * bytes(out1));
  EXPECT_GT(bytes(out2), 0.45 * bytes(out1));
}

// parallel.world with auto axes: the plan names the layout it chose; --explain adds the table
// of every candidate (d, t, p, recompute, predicted step time, tokens/s, peak bytes, why
// refused); a budget no layout fits is refused naming the smallest predicted peak.
TEST(PlanCommand, ChoosesTheLayoutOfAWorld) {
  const std::string dir = ::testing::TempDir() + "/plan_cmd_world";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/job.yaml")
      << "model: {layers: 8, hidden: 64, heads: 4, vocab_size: 1000, seq_len: 64}\n"
         "parallel: {world: 4, pipeline: auto, data: auto, tensor: auto, recompute: auto,\n"
         "           microbatches: 8, schedule: 1f1b, vocab: vocab2}\n"
         "data: {path: train.bin}\n";
  std::string out, err;
  ASSERT_EQ(RunPlan({dir + "/job.yaml"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("layout: d "), std::string::npos) << out;
  EXPECT_NE(out.find("of 18 candidates for 4 ranks"), std::string::npos) << out;
  EXPECT_EQ(out.find("tokens/s"), std::string::npos);  // the table only with --explain
  ASSERT_EQ(RunPlan({dir + "/job.yaml", "--explain"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("tokens/s"), std::string::npos) << out;
  EXPECT_NE(out.find("<- chosen"), std::string::npos) << out;
  EXPECT_NE(out.find("recompute"), std::string::npos) << out;
  EXPECT_EQ(RunPlan({dir + "/job.yaml", "--budget", "1000"}, &out, &err), 2);
  EXPECT_NE(err.find("the smallest predicted peak is"), std::string::npos) << err;
}

// Number after `"key":` in the JSON output (the first occurrence).
double JsonNumber(const std::string& out, const std::string& key) {
  const size_t at = out.find("\"" + key + "\":");
  EXPECT_NE(at, std::string::npos) << key;
  return at == std::string::npos ? -1 : std::stod(out.substr(at + key.size() + 3));
}

// --plan times a plan built before (a run's plan.txt) with the job's shape and --costs; the
// link keys give the communication its time (comm per rank in the JSON).
TEST(PlanCommand, SimulatesAGivenPlanWithTheLinkModel) {
  const std::string job = WriteJob("plan_cmd_given");
  std::string out, err;
  ASSERT_EQ(RunPlan({job, "--costs", "F=1,B=1,W=1", "--format", "text"}, &out, &err), 0) << err;
  const std::string plan_path = ::testing::TempDir() + "/plan_cmd_given/plan.txt";
  std::ofstream(plan_path) << out;
  ASSERT_EQ(
      RunPlan({job, "--plan", plan_path, "--costs", "F=1,B=1,W=1", "--format", "json"}, &out, &err),
      0)
      << err;
  const double free_makespan = JsonNumber(out, "makespan");
  EXPECT_EQ(JsonNumber(out, "comm"), 0);
  ASSERT_EQ(RunPlan({job, "--plan", plan_path, "--costs",
                     "F=1,B=1,W=1,p2p_lat=0.5,p2p_bw=0,ar_lat=0.25,ar_bw=1e6,bcast_lat=0.125",
                     "--format", "json"},
                    &out, &err),
            0)
      << err;
  EXPECT_GT(JsonNumber(out, "makespan"), free_makespan + 0.5);
  EXPECT_GT(JsonNumber(out, "comm"), 0);
  // A plan of another job, a bad link key.
  ASSERT_EQ(RunPlan({job, "--pipeline", "2", "--format", "text"}, &out, &err), 0) << err;
  std::ofstream(plan_path) << out;
  EXPECT_EQ(RunPlan({job, "--plan", plan_path}, &out, &err), 2);
  EXPECT_NE(err.find("--plan"), std::string::npos) << err;
  EXPECT_EQ(RunPlan({job, "--plan", plan_path + ".missing"}, &out, &err), 2);
  EXPECT_EQ(RunPlan({job, "--costs", "ar_bw=-1"}, &out, &err), 2);
  EXPECT_NE(err.find("ar_bw"), std::string::npos) << err;
}

}  // namespace
