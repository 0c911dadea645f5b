// vocabpipe sample CHECKPOINT [--prompt TEXT] [--max-tokens N] [--temperature T] [--top-k K]
//                             [--seed S] [--tokenizer FILE]:
// generates text from a checkpoint with the CPU engine and a key/value cache
// (worker/runtime/sampler.h). CHECKPOINT is a step folder (step_<N>, with config.json,
// model.safetensors and DONE) or a run folder (its latest complete step). The tokenizer is the
// tokenizer.model in the step folder unless --tokenizer names one. Prints the prompt followed
// by the generated text.
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/commands.h"
#include "worker/runtime/checkpoint.h"
#include "worker/runtime/sampler.h"

namespace vp::cli {
namespace fs = std::filesystem;
namespace {

constexpr char kUsage[] =
    "usage: vocabpipe sample CHECKPOINT [--prompt TEXT] [--max-tokens N] [--temperature T]\n"
    "                        [--top-k K] [--seed S] [--tokenizer FILE]\n"
    "  CHECKPOINT: a step folder (step_<N>) or a run folder (its latest complete step)\n"
    "  defaults: --max-tokens 64 --temperature 1 --top-k 0 (all) --seed 1337; an empty prompt\n"
    "  starts a new document\n";

}  // namespace

int RunSampleCommand(const Args& args, std::ostream& out, std::ostream& err) {
  std::string checkpoint, prompt, tokenizer;
  runtime::SampleOptions options;
  auto bad = [&](const std::string& what) {
    err << "vocabpipe sample: " << what << "\n" << kUsage;
    return 2;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      out << kUsage;
      return 0;
    }
    const bool has_value = i + 1 < args.size();
    const std::string v = has_value ? args[i + 1] : std::string();
    if (a == "--prompt" || a == "--tokenizer") {
      if (!has_value) return bad(a + " needs a value");
      (a == "--prompt" ? prompt : tokenizer) = v;
      ++i;
    } else if (a == "--max-tokens" || a == "--top-k") {
      int n = 0;
      if (!has_value || !absl::SimpleAtoi(v, &n)) return bad(a + " needs an integer");
      (a == "--max-tokens" ? options.max_tokens : options.top_k) = n;
      ++i;
    } else if (a == "--temperature") {
      float t = 0;
      if (!has_value || !absl::SimpleAtof(v, &t)) return bad("--temperature needs a number");
      options.temperature = t;
      ++i;
    } else if (a == "--seed") {
      uint64_t s = 0;
      if (!has_value || !absl::SimpleAtoi(v, &s)) return bad("--seed needs an integer >= 0");
      options.seed = s;
      ++i;
    } else if (!a.empty() && a[0] == '-') {
      return bad(absl::StrCat("unknown flag ", a));
    } else if (checkpoint.empty()) {
      checkpoint = a;
    } else {
      return bad("more than one CHECKPOINT given");
    }
  }
  if (checkpoint.empty()) return bad("missing CHECKPOINT");
  if (auto st = runtime::ValidateSampleOptions(options); !st.ok())
    return bad(std::string(st.message()));

  // A run folder: its latest complete step.
  std::string step_dir = checkpoint;
  std::error_code ec;
  if (!fs::exists(fs::path(checkpoint) / "config.json", ec)) {
    auto latest = runtime::LatestCheckpointStep(checkpoint);
    if (!latest.ok()) {
      err << "vocabpipe sample: " << checkpoint
          << ": neither a checkpoint step folder (no config.json) nor a run folder with a "
             "complete step\n";
      return 2;
    }
    step_dir = runtime::CheckpointDir(checkpoint, *latest);
  }
  if (tokenizer.empty()) tokenizer = (fs::path(step_dir) / "tokenizer.model").string();
  if (!fs::exists(tokenizer, ec)) {
    err << "vocabpipe sample: " << tokenizer
        << ": no tokenizer (train on `vocabpipe data tokenize` output, whose tokenizer.model "
           "is copied into each checkpoint, or pass --tokenizer)\n";
    return 2;
  }
  auto decoder = runtime::LoadDecoder(step_dir);
  if (!decoder.ok()) {
    err << "vocabpipe sample: " << decoder.status().message() << "\n";
    return absl::IsUnimplemented(decoder.status()) ? 2 : 1;
  }
  auto sample = runtime::SampleText(**decoder, tokenizer, prompt, options);
  if (!sample.ok()) {
    err << "vocabpipe sample: " << sample.status().message() << "\n";
    const auto code = sample.status().code();
    return code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kOutOfRange ||
                   code == absl::StatusCode::kFailedPrecondition
               ? 2
               : 1;
  }
  out << prompt << sample->text << "\n";
  return 0;
}

}  // namespace vp::cli
