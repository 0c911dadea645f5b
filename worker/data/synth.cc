#include "worker/data/synth.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace vp::data {
namespace {

// SplitMix64: small, fast, and the same stream on every platform (std::*_distribution is
// implementation-defined, so it is not used: a seed must give the same corpus everywhere).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1), never 0 so that -log(u) is finite.
  double Uniform() { return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53; }
  // Uniform in [0, n) (the modulo bias is below 2^-40 for n < 2^24; irrelevant here).
  uint64_t Below(uint64_t n) { return Next() % n; }

 private:
  uint64_t state_;
};

}  // namespace

absl::StatusOr<MarkovChain> MakeMarkovChain(int32_t vocab_size, std::vector<int64_t> row_offsets,
                                            std::vector<int32_t> successors,
                                            std::vector<double> probs) {
  if (vocab_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size: must be >= 1 (got ", vocab_size, ")"));
  }
  if (row_offsets.size() != static_cast<size_t>(vocab_size) + 1 || row_offsets[0] != 0) {
    return absl::InvalidArgumentError("row_offsets: must have V + 1 entries starting at 0");
  }
  if (successors.size() != probs.size() ||
      row_offsets.back() != static_cast<int64_t>(successors.size())) {
    return absl::InvalidArgumentError("successors, probs: must both have row_offsets[V] entries");
  }
  for (int32_t i = 0; i < vocab_size; ++i) {
    const int64_t begin = row_offsets[i], end = row_offsets[i + 1];
    if (end <= begin) {
      return absl::InvalidArgumentError(absl::StrCat("row ", i, ": has no successors"));
    }
    double sum = 0;
    for (int64_t e = begin; e < end; ++e) {
      if (successors[e] < 0 || successors[e] >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("row ", i, ": successor ", successors[e],
                                                       " not in [0, ", vocab_size, ")"));
      }
      if (!(probs[e] >= 0)) {
        return absl::InvalidArgumentError(absl::StrCat("row ", i, ": negative probability"));
      }
      sum += probs[e];
    }
    if (std::fabs(sum - 1.0) > 1e-6) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", i, ": probabilities sum to ", sum, ", not 1"));
    }
    for (int64_t e = begin; e < end; ++e) probs[e] /= sum;
  }
  MarkovChain chain;
  chain.vocab_size = vocab_size;
  chain.row_offsets = std::move(row_offsets);
  chain.successors = std::move(successors);
  chain.probs = std::move(probs);
  return chain;
}

absl::StatusOr<MarkovChain> MakeRandomMarkovChain(int32_t vocab_size, int32_t branching,
                                                  uint64_t seed) {
  if (vocab_size < 2) {
    return absl::InvalidArgumentError(absl::StrCat("vocab: must be >= 2 (got ", vocab_size, ")"));
  }
  if (branching < 2 || branching > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("branching: must be in [2, 256] (got ", branching, ")"));
  }
  const int32_t k = std::min(branching, vocab_size);
  MarkovChain chain;
  chain.vocab_size = vocab_size;
  chain.row_offsets.resize(static_cast<size_t>(vocab_size) + 1);
  chain.successors.resize(static_cast<size_t>(vocab_size) * k);
  chain.probs.resize(chain.successors.size());
  Rng rng(seed);
  for (int32_t i = 0; i < vocab_size; ++i) {
    chain.row_offsets[i] = static_cast<int64_t>(i) * k;
    int32_t* succ = chain.successors.data() + static_cast<int64_t>(i) * k;  // (k,)
    double* p = chain.probs.data() + static_cast<int64_t>(i) * k;           // (k,)
    int32_t n = 0;
    succ[n++] = (i + 1) % vocab_size;             // the Hamiltonian cycle: irreducible
    if (i == 0 && vocab_size > 1) succ[n++] = 0;  // a self-loop next to it: aperiodic
    while (n < k) {  // distinct random successors; k <= 256, so a linear scan is fine
      const int32_t c = static_cast<int32_t>(rng.Below(static_cast<uint64_t>(vocab_size)));
      if (std::find(succ, succ + n, c) == succ + n) succ[n++] = c;
    }
    double sum = 0;
    for (int32_t e = 0; e < k; ++e) sum += (p[e] = -std::log(rng.Uniform()));
    for (int32_t e = 0; e < k; ++e) p[e] /= sum;
  }
  chain.row_offsets[vocab_size] = static_cast<int64_t>(vocab_size) * k;
  return chain;
}

std::vector<uint32_t> GenerateTokens(const MarkovChain& chain, int64_t n, uint64_t seed) {
  std::vector<uint32_t> tokens(static_cast<size_t>(std::max<int64_t>(n, 0)));
  if (tokens.empty()) return tokens;
  Rng rng(seed ^ 0x5bd1e9955bd1e995ull);  // a different stream than the chain's own
  int32_t x = static_cast<int32_t>(rng.Below(static_cast<uint64_t>(chain.vocab_size)));
  for (int64_t t = 0; t < n; ++t) {
    tokens[static_cast<size_t>(t)] = static_cast<uint32_t>(x);
    // Inverse-CDF sampling over the (short) row.
    const int64_t begin = chain.row_offsets[x], end = chain.row_offsets[x + 1];
    double u = rng.Uniform();
    int64_t e = begin;
    for (; e < end - 1; ++e) {
      u -= chain.probs[e];
      if (u < 0) break;
    }
    x = chain.successors[e];
  }
  return tokens;
}

Stationary StationaryDistribution(const MarkovChain& chain, double tol, int max_iterations) {
  const int32_t v = chain.vocab_size;
  Stationary result;
  result.pi.assign(static_cast<size_t>(v), 1.0 / v);
  std::vector<double> next(static_cast<size_t>(v));
  for (int it = 1; it <= max_iterations; ++it) {
    // next = (pi + pi P) / 2: the lazy chain, aperiodic whatever P is.
    for (int32_t j = 0; j < v; ++j) next[j] = 0.5 * result.pi[j];
    for (int32_t i = 0; i < v; ++i) {
      const double half = 0.5 * result.pi[i];
      for (int64_t e = chain.row_offsets[i]; e < chain.row_offsets[i + 1]; ++e) {
        next[chain.successors[e]] += half * chain.probs[e];
      }
    }
    // Renormalize against rounding drift, then measure the change.
    double sum = 0;
    for (double x : next) sum += x;
    double diff = 0;
    for (int32_t j = 0; j < v; ++j) {
      next[j] /= sum;
      diff += std::fabs(next[j] - result.pi[j]);
    }
    result.pi.swap(next);
    result.iterations = it;
    result.residual = diff;
    if (diff < tol) break;
  }
  return result;
}

double EntropyRate(const MarkovChain& chain) {
  const Stationary st = StationaryDistribution(chain);
  double h = 0;
  for (int32_t i = 0; i < chain.vocab_size; ++i) {
    double row = 0;  // H(row_i) = -sum_j P_ij ln P_ij
    for (int64_t e = chain.row_offsets[i]; e < chain.row_offsets[i + 1]; ++e) {
      const double p = chain.probs[e];
      if (p > 0) row -= p * std::log(p);
    }
    h += st.pi[i] * row;
  }
  return h;
}

}  // namespace vp::data
