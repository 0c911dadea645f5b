// Control-plane costs per training step, over real gRPC on loopback against an in-process
// coordinator with a SQLite file: a heartbeat, one step's metric reports from p = 2 ranks (the
// second completes the step: merge, one event committed to SQLite, watchers woken), and a
// rendezvous store set + get. None of these runs on a rank's critical path (the worker daemon
// reports while the rank process trains); bench/control/overhead.sh measures the end-to-end
// step time. Results: docs/operations.md, "Control plane" / "Overhead".
#include <benchmark/benchmark.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "coordinator/server/coordinator.h"
#include "coordinator/server/service.h"
#include "proto/spec/job_spec.h"
#include "vocabpipe/v1/service.grpc.pb.h"

namespace {

namespace v1 = vocabpipe::v1;
namespace fs = std::filesystem;

struct Fixture {
  fs::path dir;
  std::unique_ptr<vp::server::Coordinator> coordinator;
  std::unique_ptr<vp::server::CoordinatorServer> server;
  std::unique_ptr<v1::WorkerService::Stub> workers;
  std::unique_ptr<v1::StoreService::Stub> store;
  std::vector<std::string> worker_ids;
  std::string job_id;

  Fixture() {
    dir = fs::temp_directory_path() / absl::StrCat("vp_control_bench_", getpid());
    fs::create_directories(dir);
    vp::server::CoordinatorOptions options;
    options.db_path = (dir / "jobs.db").string();
    options.profile = false;
    options.heartbeat_timeout = absl::Hours(1);
    coordinator = *vp::server::Coordinator::Open(options);
    server = *vp::server::CoordinatorServer::Start(coordinator.get(), "127.0.0.1:0");
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()),
                                       grpc::InsecureChannelCredentials());
    workers = v1::WorkerService::NewStub(channel);
    store = v1::StoreService::NewStub(channel);
    for (int i = 0; i < 2; ++i) {
      v1::RegisterWorkerRequest req;
      req.set_device("cpu");
      req.set_address("127.0.0.1");
      req.set_peak_flops(1e11);
      v1::RegisterWorkerResponse resp;
      grpc::ClientContext ctx;
      workers->RegisterWorker(&ctx, req, &resp);
      worker_ids.push_back(resp.worker_id());
    }
    auto spec = vp::spec::ParseJobSpec(
        "model: {layers: 4, hidden: 64, heads: 2, vocab_size: 1024, seq_len: 64}\n"
        "parallel: {pipeline: 2, microbatches: 4}\ntrain: {steps: 100000000}\n"
        "data: {path: /unused.bin}\n",
        dir.string());
    job_id = *coordinator->Submit(*spec);  // runs at once on the two registered workers
  }
  ~Fixture() {
    server->Shutdown();
    server.reset();
    coordinator.reset();
    fs::remove_all(dir);
  }
};

Fixture& Shared() {
  static Fixture* f = new Fixture();  // lives for the whole benchmark process
  return *f;
}

void BM_Heartbeat(benchmark::State& state) {
  Fixture& f = Shared();
  v1::HeartbeatRequest req;
  req.set_worker_id(f.worker_ids[0]);
  for (auto _ : state) {
    grpc::ClientContext ctx;
    v1::HeartbeatResponse resp;
    if (!f.workers->Heartbeat(&ctx, req, &resp).ok()) state.SkipWithError("heartbeat failed");
  }
}
BENCHMARK(BM_Heartbeat)->UseRealTime();

// One training step's metric traffic: both ranks report their line; the second report merges
// the step and commits its event.
void BM_ReportStep(benchmark::State& state) {
  Fixture& f = Shared();
  static int64_t step = 0;
  for (auto _ : state) {
    for (int rank = 0; rank < 2; ++rank) {
      v1::ReportMetricsRequest req;
      req.set_worker_id(f.worker_ids[rank]);
      req.set_job_id(f.job_id);
      req.set_rank(rank);
      req.add_step_json(
          absl::StrCat(R"({"step":)", step, R"(,"rank":)", rank,
                       R"(,"has_loss":true,"loss":3.5,"grad_norm":1.0,"lr":0.001,"seconds":0.25,)",
                       R"("busy_seconds":0.2,"comm_seconds":0.01,"memory":{"total":1048576}})"));
      grpc::ClientContext ctx;
      v1::ReportMetricsResponse resp;
      grpc::Status st = f.workers->ReportMetrics(&ctx, req, &resp);
      if (!st.ok()) state.SkipWithError(st.error_message().c_str());
    }
    ++step;
  }
  state.counters["steps_stored"] = static_cast<double>(step);
}
BENCHMARK(BM_ReportStep)->UseRealTime();

void BM_StoreSetGet(benchmark::State& state) {
  Fixture& f = Shared();
  int64_t i = 0;
  for (auto _ : state) {
    const std::string key = absl::StrCat("bench/", i++);
    grpc::ClientContext set_ctx, get_ctx;
    v1::StoreSetRequest set;
    set.set_key(key);
    set.set_value(std::string(128, 'x'));
    v1::StoreSetResponse set_resp;
    f.store->Set(&set_ctx, set, &set_resp);
    v1::StoreGetRequest get;
    get.set_key(key);
    v1::StoreGetResponse get_resp;
    if (!f.store->Get(&get_ctx, get, &get_resp).ok()) state.SkipWithError("get failed");
  }
}
BENCHMARK(BM_StoreSetGet)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
