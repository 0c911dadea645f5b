// The planner: schedule generators × vocabulary methods -> lowered Plan, validator,
// simulator, automatic choice and renderers (docs/planner.md). No tensor code.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/plan/plan.h"

namespace vp::planner {

enum class Schedule {
  k1F1B,
  kInterleaved,
  kVHalf,
  kZBH1,
  kZBV,
  kSeq1F1B,
  kSeq1F1BInterleaved,
  kVMin,
};
enum class VocabMethod { kBaseline, kRedis, kInterlaced, kVocab1, kVocab2 };
// Activation recomputation (parallel.recompute, docs/recompute.md): what a layer keeps from its
// F until its backward, and what the backward computes again. The engine's Recompute twin.
enum class Recompute { kNone, kSelective, kFull };

absl::string_view ScheduleName(
    Schedule s);  // 1f1b, interleaved, vhalf, zbh1, zbv, seq1f1b, ..., vmin
absl::string_view VocabName(VocabMethod v);  // baseline, redis, interlaced, vocab1, vocab2
absl::StatusOr<Schedule> ParseSchedule(absl::string_view name);
absl::StatusOr<VocabMethod> ParseVocab(absl::string_view name);
absl::string_view RecomputeName(Recompute r);  // none, selective, full
absl::StatusOr<Recompute> ParseRecompute(absl::string_view name);
std::vector<Schedule> AllSchedules();
std::vector<VocabMethod> AllVocabMethods();

// Per-pass costs (any time unit; seconds when MFU is wanted). F, B, W are one pass of one
// stage's layers (layers/pipeline of them) over one whole microbatch; a model chunk or a
// sequence chunk costs its share. S and T are one rank's vocabulary shard (1/p of the output
// layer) for one microbatch; the unsharded output layer (baseline, redis) costs p·S and p·T.
// IF/IB are the input layer passes (a row gather costs the same for a shard and the whole).
//
// Communication: every action the lowering emits costs `comm` (a P2P transfer) or `collective`
// (BCAST_X, C1, C2, IF_REDUCE, IB_BCAST) fixed seconds, plus what the link model below gives
// for the bytes it moves (CommSeconds in internal.h: the calls each action makes in the runtime
// and their sizes from the model shape). Both zero: communication is free.
struct LinkCost {
  double latency = 0;    // seconds per call
  double bandwidth = 0;  // bytes per second; 0: the size costs nothing
  double Seconds(double bytes) const { return latency + (bandwidth > 0 ? bytes / bandwidth : 0); }
};
struct Costs {
  double f = 1, b = 2, w = 1;
  double s = 0, t = 0;
  double input_f = 0, input_b = 0;
  double comm = 0;  // fixed seconds of one point-to-point transfer
  double collective =
      0;           // fixed seconds of one vocabulary collective (C0, C1, C2, IF_REDUCE, IB_BCAST)
  double opt = 0;  // optimizer step
  // One call between the job's ranks (profiled at its p): a send/recv pair, a broadcast from
  // one rank to all, an all-reduce over all.
  LinkCost p2p, broadcast, allreduce;
  // One all-gather or reduce-scatter call over a tensor group (bytes: the whole gathered
  // buffer), as the profile measures it. Every pass's F/B/W gets its layers' tensor-group calls
  // at this link (TensorCollectiveSeconds): the passes are timed on one worker without them.
  LinkCost tensor;
  // Activation recomputation: seconds one B (or BW) pass of a stage's layers over a whole
  // microbatch spends computing again what F dropped (full: the layers' forward; selective:
  // the attention core's), on top of b. 0 under recompute none.
  double recompute = 0;
  // Measured costs only (SpecPlanOptions::measured_costs): the tensor group they were timed on.
  // Equal to the job's t > 1: every pass is already one tensor rank's, its collectives inside;
  // otherwise (1) one worker timed the whole stage and BuildPlanFromSpec divides by t.
  int tensor_measured = 1;
};

// Model shape for byte counts, FLOPs and the sequence partition (all optional: zeros mean
// "unknown", then bytes/MFU are reported as 0 and sequence chunks are equal).
struct ModelShape {
  int64_t hidden = 0, heads = 0, seq_len = 0, vocab = 0, ffn = 0, microbatch_size = 1;
  bool tie_embeddings = false;
  // Llama layers (RMSNorm, RoPE, GQA, SwiGLU, no biases, no position table); kv_heads is the
  // number of key/value heads (0 = heads).
  bool llama = false;
  int64_t kv_heads = 0;
  // One layer's forward FLOPs for one microbatch and its parameter count (proto/plan/flops.h).
  double LayerForwardFlops() const;
  double LayerParams() const;
  // Tensor parallelism (parallel.tensor, docs/tensor-parallel.md): t ranks share every stage,
  // each holding 1/t of a layer's matrices (the norms and the row-parallel biases whole), 1/t of
  // its activations (sequence parallelism), a vocabulary shard of V/(p·t) rows, and 1/t of every
  // token row the pipeline moves. Costs are per rank of the group: profiled on a whole group,
  // they include the all-gathers and reduce-scatters inside the passes.
  int tensor_parallel = 1;
  // One tensor rank's parameters of one layer: LayerParams() with the split matrices / t.
  double LayerParamsPerTensorRank() const;
  int activation_bytes_per_element = 2;  // bf16 activations on GPU, 4 on CPU
  // Bytes one transformer layer keeps for one microbatch of the whole sequence between its F
  // and its backward, as measured on the engine that runs the plan (the runtime measures it
  // with engine::MeasureLayerActivationBytes). 0: Megatron's estimate b·s·h·34 at
  // activation_bytes_per_element / 2, plus 4·b·heads·s for the attention's log-sum-exp (both
  // engines recompute the softmax in the backward: no s² term).
  double layer_activation_bytes = 0;
  // Extra bytes while one layer's backward runs (its gradient working set), added once to a
  // rank's peak; measured by the same engine call. 0: not modelled.
  double layer_backward_transient_bytes = 0;
  // Bytes one layer holds for one microbatch from its B until its W when the backward is split
  // (the B stash W reads, and the forward activations W reads); same engine call. 0: not
  // modelled (the layer is taken to hold its F bytes until W).
  double layer_held_for_w_bytes = 0;
  // What the layers keep and recompute (the measured bytes above are the mode's).
  Recompute recompute = Recompute::kNone;
  int state_bytes_per_param = 16;  // fp32 weight + grad + Adam m, v
  double peak_flops = 0;           // per device, for MFU (costs must then be seconds)
  // Data parallelism (parallel.data, parallel.zero): d replicas of every stage. Under ZeRO-1 a
  // rank keeps 1/d of its stage's AdamW state (m and v, 8 bytes per parameter), plus at most
  // one element of each for the balanced ranges.
  int data_parallel = 1;
  bool zero = false;
};

struct PlannerInput {
  int pipeline = 1;         // p
  int microbatches = 1;     // m
  int layers = 1;           // transformer layers L
  int seq_chunks = 1;       // k (Seq1F1B schedules)
  int chunks_per_rank = 2;  // v for interleaved schedules (V-shapes always 2)
  Schedule schedule = Schedule::k1F1B;
  VocabMethod vocab = VocabMethod::kVocab2;
  int max_pending_t = 1;  // Vocab-2 T passes allowed to wait (T(i) before S(i+max_pending_t))
  // Communication threads per rank in the runtime: 1 (Gloo: point-to-point transfers and
  // collectives in plan order on one thread) or 2 (NCCL: each on its own thread and stream).
  int comm_lanes = 1;
  Costs costs;
  ModelShape model;
  // Polled between the expensive steps (each candidate of an auto choice, building and timing
  // a plan): once it reads true the planner stops with Cancelled. Null: never. The caller
  // owns it and keeps it alive until the planner returns (a deadline's watchdog sets it).
  const std::atomic<bool>* cancel = nullptr;
};

// Cancelled when in.cancel is set (the planner's deadline passed), else OK.
absl::Status CheckCancelled(const PlannerInput& in);

// Costs proportional to the paper's FLOP counts (Table 4) at `flops_per_second` per device:
// F = B = W = one stage's transformer forward FLOPs, S = 2bshV/p, T = 4bshV/p (the output
// layer's 6bshV split over p shards), no input-layer or communication cost.
// Under tensor parallelism (m.tensor_parallel = t) every pass's FLOPs are divided by t and F, B
// and W get the tensor group's collectives at `tensor_link` (TensorCollectiveSeconds).
Costs FlopProportionalCosts(int pipeline, int layers, const ModelShape& m, double flops_per_second,
                            const LinkCost& tensor_link = {});

// Seconds of one layer's tensor-group collectives for one microbatch under sequence parallelism:
// F and B each all-gather twice and reduce-scatter twice (b·s, h) activations, W all-gathers
// four times: four calls of the link at b·s·h elements each. 0 at t = 1.
struct TensorCollectives {
  double f = 0, b = 0, w = 0;
};
TensorCollectives TensorCollectiveSeconds(const ModelShape& m, const LinkCost& tensor_link);

// Builds, lowers and validates a plan. Impossible requests get InvalidArgument naming the
// field and the rule.
absl::StatusOr<Plan> BuildPlan(const PlannerInput& in);

// Checks a plan: placement covers every layer once, every pass present exactly once on the
// rank holding its chunk, every dependency respected, every send matched by a receive,
// collectives in the same order on every rank, no deadlock (rendezvous semantics). On
// failure the message lists the first offending action of each stuck rank.
absl::Status ValidatePlan(const Plan& plan);

struct RankStats {
  int rank = 0;
  double busy = 0;  // compute time
  double comm = 0;  // seconds the rank's communication lanes spend in transfers and collectives
  double first_start = 0, last_end = 0;
  double peak_activation_microbatches = 0;  // one stage's layers × one microbatch = 1
  int64_t peak_activation_bytes = 0;
  int64_t parameter_bytes = 0;  // weights only
  int64_t state_bytes = 0;      // weights + gradients + optimizer state
  int layers = 0;
};

struct TimedAction {
  double start = 0, end = 0;
};

struct SimResult {
  double makespan = 0;
  double bubble_ratio = 0;  // 1 - mean busy / max span
  double step_time = 0;     // makespan + optimizer + the data-parallel reduction
  // Seconds the gradient reduction over d replicas adds to the step, beyond the pipeline's
  // makespan: a ring all-reduce — or reduce-scatter + all-gather under ZeRO-1, the same bytes —
  // costs 2(d-1) of the link's latencies and 2(d-1)/d of the fp32 bytes at its bandwidth
  // (Costs::allreduce). Each GRAD_SYNC(c) (no ZeRO) sums its chunk while the rank still
  // computes; what is left when OPT starts, plus the tensors no GRAD_SYNC covers, is exposed.
  // The largest rank's exposure; 0 for d = 1.
  double data_parallel_seconds = 0;
  int tensor_parallel = 1;  // t: every rank below is one of t tensor ranks of its stage
  int data_parallel = 1;    // d, from the model shape (the plan itself is one replica's)
  bool zero = false;
  double model_flops = 0;  // per step (paper Table 4); 0 when the shape is unknown
  double mfu = 0;          // model_flops / (step_time · p · peak_flops)
  std::vector<RankStats> ranks;
  std::vector<std::vector<TimedAction>> times;  // per rank, per action
};

// Validates, then times the plan the way the runtime runs it: per rank one compute lane and
// in.comm_lanes communication lanes, each in plan order. A compute action starts when its
// lane is free and its inputs are there; a transfer starts when the data is computed and both
// ends' lanes are free (a send blocks until the receive is posted) and ends CommSeconds later,
// when the receiver has the data; a collective starts when every rank's lane is free and its
// inputs are there, and ends CommSeconds later on every rank.
absl::StatusOr<SimResult> Simulate(const Plan& plan, const PlannerInput& in);

// Computation-wise sequence partition: k chunk boundaries (k+1 offsets) with equal forward
// FLOPs under the causal model of docs/planner.md. Equal lengths when the shape is unknown.
absl::StatusOr<std::vector<int>> PartitionSequence(const ModelShape& shape, int layers, int k);
// Forward FLOPs of tokens [begin, end) of one sequence (causal attention to all keys < end).
double ChunkForwardFlops(const ModelShape& shape, int layers, int64_t begin, int64_t end);

// BuildPlan + Simulate with one run of the abstract machine (it validates while it times).
struct SimulatedPlan {
  Plan plan;
  SimResult sim;
};
absl::StatusOr<SimulatedPlan> BuildAndSimulate(const PlannerInput& in);

// Automatic choice: every (schedule, vocab, k) candidate ranked by predicted step time.
struct Candidate {
  Schedule schedule;
  VocabMethod vocab;
  int seq_chunks = 1;
  bool ok = false;  // built and simulated
  std::string error;
  double step_time = 0, bubble_ratio = 0, mfu = 0;
  int64_t peak_bytes = 0;  // max over ranks of state + activations
  bool fits = false;
};
struct AutoChoice {
  PlannerInput chosen;
  std::vector<Candidate> candidates;  // sorted: fitting first, then by step time
};
// Candidates: every schedule when in.schedule_auto, else in.schedule; same for vocab; k in
// {2,4} for Seq1F1B schedules when the schedule or seq_chunks_auto says so, else in.seq_chunks.
// budget_bytes 0 = unlimited.
absl::StatusOr<AutoChoice> ChoosePlan(const PlannerInput& in, bool schedule_auto, bool vocab_auto,
                                      int64_t budget_bytes, bool seq_chunks_auto = false);
std::string CandidatesTable(const AutoChoice& choice);

// Renderers.
std::string RenderTable(const Plan& plan, const SimResult& sim);
std::string RenderJson(const Plan& plan, const SimResult& sim);
// The timeline: one row of boxes per rank (each pass a box, its microbatch written inside where
// it fits), a time axis with round ticks in the costs' units, and a legend of the kinds of pass
// the plan has. Its height attribute is the picture's height.
std::string RenderSvg(const Plan& plan, const SimResult& sim);
// A time axis label: `v` with as many decimals as the tick step needs, never an exponent
// (TimeLabel(0.0003, 0.0001) == "0.0003", TimeLabel(40, 10) == "40"); zero is "0".
std::string TimeLabel(double v, double step);

}  // namespace vp::planner
