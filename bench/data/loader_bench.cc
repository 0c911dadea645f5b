// data_loader_bench: how fast a rank's sample reader delivers tokens from token shards read in
// place (worker/data/token_shards.h), against how fast training consumes them, and what it costs
// in resident memory.
//
//   data_loader_bench --data PATH [--seq 1024] [--batch 8] [--seconds 5] [--cold]
//
// PATH is a data path as a job spec takes it (a file, a folder of shards, or a glob). For
// sequential and shuffled order, it fills (batch, seq) microbatches for --seconds and prints the
// tokens delivered per second and the process's resident memory before and after (VmRSS). --cold
// first drops the shards' pages from the page cache (posix_fadvise DONTNEED, no root needed) and
// times the first microbatch and the first 100: the first-step latency of a rank on a cold cache.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "worker/data/sample_reader.h"
#include "worker/data/token_shards.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

long VmRssKb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

void DropFromPageCache(const std::vector<vp::data::TokenShard>& shards) {
  for (const vp::data::TokenShard& s : shards) {
    const int fd = open(s.path.c_str(), O_RDONLY);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string data;
  int64_t seq = 1024, batch = 8;
  double seconds = 5;
  bool cold = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--data") {
      data = next();
    } else if (a == "--seq") {
      seq = std::stoll(next());
    } else if (a == "--batch") {
      batch = std::stoll(next());
    } else if (a == "--seconds") {
      seconds = std::stod(next());
    } else if (a == "--cold") {
      cold = true;
    } else {
      std::fprintf(stderr,
                   "usage: data_loader_bench --data PATH [--seq N] [--batch N] [--seconds S] "
                   "[--cold]\n");
      return 2;
    }
  }
  if (data.empty()) {
    std::fprintf(stderr, "data_loader_bench: --data PATH required\n");
    return 2;
  }
  const long rss_start = VmRssKb();
  for (bool shuffle : {false, true}) {
    auto shards = vp::data::OpenTokenShards(
        "data.path", {data}, 0,
        shuffle ? vp::data::TokenAccess::kRandom : vp::data::TokenAccess::kSequential);
    if (!shards.ok()) {
      std::fprintf(stderr, "%s\n", std::string(shards.status().message()).c_str());
      return 1;
    }
    auto reader = vp::data::SampleReader::Create(*shards, {.seq_len = seq,
                                                           .microbatch_size = batch,
                                                           .microbatches = 1,
                                                           .shuffle = shuffle,
                                                           .seed = 1234});
    if (!reader.ok()) return 1;
    std::vector<int32_t> in(static_cast<size_t>(batch * seq)), tg(in.size());
    const char* order = shuffle ? "shuffled" : "sequential";
    int64_t step = 0;
    if (cold) {
      DropFromPageCache((*shards)->shards());
      const auto t0 = Clock::now();
      if (!reader->Fill(step++, 0, in.data(), tg.data()).ok()) return 1;
      const double first = Since(t0);
      for (int k = 1; k < 100; ++k) {
        if (!reader->Fill(step++, 0, in.data(), tg.data()).ok()) return 1;
      }
      std::printf("%s, cold cache: first microbatch %.2f ms, first 100 in %.1f ms\n", order,
                  first * 1e3, Since(t0) * 1e3);
    }
    const auto t0 = Clock::now();
    int64_t filled = 0;
    while (Since(t0) < seconds) {
      if (!reader->Fill(step++, 0, in.data(), tg.data()).ok()) return 1;
      ++filled;
    }
    const double s = Since(t0);
    std::printf(
        "%s: %lld shards, %.3g tokens; %.3g tokens/s delivered (%lld microbatches of %lld x "
        "%lld in %.1f s); process RSS %.1f MiB (%.1f at start)\n",
        order, static_cast<long long>((*shards)->shards().size()),
        static_cast<double>((*shards)->size()), filled * batch * seq / s,
        static_cast<long long>(filled), static_cast<long long>(batch), static_cast<long long>(seq),
        s, VmRssKb() / 1024.0, rss_start / 1024.0);
  }
  return 0;
}
