// Tensor parallelism at a fixed model on this machine: the same GPT-2 job at p stages with
// t = 1 and t = 2 (and more with --t), every rank a thread of this process with its own Gloo
// contexts (pipeline group and tensor group over loopback, as worker processes would have).
// Per t: tokens/s (median step after one warm-up), the largest rank's peak memory (the engine's
// tracker) beside the planner's prediction for it, and per rank and step the bytes of the
// vocabulary collectives (BCAST_X, C1, C2, IF_REDUCE, IB_BCAST: the pipeline group's), of
// the stage-to-stage transfers, and of the tensor group's all-gathers and reduce-scatters.
//
//   tensor_parallel_bench [--hidden=256] [--heads=8] [--layers=4] [--vocab=16384] [--seq=256]
//                         [--b=2] [--m=4] [--p=2] [--steps=4] [--t=1,2] [--vocab_method=vocab2]
//
// docs/benchmarks.md ("Tensor parallelism") has the numbers and the command.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/planner/planner.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/transformer/transformer.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/trainer.h"

namespace {

using vp::comm::Communicator;
using vp::comm::ReduceOp;

// Counts the bytes a rank moves through a communicator: collectives and point-to-point apart.
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduce(float* d, size_t n, ReduceOp op) override {
    collective_ += 4 * n;
    return inner_->AllReduce(d, n, op);
  }
  absl::Status Broadcast(float* d, size_t n, int root) override {
    collective_ += 4 * n;
    return inner_->Broadcast(d, n, root);
  }
  absl::Status ReduceScatterSum(float* d, size_t n) override {
    collective_ += 4 * n;
    return inner_->ReduceScatterSum(d, n);
  }
  absl::Status AllGather(float* d, size_t n) override {
    collective_ += 4 * n;
    return inner_->AllGather(d, n);
  }
  absl::Status Send(const float* d, size_t n, int peer, uint64_t tag) override {
    p2p_ += 4 * n;
    return inner_->Send(d, n, peer, tag);
  }
  absl::Status Recv(float* d, size_t n, int peer, uint64_t tag) override {
    p2p_ += 4 * n;
    return inner_->Recv(d, n, peer, tag);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }

  // Bytes of each kind since the last Take, then reset.
  std::pair<int64_t, int64_t> Take() {
    const std::pair<int64_t, int64_t> out{collective_.load(), p2p_.load()};
    collective_ = 0;
    p2p_ = 0;
    return out;
  }

 private:
  Communicator* inner_;
  std::atomic<int64_t> collective_{0}, p2p_{0};
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double tokens_per_second = 0;
  int64_t peak_bytes = 0;       // the largest rank's measured peak
  int64_t predicted_bytes = 0;  // the planner's for that stage (state + peak activations)
  int64_t barrier_bytes = 0;    // per rank per step, the largest
  int64_t p2p_bytes = 0;
  int64_t tensor_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int hidden = 256, heads = 8, layers = 4, vocab = 16384, seq = 256, b = 2, m = 4, p = 2, steps = 4;
  std::string ts = "1,2", method = "vocab2";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq),
                      value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    int v = 0;
    const bool number = absl::SimpleAtoi(value, &v);
    if (key == "--t") {
      ts = value;
    } else if (key == "--vocab_method") {
      method = value;
    } else if (number && key == "--hidden") {
      hidden = v;
    } else if (number && key == "--heads") {
      heads = v;
    } else if (number && key == "--layers") {
      layers = v;
    } else if (number && key == "--vocab") {
      vocab = v;
    } else if (number && key == "--seq") {
      seq = v;
    } else if (number && key == "--b") {
      b = v;
    } else if (number && key == "--m") {
      m = v;
    } else if (number && key == "--p") {
      p = v;
    } else if (number && key == "--steps") {
      steps = v;
    } else {
      std::fprintf(stderr, "unknown or malformed argument: %s\n", arg.c_str());
      return 2;
    }
  }
  auto vocab_method = vp::planner::ParseVocab(method);
  if (!vocab_method.ok()) {
    std::fprintf(stderr, "%s\n", std::string(vocab_method.status().message()).c_str());
    return 2;
  }
  std::printf("GPT-2 h=%d heads=%d layers=%d V=%d s=%d b=%d m=%d p=%d %s, %d steps (1 warm-up)\n",
              hidden, heads, layers, vocab, seq, b, m, p, method.c_str(), steps);
  std::printf("%3s %6s %12s %14s %16s %15s %13s %14s\n", "t", "ranks", "tokens/s", "peak_MiB",
              "predicted_MiB", "barrier_KiB", "p2p_KiB", "tensor_KiB");
  auto tokens =
      std::make_shared<std::vector<int32_t>>(static_cast<size_t>(steps) * m * b * seq + 1);
  std::mt19937 rng(5);
  for (auto& tok : *tokens) tok = static_cast<int32_t>(rng() % vocab);
  const vp::runtime::BatchFn batches = [tokens, b, m, seq](int64_t step, int j, int32_t* in,
                                                           int32_t* out) {
    const size_t base = (static_cast<size_t>(step) * m + j) * b * seq;
    for (int i = 0; i < b * seq; ++i) {
      in[i] = (*tokens)[base + i];
      out[i] = (*tokens)[base + i + 1];
    }
    return absl::OkStatus();
  };

  for (const absl::string_view tv : absl::StrSplit(ts, ',')) {
    int t = 1;
    if (!absl::SimpleAtoi(tv, &t) || t < 1) return 2;
    vp::runtime::TrainerOptions opt;
    opt.model = {.layers = layers,
                 .hidden = hidden,
                 .heads = heads,
                 .vocab = vocab,
                 .seq_len = seq,
                 .ffn_hidden = 4 * hidden};
    opt.microbatch_size = b;
    opt.microbatches = m;
    opt.lr = {.lr = 1e-4f, .total_steps = steps};
    opt.tensor.size = t;
    vp::planner::PlannerInput in;
    in.pipeline = p;
    in.microbatches = m;
    in.layers = layers;
    in.schedule = vp::planner::Schedule::k1F1B;
    in.vocab = *vocab_method;
    in.model.hidden = hidden;
    in.model.heads = heads;
    in.model.seq_len = seq;
    in.model.vocab = vocab;
    in.model.ffn = 4 * hidden;
    in.model.microbatch_size = b;
    in.model.activation_bytes_per_element = 4;
    in.model.tensor_parallel = t;
    auto footprint = vp::engine::MeasureLayerActivationBytes(opt.model, b);
    if (footprint.ok()) {
      in.model.layer_activation_bytes = static_cast<double>(footprint->kept);
      in.model.layer_backward_transient_bytes = static_cast<double>(footprint->backward_transient);
    }
    in.costs = vp::planner::FlopProportionalCosts(p, layers, in.model, 1e11);
    auto plan = vp::planner::BuildPlan(in);
    if (!plan.ok()) {
      std::fprintf(stderr, "t=%d: %s\n", t, std::string(plan.status().message()).c_str());
      return 1;
    }
    auto sim = vp::planner::Simulate(*plan, in);
    const int world = p * t;
    std::vector<Result> per_rank(world);
    std::vector<std::vector<double>> seconds(world);
    std::vector<std::string> errors(world);
    auto store = vp::comm::MakeHashStore();
    const std::string prefix = absl::StrCat("tp-bench-t", t);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        const int tp = rank % t, stage = rank / t;
        // The machine's cores shared by the ranks, as worker processes get them.
        vp::engine::cpu::SetBlasThreads(
            std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
        auto connect = [&](const std::string& name, int r, int size) {
          vp::comm::GlooOptions o;
          o.rank = r;
          o.size = size;
          o.store = store;
          o.prefix = absl::StrCat(prefix, "/", name);
          o.timeout = absl::Seconds(300);
          return vp::comm::ConnectGloo(o);
        };
        auto pipe = connect(absl::StrCat("pipe", tp), stage, p);
        auto tensor = connect(absl::StrCat("tensor", stage), tp, t);
        if (!pipe.ok() || !tensor.ok()) {
          errors[rank] = "connect failed";
          return;
        }
        CountingCommunicator pc(pipe->get()), tc(tensor->get());
        vp::runtime::TrainerOptions mine = opt;
        mine.tensor.rank = tp;
        auto pr = vp::runtime::PipelineRank::Create(*plan, stage, mine, &pc, nullptr,
                                                    t > 1 ? &tc : nullptr);
        if (!pr.ok()) {
          errors[rank] = std::string(pr.status().message());
          return;
        }
        for (int step = 0; step < steps; ++step) {
          pc.Take();
          tc.Take();
          auto r = (*pr)->Step(step, batches);
          if (!r.ok()) {
            errors[rank] = std::string(r.status().message());
            return;
          }
          const auto [coll, p2p] = pc.Take();
          const auto [tcoll, tp2p] = tc.Take();
          (void)tp2p;
          if (step == 0) continue;  // warm-up
          seconds[rank].push_back(r->seconds);
          per_rank[rank].peak_bytes = std::max(per_rank[rank].peak_bytes, r->peak_total);
          // The step's vocabulary collectives, less OPT's one-float norm sum.
          per_rank[rank].barrier_bytes = coll - 4;
          per_rank[rank].p2p_bytes = p2p;
          per_rank[rank].tensor_bytes = tcoll;
        }
        if (sim.ok()) {
          const vp::planner::RankStats& st = sim->ranks[stage];
          per_rank[rank].predicted_bytes = st.state_bytes + st.peak_activation_bytes;
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int r = 0; r < world; ++r) {
      if (!errors[r].empty()) {
        std::fprintf(stderr, "t=%d rank %d: %s\n", t, r, errors[r].c_str());
        return 1;
      }
    }
    std::vector<double> step_seconds;
    for (size_t i = 0; i < seconds[0].size(); ++i) {
      double worst = 0;
      for (int r = 0; r < world; ++r) worst = std::max(worst, seconds[r][i]);
      step_seconds.push_back(worst);
    }
    Result top;
    int top_rank = 0;
    for (int r = 0; r < world; ++r) {
      if (per_rank[r].peak_bytes > per_rank[top_rank].peak_bytes) top_rank = r;
      top.barrier_bytes = std::max(top.barrier_bytes, per_rank[r].barrier_bytes);
      top.p2p_bytes = std::max(top.p2p_bytes, per_rank[r].p2p_bytes);
      top.tensor_bytes = std::max(top.tensor_bytes, per_rank[r].tensor_bytes);
    }
    const double mib = 1 << 20;
    std::printf("%3d %6d %12.0f %14.1f %16.1f %15.1f %13.1f %14.1f\n", t, world,
                static_cast<double>(m) * b * seq / Median(step_seconds),
                per_rank[top_rank].peak_bytes / mib, per_rank[top_rank].predicted_bytes / mib,
                top.barrier_bytes / 1024.0, top.p2p_bytes / 1024.0, top.tensor_bytes / 1024.0);
  }
  return 0;
}
