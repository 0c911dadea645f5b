// Names, the computation-wise sequence partition and the automatic choice.
#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "coordinator/planner/planner.h"
#include "proto/plan/flops.h"

namespace vp::planner {
namespace {

constexpr std::array<absl::string_view, 8> kScheduleNames = {
    "1f1b", "interleaved", "vhalf", "zbh1", "zbv", "seq1f1b", "seq1f1b-interleaved", "vmin"};
constexpr std::array<absl::string_view, 5> kVocabNames = {"baseline", "redis", "interlaced",
                                                          "vocab1", "vocab2"};

}  // namespace

absl::string_view ScheduleName(Schedule s) { return kScheduleNames[static_cast<int>(s)]; }
absl::string_view VocabName(VocabMethod v) { return kVocabNames[static_cast<int>(v)]; }

absl::StatusOr<Schedule> ParseSchedule(absl::string_view name) {
  for (size_t i = 0; i < kScheduleNames.size(); ++i)
    if (kScheduleNames[i] == name) return static_cast<Schedule>(i);
  return absl::InvalidArgumentError(absl::StrCat(
      "parallel.schedule: unknown schedule '", name,
      "' (expected 1f1b|interleaved|vhalf|vmin|zbh1|zbv|seq1f1b|seq1f1b-interleaved|auto)"));
}

constexpr std::array<absl::string_view, 3> kRecomputeNames = {"none", "selective", "full"};

absl::string_view RecomputeName(Recompute r) { return kRecomputeNames[static_cast<int>(r)]; }

absl::StatusOr<Recompute> ParseRecompute(absl::string_view name) {
  for (size_t i = 0; i < kRecomputeNames.size(); ++i)
    if (kRecomputeNames[i] == name) return static_cast<Recompute>(i);
  return absl::InvalidArgumentError(
      absl::StrCat("parallel.recompute: unknown mode '", name, "' (expected none|selective|full)"));
}

absl::StatusOr<VocabMethod> ParseVocab(absl::string_view name) {
  for (size_t i = 0; i < kVocabNames.size(); ++i)
    if (kVocabNames[i] == name) return static_cast<VocabMethod>(i);
  return absl::InvalidArgumentError(
      absl::StrCat("parallel.vocab: unknown method '", name,
                   "' (expected baseline|redis|interlaced|vocab1|vocab2|auto)"));
}

std::vector<Schedule> AllSchedules() {
  std::vector<Schedule> v;
  for (size_t i = 0; i < kScheduleNames.size(); ++i) v.push_back(static_cast<Schedule>(i));
  return v;
}
std::vector<VocabMethod> AllVocabMethods() {
  std::vector<VocabMethod> v;
  for (size_t i = 0; i < kVocabNames.size(); ++i) v.push_back(static_cast<VocabMethod>(i));
  return v;
}

// Causal forward FLOPs (docs/planner.md, "Sequence partition"): per layer causal QK^T/AV +
// softmax over the keys < end, QKV/O projections, the two FFN GEMMs; plus embedding + output
// 4·H·V per token.
// Matmul FLOPs per token of one layer's forward: GPT-2 8h² + 4hf; Llama 4h² + 4h·kv + 6hf
// (q, o h×h; k, v h×kv; three h×f SwiGLU matrices).
double TokenLinearFlops(const ModelShape& m) {
  const double h = m.hidden, ffn = m.ffn > 0 ? m.ffn : 4 * h;
  if (!m.llama) return 8 * h * h + 4 * h * ffn;
  const double kv = m.kv_heads > 0 && m.heads > 0 ? h / m.heads * m.kv_heads : h;
  return 4 * h * h + 4 * h * kv + 6 * h * ffn;
}

double ChunkForwardFlops(const ModelShape& m, int layers, int64_t begin, int64_t end) {
  const double s = static_cast<double>(end - begin), e = static_cast<double>(end);
  const double h = m.hidden, a = m.heads > 0 ? m.heads : 1, d = h / a;
  return layers * ((4 * d + 3) * a * (s * e - s * s / 2) + TokenLinearFlops(m) * s) +
         4 * h * static_cast<double>(m.vocab) * s;
}

absl::StatusOr<std::vector<int>> PartitionSequence(const ModelShape& m, int layers, int k) {
  if (k < 1) return absl::InvalidArgumentError("parallel.seq_chunks: must be >= 1");
  std::vector<int> b(k + 1, 0);
  if (m.seq_len <= 0) {  // unknown length: k equal chunks of one unit each
    for (int q = 0; q <= k; ++q) b[q] = q;
    return b;
  }
  if (m.seq_len < k)
    return absl::InvalidArgumentError(absl::StrCat("parallel.seq_chunks: ", k,
                                                   " chunks do not fit model.seq_len ", m.seq_len,
                                                   " (need >= 1 token each)"));
  const int64_t n = m.seq_len;
  b[k] = static_cast<int>(n);
  if (m.hidden <= 0) {
    for (int q = 1; q < k; ++q) b[q] = static_cast<int>(n * q / k);
    return b;
  }
  // Tail-first: each chunk ending at E takes total/k FLOPs; FLOPs(s, E) = -A s^2 + Bq s.
  const double h = m.hidden, a = m.heads > 0 ? m.heads : 1, d = h / a;
  const double target = ChunkForwardFlops(m, layers, 0, n) / k;
  const double A = layers * (4 * d + 3) * a / 2;
  int64_t e = n;
  for (int q = k - 1; q >= 1; --q) {
    const double bq =
        layers * ((4 * d + 3) * a * e + TokenLinearFlops(m)) + 4 * h * static_cast<double>(m.vocab);
    const double disc = std::max(0.0, bq * bq - 4 * A * target);
    int64_t s = static_cast<int64_t>((bq - std::sqrt(disc)) / (2 * A));
    s = std::clamp<int64_t>(s, 1, e - q);  // leave >= 1 token for each earlier chunk
    e -= s;
    b[q] = static_cast<int>(e);
  }
  // Tensor parallelism splits every chunk's tokens over t ranks: boundaries on multiples of t
  // (the nearest, keeping every chunk at least t long; seq_len is a multiple of t).
  const int64_t t = std::max<int64_t>(1, m.tensor_parallel);
  if (t > 1) {
    if (n % t != 0 || n / t < k) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.seq_chunks: ", k,
                                                     " chunks of multiples of parallel.tensor ", t,
                                                     " tokens do not fit model.seq_len ", n));
    }
    for (int q = 1; q < k; ++q) {
      const int64_t rounded = (b[q] + t / 2) / t * t;
      b[q] = static_cast<int>(std::clamp<int64_t>(rounded, b[q - 1] + t, n - (k - q) * t));
    }
  }
  return b;
}

TensorCollectives TensorCollectiveSeconds(const ModelShape& m, const LinkCost& tensor_link) {
  const int t = std::max(1, m.tensor_parallel);
  if (t == 1) return {};
  const double bytes = static_cast<double>(m.microbatch_size) * m.seq_len * m.hidden *
                       m.activation_bytes_per_element;
  const double one = tensor_link.Seconds(bytes);
  return {4 * one, 4 * one, 4 * one};
}

Costs FlopProportionalCosts(int pipeline, int layers, const ModelShape& m, double flops_per_second,
                            const LinkCost& tensor_link) {
  const double b = m.microbatch_size, s = m.seq_len, h = m.hidden;
  const double t = std::max(1, m.tensor_parallel);
  const double layer_fwd = m.LayerForwardFlops();
  Costs c;
  c.f = c.b = c.w = layer_fwd * layers / pipeline / t / flops_per_second;
  const TensorCollectives tc = TensorCollectiveSeconds(m, tensor_link);
  const double stage_layers = static_cast<double>(layers) / pipeline;
  c.f += tc.f * stage_layers;
  c.b += tc.b * stage_layers;
  c.w += tc.w * stage_layers;
  c.tensor = tensor_link;
  // Full recomputation runs F again (its tensor-group calls too); selective the attention
  // core, 4bs²h of the layer's forward FLOPs.
  if (m.recompute == Recompute::kFull) c.recompute = c.f;
  if (m.recompute == Recompute::kSelective && layer_fwd > 0) {
    c.recompute = 4 * b * s * s * h * layers / pipeline / t / flops_per_second;
  }
  // S is the logits forward, a third of the output layer's 6bshV; T the other two thirds.
  c.s = flops::OutputLayer(b, s, h, static_cast<double>(m.vocab)) / 3 / pipeline / t /
        flops_per_second;
  c.t = 2 * c.s;
  c.input_f = c.input_b = c.comm = c.collective = c.opt = 0;
  return c;
}

absl::StatusOr<AutoChoice> ChoosePlan(const PlannerInput& in, bool schedule_auto, bool vocab_auto,
                                      int64_t budget_bytes, bool seq_chunks_auto) {
  AutoChoice choice;
  std::vector<Schedule> scheds = schedule_auto ? AllSchedules() : std::vector{in.schedule};
  std::vector<VocabMethod> vocabs = vocab_auto ? AllVocabMethods() : std::vector{in.vocab};
  for (Schedule s : scheds) {
    const bool seq = s == Schedule::kSeq1F1B || s == Schedule::kSeq1F1BInterleaved;
    std::vector<int> ks =
        seq ? (schedule_auto || seq_chunks_auto ? std::vector{2, 4} : std::vector{in.seq_chunks})
            : std::vector{1};
    for (VocabMethod v : vocabs)
      for (int k : ks) {
        PlannerInput cand = in;
        cand.schedule = s;
        cand.vocab = v;
        cand.seq_chunks = k;
        Candidate c{s, v, k, false, ""};
        // A choice over many candidates is the planner's longest work: stop between them.
        if (absl::Status st = CheckCancelled(in); !st.ok()) return st;
        absl::StatusOr<SimulatedPlan> built = BuildAndSimulate(cand);
        if (!built.ok()) {
          c.error = std::string(built.status().message());
        } else {
          const SimResult* sim = &built->sim;
          c.ok = true;
          c.step_time = sim->step_time;
          c.bubble_ratio = sim->bubble_ratio;
          c.mfu = sim->mfu;
          for (const RankStats& r : sim->ranks)
            c.peak_bytes = std::max(c.peak_bytes, r.state_bytes + r.peak_activation_bytes);
          c.fits = budget_bytes <= 0 || c.peak_bytes <= budget_bytes;
        }
        choice.candidates.push_back(c);
      }
  }
  std::stable_sort(choice.candidates.begin(), choice.candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.ok != b.ok) return a.ok;
                     if (a.fits != b.fits) return a.fits;
                     return a.step_time < b.step_time;
                   });
  if (choice.candidates.empty() || !choice.candidates[0].fits)
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.memory_budget_bytes: no (schedule, vocab, k) candidate fits ",
                     budget_bytes, " bytes per rank\n", CandidatesTable(choice)));
  choice.chosen = in;
  choice.chosen.schedule = choice.candidates[0].schedule;
  choice.chosen.vocab = choice.candidates[0].vocab;
  choice.chosen.seq_chunks = choice.candidates[0].seq_chunks;
  return choice;
}

std::string CandidatesTable(const AutoChoice& choice) {
  std::string s = absl::StrFormat("%-4s %-20s %-10s %2s %12s %7s %6s %14s %s\n", "rank", "schedule",
                                  "vocab", "k", "step_time", "bubble", "mfu", "peak_bytes", "fits");
  int i = 0;
  for (const Candidate& c : choice.candidates) {
    ++i;
    if (!c.ok) {
      absl::StrAppendFormat(&s, "%-4s %-20s %-10s %2d %s\n", "-", ScheduleName(c.schedule),
                            VocabName(c.vocab), c.seq_chunks, c.error);
      continue;
    }
    absl::StrAppendFormat(&s, "%-4d %-20s %-10s %2d %12.6g %6.1f%% %5.1f%% %14d %s\n", i,
                          ScheduleName(c.schedule), VocabName(c.vocab), c.seq_chunks, c.step_time,
                          100 * c.bubble_ratio, 100 * c.mfu, c.peak_bytes,
                          c.fits ? (i == 1 ? "yes <- chosen" : "yes") : "no");
  }
  return s;
}

}  // namespace vp::planner
