// `vocabpipe report` on the run directory of a real 2-rank pipeline run (launcher + worker
// processes): the SVG parses as XML (expat) and names every rank; bad run directories get an
// error naming the file without echoing its contents.
#include <expat.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/support/vocabpipe_cli.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using vp::testing::Vocabpipe;

// The concatenated character data of an XML document; false when it does not parse.
bool ParseXml(const std::string& doc, std::string* text) {
  XML_Parser parser = XML_ParserCreate("UTF-8");
  XML_SetUserData(parser, text);
  XML_SetCharacterDataHandler(parser, [](void* user, const XML_Char* s, int len) {
    static_cast<std::string*>(user)->append(s, len);
  });
  const bool ok = XML_Parse(parser, doc.data(), static_cast<int>(doc.size()), 1) == XML_STATUS_OK;
  XML_ParserFree(parser);
  return ok;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class CliReportTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("vp_report_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A tiny p = 2 vocab1 job over synthetic data: dir_/job.yaml, saving to dir_/`checkpoint_dir`.
  void WriteTinyJob(int steps, const std::string& checkpoint_dir) {
    auto synth = Vocabpipe(absl::StrCat("data synth --vocab 64 --tokens 2000 --seed 3 --out ",
                                        (dir_ / "data.bin").string()));
    ASSERT_EQ(synth.code, 0) << synth.output;
    std::ofstream(dir_ / "job.yaml")
        << "model: {layers: 2, hidden: 32, heads: 4, vocab_size: 64, seq_len: 16}\n"
        << "parallel: {pipeline: 2, microbatches: 2, vocab: vocab1}\n"
        << "train: {steps: " << steps << ", threads: 1}\n"
        << "data: {path: data.bin}\n"
        << "checkpoint: {dir: " << checkpoint_dir << "}\n";
  }
  fs::path dir_;
};

TEST_F(CliReportTest, ReportOfARealPipelineRunParsesAndNamesEveryRank) {
  ASSERT_NO_FATAL_FAILURE(WriteTinyJob(3, "run"));
  auto run = Vocabpipe("run --direct " + (dir_ / "job.yaml").string());
  ASSERT_EQ(run.code, 0) << run.output;

  auto report = Vocabpipe("report " + (dir_ / "run").string());
  ASSERT_EQ(report.code, 0) << report.output;
  EXPECT_THAT(report.output, HasSubstr("report.svg"));
  const std::string svg = ReadFile(dir_ / "run" / "report.svg");
  std::string text;
  ASSERT_TRUE(ParseXml(svg, &text)) << "report.svg is not well-formed XML";
  for (const char* want : {"rank 0", "rank 1", "Loss", "tokens/s", "Peak memory", "measured",
                           "predicted", "Plan timeline", "vocab1"}) {
    EXPECT_THAT(text, HasSubstr(want));
  }
  const std::string html = ReadFile(dir_ / "run" / "report.html");
  EXPECT_THAT(html, HasSubstr("<!DOCTYPE html>"));
  EXPECT_THAT(html, HasSubstr("<svg"));

  // A malformed metrics line: the error names the file and the line, not the contents.
  {
    std::ofstream f(dir_ / "run" / "metrics.jsonl", std::ios::app);
    f << "SECRET-CONTENT{\n";
  }
  auto bad = Vocabpipe("report " + (dir_ / "run").string());
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("metrics.jsonl: line 4: not a JSON object"));
  EXPECT_THAT(bad.output, Not(HasSubstr("SECRET")));

  // A field of the wrong type.
  std::ofstream(dir_ / "run" / "metrics.jsonl", std::ios::trunc)
      << R"({"step": 0, "loss": "SECRET"})"
      << "\n";
  bad = Vocabpipe("report " + (dir_ / "run").string());
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("line 1.loss: must be a number"));
  EXPECT_THAT(bad.output, Not(HasSubstr("SECRET")));

  // No metrics at all.
  fs::remove(dir_ / "run" / "metrics.jsonl");
  bad = Vocabpipe("report " + (dir_ / "run").string());
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.output, HasSubstr("metrics.jsonl: missing"));
}

// Plain `vocabpipe run` goes through the local control plane: each worker daemon leaves only
// its rank's slice of the plan (plan_rank_R.txt), and the report rebuilds the whole plan from
// them to time it.
TEST_F(CliReportTest, ReportOfAControlPlaneRunRebuildsThePlanFromItsSlices) {
  ASSERT_NO_FATAL_FAILURE(WriteTinyJob(2, "cp"));
  auto run = Vocabpipe("run " + (dir_ / "job.yaml").string());
  ASSERT_EQ(run.code, 0) << run.output;
  ASSERT_TRUE(fs::exists(dir_ / "cp" / "plan_rank_0.txt"));
  ASSERT_TRUE(fs::exists(dir_ / "cp" / "plan_rank_1.txt"));

  auto report = Vocabpipe("report " + (dir_ / "cp").string());
  ASSERT_EQ(report.code, 0) << report.output;
  std::string text;
  ASSERT_TRUE(ParseXml(ReadFile(dir_ / "cp" / "report.svg"), &text));
  for (const char* want : {"rank 0", "rank 1", "Plan timeline", "vocab1"}) {
    EXPECT_THAT(text, HasSubstr(want));
  }
}

TEST_F(CliReportTest, MissingOrForeignDirectoryIsAClearError) {
  auto missing = Vocabpipe("report " + (dir_ / "nope").string());
  EXPECT_EQ(missing.code, 2);
  EXPECT_THAT(missing.output, HasSubstr("nope: not a directory"));
  // A folder without job.yaml / plan.txt.
  auto foreign = Vocabpipe("report " + dir_.string());
  EXPECT_EQ(foreign.code, 2);
  EXPECT_THAT(foreign.output, HasSubstr("is not a pipeline run directory"));
  EXPECT_THAT(foreign.output, HasSubstr("job.yaml"));
  auto usage = Vocabpipe("report");
  EXPECT_EQ(usage.code, 2);
  EXPECT_THAT(usage.output, HasSubstr("usage: vocabpipe report"));
}

}  // namespace
