// Every subcommand answers --help (and -h) with its own usage on stdout and exit code 0, doing
// nothing else, wherever the flag stands among its arguments (the command functions directly;
// tests/e2e/cli/cli_help_test runs the binary for the top-level list and the dispatch).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "client/commands.h"

namespace vp::cli {
namespace {

using ::testing::HasSubstr;

struct Case {
  std::function<int(const Args&, std::ostream&, std::ostream&)> run;
  Args before;        // arguments in front of the flag
  std::string usage;  // what the usage must name
};

TEST(Help, EverySubcommandAnswersHelpWithItsUsage) {
  const std::vector<Case> cases = {
      {RunRunCommand, {}, "usage: vocabpipe run JOB.yaml"},
      {RunRunCommand, {"job.yaml", "--direct"}, "usage: vocabpipe run JOB.yaml"},
      {RunPlanCommand, {}, "usage: vocabpipe plan job.yaml"},
      {RunRemotePlanCommand, {"job.yaml"}, "usage: vocabpipe plan JOB.yaml --coordinator"},
      {RunExportCommand, {}, "usage: vocabpipe export RUN_DIR"},
      {RunReportCommand, {}, "usage: vocabpipe report RUN_DIR"},
      {RunSampleCommand, {}, "usage: vocabpipe sample"},
      {RunSubmitCommand, {}, "usage: vocabpipe submit JOB.yaml"},
      {RunStatusCommand, {}, "usage: vocabpipe status"},
      {RunWatchCommand, {"job-1"}, "usage: vocabpipe watch JOB"},
      {RunCancelCommand, {}, "usage: vocabpipe cancel JOB"},
      {RunWorkersCommand, {}, "usage: vocabpipe workers"},
      {RunCertsCommand, {}, "usage: vocabpipe certs init DIR"},
      {RunCertsCommand, {"token", "alice"}, "vocabpipe certs token USER"},
      {RunDataCommand, {}, "vocabpipe data synth"},
      {RunDataCommand, {"synth"}, "vocabpipe data synth"},
      {RunDataCommand, {"inspect"}, "vocabpipe data inspect"},
      {RunDataCommand, {"train-tokenizer"}, "vocabpipe data train-tokenizer"},
      {RunDataCommand, {"tokenize", "--out"}, "vocabpipe data tokenize"},
  };
  for (const Case& c : cases) {
    for (const char* flag : {"--help", "-h"}) {
      Args args = c.before;
      args.push_back(flag);
      std::ostringstream out, err;
      const int code = c.run(args, out, err);
      const std::string what = c.usage + " with " + flag;
      EXPECT_EQ(code, 0) << what << ": " << err.str();
      EXPECT_THAT(out.str(), HasSubstr(c.usage)) << what;
      EXPECT_EQ(err.str(), "") << what;
    }
  }
}

}  // namespace
}  // namespace vp::cli
