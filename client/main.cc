// vocabpipe: the command-line interface. `vocabpipe help` lists the commands.
#include <algorithm>
#include <iostream>
#include <string>

#include "client/commands.h"
#include "client/version.h"
#include "worker/launch/cuda_environment.h"

namespace {

constexpr char kUsage[] = R"(vocabpipe — vocabulary-parallel pipeline training

usage: vocabpipe COMMAND [ARGS]

commands:
  run JOB.yaml [--resume] [--steps N] [--timeout S] [--output text|json]
                                        train a job through an in-process coordinator and
                                        p local worker daemons (the control plane's gRPC
                                        path); writes metrics.jsonl and checkpoints
  run JOB.yaml --direct                 the same without the control plane: in this
                                        process (p = 1) or p rank processes (p > 1)
  export RUN_DIR [--step N]             merge per-rank checkpoint shards into
                                        step_N/model.safetensors (Hugging Face GPT-2)
  report RUN_DIR [--out PREFIX]         an SVG (and HTML) report of a run: loss, tokens/s,
                                        per-rank busy and memory beside the planner's
                                        prediction, the plan timeline (RUN_DIR/report.svg)
  plan JOB.yaml [--format table|json|text|svg] [overrides]
                                        build, check and simulate the pipeline plan (offline)
  run JOB.yaml --coordinator HOST:PORT  submit to a coordinator and watch to the end
  plan JOB.yaml --coordinator HOST:PORT the coordinator's dry run (plan, candidates)
  submit JOB.yaml                       send a job to the coordinator; prints its id
  status [JOB]                          one job (state, step, loss, MFU, plan, stages) or all
  watch JOB [--after-event N]           follow a job: progress, loss, tok/s, MFU, ETA, memory
  cancel JOB [--reason TEXT]            stop a job; its workers are free again
  workers                               the registered worker daemons
                                        (these five take --coordinator HOST:PORT, default
                                        $VOCABPIPE_COORDINATOR, --output text|json, and
                                        --tls-ca FILE with $VOCABPIPE_TOKEN, or --insecure
                                        for a loopback coordinator)
  certs init DIR [--hosts H1,H2]        a CA, the coordinator's and the workers' TLS
                                        certificates (OpenSSL), keys 0600
  certs worker NAME DIR                 a worker certificate of its own (CN=NAME) from
                                        DIR's CA; prints its serial and fingerprint
  certs token USER --tokens FILE [--role user|admin] [--days N | --expires TIME]
                                        a bearer token for USER; its hash (and expiry)
                                        goes to FILE
  data synth --vocab V --tokens N --out FILE [--seed S] [--branching K]
                                        write a synthetic Markov-chain corpus
  data inspect FILE [--vocab V]         show and validate a token file
  data train-tokenizer TEXT... --vocab-size N --out FILE [--model-type bpe|unigram]
                                        train a SentencePiece tokenizer on text files
  data tokenize --tokenizer FILE TEXT... --out DIR [--val-fraction X] [--shard-tokens N]
                                        text files to train/validation token shards
  sample CHECKPOINT [--prompt TEXT] [--max-tokens N] [--temperature T] [--top-k K] [--seed S]
                                        text from a checkpoint (KV-cache decoding on the CPU)
  version                               print the version
  help                                  this list; COMMAND --help prints a command's usage

exit codes: 0 ok, 1 the command failed while running, 2 bad usage or invalid input,
            3 no such job, 4 coordinator unreachable, 5 the watched job was cancelled
)";

}  // namespace

int main(int argc, char** argv) {
  // Before anything can initialise CUDA; rank processes inherit it (cuda_environment.h).
  if (const std::string note = vp::launch::PrepareCudaEnvironment(); !note.empty()) {
    std::cerr << "vocabpipe: " << note << "\n";
  }
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string cmd = argv[1];
  vp::cli::Args args(argv + 2, argv + argc);
  // --coordinator sends plan to a coordinator's dry run.
  const bool control = std::find(args.begin(), args.end(), "--coordinator") != args.end();
  if (cmd == "plan" && control) return vp::cli::RunRemotePlanCommand(args, std::cout, std::cerr);
  if (cmd == "run") return vp::cli::RunRunCommand(args, std::cout, std::cerr);
  if (cmd == "plan") return vp::cli::RunPlanCommand(args, std::cout, std::cerr);
  if (cmd == "data") return vp::cli::RunDataCommand(args, std::cout, std::cerr);
  if (cmd == "certs") return vp::cli::RunCertsCommand(args, std::cout, std::cerr);
  if (cmd == "export") return vp::cli::RunExportCommand(args, std::cout, std::cerr);
  if (cmd == "sample") return vp::cli::RunSampleCommand(args, std::cout, std::cerr);
  if (cmd == "report") return vp::cli::RunReportCommand(args, std::cout, std::cerr);
  if (cmd == "submit") return vp::cli::RunSubmitCommand(args, std::cout, std::cerr);
  if (cmd == "status") return vp::cli::RunStatusCommand(args, std::cout, std::cerr);
  if (cmd == "watch") return vp::cli::RunWatchCommand(args, std::cout, std::cerr);
  if (cmd == "cancel") return vp::cli::RunCancelCommand(args, std::cout, std::cerr);
  if (cmd == "workers") return vp::cli::RunWorkersCommand(args, std::cout, std::cerr);
  if (cmd == "version" && vp::cli::WantsHelp(args)) {
    std::cout << "usage: vocabpipe version\n";
    return 0;
  }
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
