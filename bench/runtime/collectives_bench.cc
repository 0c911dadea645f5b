// The data-parallel collectives on Gloo over loopback: AllReduce (zero: 0's gradient
// reduction) against ReduceScatterSum + AllGather (ZeRO-1's), for one stage's fp32 gradient
// buffer, d ranks as threads of this process (each its own TCP context, as separate worker
// processes would have).
//
//   collectives_bench [--floats=20000000] [--d=2] [--iters=5]
//
// Prints the median seconds of each over iters repeats (after one warm-up), and the bus
// bandwidth 2(d−1)/d · bytes / seconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/gloo/gloo_communicator.h"

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  long floats = 20000000;
  int d = 2, iters = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq);
    const long v = eq == std::string::npos ? 0 : std::atol(arg.c_str() + eq + 1);
    if (key == "--floats" && v > 0) {
      floats = v;
    } else if (key == "--d" && v >= 2) {
      d = static_cast<int>(v);
    } else if (key == "--iters" && v > 0) {
      iters = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "usage: %s [--floats=20000000] [--d=2] [--iters=5]\n", argv[0]);
      return 2;
    }
  }
  auto store = vp::comm::MakeHashStore();
  std::vector<std::vector<double>> allreduce(d), scatter(d), gather(d);
  std::vector<std::thread> threads;
  for (int r = 0; r < d; ++r) {
    threads.emplace_back([&, r] {
      auto comm = vp::comm::ConnectGloo(
          {.rank = r, .size = d, .store = store, .prefix = "bench", .timeout = absl::Seconds(120)});
      if (!comm.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, std::string(comm.status().message()).c_str());
        std::exit(1);
      }
      std::vector<float> buf(static_cast<size_t>(floats), 1.0f);
      auto time = [&](auto&& op, std::vector<double>* out) {
        (void)(*comm)->Barrier();
        const auto t0 = Clock::now();
        if (absl::Status st = op(); !st.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", r, std::string(st.message()).c_str());
          std::exit(1);
        }
        out->push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      };
      for (int i = 0; i <= iters; ++i) {
        std::vector<double> warm;
        std::vector<double>* a = i == 0 ? &warm : &allreduce[r];
        std::vector<double>* s = i == 0 ? &warm : &scatter[r];
        std::vector<double>* g = i == 0 ? &warm : &gather[r];
        time([&] { return (*comm)->AllReduce(buf.data(), buf.size(), vp::comm::ReduceOp::kSum); },
             a);
        time([&] { return (*comm)->ReduceScatterSum(buf.data(), buf.size()); }, s);
        time([&] { return (*comm)->AllGather(buf.data(), buf.size()); }, g);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double bytes = 4.0 * floats, bus = 2.0 * (d - 1) / d * bytes;
  const double ar = Median(allreduce[0]), rs = Median(scatter[0]), ag = Median(gather[0]);
  std::printf("d=%d, %ld floats (%.1f MiB), median of %d\n", d, floats, bytes / 1048576, iters);
  std::printf("all-reduce                 %.4f s  %.2f GB/s bus\n", ar, bus / ar / 1e9);
  std::printf("reduce-scatter             %.4f s\n", rs);
  std::printf("all-gather                 %.4f s\n", ag);
  std::printf("reduce-scatter + all-gather %.4f s  %.2f GB/s bus\n", rs + ag,
              bus / (rs + ag) / 1e9);
  return 0;
}
