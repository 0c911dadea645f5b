// The device twin of the CPU LayerStack/TransformerLayer (../transformer.cc): the same
// math in the same order, the same F / B / W split and B-pass stash, the same per-(layer,
// microbatch) K/V cache over Seq1F1B chunks and the same order checks and messages. Differences:
//   - attention is flash-style: F keeps lse (b, heads, t) instead of the (t × end)
//     probabilities, and B recomputes them from lse and the attention output atty (kept anyway
//     for c_proj's W);
//   - every pass enqueues on ctx.stream and the public methods return after Finish(ctx), so a
//     buffer freed mid-pass (e.g. qkv after B) is reused only once the stream is idle.
//
// Precision (T = bf16): parameters and activations are bf16, LayerNorm statistics and lse fp32,
// weight gradients fp32 (GEMMs accumulate in fp32 and add into the fp32 gradient with beta = 1).
// The dK/dV accumulators that carry key/value gradients from later chunks to earlier ones are
// T, i.e. bf16, because the attention backward kernel accumulates into T: with k chunks a key
// row's gradient is rounded to bf16 up to k times (once per chunk that attends to it). That is
// the one place where chunking changes bf16 rounding; with one chunk it matches the unchunked
// backward.
#include "worker/engine/transformer/cuda/transformer.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/attention_cudnn.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/phase_timer.h"
#include "worker/engine/tensor_parallel/cuda/parallel_linear.h"
#include "worker/engine/tensor_parallel/split.h"

// Propagates a non-OK absl::Status (the GEMM wrappers and DeviceArray::Create return one).
#define VP_LS_RETURN_IF_ERROR(expr)                                 \
  do {                                                              \
    if (absl::Status vp_ls_status_ = (expr); !vp_ls_status_.ok()) { \
      return vp_ls_status_;                                         \
    }                                                               \
  } while (0)

namespace vp::engine::cuda {
namespace {

// A device array of `count` E charged to kActivations; zero-filled only when the pass relies on
// zeros (accumulators), since a memset is a kernel launch.
template <typename E>
absl::Status Acquire(const DeviceContext& ctx, size_t count, DeviceArray<E>& out,
                     bool zero = false) {
  absl::StatusOr<DeviceArray<E>> a =
      DeviceArray<E>::Create(ctx, MemoryCategory::kActivations, count, zero);
  if (!a.ok()) return a.status();
  out = std::move(*a);
  return absl::OkStatus();
}

template <typename T>
cudaError_t CopyDevice(T* dst, const T* src, size_t count, cudaStream_t stream) {
  return cudaMemcpyAsync(dst, src, count * sizeof(T), cudaMemcpyDeviceToDevice, stream);
}

// Copies rows [0, t) of column block [col, col+h) of `chunk` (b, t, ld) to rows [begin, begin+t)
// of `cache` (b, s, h), or the reverse direction when to_cache is false (the CPU CopyRows). One
// strided 2-D copy per sequence: the cache's per-sequence row stride s differs from the chunk's t.
template <typename T>
cudaError_t CopyRows(T* cache,  // (b, s, h)
                     T* chunk,  // (b, t, ld)
                     int b, int t, int s, int h, int ld, int col, int begin, bool to_cache,
                     cudaStream_t stream) {
  const size_t row = sizeof(T) * h;
  for (int i = 0; i < b; ++i) {
    T* c = cache + (static_cast<size_t>(i) * s + begin) * h;
    T* x = chunk + static_cast<size_t>(i) * t * ld + col;
    const cudaError_t e = to_cache ? cudaMemcpy2DAsync(c, row, x, sizeof(T) * ld, row, t,
                                                       cudaMemcpyDeviceToDevice, stream)
                                   : cudaMemcpy2DAsync(x, sizeof(T) * ld, c, row, row, t,
                                                       cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Per (layer, microbatch): the key/value cache filled by the forwards of chunks 0, 1, ... and
// the dK/dV accumulator filled by the backwards of chunks k-1, ..., 0 (LayerKvState).
// Widths: h for GPT-2, kv = kv_heads·head_dim for Llama.
template <typename T>
struct DeviceKvState {
  DeviceArray<T> k;   // (b, s, h | kv)
  DeviceArray<T> v;   // (b, s, h | kv)
  DeviceArray<T> dk;  // (b, s, h | kv) T: bf16 in the bf16 path (see the file comment)
  DeviceArray<T> dv;  // (b, s, h | kv)
};

// Activations of one layer for one (microbatch, chunk) (LayerActivations, with lse in place of
// the attention probabilities). Llama: qkv and d_qkv are (b, t, h + 2kv), fch and d_fch the
// (b, t, 2f) gate|up rows, fch_gelu the SwiGLU output, ln*_mean unused.
template <typename T>
struct DeviceLayerActivations {
  SeqChunk seq;
  const T* inp = nullptr;  // (b, t, h) the layer input; the stack keeps it alive until W
  // Forward.
  DeviceArray<T> ln1;                     // (b, t, h)
  DeviceArray<float> ln1_mean, ln1_rstd;  // (b, t)
  DeviceArray<T> qkv;                     // (b, t, 3h)  freed by B
  DeviceArray<float> lse;                 // (b, heads, t)  freed by B
  DeviceArray<T> atty;                    // (b, t, h)  attention output before c_proj
  DeviceArray<T> res1;                    // (b, t, h)  x + attn
  DeviceArray<T> ln2;                     // (b, t, h)
  DeviceArray<float> ln2_mean, ln2_rstd;  // (b, t)
  DeviceArray<T> fch;                     // (b, t, f)  c_fc output, pre-GELU; freed by B
  DeviceArray<T> fch_gelu;                // (b, t, f)
  // B-pass stash for W.
  DeviceArray<T> d_out;   // (b, t, h)  gradient of the layer output (mlp.c_proj's output)
  DeviceArray<T> d_fch;   // (b, t, f)  gradient of c_fc's output
  DeviceArray<T> d_ln2;   // (b, t, h)  gradient of ln_2's output
  DeviceArray<T> d_res1;  // (b, t, h)  gradient of res1 (= attn.c_proj's output gradient)
  DeviceArray<T> d_qkv;   // (b, t, 3h) gradient of c_attn's output (dK, dV fully accumulated)
  DeviceArray<T> d_ln1;   // (b, t, h)  gradient of ln_1's output
  bool forward_done = false;
  bool backward_input_done = false;
};

// One transformer layer bound to its device parameters and fp32 gradient block. The stack
// checks the call order; this class assumes it (as TransformerLayer does).
template <typename T>
class DeviceLayer {
 public:
  // sp: the stack's sequence-parallel rows (its group of t = 1 when the layer is whole); the
  // tensors are one tensor rank's slices (LayerTensorSpecs(cfg, t)).
  DeviceLayer(const ModelConfig& cfg, int batch, const T* params, float* grads,
              const tp::DeviceSequenceParallel<T>* sp)
      : cfg_(cfg),
        batch_(batch),
        sp_(sp),
        w_(engine::tp::LocalLayerWidths(cfg, sp->group().size())),
        p_(BindLayerTensors(params, cfg, sp->group().size())),
        g_(BindLayerTensors(grads, cfg, sp->group().size())),
        lp_(BindLlamaLayerTensors(params, cfg, sp->group().size())),
        lg_(BindLlamaLayerTensors(grads, cfg, sp->group().size())),
        qkv_(sp, cfg.llama()
                     ? tp::DeviceLinearWeights<T>{tp::WeightLayout::kOutIn, cfg.hidden, w_.qkv(),
                                                  lp_.wqkv, nullptr, lg_.wqkv, nullptr}
                     : tp::DeviceLinearWeights<T>{tp::WeightLayout::kInOut, cfg.hidden, w_.qkv(),
                                                  p_.attn_w, p_.attn_b, g_.attn_w, g_.attn_b}),
        attn_out_(sp, cfg.llama()
                          ? tp::DeviceLinearWeights<T>{tp::WeightLayout::kOutIn, w_.attn,
                                                       cfg.hidden, lp_.wo, nullptr, lg_.wo, nullptr}
                          : tp::DeviceLinearWeights<T>{tp::WeightLayout::kInOut, w_.attn,
                                                       cfg.hidden, p_.attn_proj_w, p_.attn_proj_b,
                                                       g_.attn_proj_w, g_.attn_proj_b}),
        mlp_in_(sp, cfg.llama()
                        ? tp::DeviceLinearWeights<T>{tp::WeightLayout::kOutIn, cfg.hidden,
                                                     2 * w_.ffn, lp_.wgu, nullptr, lg_.wgu, nullptr}
                        : tp::DeviceLinearWeights<T>{tp::WeightLayout::kInOut, cfg.hidden, w_.ffn,
                                                     p_.fc_w, p_.fc_b, g_.fc_w, g_.fc_b}),
        mlp_out_(sp, cfg.llama()
                         ? tp::DeviceLinearWeights<T>{tp::WeightLayout::kOutIn, w_.ffn, cfg.hidden,
                                                      lp_.wdown, nullptr, lg_.wdown, nullptr}
                         : tp::DeviceLinearWeights<T>{tp::WeightLayout::kInOut, w_.ffn, cfg.hidden,
                                                      p_.proj_w, p_.proj_b, g_.proj_w, g_.proj_b}) {
  }

  // Selective recomputation (config.h): after F the attention core's output and log-sum-exp
  // are dropped ...
  void DropAttentionCore(DeviceLayerActivations<T>& acts) const {
    if (cfg_.recompute != Recompute::kSelective) return;
    acts.atty.Reset();
    acts.lse.Reset();
  }
  // ... and B computes them again from the kept q|k|v rows and the K/V cache (a no-op when F
  // kept them).
  absl::Status RecomputeAttention(const DeviceContext& ctx, DeviceKvState<T>& kv,
                                  DeviceLayerActivations<T>& acts) const {
    if (!acts.atty.empty()) return absl::OkStatus();
    const SeqChunk seq = acts.seq;
    const int b = batch_, t = seq.len(), a = w_.attn, heads = w_.heads;
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * heads * t, acts.lse));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * t * a, acts.atty));
    MarkPhase(ctx.stream, Phase::kAttention);
    VP_LS_RETURN_IF_ERROR(RunAttentionForward(ctx, acts.atty.data(), acts.lse.data(),
                                              acts.qkv.data(), w_.qkv(), kv.k.data(), kv.v.data(),
                                              Shape(seq)));
    return absl::OkStatus();
  }

  // Letters (both blocks): b batch, t chunk length, s sequence length, n = b·t the chunk's token
  // rows, m = n / t_p this rank's rows (sequence parallelism; m = n for a whole layer), h width,
  // a this rank's attention width (its heads · head_dim), kvd its key/value width, qd = a + 2kvd
  // its fused q|k|v row, f its MLP width. The layer's input and output are this rank's m rows;
  // the four products exchange rows inside (tensor_parallel/cuda/parallel_linear.h).

  // F: out = layer(x) for the chunk's positions; appends the chunk's K/V to kv.
  absl::Status Forward(const DeviceContext& ctx, SeqChunk seq,
                       const T* x,  // (m, h) kept alive by the stack until W
                       T* out,      // (m, h)
                       DeviceKvState<T>& kv, DeviceLayerActivations<T>& acts) const {
    if (cfg_.llama()) return ForwardLlama(ctx, seq, x, out, kv, acts);
    const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
    const int a = w_.attn, qd = w_.qkv();
    const int n = b * t, m = sp_->LocalRows(n);
    const long mh = static_cast<long>(m) * h;
    cudaStream_t st = ctx.stream;
    acts.seq = seq;
    acts.inp = x;
    if (kv.k.empty()) {  // the microbatch's first chunk: the cache spans the whole sequence
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * a, kv.k));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * a, kv.v));
    }
    // Attention sub-block: res1 = x + c_proj(attn(c_attn(ln_1(x)))).
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.ln1));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln1_mean));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln1_rstd));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormForward(acts.ln1.data(), acts.ln1_mean.data(),
                                             acts.ln1_rstd.data(), x, p_.ln1_w, p_.ln1_b, m, h,
                                             st));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * qd, acts.qkv));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.Forward(acts.qkv.data(), acts.ln1.data(), n));
    // Append this chunk's keys and values to the cache so later chunks can attend to them.
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.k.data(), acts.qkv.data(), b, t, s, a, qd, a, seq.begin, true, st));
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.v.data(), acts.qkv.data(), b, t, s, a, qd, 2 * a, seq.begin, true, st));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * w_.heads * t, acts.lse));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * a, acts.atty));
    MarkPhase(st, Phase::kAttention);
    VP_LS_RETURN_IF_ERROR(RunAttentionForward(ctx, acts.atty.data(), acts.lse.data(),
                                              acts.qkv.data(), qd, kv.k.data(), kv.v.data(),
                                              Shape(seq)));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.res1));
    MarkPhase(st, Phase::kGemmProj);  // the residual add in the GEMM's C, or marked kElementwise
    VP_LS_RETURN_IF_ERROR(attn_out_.ForwardResidual(acts.res1.data(), acts.atty.data(), x, n));
    DropAttentionCore(acts);
    // MLP sub-block: out = res1 + c_proj(gelu(c_fc(ln_2(res1)))).
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.ln2));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln2_mean));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln2_rstd));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormForward(acts.ln2.data(), acts.ln2_mean.data(),
                                             acts.ln2_rstd.data(), acts.res1.data(), p_.ln2_w,
                                             p_.ln2_b, m, h, st));
    const long nf = static_cast<long>(n) * f;
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, nf, acts.fch));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, nf, acts.fch_gelu));
    MarkPhase(st, Phase::kGemmFc1);  // the GELU in the GEMM's epilogue, or marked kElementwise
    VP_LS_RETURN_IF_ERROR(
        mlp_in_.ForwardGelu(acts.fch_gelu.data(), acts.fch.data(), acts.ln2.data(), n));
    MarkPhase(st, Phase::kGemmFc2);
    VP_LS_RETURN_IF_ERROR(mlp_out_.ForwardResidual(out, acts.fch_gelu.data(), acts.res1.data(), n));
    acts.forward_done = true;
    return absl::OkStatus();
  }

  // B: dx = dL/dx for the chunk (overwritten); adds this chunk's dK/dV of positions
  // [0, seq.end) into kv and uses the accumulated values for the chunk's own positions.
  absl::Status BackwardInput(const DeviceContext& ctx,
                             const T* dout,  // (m, h)
                             T* dx,          // (m, h)
                             DeviceKvState<T>& kv, DeviceLayerActivations<T>& acts) const {
    if (cfg_.llama()) return BackwardInputLlama(ctx, dout, dx, kv, acts);
    const SeqChunk seq = acts.seq;
    const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
    const int a = w_.attn, qd = w_.qkv();
    const int n = b * t, m = sp_->LocalRows(n);
    const long mh = static_cast<long>(m) * h;
    const long nf = static_cast<long>(n) * f;
    cudaStream_t st = ctx.stream;
    // MLP sub-block. The layer output gradient is both the skip-path gradient of res1 and the
    // output gradient of mlp.c_proj (stashed for W: the caller's dout need not outlive B).
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_out));
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(CopyDevice(acts.d_out.data(), dout, mh, st));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, nf, acts.d_fch));
    MarkPhase(st, Phase::kGemmFc2);  // the GELU gradient in the GEMM's epilogue, or kElementwise
    VP_LS_RETURN_IF_ERROR(mlp_out_.BackwardInputGelu(acts.d_fch.data(), dout, acts.fch.data(), n));
    acts.fch.Reset();  // W needs only the GELU output
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_ln2));
    MarkPhase(st, Phase::kGemmFc1);
    VP_LS_RETURN_IF_ERROR(mlp_in_.BackwardInput(acts.d_ln2.data(), acts.d_fch.data(), n));
    // d_res1 = dout (the skip path's gradient) + ln_2's input gradient, in one kernel.
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_res1));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardInput(acts.d_res1.data(), dout, acts.d_ln2.data(),
                                                   acts.res1.data(), p_.ln2_w, acts.ln2_mean.data(),
                                                   acts.ln2_rstd.data(), m, h, st));
    // Run 4 charged ~10x the forward norm's time to these norms: the host mark splits the
    // kernel from any wait for the host's next launch.
    MarkPhase(st, Phase::kHost);
    // Attention sub-block.
    DeviceArray<T> d_atty;  // (n, a)
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * a, d_atty));
    MarkPhase(st, Phase::kGemmProj);
    VP_LS_RETURN_IF_ERROR(attn_out_.BackwardInput(d_atty.data(), acts.d_res1.data(), n));
    VP_LS_RETURN_IF_ERROR(RecomputeAttention(ctx, kv, acts));
    if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
      // Zeroed: the attention backward accumulates dK/dV over the chunks that attend to a key.
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * a, kv.dk, /*zero=*/true));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * a, kv.dv, /*zero=*/true));
    }
    // No zero fill: the kernel overwrites the Q column block and the K/V blocks are copied in.
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * qd, acts.d_qkv));
    {
      DeviceArray<float> delta;  // (b, heads, t) scratch: Σ_d dout·out per query row
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * w_.heads * t, delta));
      MarkPhase(st, Phase::kAttention);
      VP_LS_RETURN_IF_ERROR(RunAttentionBackward(ctx, acts.d_qkv.data(), kv.dk.data(), kv.dv.data(),
                                                 delta.data(), d_atty.data(), acts.atty.data(),
                                                 acts.lse.data(), acts.qkv.data(), qd, kv.k.data(),
                                                 kv.v.data(), Shape(seq)));
    }
    // Later chunks (already run backward) and this chunk have now added everything they owe to
    // the keys/values at this chunk's positions; earlier chunks never see them. So the
    // accumulated dK/dV rows [begin, end) are final: take them as c_attn's output gradient.
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, a, qd, a, seq.begin, false, st));
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, a, qd, 2 * a, seq.begin, false, st));
    // Freed blocks stay unusable by other threads until Finish (ReuseAfterSync), and this
    // stream's later work is ordered after the kernels above, so releasing here is safe.
    acts.lse.Reset();
    acts.qkv.Reset();
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_ln1));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.BackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), n));
    // dx = d_res1 (the skip path) + ln_1's input gradient.
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardInput(dx, acts.d_res1.data(), acts.d_ln1.data(),
                                                   acts.inp, p_.ln1_w, acts.ln1_mean.data(),
                                                   acts.ln1_rstd.data(), m, h, st));
    MarkPhase(st, Phase::kHost);
    if (seq.begin == 0) kv = DeviceKvState<T>();  // the microbatch's last backward
    acts.backward_input_done = true;
    return absl::OkStatus();
  }

  // W: accumulates every parameter gradient of the chunk into the fp32 gradient block, then
  // frees the activations. The products gather again the rows they need.
  absl::Status BackwardWeight(const DeviceContext& ctx, DeviceLayerActivations<T>& acts) const {
    if (cfg_.llama()) return BackwardWeightLlama(ctx, acts);
    const int n = batch_ * acts.seq.len(), m = sp_->LocalRows(n), h = cfg_.hidden;
    cudaStream_t st = ctx.stream;
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardWeight(g_.ln1_w, g_.ln1_b, acts.d_ln1.data(), acts.inp,
                                                    acts.ln1_mean.data(), acts.ln1_rstd.data(), m,
                                                    h, st));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.BackwardWeight(acts.d_qkv.data(), acts.ln1.data(), n));
    MarkPhase(st, Phase::kGemmProj);
    VP_LS_RETURN_IF_ERROR(attn_out_.BackwardWeight(acts.d_res1.data(), acts.atty.data(), n));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(LayerNormBackwardWeight(g_.ln2_w, g_.ln2_b, acts.d_ln2.data(),
                                                    acts.res1.data(), acts.ln2_mean.data(),
                                                    acts.ln2_rstd.data(), m, h, st));
    MarkPhase(st, Phase::kGemmFc1);
    VP_LS_RETURN_IF_ERROR(mlp_in_.BackwardWeight(acts.d_fch.data(), acts.ln2.data(), n));
    MarkPhase(st, Phase::kGemmFc2);
    VP_LS_RETURN_IF_ERROR(mlp_out_.BackwardWeight(acts.d_out.data(), acts.fch_gelu.data(), n));
    acts = DeviceLayerActivations<T>();
    return absl::OkStatus();
  }

 private:
  // This rank's attention over the chunk: its query heads (and, for Llama, its key/value heads).
  AttentionShape Shape(SeqChunk seq) const {
    return AttentionShape{batch_,
                          w_.heads,
                          w_.head_dim,
                          seq.begin,
                          seq.end,
                          cfg_.seq_len,
                          cfg_.llama() ? w_.kv_heads : 0};
  }

  // -------------------------------------------------------------------------------------------
  // The Llama block (TransformerLayer::ForwardLlama & co. in ../transformer.cc, step by step;
  // the same letters). The cache and its gradient hold kvd columns; fch is the (n, 2f) gate|up
  // row; ln*_mean unused.

  absl::Status ForwardLlama(const DeviceContext& ctx, SeqChunk seq, const T* x, T* out,
                            DeviceKvState<T>& kv, DeviceLayerActivations<T>& acts) const {
    const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
    const int a = w_.attn, kvd = w_.kv, qd = w_.qkv(), hd = w_.head_dim;
    const int n = b * t, m = sp_->LocalRows(n);
    const long mh = static_cast<long>(m) * h;
    cudaStream_t st = ctx.stream;
    acts.seq = seq;
    acts.inp = x;
    if (kv.k.empty()) {
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * kvd, kv.k));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * kvd, kv.v));
    }
    // Attention: res1 = x + o_proj(attn(rope(q), rope(k), v)), q|k|v = rms(x)·Wqkvᵀ.
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.ln1));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln1_rstd));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(RmsNormForward(acts.ln1.data(), acts.ln1_rstd.data(), x,
                                           lp_.attn_norm_w, m, h, cfg_.rms_eps, st));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * qd, acts.qkv));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.Forward(acts.qkv.data(), acts.ln1.data(), n));
    // q and k rotated at absolute positions seq.begin + j, so keys enter the cache rotated.
    MarkPhase(st, Phase::kElementwise);
    VP_CUDA_RETURN_IF_ERROR(
        RopeForward(acts.qkv.data(), qd, b, t, w_.heads, hd, seq.begin, cfg_.rope_theta, st));
    VP_CUDA_RETURN_IF_ERROR(RopeForward(acts.qkv.data() + a, qd, b, t, w_.kv_heads, hd, seq.begin,
                                        cfg_.rope_theta, st));
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.k.data(), acts.qkv.data(), b, t, s, kvd, qd, a, seq.begin, true, st));
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.v.data(), acts.qkv.data(), b, t, s, kvd, qd, a + kvd, seq.begin, true, st));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * w_.heads * t, acts.lse));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * a, acts.atty));
    MarkPhase(st, Phase::kAttention);
    VP_LS_RETURN_IF_ERROR(RunAttentionForward(ctx, acts.atty.data(), acts.lse.data(),
                                              acts.qkv.data(), qd, kv.k.data(), kv.v.data(),
                                              Shape(seq)));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.res1));
    MarkPhase(st, Phase::kGemmProj);  // the residual add in the GEMM's C, or marked kElementwise
    VP_LS_RETURN_IF_ERROR(attn_out_.ForwardResidual(acts.res1.data(), acts.atty.data(), x, n));
    DropAttentionCore(acts);
    // MLP: out = res1 + down(silu(gate) · up), gate|up = rms(res1)·Wguᵀ.
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.ln2));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, m, acts.ln2_rstd));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(RmsNormForward(acts.ln2.data(), acts.ln2_rstd.data(), acts.res1.data(),
                                           lp_.mlp_norm_w, m, h, cfg_.rms_eps, st));
    const long nf = static_cast<long>(n) * f;
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, 2 * nf, acts.fch));
    MarkPhase(st, Phase::kGemmFc1);
    VP_LS_RETURN_IF_ERROR(mlp_in_.Forward(acts.fch.data(), acts.ln2.data(), n));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, nf, acts.fch_gelu));
    MarkPhase(st, Phase::kElementwise);
    VP_CUDA_RETURN_IF_ERROR(SwigluForward(acts.fch_gelu.data(), acts.fch.data(), n, f, st));
    MarkPhase(st, Phase::kGemmFc2);
    VP_LS_RETURN_IF_ERROR(mlp_out_.ForwardResidual(out, acts.fch_gelu.data(), acts.res1.data(), n));
    acts.forward_done = true;
    return absl::OkStatus();
  }

  absl::Status BackwardInputLlama(const DeviceContext& ctx, const T* dout, T* dx,
                                  DeviceKvState<T>& kv, DeviceLayerActivations<T>& acts) const {
    const SeqChunk seq = acts.seq;
    const int b = batch_, t = seq.len(), h = cfg_.hidden, f = w_.ffn, s = cfg_.seq_len;
    const int a = w_.attn, kvd = w_.kv, qd = w_.qkv(), hd = w_.head_dim;
    const int n = b * t, m = sp_->LocalRows(n);
    const long mh = static_cast<long>(m) * h;
    const long nf = static_cast<long>(n) * f;
    cudaStream_t st = ctx.stream;
    // MLP. dout is both res1's skip-path gradient and down_proj's output gradient (kept for W).
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_out));
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(CopyDevice(acts.d_out.data(), dout, mh, st));
    {
      DeviceArray<T> d_act;  // (n, f) gradient of the SwiGLU output
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, nf, d_act));
      MarkPhase(st, Phase::kGemmFc2);
      VP_LS_RETURN_IF_ERROR(mlp_out_.BackwardInput(d_act.data(), dout, n));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, 2 * nf, acts.d_fch));
      MarkPhase(st, Phase::kElementwise);
      VP_CUDA_RETURN_IF_ERROR(
          SwigluBackward(acts.d_fch.data(), acts.fch.data(), d_act.data(), n, f, st));
    }
    acts.fch.Reset();  // W needs only the SwiGLU output
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_ln2));
    MarkPhase(st, Phase::kGemmFc1);
    VP_LS_RETURN_IF_ERROR(mlp_in_.BackwardInput(acts.d_ln2.data(), acts.d_fch.data(), n));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_res1));  // dout + the MLP norm's gradient
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(RmsNormBackwardInput(acts.d_res1.data(), dout, acts.d_ln2.data(),
                                                 acts.res1.data(), lp_.mlp_norm_w,
                                                 acts.ln2_rstd.data(), m, h, st));
    MarkPhase(st, Phase::kHost);
    // Attention.
    DeviceArray<T> d_atty;  // (n, a)
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * a, d_atty));
    MarkPhase(st, Phase::kGemmProj);
    VP_LS_RETURN_IF_ERROR(attn_out_.BackwardInput(d_atty.data(), acts.d_res1.data(), n));
    VP_LS_RETURN_IF_ERROR(RecomputeAttention(ctx, kv, acts));
    if (kv.dk.empty()) {  // the first backward of this microbatch (its last chunk)
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * kvd, kv.dk, /*zero=*/true));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * s * kvd, kv.dv, /*zero=*/true));
    }
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(n) * qd, acts.d_qkv));
    {
      DeviceArray<float> delta;  // (b, heads, t)
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, static_cast<size_t>(b) * w_.heads * t, delta));
      MarkPhase(st, Phase::kAttention);
      VP_LS_RETURN_IF_ERROR(RunAttentionBackward(ctx, acts.d_qkv.data(), kv.dk.data(), kv.dv.data(),
                                                 delta.data(), d_atty.data(), acts.atty.data(),
                                                 acts.lse.data(), acts.qkv.data(), qd, kv.k.data(),
                                                 kv.v.data(), Shape(seq)));
    }
    // As in the GPT-2 block, rows [begin, end) of the dK/dV accumulators are final now. (With
    // replicated key/value heads they hold only this rank's query heads' share: the k and v
    // weight gradients are summed over the group as replicated tensors, and the input gradient
    // by the q|k|v product's reduce-scatter.)
    MarkPhase(st, Phase::kCopy);
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.dk.data(), acts.d_qkv.data(), b, t, s, kvd, qd, a, seq.begin, false, st));
    VP_CUDA_RETURN_IF_ERROR(
        CopyRows(kv.dv.data(), acts.d_qkv.data(), b, t, s, kvd, qd, a + kvd, seq.begin, false, st));
    // Gradients of the rotated q, k: rotate back to the projections' gradients.
    MarkPhase(st, Phase::kElementwise);
    VP_CUDA_RETURN_IF_ERROR(
        RopeBackward(acts.d_qkv.data(), qd, b, t, w_.heads, hd, seq.begin, cfg_.rope_theta, st));
    VP_CUDA_RETURN_IF_ERROR(RopeBackward(acts.d_qkv.data() + a, qd, b, t, w_.kv_heads, hd,
                                         seq.begin, cfg_.rope_theta, st));
    acts.lse.Reset();
    acts.qkv.Reset();
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, mh, acts.d_ln1));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.BackwardInput(acts.d_ln1.data(), acts.d_qkv.data(), n));
    MarkPhase(st, Phase::kNorm);  // dx = d_res1 + the attention norm's gradient
    VP_CUDA_RETURN_IF_ERROR(RmsNormBackwardInput(dx, acts.d_res1.data(), acts.d_ln1.data(),
                                                 acts.inp, lp_.attn_norm_w, acts.ln1_rstd.data(), m,
                                                 h, st));
    MarkPhase(st, Phase::kHost);
    if (seq.begin == 0) kv = DeviceKvState<T>();  // the microbatch's last backward
    acts.backward_input_done = true;
    return absl::OkStatus();
  }

  absl::Status BackwardWeightLlama(const DeviceContext& ctx,
                                   DeviceLayerActivations<T>& acts) const {
    const int n = batch_ * acts.seq.len(), m = sp_->LocalRows(n), h = cfg_.hidden;
    cudaStream_t st = ctx.stream;
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(RmsNormBackwardWeight(lg_.attn_norm_w, acts.d_ln1.data(), acts.inp,
                                                  acts.ln1_rstd.data(), m, h, st));
    MarkPhase(st, Phase::kGemmQkv);
    VP_LS_RETURN_IF_ERROR(qkv_.BackwardWeight(acts.d_qkv.data(), acts.ln1.data(), n));
    MarkPhase(st, Phase::kGemmProj);
    VP_LS_RETURN_IF_ERROR(attn_out_.BackwardWeight(acts.d_res1.data(), acts.atty.data(), n));
    MarkPhase(st, Phase::kNorm);
    VP_CUDA_RETURN_IF_ERROR(RmsNormBackwardWeight(
        lg_.mlp_norm_w, acts.d_ln2.data(), acts.res1.data(), acts.ln2_rstd.data(), m, h, st));
    MarkPhase(st, Phase::kGemmFc1);
    VP_LS_RETURN_IF_ERROR(mlp_in_.BackwardWeight(acts.d_fch.data(), acts.ln2.data(), n));
    MarkPhase(st, Phase::kGemmFc2);
    VP_LS_RETURN_IF_ERROR(mlp_out_.BackwardWeight(acts.d_out.data(), acts.fch_gelu.data(), n));
    acts = DeviceLayerActivations<T>();
    return absl::OkStatus();
  }

  ModelConfig cfg_;
  int batch_;
  const tp::DeviceSequenceParallel<T>* sp_;
  engine::tp::LayerWidths w_;  // this tensor rank's widths (the whole layer's at t = 1)
  LayerTensors<const T> p_;
  LayerTensors<float> g_;
  LlamaLayerTensors<const T> lp_;  // Llama's tensors (empty for GPT-2)
  LlamaLayerTensors<float> lg_;
  // The four products: column-parallel q|k|v and MLP-in, row-parallel attention-out and
  // MLP-out (at t = 1 the plain linears).
  tp::DeviceColumnParallelLinear<T> qkv_;
  tp::DeviceRowParallelLinear<T> attn_out_;
  tp::DeviceColumnParallelLinear<T> mlp_in_;
  tp::DeviceRowParallelLinear<T> mlp_out_;
};

}  // namespace

template <typename T>
struct DeviceLayerStack<T>::Impl : LayerStackShape {
  struct Slot {
    std::vector<DeviceArray<T>> inputs;  // inputs[i]: the input of layer i (b, t, h)
    std::vector<DeviceLayerActivations<T>> acts;
  };

  DeviceContext ctx;
  // The tensor group's row exchanges (t = 1: none); the layers point at it.
  std::unique_ptr<tp::DeviceSequenceParallel<T>> sp;
  std::vector<DeviceLayer<T>> layers;

  // Elements of one layer input / output of a chunk: this rank's rows (b·len / t) · h.
  size_t RowsTimesWidth(const SeqChunk& c) const {
    return static_cast<size_t>(sp->LocalRows(batch * c.len())) * cfg.hidden;
  }
  SlotOrder order{1};
  // Device buffers in the maps go back to ctx.alloc, which outlives the stack.
  std::map<SlotKey, Slot> slots;
  std::map<int, std::vector<DeviceKvState<T>>> kv;  // per microbatch in flight, per layer

  // The public passes: `s` is the pass's status; the stream is drained either way (so nothing
  // this pass enqueued is still running when the caller sees an error), the first error wins.
  absl::Status Finished(absl::Status s) const {
    absl::Status f = Finish(ctx);
    return s.ok() ? f : s;
  }

  // F after order.CheckForward. On an error the slot is dropped (the sequence chunk may be
  // forwarded again: its K/V rows are simply rewritten); a sticky device error leaves the context
  // unusable anyway.
  absl::Status RunForward(SlotKey slot, const T* x, T* out) {
    std::vector<DeviceKvState<T>>& mb_kv = kv[slot.microbatch];
    if (mb_kv.empty()) mb_kv.resize(count);
    const SeqChunk c = seq_chunk(slot.seq);
    const size_t nh = RowsTimesWidth(c);
    Slot& st = slots[slot];
    st.acts.resize(count);
    absl::Status status = [&]() -> absl::Status {
      st.inputs.resize(count);
      for (int i = 0; i < count; ++i) VP_LS_RETURN_IF_ERROR(Acquire(ctx, nh, st.inputs[i]));
      // W reads each layer's input; the caller's x need not live that long.
      MarkPhase(ctx.stream, Phase::kCopy);
      VP_CUDA_RETURN_IF_ERROR(CopyDevice(st.inputs[0].data(), x, nh, ctx.stream));
      for (int i = 0; i < count; ++i) {
        T* y = i + 1 < count ? st.inputs[i + 1].data() : out;
        VP_LS_RETURN_IF_ERROR(
            layers[i].Forward(ctx, c, st.inputs[i].data(), y, mb_kv[i], st.acts[i]));
        if (cfg.recompute == Recompute::kFull) {
          // Only the layer's input is kept; the K/V cache once no later chunk reads it in F.
          st.acts[i] = DeviceLayerActivations<T>();
          if (slot.seq + 1 == num_seq_chunks()) {
            mb_kv[i].k.Reset();
            mb_kv[i].v.Reset();
          }
        }
      }
      return absl::OkStatus();
    }();
    if (!status.ok()) {
      slots.erase(slot);
      return status;
    }
    order.ForwardDone(slot);
    return absl::OkStatus();
  }

  // Full recomputation: layer i's F of the slot again, before its B. When the K/V cache was
  // released, the microbatch's earlier chunks go forward again first, in order, to refill it
  // (still held: B runs the chunks in reverse order).
  absl::Status RecomputeForward(SlotKey slot, int i) {
    DeviceKvState<T>& layer_kv = kv.at(slot.microbatch)[i];
    DeviceArray<T> out;  // the layer's output again: equal to the next layer's kept input
    size_t most = 0;     // earlier chunks may be longer (uneven bounds): room for the longest
    for (int q = 0; q <= slot.seq; ++q) most = std::max(most, RowsTimesWidth(seq_chunk(q)));
    VP_LS_RETURN_IF_ERROR(Acquire(ctx, most, out));
    if (layer_kv.k.empty()) {
      for (int q = 0; q < slot.seq; ++q) {
        DeviceLayerActivations<T> scratch;
        VP_LS_RETURN_IF_ERROR(layers[i].Forward(ctx, seq_chunk(q),
                                                slots.at({slot.microbatch, q}).inputs[i].data(),
                                                out.data(), layer_kv, scratch));
      }
    }
    Slot& st = slots.at(slot);
    return layers[i].Forward(ctx, seq_chunk(slot.seq), st.inputs[i].data(), out.data(), layer_kv,
                             st.acts[i]);
  }

  // B after order.CheckBackwardInput (with `weights`, each layer's W right after its B and the
  // slot released: full recomputation's unsplit backward). A device error part-way leaves the
  // slot's layers in mixed states; the caller must stop (as after any device error).
  absl::Status RunBackwardInput(SlotKey slot, const T* dout, T* dx, bool weights = false) {
    Slot& st = slots.at(slot);
    std::vector<DeviceKvState<T>>& mb_kv = kv.at(slot.microbatch);
    const SeqChunk c = seq_chunk(slot.seq);
    const size_t nh = RowsTimesWidth(c);
    // Ping-pong gradients between layers; the first layer writes straight into dx.
    DeviceArray<T> grad[2];  // (b, t, h) each
    if (count > 1) {
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, nh, grad[0]));
      VP_LS_RETURN_IF_ERROR(Acquire(ctx, nh, grad[1]));
    }
    const T* g_in = dout;
    for (int i = count - 1; i >= 0; --i) {
      if (cfg.recompute == Recompute::kFull) VP_LS_RETURN_IF_ERROR(RecomputeForward(slot, i));
      T* g_out = i == 0 ? dx : grad[i % 2].data();
      VP_LS_RETURN_IF_ERROR(layers[i].BackwardInput(ctx, g_in, g_out, mb_kv[i], st.acts[i]));
      if (weights) VP_LS_RETURN_IF_ERROR(layers[i].BackwardWeight(ctx, st.acts[i]));
      g_in = g_out;
    }
    // The K/V caches were released by the layers at the microbatch's last B.
    if (order.BackwardInputDone(slot)) kv.erase(slot.microbatch);
    if (weights) {
      slots.erase(slot);
      order.BackwardWeightDone(slot);
    }
    return absl::OkStatus();
  }

  // W after order.CheckBackwardWeight.
  absl::Status RunBackwardWeight(SlotKey slot) {
    auto it = slots.find(slot);
    for (int i = count - 1; i >= 0; --i) {
      VP_LS_RETURN_IF_ERROR(layers[i].BackwardWeight(ctx, it->second.acts[i]));
    }
    slots.erase(it);
    order.BackwardWeightDone(slot);
    return absl::OkStatus();
  }
};

template <typename T>
absl::StatusOr<std::unique_ptr<DeviceLayerStack<T>>> DeviceLayerStack<T>::Create(
    const ModelConfig& cfg, int first_layer, int count, int microbatch_size,
    std::vector<int> seq_bounds, const T* params, float* grads, const DeviceContext& ctx,
    engine::tp::TensorGroup group) {
  // Everything is checked before the device is touched (Create itself enqueues nothing:
  // buffers are taken per pass), so these checks run on machines without a GPU. First the rules
  // every stack keeps (slot_order.h), then the device's own.
  if (absl::Status s = ValidateLayerStackArgs(cfg, first_layer, count, microbatch_size, params,
                                              grads, seq_bounds);
      !s.ok()) {
    return s;
  }
  // cuBLASLt wants 16-byte aligned operands: with h and f multiples of 8 every tensor offset of
  // the layer layout (and the qkv row stride 3h) is a multiple of 8 elements (GemmRunner's rule).
  if (cfg.hidden % 8 != 0 || cfg.ffn_hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: hidden ", cfg.hidden, " and ffn_hidden ", cfg.ffn_hidden,
                     " must be multiples of 8 on a CUDA device (16-byte aligned GEMM operands)"));
  }
  // Llama's q|k|v row is h + 2·kv_heads·head_dim wide and k, v start at columns h, h + kv.
  if (cfg.llama() && cfg.kv_dim() % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: kv_heads·head_dim ", cfg.kv_dim(),
                     " must be a multiple of 8 on a CUDA device (16-byte aligned GEMM operands)"));
  }
  // Tensor parallelism: the model splits over t (heads, kv_heads, ffn_hidden), every sequence
  // chunk's rows split over t, and this rank's widths keep the GEMM operands aligned.
  const int t = group.size();
  if (absl::Status s = engine::tp::ValidateTensorSplit(cfg, t); !s.ok()) return s;
  for (size_t q = 0; t > 1 && q + 1 < seq_bounds.size(); ++q) {
    const int len = seq_bounds[q + 1] - seq_bounds[q];
    if (len % t != 0) {
      return absl::InvalidArgumentError(absl::StrCat("sequence chunk ", q, " (", len,
                                                     " positions): its length must be divisible by "
                                                     "parallel.tensor (",
                                                     t, ")"));
    }
  }
  if (t > 1) {
    const engine::tp::LayerWidths w = engine::tp::LocalLayerWidths(cfg, t);
    if (w.attn % 8 != 0 || w.kv % 8 != 0 || w.ffn % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallel.tensor: a rank's attention width ", w.attn, ", key/value width ",
                       w.kv, " and MLP width ", w.ffn,
                       " must be multiples of 8 on a CUDA device (16-byte aligned "
                       "GEMM operands)"));
    }
  }
  if (reinterpret_cast<uintptr_t>(params) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(grads) % 16 != 0) {
    return absl::InvalidArgumentError("params/grads: must be 16-byte aligned device pointers");
  }
  if (ctx.gemm == nullptr || ctx.alloc == nullptr) {
    return absl::InvalidArgumentError("ctx: gemm and alloc must not be null");
  }
  auto impl = std::make_unique<Impl>();
  impl->order = SlotOrder(static_cast<int>(seq_bounds.size()) - 1);
  static_cast<LayerStackShape&>(*impl) = {
      cfg, first_layer, count, microbatch_size, LayerParamCount(cfg, t), std::move(seq_bounds), t};
  impl->ctx = ctx;
  impl->sp = std::make_unique<tp::DeviceSequenceParallel<T>>(group, ctx);
  for (int i = 0; i < count; ++i) {
    const size_t offset = static_cast<size_t>(i) * impl->layer_params;
    impl->layers.emplace_back(cfg, microbatch_size, params + offset, grads + offset,
                              impl->sp.get());
  }
  return std::make_unique<DeviceLayerStack<T>>(std::move(impl));
}

template <typename T>
DeviceLayerStack<T>::DeviceLayerStack(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

// Every pass ended with Finish, so no kernel still reads the buffers released here.
template <typename T>
DeviceLayerStack<T>::~DeviceLayerStack() = default;

template <typename T>
int DeviceLayerStack<T>::first_layer() const {
  return impl_->first;
}

template <typename T>
int DeviceLayerStack<T>::count() const {
  return impl_->count;
}

template <typename T>
int DeviceLayerStack<T>::num_seq_chunks() const {
  return impl_->num_seq_chunks();
}

template <typename T>
SeqChunk DeviceLayerStack<T>::seq_chunk(int q) const {
  return impl_->seq_chunk(q);
}

template <typename T>
int DeviceLayerStack<T>::live_slots() const {
  return impl_->order.live_slots();
}

// A call rejected by an order check enqueues nothing and returns at once.
template <typename T>
absl::Status DeviceLayerStack<T>::Forward(SlotKey slot, const T* x, T* out) {
  VP_LS_RETURN_IF_ERROR(impl_->order.CheckForward(slot));
  return impl_->Finished(impl_->RunForward(slot, x, out));
}

template <typename T>
absl::Status DeviceLayerStack<T>::BackwardInput(SlotKey slot, const T* dout, T* dx) {
  VP_LS_RETURN_IF_ERROR(impl_->order.CheckBackwardInput(slot));
  return impl_->Finished(impl_->RunBackwardInput(slot, dout, dx));
}

template <typename T>
absl::Status DeviceLayerStack<T>::BackwardWeight(SlotKey slot) {
  VP_LS_RETURN_IF_ERROR(impl_->order.CheckBackwardWeight(slot));
  return impl_->Finished(impl_->RunBackwardWeight(slot));
}

// One Finish for both halves: W's kernels queue behind B's on the same stream.
template <typename T>
absl::Status DeviceLayerStack<T>::Backward(SlotKey slot, const T* dout, T* dx) {
  VP_LS_RETURN_IF_ERROR(impl_->order.CheckBackwardInput(slot));
  // Full recomputation: each layer's W right after its B (one layer's recomputed activations
  // live at a time), as LayerStack::Backward does.
  if (impl_->cfg.recompute == Recompute::kFull) {
    return impl_->Finished(impl_->RunBackwardInput(slot, dout, dx, /*weights=*/true));
  }
  absl::Status s = impl_->RunBackwardInput(slot, dout, dx);
  if (s.ok()) s = impl_->RunBackwardWeight(slot);
  return impl_->Finished(std::move(s));
}

template <typename T>
void DeviceLayerStack<T>::DiscardMicrobatch(int microbatch) {
  // A pass that enqueued kernels on these buffers has returned after Finish, but a failed one
  // may not have: drain before the buffers go back to the allocator. A drain error is sticky
  // and the next pass reports it.
  (void)Finish(impl_->ctx);
  std::erase_if(impl_->slots,
                [microbatch](const auto& e) { return e.first.microbatch == microbatch; });
  impl_->kv.erase(microbatch);
  impl_->order.Discard(microbatch);
}

template class DeviceLayerStack<float>;
template class DeviceLayerStack<bf16>;

}  // namespace vp::engine::cuda

#undef VP_LS_RETURN_IF_ERROR
