// The synthetic corpus: tokens from a random sparse first-order Markov chain over V tokens.
//
// Why: a training run on it has a known loss floor. For a stationary first-order chain the
// best possible next-token predictor, with any amount of context, is the chain's own row
// P(x_{t+1} | x_t), and its expected cross-entropy is the entropy rate
//   H = sum_i pi_i * H(row_i) = -sum_i pi_i sum_j P_ij ln P_ij   (nats/token)
// with pi the stationary distribution. Earlier context adds nothing (Markov property), so a
// model with seq_len context converges towards H, never below it; the gap to H measures how
// much is left to learn. The chains are built irreducible and aperiodic (see
// MakeRandomMarkovChain), so pi is unique and the generated stream's statistics converge to it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace vp::data {

// Transition matrix in CSR form: row i lists the successors of token i and their
// probabilities.
struct MarkovChain {
  int32_t vocab_size = 0;            // V
  std::vector<int64_t> row_offsets;  // (V + 1), row i is [row_offsets[i], row_offsets[i+1])
  std::vector<int32_t> successors;   // (nnz,) token ids in [0, V)
  std::vector<double> probs;         // (nnz,) each row sums to 1
};

// Validates a hand-made chain (every row non-empty, ids in range, probabilities >= 0 summing
// to 1 within 1e-6; rows are renormalized exactly).
absl::StatusOr<MarkovChain> MakeMarkovChain(int32_t vocab_size, std::vector<int64_t> row_offsets,
                                            std::vector<int32_t> successors,
                                            std::vector<double> probs);

// A random chain: every token i gets K = min(branching, V) distinct successors with
// Dirichlet(1) probabilities (normalized Exp(1) weights), seeded. Successor (i + 1) mod V is
// always among them, so the chain contains the cycle 0 -> 1 -> ... -> V-1 -> 0 (irreducible),
// and token 0 always has itself as a successor, a cycle of length 1 next to one of length V
// (aperiodic). vocab_size >= 2, 2 <= branching <= 256.
absl::StatusOr<MarkovChain> MakeRandomMarkovChain(int32_t vocab_size, int32_t branching,
                                                  uint64_t seed);

// n tokens of the chain, the first one uniform over [0, V), seeded; all ids < V.
std::vector<uint32_t> GenerateTokens(const MarkovChain& chain, int64_t n, uint64_t seed);

struct Stationary {
  std::vector<double> pi;  // (V,) sums to 1
  int iterations = 0;
  double residual = 0;  // L1 change of the last iteration
};

// Power iteration on the lazy chain (I + P) / 2, which has the same stationary distribution
// and converges even for periodic chains, from the uniform distribution, until the L1 change
// is below tol. O(nnz) per iteration.
Stationary StationaryDistribution(const MarkovChain& chain, double tol = 1e-13,
                                  int max_iterations = 100000);

// Entropy rate in nats/token: sum_i pi_i H(row_i). The loss floor of a model trained on the
// chain's tokens.
double EntropyRate(const MarkovChain& chain);

}  // namespace vp::data
