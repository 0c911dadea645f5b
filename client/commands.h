// Subcommands of the `vocabpipe` CLI. Each takes the arguments after its name and returns the
// process exit code (0 ok, 1 runtime failure, 2 usage or invalid input; see docs/operations.md).
// Output goes to the given streams so tests can capture it.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace vp::cli {

using Args = std::vector<std::string>;

// Whether the arguments ask for help (-h or --help anywhere): every command then prints its
// usage to `out` and exits 0, doing nothing else.
inline bool WantsHelp(const Args& args) {
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") return true;
  }
  return false;
}

// vocabpipe data synth --vocab V --tokens N --out F [--seed S] [--branching K]
int RunDataCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe plan job.yaml [--pipeline P ...] [--format table|json|text|svg]
int RunPlanCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe run job.yaml [--resume] [--steps N] [--coordinator ADDR | --direct]: through an
// in-process coordinator and local worker daemons (default), a running coordinator, or
// without a control plane (run_command.cc)
int RunRunCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe certs init DIR [--hosts H,...] | certs token USER --tokens FILE [--role R]:
// a CA and TLS certificates, bearer tokens (certs_command.cc)
int RunCertsCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe export RUN_DIR [--step N]: merges per-rank checkpoint shards into model.safetensors
int RunExportCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe sample CHECKPOINT [--prompt TEXT] [--max-tokens N] [--temperature T] [--top-k K]
// [--seed S]: text from a checkpoint (sample_command.cc)
int RunSampleCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe report RUN_DIR [--out PREFIX]: an SVG + HTML report of a run (report_command.cc)
int RunReportCommand(const Args& args, std::ostream& out, std::ostream& err);

// Control plane (client/control_client.h: --coordinator or $VOCABPIPE_COORDINATOR, --output
// text|json, exit codes 0-5).
// vocabpipe submit JOB.yaml: prints the job id
int RunSubmitCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe status [JOB]: one job's record or every job
int RunStatusCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe watch JOB [--after-event N]: follows a job to its end (progress bars)
int RunWatchCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe cancel JOB [--reason TEXT]
int RunCancelCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe workers: the registered worker daemons
int RunWorkersCommand(const Args& args, std::ostream& out, std::ostream& err);
// vocabpipe plan JOB.yaml --coordinator ADDR: the coordinator's dry run (remote_commands.cc)
int RunRemotePlanCommand(const Args& args, std::ostream& out, std::ostream& err);

}  // namespace vp::cli
