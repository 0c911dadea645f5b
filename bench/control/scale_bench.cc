// The coordinator under N worker daemons (issue 36): N simulated workers, each a thread of this
// process with its own gRPC connection over TLS (the workers' client certificate), register,
// heartbeat every second, take the rank the coordinator gives them in a job of N ranks and
// report one step line a second, as a daemon does while its rank trains. Measured over a window
// once every rank runs: the coordinator process's CPU seconds per wall second and resident
// memory (/proc/PID), the heartbeat and report latencies (p50, p99) and the steps merged.
// bench/control/scale_bench.py starts the coordinator, runs this for N = 64, 256, 1024 and adds
// what it reads from outside (SQLite bytes a step, Prometheus series and scrape time).
//
//   scale_bench --coordinator HOST:PORT --certs DIR --token TOKEN --pid PID --workers N
//               --data FILE [--db FILE] [--warmup 5] [--seconds 20]
//
// Prints one JSON object. docs/benchmarks.md §18 has the table and the command.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/grpc/auth.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace {

namespace v1 = vocabpipe::v1;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::string coordinator, certs, token, data, db;
  int pid = 0, workers = 64, warmup = 5, seconds = 20;
};

// utime + stime of process `pid`, in seconds (/proc/PID/stat fields 14 and 15).
double ProcessCpuSeconds(int pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(f, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Bytes of the coordinator's SQLite file and its write-ahead log (0 without --db).
int64_t DbBytes(const std::string& db) {
  int64_t total = 0;
  for (const char* suffix : {"", "-wal"}) {
    std::ifstream f(db + suffix, std::ios::binary | std::ios::ate);
    if (f) total += static_cast<int64_t>(f.tellg());
  }
  return total;
}

// VmRSS of process `pid`, bytes.
int64_t ProcessRssBytes(int pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kb = 0;
      std::istringstream(line.substr(6)) >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// One simulated worker daemon.
class SimWorker {
 public:
  SimWorker(const Flags& f, std::shared_ptr<grpc::ChannelCredentials> creds, int index)
      : index_(index) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    stub_ = v1::WorkerService::NewStub(grpc::CreateCustomChannel(f.coordinator, creds, args));
  }

  bool Register() {
    v1::RegisterWorkerRequest req;
    req.set_device("cpu");
    req.set_memory_bytes(int64_t{16} << 30);
    // 8 workers a simulated host, each host a made-up routable address (no rank ever connects:
    // only the coordinator is real).
    const int host = index_ / 8;
    req.set_address(absl::StrCat("10.77.", host / 256, ".", host % 256));
    req.set_hostname(absl::StrCat("sim-", host));
    req.set_pid(getpid());
    req.set_threads(1);
    req.set_peak_flops(1e11);
    req.set_rank_hint(index_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RegisterWorkerResponse resp;
    if (!stub_->RegisterWorker(&ctx, req, &resp).ok()) return false;
    worker_id_ = resp.worker_id();
    return true;
  }

  // One second's traffic: a heartbeat, and a step report once a rank is given.
  void Tick(bool measure) {
    v1::HeartbeatRequest hb;
    hb.set_worker_id(worker_id_);
    hb.set_job_id(job_id_);
    hb.set_attempt(attempt_);
    hb.set_acked_seq(acked_);
    v1::HeartbeatResponse hb_resp;
    const auto t0 = Clock::now();
    grpc::ClientContext hb_ctx;
    hb_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const bool hb_ok = stub_->Heartbeat(&hb_ctx, hb, &hb_resp).ok();
    const double hb_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (measure) (hb_ok ? heartbeat_ms : errors).push_back(hb_ms);
    for (const v1::WorkerCommand& c : hb_resp.commands()) {
      if (c.seq() <= acked_) continue;
      acked_ = std::max(acked_, c.seq());
      if (c.has_run()) {
        job_id_ = c.run().job_id();
        attempt_ = c.run().attempt();
        rank_ = c.run().rank();
      }
    }
    if (job_id_.empty()) return;
    v1::ReportMetricsRequest rep;
    rep.set_worker_id(worker_id_);
    rep.set_job_id(job_id_);
    rep.set_attempt(attempt_);
    rep.set_rank(rank_);
    rep.add_step_json(
        absl::StrCat(R"({"step":)", step_, R"(,"rank":)", rank_,
                     R"(,"has_loss":true,"loss":3.5,"grad_norm":1.0,"lr":0.001,"seconds":1.0,)",
                     R"("busy_seconds":0.9,"comm_seconds":0.05,"memory":{"total":1048576}})"));
    ++step_;
    const auto t1 = Clock::now();
    grpc::ClientContext rep_ctx;
    rep_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ReportMetricsResponse rep_resp;
    const bool rep_ok = stub_->ReportMetrics(&rep_ctx, rep, &rep_resp).ok();
    const double rep_ms = std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
    if (measure) (rep_ok ? report_ms : errors).push_back(rep_ms);
  }

  bool running() const { return !job_id_.empty(); }

  std::vector<double> heartbeat_ms, report_ms, errors;

 private:
  int index_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::string worker_id_, job_id_, attempt_;
  int rank_ = 0;
  int64_t acked_ = 0, step_ = 0;
};

int Run(const Flags& f) {
  auto creds = vp::auth::ClientCredentials({.cert = f.certs + "/worker.pem",
                                            .key = f.certs + "/worker-key.pem",
                                            .ca = f.certs + "/ca.pem"});
  if (!creds.ok()) {
    std::fprintf(stderr, "scale_bench: %s\n", std::string(creds.status().message()).c_str());
    return 2;
  }
  std::vector<std::unique_ptr<SimWorker>> workers;
  for (int i = 0; i < f.workers; ++i) workers.push_back(std::make_unique<SimWorker>(f, *creds, i));
  // Register, a few threads at a time so the handshakes do not all land at once.
  {
    std::atomic<int> next{0}, failed{0};
    std::vector<std::thread> reg;
    for (int t = 0; t < 16; ++t) {
      reg.emplace_back([&] {
        for (int i = next++; i < f.workers; i = next++) failed += !workers[i]->Register();
      });
    }
    for (auto& t : reg) t.join();
    if (failed > 0) {
      std::fprintf(stderr, "scale_bench: %d workers failed to register\n", failed.load());
      return 1;
    }
  }
  // A job of N ranks: p = 4 stages (fewer when N < 4) of N/p replicas.
  const int p = std::min(4, f.workers), d = f.workers / p;
  std::unique_ptr<v1::JobService::Stub> jobs;
  std::string job_id;
  {
    vp::auth::TlsFiles cli_files;
    cli_files.ca = f.certs + "/ca.pem";
    auto creds_cli = vp::auth::ClientCredentials(cli_files, f.token);
    jobs = v1::JobService::NewStub(grpc::CreateChannel(f.coordinator, *creds_cli));
    v1::SubmitJobRequest req;
    req.set_spec_text(absl::StrCat(
        "name: scale\nmodel: {layers: 4, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n",
        "parallel: {pipeline: ", p, ", data: ", d, ", microbatches: 4}\n",
        "train: {steps: 100000000, threads: 1}\ndata: {path: ", f.data, "}\n",
        "checkpoint: {dir: scale-runs}\n"));
    req.set_base_dir(".");
    grpc::ClientContext ctx;
    v1::SubmitJobResponse resp;
    grpc::Status st = jobs->SubmitJob(&ctx, req, &resp);
    if (!st.ok()) {
      std::fprintf(stderr, "scale_bench: submit: %s\n", st.error_message().c_str());
      return 1;
    }
    job_id = resp.job_id();
  }
  // Every worker ticks once a second from its own thread, phases spread over the second.
  std::atomic<bool> stop{false}, measure{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < f.workers; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 rng(i);
      auto next = Clock::now() + std::chrono::milliseconds(rng() % 1000);
      while (!stop) {
        std::this_thread::sleep_until(next);
        next += std::chrono::seconds(1);
        workers[i]->Tick(measure);
      }
    });
  }
  // Wait for every rank to be running, then warm up and measure.
  const auto give_up = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < give_up &&
         !std::all_of(workers.begin(), workers.end(), [](const auto& w) { return w->running(); })) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const int running = static_cast<int>(
      std::count_if(workers.begin(), workers.end(), [](const auto& w) { return w->running(); }));
  if (running < f.workers) {
    v1::GetJobRequest get;
    get.set_job_id(job_id);
    v1::Job job;
    grpc::ClientContext ctx;
    if (jobs->GetJob(&ctx, get, &job).ok()) {
      std::fprintf(stderr, "scale_bench: %d of %d ranks running; job %s: %s\n", running, f.workers,
                   v1::JobState_Name(job.state()).c_str(), job.reason().c_str());
    }
  }
  std::this_thread::sleep_for(std::chrono::seconds(f.warmup));
  measure = true;
  const double cpu0 = ProcessCpuSeconds(f.pid);
  const int64_t db0 = f.db.empty() ? 0 : DbBytes(f.db);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(f.seconds));
  const double cpu1 = ProcessCpuSeconds(f.pid);
  const int64_t db1 = f.db.empty() ? 0 : DbBytes(f.db);
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  measure = false;
  const int64_t rss = ProcessRssBytes(f.pid);
  stop = true;
  for (auto& t : threads) t.join();
  std::vector<double> hb, rep;
  size_t errors = 0;
  for (const auto& w : workers) {
    hb.insert(hb.end(), w->heartbeat_ms.begin(), w->heartbeat_ms.end());
    rep.insert(rep.end(), w->report_ms.begin(), w->report_ms.end());
    errors += w->errors.size();
  }
  std::printf(
      "{\"workers\": %d, \"ranks_running\": %d, \"pipeline\": %d, \"data\": %d, "
      "\"window_s\": %.2f, \"coordinator_cpu_per_s\": %.4f, \"coordinator_rss_bytes\": %lld, "
      "\"heartbeats\": %zu, \"heartbeat_p50_ms\": %.3f, \"heartbeat_p99_ms\": %.3f, "
      "\"reports\": %zu, \"report_p50_ms\": %.3f, \"report_p99_ms\": %.3f, \"errors\": %zu, "
      "\"db_bytes_in_window\": %lld}\n",
      f.workers, running, p, d, wall, (cpu1 - cpu0) / wall, static_cast<long long>(rss), hb.size(),
      Percentile(hb, 0.5), Percentile(hb, 0.99), rep.size(), Percentile(rep, 0.5),
      Percentile(rep, 0.99), errors, static_cast<long long>(db1 - db0));
  return running == f.workers ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--coordinator") {
      f.coordinator = v;
    } else if (k == "--certs") {
      f.certs = v;
    } else if (k == "--token") {
      f.token = v;
    } else if (k == "--data") {
      f.data = v;
    } else if (k == "--db") {
      f.db = v;
    } else if (k == "--pid") {
      ok = absl::SimpleAtoi(v, &f.pid);
    } else if (k == "--workers") {
      ok = absl::SimpleAtoi(v, &f.workers);
    } else if (k == "--warmup") {
      ok = absl::SimpleAtoi(v, &f.warmup);
    } else if (k == "--seconds") {
      ok = absl::SimpleAtoi(v, &f.seconds);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "scale_bench: bad flag %s %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  if (f.coordinator.empty() || f.certs.empty() || f.token.empty() || f.pid <= 0 || f.data.empty() ||
      f.workers < 1) {
    std::fprintf(stderr,
                 "usage: scale_bench --coordinator HOST:PORT --certs DIR --token TOKEN --pid PID "
                 "--workers N --data FILE [--db FILE] [--warmup 5] [--seconds 20]\n");
    return 2;
  }
  return Run(f);
}
