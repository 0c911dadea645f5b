// vocabpipe-coordinator [--listen HOST:PORT] --db FILE
//     (--tls-cert FILE --tls-key FILE --tls-ca FILE --tokens FILE --storage-root DIR|none
//      | --insecure)
//     [--heartbeat-interval S] [--heartbeat-timeout S] [--rank-timeout S] [--no-profile]
//     [--flops-per-second X]
//     [--metrics-listen HOST:PORT] [--storage-root DIR|none] [--planning-deadline S]
//     [--max-watchers N] [--max-watchers-per-user N] [--metrics-keep-finished N]
//     [--max-queued-per-user N] [--max-worker-memory BYTES] [--revoked FILE]
//     [--adopt-grace S] [--profiling-deadline S] [--progress-timeout S]
//     [--finished-ttl S] [--max-finished-per-user N]
// The control plane daemon (docs/operations.md, "Control plane"). Prints
// "vocabpipe-coordinator: listening on HOST:PORT" once it serves (port 0 picks one), and
// stops cleanly on SIGINT/SIGTERM; SIGHUP reloads --tokens and --revoked (which are also
// reloaded when they change). Exit codes: 0 stopped by a signal, 1 could not start,
// 2 bad usage.
#include <sys/prctl.h>

#include <csignal>
#include <iostream>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"
#include "proto/spec/storage_root.h"
#ifdef VP_HAVE_METRICS
#include "coordinator/server/prometheus_observer.h"
#endif

namespace {

constexpr char kUsage[] =
    "usage: vocabpipe-coordinator [--listen HOST:PORT] --db FILE\n"
    "         (--tls-cert FILE --tls-key FILE --tls-ca FILE --tokens FILE | --insecure)\n"
    "         [--heartbeat-interval S]\n"
    "         [--heartbeat-timeout S] [--rank-timeout S] [--no-profile] [--flops-per-second X]\n"
    "         [--metrics-listen HOST:PORT] [--storage-root DIR|none] [--planning-deadline S]\n"
    "         [--max-watchers N] [--max-watchers-per-user N] [--metrics-keep-finished N]\n"
    "         [--max-queued-per-user N] [--max-worker-memory BYTES]\n"
    "         [--revoked FILE] [--adopt-grace S] [--profiling-deadline S]\n"
    "         [--progress-timeout S] [--finished-ttl S] [--max-finished-per-user N]\n";

int Usage(const std::string& why) {
  std::cerr << "vocabpipe-coordinator: " << why << "\n" << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  vp::server::CoordinatorOptions options;
  std::string listen = "127.0.0.1:50051", metrics_listen, tokens_path, revoked_path;
  bool insecure = false, storage_root_given = false;
  vp::server::ServerOptions server_options;
  int keep_finished = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-profile") {
      options.profile = false;
      continue;
    }
    if (a == "--insecure") {
      insecure = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (i + 1 >= argc) return Usage(a + " needs a value");
    const std::string v = argv[++i];
    double x = 0;
    const bool number = absl::SimpleAtod(v, &x) && x > 0;
    if (a == "--listen") {
      listen = v;
    } else if (vp::auth::SetTlsFlag(a, v, server_options.tls)) {
      // --tls-ca, --tls-cert or --tls-key: stored
    } else if (a == "--tokens") {
      tokens_path = v;
    } else if (a == "--revoked") {
      revoked_path = v;
    } else if (a == "--max-queued-per-user") {
      if (!absl::SimpleAtoi(v, &options.max_queued_per_user) || options.max_queued_per_user < 0) {
        return Usage("--max-queued-per-user: need an integer >= 0 (0: no limit)");
      }
    } else if (a == "--max-worker-memory") {
      if (!absl::SimpleAtoi(v, &options.max_worker_memory) || options.max_worker_memory < 0) {
        return Usage("--max-worker-memory: need bytes >= 0 (0: no cap)");
      }
    } else if (a == "--exit-with-parent") {
      if (v == "1") prctl(PR_SET_PDEATHSIG, SIGTERM);  // tests and wrappers: end with them
    } else if (a == "--metrics-listen") {
      metrics_listen = v;
    } else if (a == "--storage-root") {
      storage_root_given = true;
      if (v == "none") continue;  // explicitly unconfined
      auto root = vp::spec::ResolveStorageRoot(v);
      if (!root.ok()) return Usage(std::string(root.status().message()));
      options.storage_root = *root;
    } else if (a == "--db") {
      options.db_path = v;
    } else if (a == "--heartbeat-interval") {
      if (!number) return Usage("--heartbeat-interval: need seconds > 0");
      options.heartbeat_interval = absl::Seconds(x);
    } else if (a == "--heartbeat-timeout") {
      if (!number) return Usage("--heartbeat-timeout: need seconds > 0");
      options.heartbeat_timeout = absl::Seconds(x);
    } else if (a == "--rank-timeout") {
      if (!number) return Usage("--rank-timeout: need seconds > 0");
      options.rank_timeout = absl::Seconds(x);
    } else if (a == "--max-watchers") {
      if (!absl::SimpleAtoi(v, &server_options.max_watchers) || server_options.max_watchers < 1) {
        return Usage("--max-watchers: need an integer >= 1");
      }
    } else if (a == "--max-watchers-per-user") {
      if (!absl::SimpleAtoi(v, &server_options.max_watchers_per_user) ||
          server_options.max_watchers_per_user < 1) {
        return Usage("--max-watchers-per-user: need an integer >= 1");
      }
    } else if (a == "--metrics-keep-finished") {
      if (!absl::SimpleAtoi(v, &keep_finished) || keep_finished < 0) {
        return Usage("--metrics-keep-finished: need an integer >= 0");
      }
    } else if (a == "--adopt-grace") {
      if (!number) return Usage("--adopt-grace: need seconds > 0");
      options.adopt_grace = absl::Seconds(x);
    } else if (a == "--profiling-deadline") {
      if (!number) return Usage("--profiling-deadline: need seconds > 0");
      options.profiling_deadline = absl::Seconds(x);
    } else if (a == "--progress-timeout") {
      if (!absl::SimpleAtod(v, &x) || !(x >= 0)) {
        return Usage("--progress-timeout: need seconds >= 0 (0: no watchdog)");
      }
      options.progress_timeout = absl::Seconds(x);
    } else if (a == "--finished-ttl") {
      if (!absl::SimpleAtod(v, &x) || !(x >= 0)) {
        return Usage("--finished-ttl: need seconds >= 0 (0: keep finished jobs forever)");
      }
      options.finished_ttl = absl::Seconds(x);
    } else if (a == "--max-finished-per-user") {
      if (!absl::SimpleAtoi(v, &options.max_finished_per_user) ||
          options.max_finished_per_user < 0) {
        return Usage("--max-finished-per-user: need an integer >= 0 (0: no cap)");
      }
    } else if (a == "--planning-deadline") {
      if (!number) return Usage("--planning-deadline: need seconds > 0");
      options.planning_deadline = absl::Seconds(x);
    } else if (a == "--flops-per-second") {
      if (!number) return Usage("--flops-per-second: need a number > 0");
      options.flops_per_second = x;
    } else {
      return Usage("unknown flag " + a);
    }
  }
  if (listen.empty() || options.db_path.empty()) return Usage("--listen and --db are required");
  // Plaintext only when asked for, and only on loopback (docs/operations.md, "Security").
  if (insecure) {
    if (auto st = vp::auth::CheckInsecure(server_options.tls, listen, "--listen"); !st.ok()) {
      return Usage(std::string(st.message()));
    }
    if (!tokens_path.empty()) {
      return Usage("--tokens: needs TLS (bearer tokens are never accepted in plaintext)");
    }
    if (!revoked_path.empty()) return Usage("--revoked: needs TLS (worker certificates)");
  } else {
    if (!server_options.tls.any()) {
      return Usage(
          "TLS required: --tls-cert, --tls-key and --tls-ca (vocabpipe certs init DIR), or "
          "--insecure on a loopback --listen");
    }
    if (tokens_path.empty())
      return Usage("--tokens FILE: required with TLS (vocabpipe certs token)");
    // A coordinator that users reach over the network must say where their jobs may read and
    // write: left out, any spec could name any file the workers can reach.
    if (!storage_root_given) {
      return Usage(
          "--storage-root DIR: required with TLS (the folder every data.path and checkpoint.dir "
          "must be inside), or --storage-root none to leave the paths unconfined");
    }
    auto tokens = vp::auth::TokenTable::Load(tokens_path);
    if (!tokens.ok()) return Usage(std::string(tokens.status().message()));
    server_options.tokens = std::make_shared<const vp::auth::TokenTable>(std::move(*tokens));
    server_options.tokens_path = tokens_path;
    if (!revoked_path.empty()) {
      auto revoked = vp::auth::RevocationList::Load(revoked_path);
      if (!revoked.ok()) return Usage(std::string(revoked.status().message()));
      server_options.revoked =
          std::make_shared<const vp::auth::RevocationList>(std::move(*revoked));
      server_options.revoked_path = revoked_path;
    }
  }

  // Signals are taken by a dedicated thread (sigwait), never by an async handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (!metrics_listen.empty()) {
#ifdef VP_HAVE_METRICS
    auto exporter = vp::metrics::MetricsExporter::Create(metrics_listen);
    if (!exporter.ok()) {
      std::cerr << "vocabpipe-coordinator: --metrics-listen: " << exporter.status().message()
                << std::endl;
      return 1;
    }
    std::cout << "vocabpipe-coordinator: metrics on port " << (*exporter)->port() << std::endl;
    options.observer =
        std::make_shared<vp::server::PrometheusObserver>(std::move(*exporter), keep_finished);
#else
    return Usage("--metrics-listen: this build has no metrics library (coordinator/metrics)");
#endif
  }
  auto coordinator = vp::server::Coordinator::Open(options);
  if (!coordinator.ok()) {
    std::cerr << "vocabpipe-coordinator: " << coordinator.status().message() << std::endl;
    return 1;
  }
  auto server = vp::server::CoordinatorServer::Start(coordinator->get(), listen, server_options);
  if (!server.ok()) {
    std::cerr << "vocabpipe-coordinator: " << server.status().message() << std::endl;
    return absl::IsInvalidArgument(server.status()) ? 2 : 1;
  }
  if (listen.rfind("unix:", 0) == 0) {
    std::cout << "vocabpipe-coordinator: listening on " << listen << std::endl;
  } else {
    const std::string host = listen.substr(0, listen.rfind(':'));
    std::cout << "vocabpipe-coordinator: listening on " << host << ":" << (*server)->port()
              << std::endl;
  }
  std::thread stopper([&] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
      std::cerr << "vocabpipe-coordinator: SIGHUP: reloading --tokens and --revoked" << std::endl;
      (*server)->Reload().IgnoreError();  // logged; the previous files stay in force
    }
    std::cerr << "vocabpipe-coordinator: signal " << sig << ", stopping" << std::endl;
    (*server)->Shutdown();
  });
  (*server)->Wait();
  stopper.join();
  return 0;
}
