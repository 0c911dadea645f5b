// The plan executor behind PipelineRank, generic over the device engine: declarations.
// The action handlers are in rank_executor_actions.h, which the files that instantiate the
// executor include (pipeline_rank.cc for the CPU, runtime/cuda for CUDA); what an engine must
// provide is the StageEngine concept (stage_engine.h).
//
// Compute actions run on the calling thread in plan order; communication actions run in plan
// order on communication threads — one when the point-to-point and the collective
// communicators are the same object (Gloo), two when they differ (NCCL: stage-to-stage
// transfers and the vocabulary barriers on their own communicators and streams). A thread waits
// only for the keys of earlier actions that produce or consume its data, so the split relaxes
// the plan's order and keeps it deadlock-free (the planner proves the plan under blocking
// sends).
//
// Letters: m microbatches per step, b microbatch size, s sequence length, h hidden size;
// mb a microbatch, c (or chunk) a local model chunk, g a layer group (a model chunk's place in
// the whole pipeline), q (or seq) a sequence chunk, k the number of sequence chunks.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "proto/plan/plan.h"
#include "worker/comm/communicator.h"
#include "worker/engine/model/rank_model.h"
#include "worker/runtime/pipeline_rank.h"
#include "worker/runtime/stage_engine.h"
#include "worker/runtime/tensor_rows.h"

namespace vp::runtime::internal {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// What an action produces or waits for. Each key is produced once per step by one action,
// earlier in the plan than every action that waits for it, so waiting cannot deadlock.
enum class KeyKind : uint8_t {
  kInComputed,   // IF done (mb)
  kInReduced,    // the full embedding output is available (mb)
  kActIn,        // activation received for local chunk c (mb, c, q)
  kActOut,       // activation produced by local chunk c (mb, c, q)
  kGradIn,       // gradient received for local chunk c (mb, c, q)
  kGradOut,      // input gradient produced by local chunk c (mb, c, q)
  kXReady,       // X of the last layer group available here (mb, q)
  kSDone,        // S done (mb, q)
  kC1Done,       // C1 done (mb, q)
  kTDone,        // T done (mb, q)
  kC2Done,       // C2 done (mb, q)
  kDEmbedReady,  // the embedding-output gradient is complete (mb)
  kIbBcastDone,  // IB_BCAST done (mb)
  kWeightsDone,  // the last W (or BW) of local chunk c this step is done (chunk)
};

struct Key {
  KeyKind kind;
  int mb = 0, chunk = 0, seq = 0;  // microbatch, local model chunk, sequence chunk
  auto operator<=>(const Key&) const = default;
};

// Where a buffer belongs: a (microbatch, local model chunk, sequence chunk) for the transformer
// stacks' activations and gradients, a (microbatch, sequence chunk) for the output layer's.
struct ChunkSlot {
  int mb = 0, chunk = 0, seq = 0;
  auto operator<=>(const ChunkSlot&) const = default;
};
struct SeqSlot {
  int mb = 0, seq = 0;
  auto operator<=>(const SeqSlot&) const = default;
};

// P2P tags: a transfer is named by the group that produced it, so sender and receiver agree
// even when their local chunk numbers differ (interleaved placements).
inline uint64_t P2PTag(bool grad, int group, int q, int mb) {
  return ((((grad ? 1ull : 0ull) << 12 | static_cast<uint64_t>(group)) << 12 |
           static_cast<uint64_t>(q))
          << 20) |
         static_cast<uint64_t>(mb);
}

// What one rank holds and how its model chunks map to layer groups, from the plan.
struct RankSetup {
  engine::RankLayout layout;
  std::vector<int> chunk_group;             // local model chunk -> group
  std::map<int, int> local_chunk_of_group;  // group -> local model chunk
  int groups = 0;                           // layer groups of the whole pipeline
  int k = 1;                                // sequence chunks per microbatch
  int first_group_rank = 0;                 // the rank holding group 0 (the embedding's user)
  bool owner = false;                       // this rank holds the last group (x_owner)
  bool tied_copy_sync = false;              // tied wte copies to sum across ranks at OPT
  // Per local chunk: the index in this rank's actions of its last W or BW (after which the
  // data thread may sum the chunk's gradients, GRAD_SYNC); the action count when it has none.
  std::vector<size_t> last_weight_action;
  // GRAD_SYNC on a thread of its own, overlapping the backward (true); false: every chunk's
  // reduction waits for OPT, when the pipeline's transfers are done — for a transport that must
  // not be driven from two threads at once (NCCL communicators of one device, CudaRankOptions).
  bool overlap_data_sync = true;
  engine::vocab::OutputAlgorithm algorithm = engine::vocab::OutputAlgorithm::kAlgorithm2;
};

// Checks the plan against the rank and the job and derives the rank's layout.
absl::StatusOr<RankSetup> BuildRankSetup(const planner::Plan& plan, int rank,
                                         const TrainerOptions& options,
                                         const comm::Communicator* comm,
                                         const comm::Communicator* data = nullptr,
                                         const comm::Communicator* tensor = nullptr);

template <StageEngine E>
class RankExecutor {
 public:
  using Buffer = typename E::Buffer;
  using Elem = typename E::Elem;
  using InputState = typename E::InputState;
  using OutputState = typename E::OutputState;
  using XState = typename E::XState;

  // p2p and coll: this rank's communicators over all plan.pipeline ranks (may be the same
  // object); data: over the options.data.replicas replicas of this stage (null for one);
  // tensor: over the options.tensor.size tensor ranks of this stage (null for one; the engine
  // uses the same group inside its passes, and the compute thread here for the loss). They
  // must outlive the executor; data is used by the data thread (GRAD_SYNC) and then by the
  // compute thread at OPT.
  RankExecutor(const planner::Plan& plan, int rank, const TrainerOptions& options, RankSetup setup,
               std::unique_ptr<E> engine, comm::Communicator* p2p, comm::Communicator* coll,
               comm::Communicator* data = nullptr, comm::Communicator* tensor = nullptr)
      : plan_(plan),
        rank_(rank),
        options_(options),
        setup_(std::move(setup)),
        engine_(std::move(engine)),
        p2p_(p2p),
        coll_(coll),
        data_(data),
        tensor_(options.tensor.size > 1 ? tensor : nullptr),
        self_comm_(comm::MakeSelfCommunicator()) {}

  E& engine() { return *engine_; }
  int rank() const { return rank_; }

  absl::StatusOr<RankStepResult> Step(int64_t step, const BatchFn& batches);
  // Forward-only evaluation (PipelineRank::Evaluate).
  absl::StatusOr<RankEvalResult> Evaluate(int num_batches, const BatchFn& batches);

 private:
  // Output-layer state plus who still needs it.
  struct OutputEntry {
    OutputState state;
    bool t_done = false;
    bool grad_consumed = false;  // the owner's B has read ∇X (or this rank is not the owner)
    bool barrier_done = false;   // the last barrier on this state (C1 or C2) has run
  };

  int b() const { return options_.microbatch_size; }
  int s() const { return options_.model.seq_len; }
  int h() const { return options_.model.hidden; }
  // t: the stage's tensor ranks; each holds 1/t of every slot's token rows (tensor_rows.h).
  int t() const { return std::max(1, options_.tensor.size); }
  // Sequence chunk q covers positions [SeqBegin(q), SeqBegin(q) + SeqLen(q)); one slot's
  // activation is (b, SeqLen(q), h), SlotElems(q) elements (this rank's 1/t of them).
  int SeqBegin(int q) const { return plan_.seq_bounds[q]; }
  int SeqLen(int q) const { return plan_.seq_bounds[q + 1] - plan_.seq_bounds[q]; }
  // This rank's token rows of slot (·, q): b·len/t.
  int SlotRows(int q) const { return b() * SeqLen(q) / t(); }
  size_t SlotElems(int q) const { return static_cast<size_t>(SlotRows(q)) * h(); }
  // Sums the step's (or evaluation's) loss over the tensor group: each rank added its rows'.
  absl::Status SumLossOverTensorGroup();
  // Activation buffers are moved between ranks as raw floats (bf16: two per float; the engine
  // guarantees an even element count).
  static float* Floats(Buffer& buf) { return reinterpret_cast<float*>(buf.data()); }
  static size_t FloatCount(const Buffer& buf) { return buf.size() * sizeof(Elem) / sizeof(float); }

  // ---- synchronisation ----
  void Produce(Key key) {
    {
      std::lock_guard<std::mutex> l(mu_);
      ready_.insert(key);
    }
    cv_.notify_all();
  }
  absl::Status Wait(Key key, double* waited) {
    std::unique_lock<std::mutex> l(mu_);
    if (ready_.count(key) != 0) return absl::OkStatus();
    const auto t0 = Clock::now();
    cv_.wait(l, [&] { return ready_.count(key) != 0 || !error_.ok(); });
    if (waited != nullptr) *waited += Seconds(t0, Clock::now());
    return ready_.count(key) != 0 ? absl::OkStatus() : error_;
  }
  void Fail(const absl::Status& st) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (error_.ok()) error_ = st;
    }
    cv_.notify_all();
  }
  bool Failed() {
    std::lock_guard<std::mutex> l(mu_);
    return !error_.ok();
  }
  template <typename M>
  auto* Get(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = map.find(key);
    return it == map.end() ? nullptr : &it->second;
  }
  template <typename M, typename V>
  auto* Put(M& map, const typename M::key_type& key, V&& value) {
    std::lock_guard<std::mutex> l(mu_);
    return &(map.insert_or_assign(key, std::forward<V>(value)).first->second);
  }
  template <typename M>
  void Erase(M& map, const typename M::key_type& key) {
    std::lock_guard<std::mutex> l(mu_);
    map.erase(key);
  }

  absl::Status Missing(const planner::Action& a, const char* what) {
    return absl::InternalError(
        absl::StrCat("rank ", rank_, " ", planner::ToString(a), ": ", what, " missing"));
  }

  // ---- compute actions (the calling thread) ----

  // IF: this rank's shard of the embedding lookup.
  absl::Status DoIF(const planner::Action& a);

  // F: one model chunk's layers on one slot; the last group also runs ln_f (X).
  absl::Status DoF(const planner::Action& a, double* waited);

  // S: the output layer's first pass on X.
  absl::Status DoS(const planner::Action& a, double* waited);

  // T: the output layer's second pass; adds the slot's loss.
  absl::Status DoT(const planner::Action& a, double* waited);

  // B (input gradient) of a chunk; with `weight` also W (the fused BW).
  absl::Status DoB(const planner::Action& a, bool weight, double* waited);

  // IB: the embedding gradient into this shard's rows.
  absl::Status DoIB(const planner::Action& a, double* waited);

  // One compute action (compute thread).
  absl::Status RunCompute(const planner::Action& a, double* waited);

  // Drops an output-layer state once T, its barrier and the owner's B are all done.
  void MaybeReleaseOut(SeqSlot key);

  // ---- comm actions (communication threads) ----

  // SEND_ACT / SEND_GRAD: the activation (gradient) this rank produced for the slot, to a.peer.
  absl::Status DoSend(const planner::Action& a);

  // RECV_ACT / RECV_GRAD: the slot's activation (gradient) from a.peer, tagged by the group
  // that sent it.
  absl::Status DoRecv(const planner::Action& a);

  // BCAST_X (C0): the owner of the last layer group sends X to every rank.
  absl::Status DoBcastX(const planner::Action& a);

  // C1: the output layer's first barrier.
  absl::Status DoC1(const planner::Action& a);

  // C2: the output layer's second barrier (Algorithm 1).
  absl::Status DoC2(const planner::Action& a);

  // IF_REDUCE: the embedding lookup summed over the vocabulary shards.
  absl::Status DoIfReduce(const planner::Action& a);

  // IB_BCAST: the embedding-output gradient from the first group's rank to every shard.
  absl::Status DoIbBcast(const planner::Action& a);

  // GRAD_SYNC: after the chunk's last W, its gradients summed over the replicas (the data
  // thread; a no-op without data parallelism or under ZeRO-1, whose OPT sums everything).
  absl::Status DoGradSync(const planner::Action& a);

  // One communication action (a communication thread).
  absl::Status RunComm(const planner::Action& a);

  // Forward-only evaluation: after C1 of a slot, adds its losses and drops its output-layer
  // state and X (no T, no backward will read them).
  void TakeEvalLoss(SeqSlot key);

  // One pass over the plan's actions for microbatches filled by batches(step, j, ...): every
  // action, or with forward_only_ only the forward ones. Times go to r's busy/comm fields.
  absl::Status RunPlan(int64_t step, const BatchFn& batches, RankStepResult* r);

  // Runs `actions` (communication, plan order) on the calling thread; times go to `comm`.
  void CommLoop(const std::vector<planner::Action>& actions,
                std::array<double, planner::kNumActionKinds>* comm);

  planner::Plan plan_;
  int rank_ = 0;
  TrainerOptions options_;
  RankSetup setup_;
  std::unique_ptr<E> engine_;
  comm::Communicator* p2p_;
  comm::Communicator* coll_;
  comm::Communicator* data_;    // the replicas of this stage; null without data parallelism
  comm::Communicator* tensor_;  // the tensor ranks of this stage; null without tensor parallelism
  std::unique_ptr<comm::Communicator> self_comm_;

  // Per-step state, guarded by mu_ (the buffers' contents are ordered by the keys).
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<Key> ready_;
  absl::Status error_;
  std::map<int, InputState> input_states_;
  std::map<ChunkSlot, Buffer> act_in_, act_out_, grad_in_, grad_out_;
  std::map<SeqSlot, XState> x_states_;
  std::map<SeqSlot, OutputEntry> output_states_;
  std::map<int, Buffer> embed_grads_;  // (b, s, h) per microbatch, on first_group_rank
  double loss_ = 0;
  int losses_seen_ = 0;
  // Flat gradient ranges GRAD_SYNC summed this step (the data thread writes, OPT reads after
  // joining it).
  std::vector<comm::ShardRange> synced_;

  // Step inputs.
  std::vector<std::vector<int32_t>> inputs_, targets_;  // per microbatch, (b, s)
  float loss_grad_ = 0;  // d = 1/(m·b·s): the loss gradient of every token of the step
  // Evaluate runs only the forward actions; their loss is taken after C1.
  bool forward_only_ = false;
};

}  // namespace vp::runtime::internal
