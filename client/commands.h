// Subcommands of the `vocabpipe` CLI. Each takes the arguments after its name and returns the
// process exit code (0 ok, 1 runtime failure, 2 usage or invalid input; see docs/operations.md).
// Output goes to the given streams so tests can capture it.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace vp::cli {

using Args = std::vector<std::string>;

// vocabpipe data synth --vocab V --tokens N --out F [--seed S] [--branching K]
int RunDataCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe plan job.yaml [--pipeline P ...] [--format table|json|text|svg]
int RunPlanCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe run job.yaml [--resume] [--steps N]
int RunRunCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe export RUN_DIR [--step N]: merges per-rank checkpoint shards into model.safetensors
int RunExportCommand(const Args& args, std::ostream& out, std::ostream& err);

}  // namespace vp::cli
