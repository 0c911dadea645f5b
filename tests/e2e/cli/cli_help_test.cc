// Help as a newcomer asks for it, through the binary: --help reaches the command named, and
// the top-level help lists every command.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/support/vocabpipe_cli.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using vp::testing::Vocabpipe;

// The binary routes --help to the command (every command's usage is tests/unit/client/
// help_test's, in-process: each start of the binary costs about a second on a loaded machine).
TEST(CliHelp, TheBinaryRoutesHelpToTheCommand) {
  const std::vector<std::pair<std::string, std::string>> commands = {
      {"submit --help", "usage: vocabpipe submit JOB.yaml"},
      {"plan job.yaml --coordinator 127.0.0.1:1 -h",
       "usage: vocabpipe plan JOB.yaml --coordinator"},
      {"data tokenize --help", "vocabpipe data tokenize"},
      {"version --help", "usage: vocabpipe version"},
  };
  for (const auto& [line, usage] : commands) {
    const vp::testing::CliResult r = Vocabpipe(line);
    EXPECT_EQ(r.code, 0) << line << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(usage)) << line;
    EXPECT_THAT(r.output, Not(HasSubstr("unknown flag"))) << line;
  }
}

TEST(CliHelp, TopLevelHelpListsEveryCommand) {
  const vp::testing::CliResult r = Vocabpipe("--help");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* command : {"run JOB.yaml",   "run JOB.yaml --direct",
                              "export RUN_DIR", "report RUN_DIR",
                              "plan JOB.yaml",  "submit JOB.yaml",
                              "status [JOB]",   "watch JOB",
                              "cancel JOB",     "workers",
                              "certs init",     "certs worker",
                              "certs token",    "data synth",
                              "data inspect",   "data train-tokenizer",
                              "data tokenize",  "sample CHECKPOINT",
                              "version",        "help"}) {
    EXPECT_THAT(r.output, HasSubstr("  " + std::string(command))) << command;
  }
  EXPECT_EQ(Vocabpipe("help").output, r.output);
}

}  // namespace
