// vocabpipe-worker --run-dir DIR --rank R [--timeout SECONDS] [--attempt ID] [--resume-step N]
// One pipeline rank; started by `vocabpipe run` (worker/launch/launcher.h). Exit code 0 when
// the job's steps are done, 1 on any error (the message goes to stderr, the rank's log), 2 on
// bad usage.
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "worker/launch/worker.h"

namespace {

constexpr char kUsage[] =
    "usage: vocabpipe-worker --run-dir DIR --rank R [--timeout SECONDS] [--attempt ID] "
    "[--resume-step N]\n";

int Usage(const std::string& why) {
  std::cerr << "vocabpipe-worker: " << why << "\n" << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // Die with the launcher: a worker must never outlive the run that started it.
  const pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) return 1;

  vp::launch::WorkerOptions options;
  bool have_dir = false, have_rank = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return Usage(a + " needs a value");
    const std::string v = argv[++i];
    double seconds = 0;
    if (a == "--run-dir") {
      options.run_dir = v;
      have_dir = true;
    } else if (a == "--rank") {
      if (!absl::SimpleAtoi(v, &options.rank) || options.rank < 0) {
        return Usage("--rank: need an integer >= 0");
      }
      have_rank = true;
    } else if (a == "--timeout") {
      if (!absl::SimpleAtod(v, &seconds) || seconds <= 0) {
        return Usage("--timeout: need seconds > 0");
      }
      options.timeout = absl::Seconds(seconds);
    } else if (a == "--attempt") {
      options.attempt = v;
    } else if (a == "--resume-step") {
      if (!absl::SimpleAtoi(v, &options.resume_step) || options.resume_step < 0) {
        return Usage("--resume-step: need an integer >= 0");
      }
    } else {
      return Usage("unknown flag " + a);
    }
  }
  if (!have_dir || !have_rank) return Usage("--run-dir and --rank are required");
  const int rank = options.rank;
  // Leave without destructors: after a transport error the executor's communication thread
  // may still be blocked in Gloo until its timeout, and joining it would only delay the exit.
  auto fail = [rank](const absl::Status& st) {
    std::cerr << "rank " << rank << ": " << st.message() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);
  };
  options.on_fatal = fail;
  if (absl::Status st = vp::launch::RunWorker(options); !st.ok()) fail(st);
  std::cerr << "rank " << options.rank << ": done" << std::endl;
  return 0;
}
