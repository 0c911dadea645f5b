// Help as a newcomer asks for it: every subcommand answers --help (and -h) with its own usage
// and exit code 0, doing nothing else; the top-level help lists every command.
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

TEST(CliHelp, EverySubcommandAnswersHelpWithItsUsage) {
  // {the command line before --help, what its usage must name}
  const std::vector<std::pair<std::string, std::string>> commands = {
      {"run", "usage: vocabpipe run JOB.yaml"},
      {"run job.yaml --direct", "usage: vocabpipe run JOB.yaml"},
      {"plan", "usage: vocabpipe plan job.yaml"},
      {"plan job.yaml --coordinator 127.0.0.1:1", "usage: vocabpipe plan JOB.yaml --coordinator"},
      {"export", "usage: vocabpipe export RUN_DIR"},
      {"report", "usage: vocabpipe report RUN_DIR"},
      {"sample", "usage: vocabpipe sample"},
      {"submit", "usage: vocabpipe submit JOB.yaml"},
      {"status", "usage: vocabpipe status"},
      {"watch", "usage: vocabpipe watch JOB"},
      {"cancel", "usage: vocabpipe cancel JOB"},
      {"workers", "usage: vocabpipe workers"},
      {"certs", "usage: vocabpipe certs init DIR"},
      {"certs token alice", "vocabpipe certs token USER"},
      {"data", "vocabpipe data synth"},
      {"data synth", "vocabpipe data synth"},
      {"data inspect", "vocabpipe data inspect"},
      {"data train-tokenizer", "vocabpipe data train-tokenizer"},
      {"data tokenize", "vocabpipe data tokenize"},
      {"version", "usage: vocabpipe version"},
  };
  // --help on every command line; -h, its short form, on every fourth (each start of the
  // binary costs about a second on a loaded machine).
  for (size_t i = 0; i < commands.size(); ++i) {
    const auto& [line, usage] = commands[i];
    for (const char* flag : {"--help", "-h"}) {
      if (flag[1] == 'h' && i % 4 != 0) continue;
      const vp::testing::CliResult r = Vocabpipe(line + " " + flag);
      EXPECT_EQ(r.code, 0) << line << " " << flag << "\n" << r.output;
      EXPECT_THAT(r.output, HasSubstr(usage)) << line << " " << flag;
      EXPECT_THAT(r.output, Not(HasSubstr("unknown flag"))) << line << " " << flag;
    }
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
