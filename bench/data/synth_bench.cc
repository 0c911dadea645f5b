// data_synth_bench: seconds to build a random Markov chain (K = 8 successors per token) and its
// stationary distribution for V = 32k, 128k and 256k, the vocabulary sizes of the paper. The
// unit test (tests/unit/data/synth_test.cc) checks only that the large chain converges.
#include <chrono>
#include <cmath>
#include <cstdio>

#include "worker/data/synth.h"

int main() {
  for (int32_t vocab : {32768, 131072, 262144}) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<vp::data::MarkovChain> chain = vp::data::MakeRandomMarkovChain(vocab, 8, 1);
    if (!chain.ok()) {
      std::fprintf(stderr, "%s\n", std::string(chain.status().message()).c_str());
      return 1;
    }
    const vp::data::Stationary st = vp::data::StationaryDistribution(*chain);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("V=%d K=8: chain + stationary in %.2f s, %d iterations, rate %.4f nats\n", vocab,
                seconds, st.iterations, vp::data::EntropyRate(*chain));
  }
  return 0;
}
