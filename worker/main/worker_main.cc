// vocabpipe-worker, two modes (and two helpers: --profile-task, a daemon's profiling child, and
// --profile-comm RANKS --floats SMALL,LARGE, the communication profile alone; profile.h):
//
//   vocabpipe-worker --coordinator HOST:PORT [--device cpu|cuda:N] [--address auto|IP]
//       [--rank-hint N] (--tls-ca FILE --tls-cert FILE --tls-key FILE | --insecure)
//       [--storage-root DIR] [--profile-memory-limit BYTES] [--exit-with-parent 1]
//       The worker daemon (worker/daemon/worker_daemon.h): registers with the coordinator,
//       heartbeats and runs the ranks it is given until SIGINT/SIGTERM. The address may also
//       come from $VOCABPIPE_COORDINATOR. The IP it advertises (and its ranks bind to) is
//       --address, else $POD_IP, else (auto) the source address of the route to the
//       coordinator (worker/daemon/address.h). --rank-hint: the rank to take (the platform's
//       worker index). On SIGTERM while a rank runs, the rank gets --preempt-grace seconds
//       (default 25) to save an emergency checkpoint and stop before the daemon exits.
//       Exit code 0 when stopped by a signal, 2 on bad usage.
//
//   vocabpipe-worker --run-dir DIR --rank R [--timeout SECONDS] [--attempt ID] [--run-id ID]
//       [--resume-step N] [--store HOST:PORT [--tls-ca F --tls-cert F --tls-key F | --insecure]]
//       [--hostname IP]
//       One pipeline rank; started by `vocabpipe run` (client/launcher.h) or by a worker daemon
//       (then --store names the coordinator whose StoreService holds the rendezvous, and the
//       run's rendezvous secret comes from $VOCABPIPE_STORE_SECRET, set by the daemon). Exit
//       code 0 when the job's steps are done, 1 on any error (the message goes to stderr, the
//       rank's log), 2 on bad usage, 75 after a preemption: on SIGTERM the ranks agree on a step,
//       save an emergency checkpoint after it and stop (worker/launch/preemption.h).
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "proto/grpc/auth.h"
#include "proto/spec/storage_root.h"
#include "worker/daemon/address.h"
#include "worker/daemon/profile.h"
#include "worker/daemon/worker_daemon.h"
#include "worker/launch/cuda_environment.h"
#include "worker/launch/grpc_store.h"
#include "worker/launch/preemption.h"
#include "worker/launch/worker.h"

namespace {

constexpr char kUsage[] =
    "usage: vocabpipe-worker --coordinator HOST:PORT [--device cpu|cuda:N] [--address auto|IP] "
    "[--rank-hint N]\n"
    "         (--tls-ca FILE --tls-cert FILE --tls-key FILE | --insecure)\n"
    "         [--storage-root DIR] [--profile-memory-limit BYTES] [--preempt-grace SECONDS]\n"
    "       vocabpipe-worker --run-dir DIR --rank R [--timeout SECONDS] [--attempt ID] [--run-id "
    "ID] "
    "[--cuda-device N] "
    "[--resume-step N] [--store HOST:PORT (TLS flags | --insecure)] [--hostname IP]\n"
    "       vocabpipe-worker --profile-comm RANKS --floats SMALL,LARGE\n";

int Usage(const std::string& why) {
  std::cerr << "vocabpipe-worker: " << why << "\n" << kUsage;
  return 2;
}

bool IsDaemonMode(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--coordinator") return true;
    if (a == "--run-dir") return false;
  }
  const char* env = std::getenv("VOCABPIPE_COORDINATOR");
  return env != nullptr && *env != '\0';
}

// Set by SIGINT/SIGTERM in a daemon, by SIGTERM in a rank (a preemption). A handler, not a
// sigwait thread: OpenBLAS starts its threads before
// main with the signals unblocked, and a signal delivered to one of them would kill the daemon
// (exit 143) instead of stopping it. The only global: a signal handler can reach nothing else.
std::atomic<bool> g_stop{false};

void OnStopSignal(int) { g_stop.store(true); }

int DaemonMain(int argc, char** argv) {
  vp::daemon::DaemonOptions options;
  std::string address_flag;
  if (const char* env = std::getenv("VOCABPIPE_COORDINATOR")) options.coordinator = env;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--insecure") {
      options.insecure = true;
      continue;
    }
    if (i + 1 >= argc) return Usage(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--coordinator") {
      options.coordinator = v;
    } else if (vp::auth::SetTlsFlag(a, v, options.tls)) {
      // --tls-ca, --tls-cert or --tls-key: stored
    } else if (a == "--device") {
      options.device = v;
    } else if (a == "--address") {
      address_flag = v;
    } else if (a == "--rank-hint") {
      if (!absl::SimpleAtoi(v, &options.rank_hint) || options.rank_hint < 0) {
        return Usage("--rank-hint: need an integer >= 0");
      }
    } else if (a == "--profile-memory-limit") {
      int64_t bytes = 0;
      if (!absl::SimpleAtoi(v, &bytes) || bytes < 0) {
        return Usage("--profile-memory-limit: need bytes >= 0");
      }
      options.profile_memory_limit = bytes;
    } else if (a == "--storage-root") {
      auto root = vp::spec::ResolveStorageRoot(v);
      if (!root.ok()) return Usage(std::string(root.status().message()));
      options.storage_root = *root;
    } else if (a == "--preempt-grace") {
      double seconds = 0;
      if (!absl::SimpleAtod(v, &seconds) || !(seconds >= 0)) {
        return Usage("--preempt-grace: need seconds >= 0");
      }
      options.preempt_grace = absl::Seconds(seconds);
    } else if (a == "--exit-with-parent") {
      // Started by `vocabpipe run --control-plane`: end with it.
      if (v == "1") prctl(PR_SET_PDEATHSIG, SIGTERM);
    } else {
      return Usage("unknown flag " + a);
    }
  }
  options.worker_binary = "/proc/self/exe";
  char self[4096] = {0};
  if (const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1); n > 0) {
    options.worker_binary.assign(self, n);
  }
  if (options.coordinator.empty()) return Usage("--coordinator: HOST:PORT required");
  // Plaintext only to a loopback coordinator, checked before the address (whose resolution
  // of the coordinator's name would otherwise decide what the refusal says).
  if (options.insecure) {
    if (auto st = vp::auth::CheckInsecure(options.tls, options.coordinator, "--coordinator");
        !st.ok()) {
      return Usage(std::string(st.message()));
    }
  }
  const char* pod_ip = std::getenv("POD_IP");
  auto address = vp::daemon::ChooseAddress(address_flag, pod_ip ? pod_ip : "", options.coordinator);
  if (!address.ok()) return Usage(std::string(address.status().message()));
  options.address = *address;
  // NCCL's bootstrap picks its own interface: point it at the one holding the address.
  if (const std::string ifname = vp::daemon::InterfaceOf(options.address); !ifname.empty()) {
    setenv("NCCL_SOCKET_IFNAME", ifname.c_str(), /*overwrite=*/0);
  }
  struct sigaction on_stop = {};
  on_stop.sa_handler = OnStopSignal;
  sigemptyset(&on_stop.sa_mask);
  sigaction(SIGINT, &on_stop, nullptr);
  sigaction(SIGTERM, &on_stop, nullptr);
  if (absl::Status st = vp::daemon::RunDaemon(options, &g_stop); !st.ok()) {
    return Usage(std::string(st.message()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything can initialise CUDA (cuda_environment.h).
  if (const std::string note = vp::launch::PrepareCudaEnvironment(); !note.empty()) {
    std::cerr << "vocabpipe-worker: " << note << "\n";
  }
  // A worker daemon's profiling child (worker/daemon/profile.h).
  if (argc > 1 && std::string(argv[1]) == "--profile-task") {
    return vp::daemon::ProfileChildMain(argc, argv);
  }
  // The communication profile alone (bench/paper).
  if (argc > 1 && std::string(argv[1]) == "--profile-comm") {
    return vp::daemon::ProfileCommMain(argc, argv);
  }
  if (IsDaemonMode(argc, argv)) return DaemonMain(argc, argv);

  // Die with the launcher (or daemon): a rank must never outlive whoever started it.
  const pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) return 1;

  vp::launch::WorkerOptions options;
  bool have_dir = false, have_rank = false;
  std::string store_address;
  vp::auth::TlsFiles tls;
  bool insecure = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--insecure") {
      insecure = true;
      continue;
    }
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
    } else if (a == "--run-id") {
      if (v.empty() || v.find('\n') != std::string::npos) {
        return Usage("--run-id: need a non-empty single-line id");
      }
      options.run_id = v;
    } else if (a == "--resume-step") {
      if (!absl::SimpleAtoi(v, &options.resume_step) || options.resume_step < 0) {
        return Usage("--resume-step: need an integer >= 0");
      }
    } else if (a == "--store") {
      store_address = v;
    } else if (vp::auth::SetTlsFlag(a, v, tls)) {
      // --tls-ca, --tls-cert or --tls-key: stored
    } else if (a == "--hostname") {
      options.hostname = v;
    } else if (a == "--cuda-device") {
      if (!absl::SimpleAtoi(v, &options.cuda_device) || options.cuda_device < 0) {
        return Usage("--cuda-device: need an integer >= 0");
      }
    } else {
      return Usage("unknown flag " + a);
    }
  }
  if (!have_dir || !have_rank) return Usage("--run-dir and --rank are required");
  if (!store_address.empty()) {
    auto credentials = vp::launch::StoreCredentials(store_address, tls, insecure);
    if (!credentials.ok()) return Usage(std::string(credentials.status().message()));
    std::string secret;
    if (const char* env = std::getenv(vp::auth::kRunSecretEnv)) secret = env;
    unsetenv(vp::auth::kRunSecretEnv);  // not for whatever this rank starts
    // The store's waits are bounded by the rank's timeout, like every Gloo operation.
    options.store = std::make_shared<vp::launch::GrpcStore>(
        store_address, absl::ToChronoMilliseconds(options.timeout), std::move(*credentials),
        std::move(secret));
  }
  const int rank = options.rank;
  // Leave without destructors: after a transport error the executor's communication thread
  // may still be blocked in Gloo until its timeout, and joining it would only delay the exit.
  auto fail = [rank](const absl::Status& st) {
    std::cerr << "rank " << rank << ": " << st.message() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);
  };
  options.on_fatal = fail;
  // SIGTERM (Kubernetes eviction, Slurm preemption, the daemon passing its own on): the ranks
  // save an emergency checkpoint at an agreed step and stop (worker/launch/preemption.h).
  // SA_RESTART: the transports' blocking calls go on across the handler.
  struct sigaction on_term = {};
  on_term.sa_handler = OnStopSignal;
  on_term.sa_flags = SA_RESTART;
  sigemptyset(&on_term.sa_mask);
  sigaction(SIGTERM, &on_term, nullptr);
  options.preempt = &g_stop;
  auto outcome = vp::launch::RunWorker(options);
  if (!outcome.ok()) fail(outcome.status());
  if (outcome->preempted_after >= 0) {
    std::cerr << "rank " << options.rank << ": preempted (SIGTERM): emergency checkpoint of step "
              << outcome->preempted_after << " saved; a resume continues from it" << std::endl;
    std::fflush(nullptr);
    std::_Exit(vp::launch::kPreemptedExitCode);
  }
  std::cerr << "rank " << options.rank << ": done" << std::endl;
  return 0;
}
