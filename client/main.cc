// vocabpipe: the command-line interface. `vocabpipe help` lists the commands.
#include <iostream>
#include <string>

#include "client/commands.h"
#include "client/version.h"

namespace {

constexpr char kUsage[] = R"(vocabpipe — vocabulary-parallel pipeline training

usage: vocabpipe COMMAND [ARGS]

commands:
  run JOB.yaml [--resume] [--steps N] [--timeout S]
                                        train a job: in this process (pipeline 1) or on
                                        p local vocabpipe-worker processes (pipeline p > 1)
  export RUN_DIR [--step N]             merge per-rank checkpoint shards into
                                        step_N/model.safetensors (Hugging Face GPT-2)
  plan JOB.yaml [--format table|json|text|svg] [overrides]
                                        build, check and simulate the pipeline plan (offline)
  data synth --vocab V --tokens N --out FILE [--seed S] [--branching K]
                                        write a synthetic Markov-chain corpus
  data inspect FILE [--vocab V]         show and validate a token file
  version                               print the version

exit codes: 0 ok, 1 the command failed while running, 2 bad usage or invalid input
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string cmd = argv[1];
  vp::cli::Args args(argv + 2, argv + argc);
  if (cmd == "run") return vp::cli::RunRunCommand(args, std::cout, std::cerr);
  if (cmd == "plan") return vp::cli::RunPlanCommand(args, std::cout, std::cerr);
  if (cmd == "data") return vp::cli::RunDataCommand(args, std::cout, std::cerr);
  if (cmd == "export") return vp::cli::RunExportCommand(args, std::cout, std::cerr);
  if (cmd == "version" || cmd == "--version") {
    std::cout << "vocabpipe " << vp::cli::Version() << "\n";
    return 0;
  }
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::cout << kUsage;
    return 0;
  }
  std::cerr << "vocabpipe: unknown command '" << cmd << "'\n\n" << kUsage;
  return 2;
}
