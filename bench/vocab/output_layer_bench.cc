// Output-layer S+T throughput versus a plain sgemm of the same shape on the same threads.
//
//   vocab_output_bench [--n=1024] [--h=512] [--V=32768] [--p=1] [--threads=0] [--iters=5]
//
// FLOPs per microbatch = 6·n·h·V (paper Table 4, the real V): S's logits GEMM plus T's two
// gradient GEMMs (Algorithm 1: ∇W, ∇X; Algorithm 2: S's A = P'·W and T's ∇W). The reference is
// the S logits GEMM alone (n×h · h×V, 2·n·h·V FLOPs) timed the same way, so the ratio says how
// much of the GEMM rate the softmax, rescale and bookkeeping cost. With --p=2 the ranks are
// threads joined by Gloo on loopback, each with V/p rows and threads/p BLAS threads.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/engine/kernels/cpu/blas.h"
#include "worker/engine/memory.h"
#include "worker/engine/vocab/output_layer.h"
#include "worker/engine/vocab/partition.h"

namespace {

using vp::engine::Buffer;
using vp::engine::MemoryCategory;
using vp::engine::vocab::OutputAlgorithm;
using vp::engine::vocab::OutputLayerShard;

struct Args {
  int n = 1024, h = 512, vocab = 32768, p = 1, threads = 0, iters = 5;
};

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto eq = s.find('=');
    if (eq == std::string::npos) return false;
    std::string key = s.substr(0, eq);
    int v = 0;
    if (!absl::SimpleAtoi(s.substr(eq + 1), &v) || v < 1) return false;
    if (key == "--n")
      a->n = v;
    else if (key == "--h")
      a->h = v;
    else if (key == "--V")
      a->vocab = v;
    else if (key == "--p")
      a->p = v;
    else if (key == "--threads")
      a->threads = v;
    else if (key == "--iters")
      a->iters = v;
    else
      return false;
  }
  return true;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One rank's share: S, C1, T (and C2 for Algorithm 1) on its vocabulary shard. Returns the
// best wall time over iters (first call is a warm-up).
struct Breakdown {
  double s, c1, t, c2;
};

double RunRank(const Args& a, OutputAlgorithm alg, vp::comm::Communicator& comm,
               Breakdown* breakdown) {
  auto part = vp::engine::vocab::MakeVocabPartition(a.vocab, comm.size(), comm.rank());
  if (!part.ok()) std::abort();
  std::mt19937 rng(7 + comm.rank());
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  Buffer w(nullptr, MemoryCategory::kParameters, part->rows * a.h);
  Buffer g(nullptr, MemoryCategory::kGradients, part->rows * a.h);
  Buffer x(nullptr, MemoryCategory::kActivations, static_cast<size_t>(a.n) * a.h);
  for (int64_t i = 0; i < part->valid_rows * a.h; ++i) w.data()[i] = u(rng);
  for (size_t i = 0; i < x.size(); ++i) x.data()[i] = 20 * u(rng);
  std::vector<int32_t> labels(a.n);
  std::mt19937 lr(11);  // same labels on every rank
  for (auto& l : labels) l = static_cast<int32_t>(lr() % a.vocab);
  auto shard = OutputLayerShard::Create(*part, a.h, alg, w.data(), g.data(), nullptr);
  if (!shard.ok()) std::abort();
  double best = 1e30;
  for (int it = 0; it <= a.iters; ++it) {
    if (!comm.Barrier().ok()) std::abort();
    const auto t0 = std::chrono::steady_clock::now();
    auto st = shard->S(x.data(), labels.data(), a.n, 1.0f / a.n);
    if (!st.ok()) std::abort();
    const double ts = Seconds(t0);
    if (!shard->C1(*st, comm).ok()) std::abort();
    const double tc1 = Seconds(t0);
    if (!shard->T(*st, x.data()).ok()) std::abort();
    const double tt = Seconds(t0);
    if (alg == OutputAlgorithm::kAlgorithm1 && !shard->C2(*st, comm).ok()) std::abort();
    const double t = Seconds(t0);
    if (it > 0 && t < best) {
      best = t;
      if (breakdown != nullptr) *breakdown = {ts, tc1 - ts, tt - tc1, t - tt};
    }
  }
  return best;
}

double TimeSgemm(const Args& a, int cols) {
  Buffer x(nullptr, MemoryCategory::kActivations, static_cast<size_t>(a.n) * a.h);
  Buffer w(nullptr, MemoryCategory::kParameters, static_cast<size_t>(cols) * a.h);
  Buffer y(nullptr, MemoryCategory::kActivations, static_cast<size_t>(a.n) * cols);
  for (size_t i = 0; i < x.size(); ++i) x.data()[i] = 0.001f * (i % 17);
  for (size_t i = 0; i < w.size(); ++i) w.data()[i] = 0.001f * (i % 13);
  double best = 1e30;
  for (int it = 0; it <= a.iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    vp::engine::cpu::Gemm(false, true, a.n, cols, a.h, 1.0f, x.data(), a.h, w.data(), a.h, 0.0f,
                          y.data(), cols);
    const double t = Seconds(t0);
    if (it > 0) best = std::min(best, t);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: %s [--n=1024] [--h=512] [--V=32768] [--p=1] [--threads=0] "
                 "[--iters=5]\n",
                 argv[0]);
    return 2;
  }
  const int threads = a.threads > 0
                          ? a.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int blas_threads = std::max(1, threads / a.p);
  vp::engine::cpu::SetBlasThreads(blas_threads);
  const double flops_st = 6.0 * a.n * a.h * a.vocab;
  std::printf("output layer S+T: n=%d h=%d V=%d p=%d threads=%d (BLAS threads per rank %d)\n", a.n,
              a.h, a.vocab, a.p, threads, blas_threads);

  // Reference: the logits GEMM of the whole (p=1) or per-rank (p>1, run concurrently) shape.
  const int cols = static_cast<int>(vp::engine::vocab::PaddedVocab(a.vocab, a.p) / a.p);
  double gemm_s = 0;
  if (a.p == 1) {
    gemm_s = TimeSgemm(a, cols);
  } else {
    std::vector<double> t(a.p);
    std::vector<std::thread> ts;
    // The thread count is per thread (blas.h): each rank thread sets its own share.
    for (int r = 0; r < a.p; ++r) {
      ts.emplace_back([&, r] {
        vp::engine::cpu::SetBlasThreads(blas_threads);
        t[r] = TimeSgemm(a, cols);
      });
    }
    for (auto& th : ts) th.join();
    gemm_s = *std::max_element(t.begin(), t.end());
  }
  const double gemm_gflops = 2.0 * a.n * a.h * static_cast<double>(cols) * a.p / gemm_s / 1e9;
  std::printf("  sgemm %dx%dx%d (x%d ranks): %.3f ms, %.1f GFLOP/s\n", a.n, cols, a.h, a.p,
              gemm_s * 1e3, gemm_gflops);

  for (OutputAlgorithm alg : {OutputAlgorithm::kAlgorithm1, OutputAlgorithm::kAlgorithm2}) {
    double secs = 0;
    Breakdown bd{};
    if (a.p == 1) {
      auto self = vp::comm::MakeSelfCommunicator();
      secs = RunRank(a, alg, *self, &bd);
    } else {
      auto store = vp::comm::MakeHashStore();
      std::vector<double> t(a.p);
      std::vector<std::unique_ptr<vp::comm::GlooCommunicator>> comms(a.p);
      std::vector<std::thread> ts;
      const std::string prefix = absl::StrCat("bench", static_cast<int>(alg));
      for (int r = 0; r < a.p; ++r) {
        ts.emplace_back([&, r] {
          vp::comm::GlooOptions o;
          o.rank = r;
          o.size = a.p;
          o.store = store;
          o.prefix = prefix;
          auto c = vp::comm::ConnectGloo(o);
          if (!c.ok()) {
            std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
            std::abort();
          }
          comms[r] = std::move(*c);
          vp::engine::cpu::SetBlasThreads(blas_threads);
          t[r] = RunRank(a, alg, *comms[r], r == 0 ? &bd : nullptr);
        });
      }
      for (auto& th : ts) th.join();
      secs = *std::max_element(t.begin(), t.end());
    }
    const double gflops = flops_st / secs / 1e9;
    std::printf("  %s S+C1+T%s: %.3f ms, %.1f GFLOP/s, ratio to sgemm %.2f\n",
                alg == OutputAlgorithm::kAlgorithm1 ? "Algorithm 1" : "Algorithm 2",
                alg == OutputAlgorithm::kAlgorithm1 ? "+C2" : "", secs * 1e3, gflops,
                gflops / gemm_gflops);
    std::printf("    best run (rank 0): S %.1f ms, C1 %.1f ms, T %.1f ms, C2 %.1f ms\n", bd.s * 1e3,
                bd.c1 * 1e3, bd.t * 1e3, bd.c2 * 1e3);
  }
  return 0;
}
