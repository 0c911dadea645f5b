#include "worker/engine/kernels/cuda/attention_cudnn.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/cudnn_library.h"

namespace vp::engine::cuda {

bool CudnnAttention::CoversForward(const AttentionShape& s, int ldq, int64_t version) {
  const bool covered = s.batch > 0 && s.heads > 0 && s.q_begin >= 0 && s.q_begin < s.q_end &&
                       s.q_end <= s.kv_rows && s.head_dim > 0 && s.head_dim % 8 == 0 &&
                       s.head_dim <= 128 && ldq % 8 == 0 && ldq >= s.width() &&
                       s.heads % s.num_kv_heads() == 0;
  if (!covered) return false;
  // A chunk past position 0 needs the bottom-right causal mask: any lengths from cuDNN 9.6,
  // multiples of 64 before (the limit cuDNN's frontend states).
  if (s.q_begin > 0 && version < 90600) return s.q_len() % 64 == 0 && s.q_end % 64 == 0;
  // One query row under the causal mask: the frontend refuses it up to cuDNN 9.9.
  if (s.q_len() == 1 && version < 91000) return false;
  return true;
}

bool CudnnAttention::CoversBackward(const AttentionShape& s, int ldq, int64_t version) {
  // One query on one key: a backward cuDNN's frontend refuses (not supported).
  return CoversForward(s, ldq, version) && !(s.q_len() == 1 && s.q_end == 1);
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> ChosenCudnnAttention(
    CachingAllocator* workspace_alloc) {
  if (DefaultAttentionKernels() != AttentionKernels::kCudnn) return nullptr;
  absl::StatusOr<std::unique_ptr<CudnnAttention>> dnn = CudnnAttention::Create(workspace_alloc);
  if (!dnn.ok()) {
    return absl::Status(dnn.status().code(),
                        absl::StrCat("VOCABPIPE_ATTENTION=cudnn: ", dnn.status().message()));
  }
  return dnn;
}

namespace {

// cuDNN's tensors are declared 16-byte aligned (its vectorised and TMA loads rely on it); the
// layers pass allocator blocks, but a pointer off that alignment runs on the kernels.
bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

}  // namespace

template <typename T>
absl::Status RunAttentionForward(const DeviceContext& ctx, T* out, float* lse, const T* q, int ldq,
                                 const T* k, const T* v, const AttentionShape& shape) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (ctx.attention != nullptr &&
        CudnnAttention::CoversForward(shape, ldq, ctx.attention->version()) &&
        Aligned16({out, lse, q, k, v})) {
      absl::Status st = ctx.attention->Forward(ctx, out, lse, q, ldq, k, v, shape);
      // Unimplemented: cuDNN has no engine for this shape here (nothing was written; the
      // runner counts it); the kernels below run it.
      if (!absl::IsUnimplemented(st)) return st;
    }
  }
  VP_CUDA_RETURN_IF_ERROR(AttentionForward(out, lse, q, ldq, k, v, shape, ctx.stream));
  return absl::OkStatus();
}

template <typename T>
absl::Status RunAttentionBackward(const DeviceContext& ctx, T* dq, T* dk, T* dv, float* delta,
                                  const T* dout, const T* out, const float* lse, const T* q,
                                  int ldq, const T* k, const T* v, const AttentionShape& shape) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (ctx.attention != nullptr &&
        CudnnAttention::CoversBackward(shape, ldq, ctx.attention->version()) &&
        Aligned16({dq, dk, dv, delta, dout, out, lse, q, k, v})) {
      absl::Status st =
          ctx.attention->Backward(ctx, dq, dk, dv, delta, dout, out, lse, q, ldq, k, v, shape);
      if (!absl::IsUnimplemented(st)) return st;  // as in the forward
    }
  }
  VP_CUDA_RETURN_IF_ERROR(
      AttentionBackward(dq, dk, dv, delta, dout, out, lse, q, ldq, k, v, shape, ctx.stream));
  return absl::OkStatus();
}

#define VP_INSTANTIATE(T)                                                                        \
  template absl::Status RunAttentionForward<T>(const DeviceContext&, T*, float*, const T*, int,  \
                                               const T*, const T*, const AttentionShape&);       \
  template absl::Status RunAttentionBackward<T>(const DeviceContext&, T*, T*, T*, float*,        \
                                                const T*, const T*, const float*, const T*, int, \
                                                const T*, const T*, const AttentionShape&);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

#if VP_HAVE_CUDNN

namespace {

// The variant pack's tensor ids: the graphs' real tensors and host scalars (virtual tensors, which
// have no memory, count up from kFirstVirtual).
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kOne,
  kDout,
  kDq,
  kDk,
  kDv,
  kRowSum,   // Σ_d dO·O per row (the caller's delta)
  kDqAccum,  // dQ in fp32 (the workspace, after the plan's own part)
  kSeqLenQ,  // a chunk's query rows and the key rows they see (int32 scalars of the mask)
  kSeqLenKv,
  kPadLenQ,   // the same per sequence, (b, 1, 1, 1) int32 in device memory: the padding mask
  kPadLenKv,  // of the backward's workaround for cuDNN up to 9.15 (Geometry)
  kPadFill,   // the padding mask's −inf (a scalar of its own, as in the frontend's graph)
  kPadFill2,  // and its second application's, before cuDNN 9.10
  kFirstVirtual = 100,
};

using Dims = std::array<int64_t, 4>;

absl::Status DnnStatus(const Cudnn& dnn, cudnnStatus_t status, absl::string_view what) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  char detail[1024] = {0};
  dnn.cudnnGetLastErrorString(detail, sizeof(detail));
  std::string message = absl::StrCat("cuDNN attention: ", what, ": ",
                                     dnn.cudnnGetErrorString(status), " (", int(status), ")");
  if (detail[0] != '\0') absl::StrAppend(&message, ": ", detail);
  // cuDNN 9 numbers its statuses by class: 3xxx "not supported" (this graph or shape on this
  // GPU and version), the rest are failures.
  if (status >= 3000 && status < 4000) return absl::UnimplementedError(message);
  return absl::InternalError(message);
}

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  Descriptor(const Cudnn* dnn, cudnnBackendDescriptor_t d) : dnn_(dnn), d_(d) {}
  Descriptor(Descriptor&& other) noexcept
      : dnn_(other.dnn_), d_(std::exchange(other.d_, nullptr)) {}
  Descriptor& operator=(Descriptor&&) = delete;
  Descriptor(const Descriptor&) = delete;
  ~Descriptor() {
    if (d_ != nullptr) dnn_->cudnnBackendDestroyDescriptor(d_);
  }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  const Cudnn* dnn_;
  cudnnBackendDescriptor_t d_;
};

}  // namespace

struct CudnnAttention::Plan {
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  // Newest first: the execution plan before the graph it was planned from, an operation before
  // the tensors it names.
  ~Plan() {
    while (!owned.empty()) owned.pop_back();
  }

  std::vector<Descriptor> owned;  // every descriptor the plan was built from, the plan last
  cudnnBackendDescriptor_t plan = nullptr;
  std::vector<int64_t> uids;   // the graph's tensors with memory or a value: its variant pack
  int64_t plan_workspace = 0;  // bytes the execution plan asks for
  int64_t dq_accum_bytes = 0;  // the backward's fp32 dQ, after the plan's part (256-aligned)
  // Host scalars the variant pack points at (passed by value).
  float scale = 0.0f;
  float neg_inf = -std::numeric_limits<float>::infinity();  // the causal mask's fill
  float one = 1.0f;
  int32_t seq_len_q = 0, seq_len_kv = 0;  // a chunk's sq and skv (the bottom-right mask)
  int64_t dkv_bytes = 0;                  // a chunk's dK and dV each, after dQ (256-aligned)
  // The padding workaround's lengths: sq for each sequence, then from pad_kv_offset (16-byte
  // aligned, as every tensor is declared) skv for each; device memory, uploaded once from
  // pad_lens_host, which outlives the copy.
  std::vector<int32_t> pad_lens_host;
  DeviceArray<int32_t> pad_lens;
  int64_t pad_kv_offset = 0;
};

namespace {

// Per-sequence lengths that override a matmul's M, N or K (null: not overridden).
struct Overrides {
  cudnnBackendDescriptor_t m = nullptr, n = nullptr, k = nullptr;
};

// Builds one operation graph and its execution plan. Errors are sticky: after the first failed
// call every later one does nothing, and Build returns that first error — so a graph reads as
// the list of its operations.
class GraphBuilder {
 public:
  using Desc = cudnnBackendDescriptor_t;

  GraphBuilder(const Cudnn& dnn, CudnnAttention::Plan& plan) : dnn_(dnn), plan_(plan) {}

  // A tensor in device memory (uid from Uid), or a virtual one (intermediate, no memory).
  Desc Tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return MakeTensor(uid, dims, strides, type, /*is_virtual=*/false, /*by_value=*/false);
  }
  Desc Virtual(const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return MakeTensor(next_virtual_++, dims, strides, type, /*is_virtual=*/true, false);
  }
  // A host scalar passed by value (dims all 1).
  Desc Scalar(int64_t uid, cudnnDataType_t type) {
    return MakeTensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, type, false, /*by_value=*/true);
  }

  // c = a · b over the last two dims (fp32 accumulation), batched over the first two.
  Desc Matmul(Desc a, Desc b, Desc c, Overrides o = {}) {
    Uses({a, b, o.m, o.n, o.k}, c);
    Desc desc = Fp32Descriptor(CUDNN_BACKEND_MATMUL_DESCRIPTOR, CUDNN_ATTR_MATMUL_COMP_TYPE);
    Finalize(desc, "matmul descriptor");
    Operation(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
               {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
               {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
               {CUDNN_ATTR_OPERATION_MATMUL_DESC, desc},
               {CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, o.m},
               {CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, o.n},
               {CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, o.k}},
              "matmul");
    return c;
  }

  // y = mode(x[, b][, t]) elementwise with broadcasting; axis only for GEN_INDEX.
  Desc Pointwise(cudnnPointwiseMode_t mode, Desc x, Desc b, Desc t, Desc y,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Uses({x, b, t}, y);
    Desc desc = Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    Set(desc, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    Set(desc, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      Set(desc, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    }
    Finalize(desc, "pointwise descriptor");
    Operation(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc},
               {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
               {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
               {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t},
               {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y}},
              "pointwise");
    return y;
  }
  Desc Unary(cudnnPointwiseMode_t mode, Desc x, Desc y) {
    return Pointwise(mode, x, nullptr, nullptr, y);
  }
  Desc Binary(cudnnPointwiseMode_t mode, Desc x, Desc b, Desc y,
              cudnnDataType_t math = CUDNN_DATA_FLOAT) {
    return Pointwise(mode, x, b, nullptr, y, math);
  }

  // y = reduce(x) over the dims where y is 1 (fp32).
  Desc Reduction(cudnnReduceTensorOp_t reduce, Desc x, Desc y) {
    Uses({x}, y);
    Desc desc = Fp32Descriptor(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, CUDNN_ATTR_REDUCTION_COMP_TYPE);
    Set(desc, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce);
    Finalize(desc, "reduction descriptor");
    Operation(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
               {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y},
               {CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc}},
              "reduction");
    return y;
  }

  // y = x viewed with y's dims and strides (a transpose of the last two dims here).
  Desc Reshape(Desc x, Desc y) {
    Uses({x}, y);
    Operation(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
              {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}},
              "reshape");
    return y;
  }

  // The first error so far.
  const absl::Status& status() const { return status_; }

  // The uids of the tensors the variant pack must give (every one that is not virtual).
  std::vector<int64_t> RealUids() const {
    std::vector<int64_t> uids;
    for (const auto& [tensor, use] : uses_) {
      if (!use.is_virtual) uids.push_back(use.uid);
    }
    return uids;
  }

  // The first error so far; when OK, whether the graph is wired: one tensor per uid, every
  // virtual tensor written by exactly one operation and read by at least one, every real tensor
  // written at most once and used. (cuDNN's graph finalize does not catch a dangling intermediate;
  // its engines reject such a graph only on a GPU, without saying which tensor.)
  absl::Status CheckWiring() const {
    if (!status_.ok()) return status_;
    std::map<int64_t, int> tensors_of_uid;  // the variant pack maps a uid to one pointer
    for (const auto& [tensor, use] : uses_) {
      if (++tensors_of_uid[use.uid] > 1) {
        return absl::InternalError(
            absl::StrCat("cuDNN attention: two tensors of the graph have uid ", use.uid));
      }
    }
    for (const auto& [tensor, use] : uses_) {
      const bool bad = use.is_virtual ? use.writes != 1 || use.reads == 0
                                      : use.writes > 1 || use.writes + use.reads == 0;
      if (bad) {
        return absl::InternalError(absl::StrCat("cuDNN attention: tensor ", use.uid, " is written ",
                                                use.writes, " times and read ", use.reads,
                                                " times"));
      }
    }
    return absl::OkStatus();
  }

  // The operation graph of the operations so far, checked for wiring first, on `handle` — or,
  // without one (a handle needs a GPU), finalized alone: cuDNN then checks what it can of the
  // graph as a whole, and its API log (CUDNN_LOGLEVEL_DBG=3) prints the graph as JSON, the form
  // in which compare_cudnn_graphs.py holds it to the graph cuDNN's own frontend builds.
  Desc OperationGraph(cudnnHandle_t handle) {
    if (status_.ok()) status_ = CheckWiring();
    Desc graph = Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
        static_cast<int64_t>(ops_.size()), ops_.data());
    if (handle != nullptr)
      Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    Finalize(graph, "operation graph");
    return graph;
  }

  // The operation graph on `handle`, the heuristics' engine configurations (mode A) and the
  // first whose execution plan finalizes; its workspace size.
  absl::Status Build(cudnnHandle_t handle) {
    Desc graph = OperationGraph(handle);
    Desc heur = Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    SetDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    Finalize(heur, "engine heuristics");
    if (!status_.ok()) return status_;
    int64_t count = 0;
    if (absl::Status st =
            Call(dnn_.cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
                 "engine count");
        !st.ok()) {
      return st;
    }
    if (count <= 0) return absl::UnimplementedError("cuDNN attention: no engine for this graph");
    std::vector<Desc> configs;
    for (int64_t i = 0; i < count; ++i) configs.push_back(Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    if (!status_.ok()) return status_;
    int64_t returned = 0;
    if (absl::Status st = Call(dnn_.cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                                             &returned, configs.data()),
                               "engine configurations");
        !st.ok()) {
      return st;
    }
    // The heuristics rank the engines; the first whose plan finalizes here runs.
    absl::Status first_failure;
    for (int64_t i = 0; i < returned; ++i) {
      cudnnBackendDescriptor_t plan = nullptr;
      if (absl::Status st = Call(
              dnn_.cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan),
              "execution plan");
          !st.ok()) {
        return st;
      }
      Descriptor owned(&dnn_, plan);
      absl::Status st = Call(dnn_.cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                                           CUDNN_TYPE_HANDLE, 1, &handle),
                             "plan handle");
      if (st.ok()) {
        st = Call(dnn_.cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &configs[i]),
                  "plan engine configuration");
      }
      if (st.ok()) st = Call(dnn_.cudnnBackendFinalize(plan), "execution plan finalize");
      if (st.ok()) {
        int64_t workspace = 0, got = 0;
        st = Call(dnn_.cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                CUDNN_TYPE_INT64, 1, &got, &workspace),
                  "plan workspace size");
        if (st.ok()) {
          plan_.plan = plan;
          plan_.plan_workspace = workspace;
          plan_.owned.push_back(std::move(owned));
          return absl::OkStatus();
        }
      }
      if (first_failure.ok()) first_failure = st;
    }
    return first_failure.ok() ? absl::UnimplementedError("cuDNN attention: no engine config")
                              : first_failure;
  }

 private:
  absl::Status Call(cudnnStatus_t status, absl::string_view what) const {
    return DnnStatus(dnn_, status, what);
  }
  void Note(cudnnStatus_t status, absl::string_view what) {
    if (status_.ok()) status_ = DnnStatus(dnn_, status, what);
  }
  Desc Make(cudnnBackendDescriptorType_t type) {
    if (!status_.ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    Note(dnn_.cudnnBackendCreateDescriptor(type, &d),
         absl::StrCat("create descriptor ", static_cast<int>(type)));
    if (!status_.ok()) return nullptr;
    plan_.owned.emplace_back(&dnn_, d);
    return d;
  }
  void Set(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* value) {
    if (!status_.ok()) return;
    Note(dnn_.cudnnBackendSetAttribute(d, name, type, count, value),
         absl::StrCat("set attribute ", static_cast<int>(name)));
  }
  void SetDesc(Desc d, cudnnBackendAttributeName_t name, Desc value) {
    Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  }
  void Finalize(Desc d, absl::string_view what) {
    if (!status_.ok()) return;
    Note(dnn_.cudnnBackendFinalize(d), absl::StrCat("finalize ", what));
  }
  // A descriptor of `type` whose compute type (attribute `compute`) is fp32, not yet finalized.
  Desc Fp32Descriptor(cudnnBackendDescriptorType_t type, cudnnBackendAttributeName_t compute) {
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    Desc d = Make(type);
    Set(d, compute, CUDNN_TYPE_DATA_TYPE, 1, &fp32);
    return d;
  }
  // An operation of `type` with its descriptor-valued attributes (a null value: not set),
  // finalized and added to the graph.
  void Operation(cudnnBackendDescriptorType_t type,
                 std::initializer_list<std::pair<cudnnBackendAttributeName_t, Desc>> attributes,
                 absl::string_view what) {
    Desc op = Make(type);
    for (const auto& [name, value] : attributes) {
      if (value != nullptr) SetDesc(op, name, value);
    }
    Finalize(op, what);
    if (status_.ok()) ops_.push_back(op);
  }
  Desc MakeTensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                  bool is_virtual, bool by_value) {
    Desc t = Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    Finalize(t, "tensor");
    if (t != nullptr) uses_[t] = Use{uid, is_virtual};
    return t;
  }
  void Uses(std::initializer_list<Desc> inputs, Desc output) {
    for (Desc in : inputs) {
      if (auto it = uses_.find(in); it != uses_.end()) ++it->second.reads;
    }
    if (auto it = uses_.find(output); it != uses_.end()) ++it->second.writes;
  }

  struct Use {
    int64_t uid = 0;
    bool is_virtual = false;
    int reads = 0, writes = 0;
  };

  const Cudnn& dnn_;
  CudnnAttention::Plan& plan_;
  absl::Status status_;
  std::vector<Desc> ops_;
  std::map<Desc, Use> uses_;  // every tensor made, by descriptor
  int64_t next_virtual_ = kFirstVirtual;
};

// The shapes both graphs share, from the attention shape and the q row stride. sq < skv: a
// Seq1F1B chunk whose queries start at position skv − sq.
struct Geometry {
  int64_t b, hq, hk, sq, skv, d, ldq, kv_rows;
  // The backward as cuDNN's frontend builds it for cuDNN up to 9.15 when skv is no multiple of
  // 128: with a padding mask (lengths sq, skv per sequence) and the matmuls' M/N/K overridden by
  // those lengths — a workaround the frontend applies for a fault of those versions' backward
  // kernels on such lengths (the lengths equal the dims, so the result is unchanged).
  bool padding_workaround = false;
  // Before 9.10 the frontend applies a padding mask a second time, after lse is subtracted.
  bool padding_twice = false;
  int64_t w() const { return hq * d; }
  int64_t kvw() const { return hk * d; }
  bool chunk() const { return sq < skv; }
  // A whole sequence writes its dK/dV in place; anything else into (b, skv, kvw) rows of the
  // workspace, added to the caller's afterwards.
  bool dkv_in_place() const { return sq == skv && skv == kv_rows; }
  Dims dkv_strides() const {
    return dkv_in_place() ? kv_strides() : Dims{skv * kvw(), d, kvw(), 1};
  }
  // (b, hq, sq, d) inside the fused q|k|v rows, and dq likewise.
  Dims q_dims() const { return {b, hq, sq, d}; }
  Dims q_strides() const { return {sq * ldq, d, ldq, 1}; }
  // (b, hk, skv, d) inside the (b, kv_rows, kvw) cache; Kᵀ swaps the last two.
  Dims kv_dims() const { return {b, hk, skv, d}; }
  Dims kv_strides() const { return {kv_rows * kvw(), d, kvw(), 1}; }
  Dims kt_dims() const { return {b, hk, d, skv}; }
  Dims kt_strides() const { return {kv_rows * kvw(), d, 1, kvw()}; }
  // (b, hq, sq, d) in the (b, sq, w) output rows.
  Dims o_dims() const { return {b, hq, sq, d}; }
  Dims o_strides() const { return {sq * w(), d, w(), 1}; }
  // Per-row statistics (b, hq, sq, 1), and the (b, hq, sq, skv) scores.
  Dims row_dims() const { return {b, hq, sq, 1}; }
  Dims row_strides() const { return {hq * sq, sq, 1, 1}; }
  Dims score_dims() const { return {b, hq, sq, skv}; }
  Dims score_strides() const { return {hq * sq * skv, sq * skv, skv, 1}; }
  // The scores transposed (b, hq, skv, sq): the same memory read column-wise.
  Dims score_t_dims() const { return {b, hq, skv, sq}; }
  Dims score_t_strides() const { return {hq * sq * skv, sq * skv, 1, skv}; }
};

Geometry GeometryOf(const AttentionShape& s, int ldq, bool backward, int64_t version) {
  Geometry geo{s.batch, s.heads, s.num_kv_heads(), s.q_len(), s.q_end, s.head_dim, ldq, s.kv_rows};
  geo.padding_workaround = backward && version <= 91500 && geo.skv % 128 != 0;
  geo.padding_twice = geo.padding_workaround && version < 91000;
  return geo;
}

// The lengths a graph's masks compare with, each tensor made once per graph (one uid, one
// tensor): by-value scalars for a chunk's bottom-right causal mask, or the padding workaround's
// (b, 1, 1, 1) tensors; null where the graph has none.
struct MaskInputs {
  GraphBuilder::Desc q = nullptr, kv = nullptr;
};

MaskInputs MaskInputsOf(GraphBuilder& g, const Geometry& geo) {
  MaskInputs in;
  if (geo.padding_workaround) {
    const Dims dims{geo.b, 1, 1, 1}, strides{1, 1, 1, 1};
    in.q = g.Tensor(kPadLenQ, dims, strides, CUDNN_DATA_INT32);
    in.kv = g.Tensor(kPadLenKv, dims, strides, CUDNN_DATA_INT32);
  } else if (geo.chunk()) {
    in.q = g.Scalar(kSeqLenQ, CUDNN_DATA_INT32);
    in.kv = g.Scalar(kSeqLenKv, CUDNN_DATA_INT32);
  }
  return in;
}

// The padding mask of the workaround: scores outside rows [0, sq) × columns [0, skv) of each
// sequence set to −inf (none are, here: the lengths are the dims).
GraphBuilder::Desc PaddingMask(GraphBuilder& g, const Geometry& geo, GraphBuilder::Desc scores,
                               const MaskInputs& lens, Uid fill) {
  using Desc = GraphBuilder::Desc;
  const Dims dims = geo.score_dims(), strides = geo.score_strides();
  auto index = [&](int64_t axis) {
    return g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr,
                       g.Virtual(dims, strides, CUDNN_DATA_INT32), CUDNN_DATA_INT32, axis);
  };
  auto below = [&](Desc index, Desc length) {
    return g.Binary(CUDNN_POINTWISE_CMP_LT, index, length,
                    g.Virtual(dims, strides, CUDNN_DATA_BOOLEAN), CUDNN_DATA_BOOLEAN);
  };
  Desc col_in = below(index(3), lens.kv);
  Desc row_in = below(index(2), lens.q);
  Desc inside = g.Binary(CUDNN_POINTWISE_LOGICAL_AND, row_in, col_in,
                         g.Virtual(dims, strides, CUDNN_DATA_BOOLEAN), CUDNN_DATA_BOOLEAN);
  return g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, g.Scalar(fill, CUDNN_DATA_FLOAT),
                     inside, g.Virtual(dims, strides, CUDNN_DATA_FLOAT));
}

// scores = (Q·Kᵀ)·scale with the causal mask: row i sees columns j ≤ i + skv − sq — the
// diagonal aligned to the scores' bottom right, so a chunk's row i (position skv − sq + i) sees
// the keys up to its own position; for a whole sequence (sq = skv) j ≤ i. Returns the masked
// fp32 scores.
GraphBuilder::Desc MaskedScores(GraphBuilder& g, const Geometry& geo, GraphBuilder::Desc scaled,
                                const MaskInputs& lens) {
  using Desc = GraphBuilder::Desc;
  const Dims dims = geo.score_dims(), strides = geo.score_strides();
  Desc row = g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, nullptr,
                         g.Virtual(dims, strides, CUDNN_DATA_INT32), CUDNN_DATA_FLOAT, /*axis=*/2);
  Desc col = g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, nullptr,
                         g.Virtual(dims, strides, CUDNN_DATA_INT32), CUDNN_DATA_FLOAT, /*axis=*/3);
  if (geo.chunk()) {  // row + skv − sq, in int32 as cuDNN's frontend forms it
    row = g.Binary(CUDNN_POINTWISE_ADD, row, lens.kv, g.Virtual(dims, strides, CUDNN_DATA_INT32),
                   CUDNN_DATA_INT32);
    row = g.Binary(CUDNN_POINTWISE_SUB, row, lens.q, g.Virtual(dims, strides, CUDNN_DATA_INT32),
                   CUDNN_DATA_INT32);
  }
  Desc keep = g.Pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr,
                          g.Virtual(dims, strides, CUDNN_DATA_BOOLEAN), CUDNN_DATA_BOOLEAN);
  // BINARY_SELECT: y = t ? x : b.
  return g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, scaled, g.Scalar(kNegInf, CUDNN_DATA_FLOAT),
                     keep, g.Virtual(dims, strides, CUDNN_DATA_FLOAT));
}

// The real tensors both graphs use: Q, Kᵀ (K's memory read transposed), O and the statistics.
struct CommonTensors {
  GraphBuilder::Desc q, kt, o, stats;
};

CommonTensors Common(GraphBuilder& g, const Geometry& geo) {
  return CommonTensors{
      .q = g.Tensor(kQ, geo.q_dims(), geo.q_strides(), CUDNN_DATA_BFLOAT16),
      .kt = g.Tensor(kK, geo.kt_dims(), geo.kt_strides(), CUDNN_DATA_BFLOAT16),
      .o = g.Tensor(kO, geo.o_dims(), geo.o_strides(), CUDNN_DATA_BFLOAT16),
      .stats = g.Tensor(kStats, geo.row_dims(), geo.row_strides(), CUDNN_DATA_FLOAT)};
}

// Forward: S = Q·Kᵀ·scale, masked; m = rowmax S; e = exp(S − m); l = Σ e; stats = m + log l
// (lse); P = e / l (bf16); O = P·V.
void BuildForward(GraphBuilder& g, const Geometry& geo) {
  using Desc = GraphBuilder::Desc;
  const Dims sd = geo.score_dims(), ss = geo.score_strides();
  const Dims rd = geo.row_dims(), rs = geo.row_strides();
  const auto [q, kt, o, stats] = Common(g, geo);
  Desc v = g.Tensor(kV, geo.kv_dims(), geo.kv_strides(), CUDNN_DATA_BFLOAT16);
  Desc s = g.Matmul(q, kt, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc scaled = g.Binary(CUDNN_POINTWISE_MUL, s, g.Scalar(kScale, CUDNN_DATA_FLOAT),
                         g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc masked = MaskedScores(g, geo, scaled, MaskInputsOf(g, geo));
  Desc max = g.Reduction(CUDNN_REDUCE_TENSOR_MAX, masked, g.Virtual(rd, rs, CUDNN_DATA_FLOAT));
  Desc shifted = g.Binary(CUDNN_POINTWISE_SUB, masked, max, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc e = g.Unary(CUDNN_POINTWISE_EXP, shifted, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc sum = g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, g.Virtual(rd, rs, CUDNN_DATA_FLOAT));
  Desc log_sum = g.Unary(CUDNN_POINTWISE_LOG, sum, g.Virtual(rd, rs, CUDNN_DATA_FLOAT));
  g.Binary(CUDNN_POINTWISE_ADD, max, log_sum, stats);
  Desc p = g.Binary(CUDNN_POINTWISE_DIV, e, sum, g.Virtual(sd, ss, CUDNN_DATA_BFLOAT16));
  g.Matmul(p, v, o);
}

// dV (or dK) = a · b into `out` (b, hk, skv, d); with grouped heads the product is formed per
// query head (b, hq, skv, d) and summed over each group by a reduction.
void ProductIntoKvHeads(GraphBuilder& g, const Geometry& geo, GraphBuilder::Desc a,
                        GraphBuilder::Desc b, GraphBuilder::Desc out, const Overrides& o) {
  if (geo.hq == geo.hk) {
    g.Matmul(a, b, out, o);
    return;
  }
  GraphBuilder::Desc full = g.Matmul(
      a, b,
      g.Virtual({geo.b, geo.hq, geo.skv, geo.d},
                {geo.hq * geo.skv * geo.d, geo.skv * geo.d, geo.d, 1}, CUDNN_DATA_BFLOAT16),
      o);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

// Backward (the forward's P recomputed from the saved lse):
//   D = Σ_d dO·O (the caller's delta); P = exp(S·scale − lse), masked;
//   dV = Pᵀ·dO; dP = dO·Vᵀ; dS = P·(dP − D)·scale; dK = dSᵀ·Q; dQ = dS·K (fp32, then bf16).
// With the padding workaround (Geometry) the scaled scores pass the padding mask before lse is
// subtracted, and every product's rows or columns over queries (keys) are overridden by the
// per-sequence sq (skv), as the frontend builds it.
void BuildBackward(GraphBuilder& g, const Geometry& geo) {
  using Desc = GraphBuilder::Desc;
  const Dims sd = geo.score_dims(), ss = geo.score_strides();
  const Dims td = geo.score_t_dims(), ts = geo.score_t_strides();
  const Dims rd = geo.row_dims(), rs = geo.row_strides();
  const auto [q, kt, o, stats] = Common(g, geo);
  Desc vt = g.Tensor(kV, geo.kt_dims(), geo.kt_strides(), CUDNN_DATA_BFLOAT16);  // V read as Vᵀ
  Desc dout = g.Tensor(kDout, geo.o_dims(), geo.o_strides(), CUDNN_DATA_BFLOAT16);
  Desc dq = g.Tensor(kDq, geo.q_dims(), geo.q_strides(), CUDNN_DATA_BFLOAT16);
  Desc dk = g.Tensor(kDk, geo.kv_dims(), geo.dkv_strides(), CUDNN_DATA_BFLOAT16);
  Desc dv = g.Tensor(kDv, geo.kv_dims(), geo.dkv_strides(), CUDNN_DATA_BFLOAT16);
  Desc row_sum = g.Tensor(kRowSum, rd, rs, CUDNN_DATA_FLOAT);
  Desc dq_accum = g.Tensor(kDqAccum, geo.q_dims(),
                           {geo.hq * geo.sq * geo.d, geo.sq * geo.d, geo.d, 1}, CUDNN_DATA_FLOAT);
  Desc scale = g.Scalar(kScale, CUDNN_DATA_FLOAT);
  // D = Σ_d dO·O, written to the caller's delta.
  Desc dout_o =
      g.Binary(CUDNN_POINTWISE_MUL, dout, o,
               g.Virtual(geo.o_dims(), {geo.hq * geo.sq * geo.d, geo.sq * geo.d, geo.w(), 1},
                         CUDNN_DATA_FLOAT));
  Desc dot = g.Reduction(CUDNN_REDUCE_TENSOR_ADD, dout_o, g.Virtual(rd, rs, CUDNN_DATA_FLOAT));
  g.Binary(CUDNN_POINTWISE_MUL, dot, g.Scalar(kOne, CUDNN_DATA_FLOAT), row_sum);
  const MaskInputs lens = MaskInputsOf(g, geo);
  const bool pad = geo.padding_workaround;
  // (queries × keys) products, (keys × queries) ones, and those over keys into queries.
  const Overrides qk = pad ? Overrides{.m = lens.q, .n = lens.kv} : Overrides{};
  const Overrides kq = pad ? Overrides{.m = lens.kv, .k = lens.q} : Overrides{};
  const Overrides q_by_k = pad ? Overrides{.m = lens.q, .k = lens.kv} : Overrides{};
  // P = exp(S·scale − lse) under the causal mask.
  Desc s = g.Matmul(q, kt, g.Virtual(sd, ss, CUDNN_DATA_FLOAT), qk);
  Desc scaled = g.Binary(CUDNN_POINTWISE_MUL, s, scale, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  if (pad) scaled = PaddingMask(g, geo, scaled, lens, kPadFill);
  Desc centred = g.Binary(CUDNN_POINTWISE_SUB, scaled, stats, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  if (geo.padding_twice) centred = PaddingMask(g, geo, centred, lens, kPadFill2);
  Desc masked = MaskedScores(g, geo, centred, lens);
  Desc p = g.Unary(CUDNN_POINTWISE_EXP, masked, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  // dV = Pᵀ·dO.
  Desc p_t = g.Reshape(p, g.Virtual(td, ts, CUDNN_DATA_BFLOAT16));
  ProductIntoKvHeads(g, geo, p_t, dout, dv, kq);
  // dS = P·(dO·Vᵀ − D)·scale.
  Desc dp = g.Matmul(dout, vt, g.Virtual(sd, ss, CUDNN_DATA_FLOAT), qk);
  Desc dp_centred = g.Binary(CUDNN_POINTWISE_SUB, dp, row_sum, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc ds_unscaled =
      g.Binary(CUDNN_POINTWISE_MUL, dp_centred, p, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  Desc ds = g.Binary(CUDNN_POINTWISE_MUL, ds_unscaled, scale, g.Virtual(sd, ss, CUDNN_DATA_FLOAT));
  // dK = dSᵀ·Q.
  Desc ds_t = g.Reshape(ds, g.Virtual(td, ts, CUDNN_DATA_BFLOAT16));
  ProductIntoKvHeads(g, geo, ds_t, q, dk, kq);
  // dQ = dS·K in fp32, then to bf16 in the q columns of dq. (K's view is labelled fp32, as in the
  // graph cuDNN's frontend builds: a view's label is the engines' pattern, not a conversion.)
  Desc k = g.Reshape(kt, g.Virtual(geo.kv_dims(), geo.kv_strides(), CUDNN_DATA_FLOAT));
  g.Matmul(ds, k, dq_accum, q_by_k);
  g.Unary(CUDNN_POINTWISE_IDENTITY, dq_accum, dq);
}

// The forward or the backward graph of `geo` into g.
void BuildGraph(GraphBuilder& g, const Geometry& geo, bool backward) {
  if (backward) {
    BuildBackward(g, geo);
  } else {
    BuildForward(g, geo);
  }
}

// Every variant-pack pointer by uid (null: none given); Execute passes those the plan's graph has.
using VariantPointers = std::array<void*, kFirstVirtual>;

// The pointers the plan itself owns: its host scalars and the padding workaround's lengths.
void AddPlanPointers(const CudnnAttention::Plan& plan, VariantPointers& p) {
  auto value = [](const auto& field) {
    return const_cast<void*>(static_cast<const void*>(&field));
  };
  p[kScale] = value(plan.scale);
  p[kNegInf] = p[kPadFill] = p[kPadFill2] = value(plan.neg_inf);
  p[kOne] = value(plan.one);
  p[kSeqLenQ] = value(plan.seq_len_q);
  p[kSeqLenKv] = value(plan.seq_len_kv);
  if (!plan.pad_lens.empty()) {
    p[kPadLenQ] = const_cast<int32_t*>(plan.pad_lens.data());
    p[kPadLenKv] = const_cast<int32_t*>(plan.pad_lens.data() + plan.pad_kv_offset);
  }
}

constexpr int64_t kWorkspaceAlign = 256;
int64_t AlignUp(int64_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Runs the plan on `stream` with the pointers of the uids its graph has (`pointers`: the
// caller's data, AddPlanPointers added here).
absl::Status Execute(const Cudnn& dnn, cudnnHandle_t handle, const CudnnAttention::Plan& plan,
                     cudaStream_t stream, VariantPointers pointers, void* workspace) {
  AddPlanPointers(plan, pointers);
  std::vector<void*> given;
  for (int64_t uid : plan.uids) {
    if (pointers[uid] == nullptr) {
      return absl::InternalError(absl::StrCat("cuDNN attention: no pointer for tensor ", uid));
    }
    given.push_back(pointers[uid]);
  }
  cudnnBackendDescriptor_t pack = nullptr;
  if (absl::Status st = DnnStatus(
          dnn, dnn.cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack),
          "variant pack");
      !st.ok()) {
    return st;
  }
  Descriptor owned(&dnn, pack);
  const int64_t n = static_cast<int64_t>(plan.uids.size());
  cudnnStatus_t status = dnn.cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                                                      CUDNN_TYPE_INT64, n, plan.uids.data());
  if (status == CUDNN_STATUS_SUCCESS) {
    status = dnn.cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                          CUDNN_TYPE_VOID_PTR, n, given.data());
  }
  if (status == CUDNN_STATUS_SUCCESS) {
    status = dnn.cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                          CUDNN_TYPE_VOID_PTR, 1, &workspace);
  }
  if (status == CUDNN_STATUS_SUCCESS) status = dnn.cudnnBackendFinalize(pack);
  if (status == CUDNN_STATUS_SUCCESS) status = dnn.cudnnSetStream(handle, stream);
  if (status == CUDNN_STATUS_SUCCESS) status = dnn.cudnnBackendExecute(handle, plan.plan, pack);
  absl::Status st = DnnStatus(dnn, status, "execute");
  // Only planning may answer Unimplemented (the callers' cue to fall back to the kernels): a
  // planned graph that then fails is an error, not a shape to move elsewhere unseen.
  if (absl::IsUnimplemented(st)) return absl::InternalError(st.message());
  return st;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(
    CachingAllocator* workspace_alloc) {
  if (workspace_alloc == nullptr) {
    return absl::InvalidArgumentError("cuDNN attention: no workspace allocator");
  }
  absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
  if (!dnn.ok()) return dnn.status();
  const int64_t version = static_cast<int64_t>((*dnn)->cudnnGetVersion());
  if (version == 91000 || version == 91001) {  // as cuDNN's frontend refuses them
    return absl::UnavailableError(absl::StrCat(
        "cuDNN attention: cuDNN ", version,
        " has known bugs in its bf16 attention (9.10.0 and 9.10.1); use 9.10.2 or later"));
  }
  std::unique_ptr<CudnnAttention> r(new CudnnAttention(  // private constructor
      *dnn, version, workspace_alloc));
  cudnnHandle_t handle = nullptr;
  if (absl::Status st = DnnStatus(**dnn, (*dnn)->cudnnCreate(&handle), "create handle"); !st.ok()) {
    return st;
  }
  r->handle_ = handle;
  return r;
}

CudnnAttention::CudnnAttention(const Cudnn* dnn, int64_t version, CachingAllocator* alloc)
    : dnn_(dnn), version_(version), alloc_(alloc) {}

CudnnAttention::~CudnnAttention() {
  plans_.clear();  // the plans' descriptors before the handle they were built on
  if (handle_ != nullptr) dnn_->cudnnDestroy(static_cast<cudnnHandle_t>(handle_));
}

absl::StatusOr<const CudnnAttention::Plan*> CudnnAttention::PlanFor(const DeviceContext& ctx,
                                                                    bool backward,
                                                                    const AttentionShape& shape,
                                                                    int ldq) {
  const Geometry geo = GeometryOf(shape, ldq, backward, version_);
  const std::array<int64_t, 9> key{backward, geo.b, geo.hq,  geo.hk,     geo.sq,
                                   geo.skv,  geo.d, geo.ldq, geo.kv_rows};
  if (auto it = plans_.find(key); it != plans_.end()) {
    if (it->second == nullptr) return absl::UnimplementedError(last_refusal_);
    return it->second.get();
  }
  auto plan = std::make_unique<Plan>();
  plan->scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(geo.d)));
  // Before 9.10 cuDNN's masked softmax expected the lowest finite float as the fill, not -inf.
  if (version_ < 91000) plan->neg_inf = std::numeric_limits<float>::lowest();
  plan->seq_len_q = static_cast<int32_t>(geo.sq);
  plan->seq_len_kv = static_cast<int32_t>(geo.skv);
  if (backward) {
    plan->dq_accum_bytes = geo.b * geo.hq * geo.sq * geo.d * static_cast<int64_t>(sizeof(float));
    if (!geo.dkv_in_place()) {
      plan->dkv_bytes = geo.b * geo.skv * geo.kvw() * static_cast<int64_t>(sizeof(bf16));
    }
  }
  if (geo.padding_workaround) {  // sq for each sequence, then skv for each
    plan->pad_kv_offset = (geo.b + 3) / 4 * 4;
    plan->pad_lens_host.assign(plan->pad_kv_offset, static_cast<int32_t>(geo.sq));
    plan->pad_lens_host.resize(plan->pad_kv_offset + geo.b, static_cast<int32_t>(geo.skv));
    const DeviceContext on{.stream = ctx.stream, .alloc = alloc_};
    absl::StatusOr<DeviceArray<int32_t>> lens = DeviceArray<int32_t>::Create(
        on, MemoryCategory::kActivations, plan->pad_lens_host.size(), /*zero=*/false);
    if (!lens.ok()) return lens.status();
    plan->pad_lens = std::move(*lens);
    VP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(plan->pad_lens.data(), plan->pad_lens_host.data(),
                                            plan->pad_lens_host.size() * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, ctx.stream));
  }
  GraphBuilder g(*dnn_, *plan);
  BuildGraph(g, geo, backward);
  if (absl::Status st = g.Build(static_cast<cudnnHandle_t>(handle_)); !st.ok()) {
    const std::string message = absl::StrCat(
        st.message(), " [", backward ? "backward" : "forward", " b ", geo.b, " heads ", geo.hq, "/",
        geo.hk, " rows ", geo.sq, "x", geo.skv, " head_dim ", geo.d, ", cuDNN ", version_, "]");
    if (absl::IsUnimplemented(st)) {  // remembered: the next call of this shape goes straight on
      plans_.emplace(key, nullptr);
      ++refused_shapes_;
      last_refusal_ = message;
    }
    return absl::Status(st.code(), message);
  }
  plan->uids = g.RealUids();
  const Plan* built = plan.get();
  plans_.emplace(key, std::move(plan));
  return built;
}

absl::Status CudnnAttention::CheckDescriptors(const AttentionShape& shape, int ldq,
                                              int64_t as_version) {
  absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
  if (!dnn.ok()) return dnn.status();
  const int64_t version =
      as_version > 0 ? as_version : static_cast<int64_t>((*dnn)->cudnnGetVersion());
  for (bool backward : {false, true}) {
    const Geometry geo = GeometryOf(shape, ldq, backward, version);
    Plan plan;
    GraphBuilder g(**dnn, plan);
    BuildGraph(g, geo, backward);
    g.OperationGraph(/*handle=*/nullptr);
    if (!g.status().ok()) return g.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudnnAttention::Workspace(const DeviceContext& ctx, int64_t bytes) {
  if (bytes == 0) return nullptr;
  if (workspace_.size() < static_cast<size_t>(bytes)) {
    workspace_.Reset();
    const DeviceContext on{.stream = ctx.stream, .alloc = alloc_};
    absl::StatusOr<DeviceArray<uint8_t>> grown = DeviceArray<uint8_t>::Create(
        on, MemoryCategory::kActivations, static_cast<size_t>(bytes), /*zero=*/false);
    if (!grown.ok()) return grown.status();
    workspace_ = std::move(*grown);
  }
  return workspace_.data();
}

absl::Status CudnnAttention::Forward(const DeviceContext& ctx, bf16* out, float* lse, const bf16* q,
                                     int ldq, const bf16* k, const bf16* v,
                                     const AttentionShape& shape) {
  if (!CoversForward(shape, ldq, version_)) {
    return absl::InvalidArgumentError("cuDNN attention: forward shape not covered");
  }
  absl::StatusOr<const Plan*> plan = PlanFor(ctx, /*backward=*/false, shape, ldq);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<void*> workspace = Workspace(ctx, (*plan)->plan_workspace);
  if (!workspace.ok()) return workspace.status();
  VariantPointers pointers{};
  pointers[kQ] = const_cast<bf16*>(q);
  pointers[kK] = const_cast<bf16*>(k);
  pointers[kV] = const_cast<bf16*>(v);
  pointers[kO] = out;
  pointers[kStats] = lse;
  return Execute(*dnn_, static_cast<cudnnHandle_t>(handle_), **plan, ctx.stream, pointers,
                 *workspace);
}

absl::Status CudnnAttention::Backward(const DeviceContext& ctx, bf16* dq, bf16* dk, bf16* dv,
                                      float* delta, const bf16* dout, const bf16* out,
                                      const float* lse, const bf16* q, int ldq, const bf16* k,
                                      const bf16* v, const AttentionShape& shape) {
  if (!CoversBackward(shape, ldq, version_)) {
    return absl::InvalidArgumentError("cuDNN attention: backward shape not covered");
  }
  absl::StatusOr<const Plan*> plan = PlanFor(ctx, /*backward=*/true, shape, ldq);
  if (!plan.ok()) return plan.status();
  // The workspace: cuDNN's part, dQ in fp32, and a chunk's dK and dV (each 256-aligned).
  const int64_t plan_part = AlignUp((*plan)->plan_workspace);
  const int64_t dq_part = AlignUp((*plan)->dq_accum_bytes);
  const int64_t dkv_part = AlignUp((*plan)->dkv_bytes);
  absl::StatusOr<void*> workspace = Workspace(ctx, plan_part + dq_part + 2 * dkv_part);
  if (!workspace.ok()) return workspace.status();
  uint8_t* const base = static_cast<uint8_t*>(*workspace);
  void* dq_accum = base + plan_part;
  const bool in_place = (*plan)->dkv_bytes == 0;
  bf16* const dk_out = in_place ? dk : reinterpret_cast<bf16*>(base + plan_part + dq_part);
  bf16* const dv_out =
      in_place ? dv : reinterpret_cast<bf16*>(base + plan_part + dq_part + dkv_part);
  // Before 9.6 the graph expects its fp32 dQ accumulator zeroed by the caller.
  if (version_ < 90600) {
    VP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dq_accum, 0, (*plan)->dq_accum_bytes, ctx.stream));
  }
  VariantPointers pointers{};
  pointers[kQ] = const_cast<bf16*>(q);
  pointers[kK] = const_cast<bf16*>(k);
  pointers[kV] = const_cast<bf16*>(v);
  pointers[kO] = const_cast<bf16*>(out);
  pointers[kDout] = const_cast<bf16*>(dout);
  pointers[kStats] = const_cast<float*>(lse);
  pointers[kDq] = dq;
  pointers[kDk] = dk_out;
  pointers[kDv] = dv_out;
  pointers[kRowSum] = delta;
  pointers[kDqAccum] = dq_accum;
  if (absl::Status st = Execute(*dnn_, static_cast<cudnnHandle_t>(handle_), **plan, ctx.stream,
                                pointers, *workspace);
      !st.ok() || in_place) {
    return st;
  }
  // A chunk: its dK/dV rows [0, skv) of each sequence added to the caller's, which keep what
  // the later chunks' backward passes (run before this one) put there.
  const int64_t kvw = shape.kv_width(), rows = static_cast<int64_t>(shape.q_end) * kvw;
  for (int i = 0; i < shape.batch; ++i) {
    const int64_t to = i * static_cast<int64_t>(shape.kv_rows) * kvw, from = i * rows;
    VP_CUDA_RETURN_IF_ERROR(ResidualForward(dk + to, dk + to, dk_out + from, rows, ctx.stream));
    VP_CUDA_RETURN_IF_ERROR(ResidualForward(dv + to, dv + to, dv_out + from, rows, ctx.stream));
  }
  return absl::OkStatus();
}

#else  // !VP_HAVE_CUDNN

struct CudnnAttention::Plan {};

absl::Status CudnnAttention::CheckDescriptors(const AttentionShape&, int, int64_t) {
  return LoadCudnn().status();
}

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(CachingAllocator*) {
  absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
  return dnn.status();  // Unavailable: no cuDNN headers in this build
}
CudnnAttention::CudnnAttention(const Cudnn* dnn, int64_t version, CachingAllocator* alloc)
    : dnn_(dnn), version_(version), alloc_(alloc) {}
CudnnAttention::~CudnnAttention() = default;
absl::Status CudnnAttention::Forward(const DeviceContext&, bf16*, float*, const bf16*, int,
                                     const bf16*, const bf16*, const AttentionShape&) {
  return absl::UnavailableError("cuDNN attention: built without cuDNN");
}
absl::Status CudnnAttention::Backward(const DeviceContext&, bf16*, bf16*, bf16*, float*,
                                      const bf16*, const bf16*, const float*, const bf16*, int,
                                      const bf16*, const bf16*, const AttentionShape&) {
  return absl::UnavailableError("cuDNN attention: built without cuDNN");
}

#endif  // VP_HAVE_CUDNN

}  // namespace vp::engine::cuda
