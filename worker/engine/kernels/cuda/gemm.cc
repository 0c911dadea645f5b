#include "worker/engine/kernels/cuda/gemm.h"

#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/phase_timer.h"

namespace vp::engine::cuda {
namespace {

cudaDataType_t ToCuda(DType t) { return t == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

template <typename T>
constexpr DType DTypeOf() {
  return std::is_same_v<T, float> ? DType::kF32 : DType::kBF16;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(size_t workspace_bytes) {
  // cuBLASLt is opened here, by the first GEMM a process makes (cublaslt_library.h).
  absl::StatusOr<const CublasLt*> lt = LoadCublasLt();
  if (!lt.ok()) return lt.status();
  std::unique_ptr<GemmRunner> r(new GemmRunner(*lt));  // private constructor
  VP_CUBLAS_RETURN_IF_ERROR((*lt)->cublasLtCreate(&r->handle_));
  if (workspace_bytes > 0) {
    VP_CUDA_RETURN_IF_ERROR(cudaMalloc(&r->workspace_, workspace_bytes));
    r->workspace_bytes_ = workspace_bytes;
  }
  return r;
}

GemmRunner::~GemmRunner() {
  for (auto& [key, plan] : plans_) Destroy(plan);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) lt_->cublasLtDestroy(handle_);
}

void GemmRunner::Destroy(Plan& p) {
  if (p.a) lt_->cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) lt_->cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) lt_->cublasLtMatrixLayoutDestroy(p.c);
  if (p.desc) lt_->cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

// Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, and a row-major matrix read as
// column-major is its transpose. So cuBLASLt computes D (n × m, col-major) with first operand
// B (stored col-major as (trans_b ? k×n : n×k), op = trans_b) and second operand A (stored
// (trans_a ? m×k : k×m), op = trans_a).
absl::StatusOr<GemmRunner::Plan*> GemmRunner::GetPlan(const Key& key) {
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  const auto [ta, tb, m, n, k, lda, ldb, ldc, ab, ct, epilogue] = key;
  const cudaDataType_t ab_type = ToCuda(static_cast<DType>(ab));
  const cudaDataType_t c_type = ToCuda(static_cast<DType>(ct));
  Plan p;
  absl::Status st = [&]() -> absl::Status {
    VP_CUBLAS_RETURN_IF_ERROR(
        lt_->cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N;   // B
    const cublasOperation_t op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // A
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
    if (epilogue != Epilogue::kNone) {
      // D is the column-major (n × m) Cᵀ: a bias over D's rows is one value per column of the
      // row-major C, added to every row. Its type defaults to D's; the pointer is set per call.
      const cublasLtEpilogue_t mode = epilogue == Epilogue::kBias ? CUBLASLT_EPILOGUE_BIAS
                                      : epilogue == Epilogue::kBiasGeluAux
                                          ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                          : CUBLASLT_EPILOGUE_DGELU;
      VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
          p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &mode, sizeof(mode)));
    }
    if (epilogue == Epilogue::kBiasGeluAux || epilogue == Epilogue::kGeluGrad) {
      // The GELU input matrix is laid out as D (the row-major C read column-major), of D's type.
      // The heuristic reads the alignment the algorithm may assume from the pointer's value, so
      // the plan is chosen for 256-byte aligned matrices (the caching allocator's blocks) and
      // Run refuses others.
      const int64_t aux_ld = ldc;
      const void* aligned = reinterpret_cast<const void*>(uintptr_t{kAuxAlignment});
      VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
          p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
      VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
          p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aligned, sizeof(aligned)));
    }
    // Layouts are (rows, cols, ld) of the stored column-major matrices.
    VP_CUBLAS_RETURN_IF_ERROR(
        lt_->cublasLtMatrixLayoutCreate(&p.b, ab_type, tb ? k : n, tb ? n : k, ldb));
    VP_CUBLAS_RETURN_IF_ERROR(
        lt_->cublasLtMatrixLayoutCreate(&p.a, ab_type, ta ? m : k, ta ? k : m, lda));
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatrixLayoutCreate(&p.c, c_type, n, m, ldc));
    cublasLtMatmulPreference_t pref = nullptr;
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = workspace_bytes_;
    lt_->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                              sizeof(ws));
    // The heuristic otherwise assumes 256-byte aligned pointers; tensors of a flat parameter
    // buffer and shard rows are only guaranteed 16 bytes (offsets multiples of 8 elements).
    const uint32_t align = 16;
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      lt_->cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t hs = lt_->cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.b, p.a, p.c,
                                                                  p.c, pref, 1, &result, &found);
    lt_->cublasLtMatmulPreferenceDestroy(pref);
    VP_CUBLAS_RETURN_IF_ERROR(hs);
    if (found == 0 && epilogue != Epilogue::kNone) {
      return absl::UnimplementedError(
          absl::StrCat("cuBLASLt has no ", epilogue == Epilogue::kBias ? "bias" : "GELU",
                       "-epilogue algorithm for gemm m ", m, " n ", n, " k ", k));
    }
    if (found == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuBLASLt has no algorithm for gemm m ", m, " n ", n, " k ", k, " lda ", lda, " ldb ",
          ldb, " ldc ", ldc, " (check 16-byte alignment of leading dimensions)"));
    }
    p.algo = result.algo;
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    Destroy(p);
    return st;
  }
  return &plans_.emplace(key, p).first->second;
}

namespace {

// Sizes >= 0 and leading dimensions that hold them (row-major; an empty product needs none):
// the checks Gemm and GemmBias share.
absl::Status CheckGemmShape(bool trans_a, bool trans_b, int m, int n, int k, int lda, int ldb,
                            int ldc) {
  if (m < 0 || n < 0 || k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: m ", m, ", n ", n, ", k ", k, " must be >= 0"));
  }
  if (m == 0 || n == 0) return absl::OkStatus();
  if (lda < (trans_a ? m : k) || ldb < (trans_b ? k : n) || ldc < n) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: leading dimensions lda ", lda, " ldb ",
                                                   ldb, " ldc ", ldc, " too small for m ", m, " n ",
                                                   n, " k ", k));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GemmRunner::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                              const void* a, int lda, const void* b, int ldb, float beta, void* c,
                              int ldc, DType ab_type, DType c_type, cudaStream_t stream) {
  return RunChecked(Epilogue::kNone, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, c,
                    ldc, ab_type, c_type, nullptr, nullptr, stream);
}

absl::Status GemmRunner::GemmBias(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                  const void* a, int lda, const void* b, int ldb, float beta,
                                  void* c, int ldc, DType ab_type, DType c_type, const void* bias,
                                  cudaStream_t stream) {
  if (bias == nullptr) return absl::InvalidArgumentError("gemm: bias must not be null");
  return RunChecked(Epilogue::kBias, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, c,
                    ldc, ab_type, c_type, bias, nullptr, stream);
}

absl::Status GemmRunner::GemmResidual(bool trans_a, bool trans_b, int m, int n, int k,
                                      const void* a, int lda, const void* b, int ldb,
                                      const void* residual, void* c, int ldc, DType ab_type,
                                      DType c_type, const void* bias, cudaStream_t stream) {
  if (residual == nullptr) return absl::InvalidArgumentError("gemm: residual must not be null");
  if (residual == c) return absl::InvalidArgumentError("gemm: residual must not alias c");
  return RunChecked(bias != nullptr ? Epilogue::kBias : Epilogue::kNone, trans_a, trans_b, m, n, k,
                    1.0f, a, lda, b, ldb, 1.0f, residual, c, ldc, ab_type, c_type, bias, nullptr,
                    stream);
}

absl::Status GemmRunner::GemmBiasGelu(bool trans_a, bool trans_b, int m, int n, int k,
                                      const void* a, int lda, const void* b, int ldb, void* c,
                                      int ldc, DType ab_type, DType c_type, const void* bias,
                                      void* pre, cudaStream_t stream) {
  if (bias == nullptr || pre == nullptr) {
    return absl::InvalidArgumentError("gemm: bias and pre must not be null");
  }
  if (reinterpret_cast<uintptr_t>(pre) % kAuxAlignment != 0) {
    return absl::UnimplementedError("gemm: the GELU epilogue's pre is not 256-byte aligned");
  }
  return RunChecked(Epilogue::kBiasGeluAux, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f,
                    c, c, ldc, ab_type, c_type, bias, pre, stream);
}

absl::Status GemmRunner::GemmGeluGrad(bool trans_a, bool trans_b, int m, int n, int k,
                                      const void* a, int lda, const void* b, int ldb, void* c,
                                      int ldc, DType ab_type, DType c_type, const void* pre,
                                      cudaStream_t stream) {
  if (pre == nullptr) return absl::InvalidArgumentError("gemm: pre must not be null");
  if (reinterpret_cast<uintptr_t>(pre) % kAuxAlignment != 0) {
    return absl::UnimplementedError("gemm: the GELU epilogue's pre is not 256-byte aligned");
  }
  return RunChecked(Epilogue::kGeluGrad, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c,
                    c, ldc, ab_type, c_type, nullptr, pre, stream);
}

absl::Status GemmRunner::RunChecked(Epilogue epilogue, bool trans_a, bool trans_b, int m, int n,
                                    int k, float alpha, const void* a, int lda, const void* b,
                                    int ldb, float beta, const void* c_in, void* c, int ldc,
                                    DType ab_type, DType c_type, const void* bias, const void* aux,
                                    cudaStream_t stream) {
  if (absl::Status st = CheckGemmShape(trans_a, trans_b, m, n, k, lda, ldb, ldc); !st.ok()) {
    return st;
  }
  if (m == 0 || n == 0) return absl::OkStatus();
  const Key key{
      trans_a, trans_b, m, n, k, lda, ldb, ldc, static_cast<int>(ab_type), static_cast<int>(c_type),
      epilogue};
  return Run(key, alpha, a, b, beta, c_in, c, bias, aux, stream);
}

absl::Status GemmRunner::Run(const Key& key, float alpha, const void* a, const void* b, float beta,
                             const void* c_in, void* c, const void* bias, const void* aux,
                             cudaStream_t stream) {
  absl::StatusOr<Plan*> plan = GetPlan(key);
  if (!plan.ok()) return plan.status();
  Plan& p = **plan;
  if (bias != nullptr) {
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (aux != nullptr) {
    VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  }
  VP_CUBLAS_RETURN_IF_ERROR(lt_->cublasLtMatmul(handle_, p.desc, &alpha, b, p.b, a, p.a, &beta,
                                                c_in, p.c, c, p.c, &p.algo, workspace_,
                                                workspace_bytes_, stream));
  return absl::OkStatus();
}

namespace {

struct EpilogueOptIns {
  bool bias = false;
  bool gelu = false;
  bool residual = false;
};

// VOCABPIPE_GEMM_EPILOGUE's words (',' or '+' between them, blanks ignored), each applied to o;
// the first word that is none of bias, gelu, residual, all ("" when every word is known).
std::string ReadEpilogueWords(EpilogueOptIns& o) {
  const char* env = std::getenv("VOCABPIPE_GEMM_EPILOGUE");
  std::string unknown;
  if (env == nullptr) return unknown;
  for (absl::string_view word : absl::StrSplit(env, absl::ByAnyChar(",+"))) {
    word = absl::StripAsciiWhitespace(word);
    const bool all = word == "all";
    if (word == "bias" || all) o.bias = true;
    if (word == "gelu" || all) o.bias = o.gelu = true;
    if (word == "residual" || all) o.bias = o.residual = true;
    const bool known =
        word.empty() || all || word == "bias" || word == "gelu" || word == "residual";
    if (!known && unknown.empty()) unknown = std::string(word);
  }
  return unknown;
}

EpilogueOptIns ReadEpilogueOptIns() {
  EpilogueOptIns o;
  ReadEpilogueWords(o);
  return o;
}

}  // namespace

bool FusedBiasEpilogue() { return ReadEpilogueOptIns().bias; }
bool FusedGeluEpilogue() { return ReadEpilogueOptIns().gelu; }
bool FusedResidualEpilogue() { return ReadEpilogueOptIns().residual; }

absl::Status CheckGemmEpilogueSwitch() {
  EpilogueOptIns o;
  const std::string unknown = ReadEpilogueWords(o);
  if (unknown.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "VOCABPIPE_GEMM_EPILOGUE: unknown word \"", absl::CHexEscape(unknown.substr(0, 40)),
      "\" (expected a list of bias, gelu, residual or all)"));
}

// Llama's nn.Linear layout [out, in], no bias (cpu::LinearT*): the same three GEMMs with the
// weight's transpose flags flipped.
template <typename T>
absl::Status LinearTForward(GemmRunner& gemm, T* out, const T* inp, const T* weight, int n,
                            int in_dim, int out_dim, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return gemm.Gemm(false, true, n, out_dim, in_dim, 1.0f, inp, in_dim, weight, in_dim, 0.0f, out,
                   out_dim, t, t, stream);
}

template <typename T>
absl::Status LinearTBackwardInput(GemmRunner& gemm, T* dinp, const T* dout, const T* weight, int n,
                                  int in_dim, int out_dim, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return gemm.Gemm(false, false, n, in_dim, out_dim, 1.0f, dout, out_dim, weight, in_dim, 0.0f,
                   dinp, in_dim, t, t, stream);
}

template <typename T>
absl::Status LinearTBackwardWeight(GemmRunner& gemm, float* dweight, const T* dout, const T* inp,
                                   int n, int in_dim, int out_dim, cudaStream_t stream) {
  return gemm.Gemm(true, false, out_dim, in_dim, n, 1.0f, dout, out_dim, inp, in_dim, 1.0f, dweight,
                   in_dim, DTypeOf<T>(), DType::kF32, stream);
}

namespace {

// A product and the elementwise step after it (bias, GELU, its gradient, the residual add): one
// cuBLASLt call with the step in its epilogue (`fused`) where the opt-in is on and cuBLASLt has
// an algorithm for it — one pass over the output and one bf16 rounding fewer — else the product
// (`product`) and then the step's kernel (`step`, a cudaError_t, charged to the eltwise phase).
template <typename Fused, typename Product, typename Step>
absl::Status FusedOrSeparate(bool opted_in, cudaStream_t stream, Fused fused, Product product,
                             Step step) {
  if (opted_in) {
    absl::Status s = fused();
    if (s.code() != absl::StatusCode::kUnimplemented) return s;
  }
  if (absl::Status s = product(); !s.ok()) return s;
  MarkPhase(stream, Phase::kElementwise);  // the caller marks its next step again
  VP_CUDA_RETURN_IF_ERROR(step());
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status LinearForward(GemmRunner& gemm, T* out, const T* inp, const T* weight, const T* bias,
                           int n, int in_dim, int out_dim, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  auto product = [&] {
    return gemm.Gemm(false, false, n, out_dim, in_dim, 1.0f, inp, in_dim, weight, out_dim, 0.0f,
                     out, out_dim, t, t, stream);
  };
  if (bias == nullptr) return product();
  return FusedOrSeparate(
      FusedBiasEpilogue(), stream,
      [&] {
        return gemm.GemmBias(false, false, n, out_dim, in_dim, 1.0f, inp, in_dim, weight, out_dim,
                             0.0f, out, out_dim, t, t, bias, stream);
      },
      product, [&] { return AddBias(out, bias, n, out_dim, stream); });
}

template <typename T>
absl::Status LinearResidualForward(GemmRunner& gemm, T* out, const T* inp, const T* weight,
                                   const T* bias, const T* residual, int n, int in_dim, int out_dim,
                                   cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return FusedOrSeparate(
      FusedResidualEpilogue(), stream,
      [&] {
        return gemm.GemmResidual(false, false, n, out_dim, in_dim, inp, in_dim, weight, out_dim,
                                 residual, out, out_dim, t, t, bias, stream);
      },
      [&] { return LinearForward<T>(gemm, out, inp, weight, bias, n, in_dim, out_dim, stream); },
      [&] { return ResidualForward(out, out, residual, static_cast<long>(n) * out_dim, stream); });
}

template <typename T>
absl::Status LinearTResidualForward(GemmRunner& gemm, T* out, const T* inp, const T* weight,
                                    const T* residual, int n, int in_dim, int out_dim,
                                    cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return FusedOrSeparate(
      FusedResidualEpilogue(), stream,
      [&] {
        return gemm.GemmResidual(false, true, n, out_dim, in_dim, inp, in_dim, weight, in_dim,
                                 residual, out, out_dim, t, t, nullptr, stream);
      },
      [&] { return LinearTForward<T>(gemm, out, inp, weight, n, in_dim, out_dim, stream); },
      [&] { return ResidualForward(out, out, residual, static_cast<long>(n) * out_dim, stream); });
}

template <typename T>
absl::Status LinearBackwardInput(GemmRunner& gemm, T* dinp, const T* dout, const T* weight, int n,
                                 int in_dim, int out_dim, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return gemm.Gemm(false, true, n, in_dim, out_dim, 1.0f, dout, out_dim, weight, out_dim, 0.0f,
                   dinp, in_dim, t, t, stream);
}

template <typename T>
absl::Status LinearGeluForward(GemmRunner& gemm, T* out, T* pre, const T* inp, const T* weight,
                               const T* bias, int n, int in_dim, int out_dim, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return FusedOrSeparate(
      bias != nullptr && FusedGeluEpilogue(), stream,
      [&] {
        return gemm.GemmBiasGelu(false, false, n, out_dim, in_dim, inp, in_dim, weight, out_dim,
                                 out, out_dim, t, t, bias, pre, stream);
      },
      [&] { return LinearForward<T>(gemm, pre, inp, weight, bias, n, in_dim, out_dim, stream); },
      [&] { return GeluForward(out, pre, static_cast<long>(n) * out_dim, stream); });
}

template <typename T>
absl::Status LinearBackwardInputGelu(GemmRunner& gemm, T* dpre, const T* dout, const T* weight,
                                     const T* pre, int n, int in_dim, int out_dim,
                                     cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  return FusedOrSeparate(
      FusedGeluEpilogue(), stream,
      [&] {
        return gemm.GemmGeluGrad(false, true, n, in_dim, out_dim, dout, out_dim, weight, out_dim,
                                 dpre, in_dim, t, t, pre, stream);
      },
      [&] { return LinearBackwardInput<T>(gemm, dpre, dout, weight, n, in_dim, out_dim, stream); },
      [&] { return GeluBackward(dpre, pre, dpre, static_cast<long>(n) * in_dim, stream); });
}

template <typename T>
absl::Status LinearBackwardWeight(GemmRunner& gemm, float* dweight, float* dbias, const T* dout,
                                  const T* inp, int n, int in_dim, int out_dim,
                                  cudaStream_t stream) {
  if (absl::Status s = gemm.Gemm(true, false, in_dim, out_dim, n, 1.0f, inp, in_dim, dout, out_dim,
                                 1.0f, dweight, out_dim, DTypeOf<T>(), DType::kF32, stream);
      !s.ok()) {
    return s;
  }
  if (dbias != nullptr) {
    MarkPhase(stream, Phase::kElementwise);
    VP_CUDA_RETURN_IF_ERROR(BiasBackward(dbias, dout, n, out_dim, stream));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status OutputLayerS(GemmRunner& gemm, T* probs, float* local_max, float* local_sum,
                          float* label_logit, float* a_out, const T* x, const T* weight,
                          const int32_t* local_label, int n, int h, int64_t rows, int64_t valid,
                          cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  const int r = static_cast<int>(rows), vld = static_cast<int>(valid);
  MarkPhase(stream, Phase::kOutGemm);
  if (valid > 0) {
    // Y (n, valid) = X (n, h) · W_rᵀ (h, valid); padding columns are zeroed by the softmax.
    if (absl::Status s =
            gemm.Gemm(false, true, n, vld, h, 1.0f, x, h, weight, h, 0.0f, probs, r, t, t, stream);
        !s.ok()) {
      return s;
    }
  }
  MarkPhase(stream, Phase::kOutSoftmax);
  VP_CUDA_RETURN_IF_ERROR(VocabSoftmaxForward(probs, local_max, local_sum, label_logit, local_label,
                                              n, rows, valid, stream));
  MarkPhase(stream, Phase::kOutGemm);
  if (a_out != nullptr) {
    if (valid == 0) {
      VP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(a_out, 0, static_cast<size_t>(n) * h * sizeof(float), stream));
    } else if (absl::Status s = gemm.Gemm(false, false, n, h, vld, 1.0f, probs, r, weight, h, 0.0f,
                                          a_out, h, t, DType::kF32, stream);
               !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status OutputLayerT(GemmRunner& gemm, T* probs, float* weight_grad, float* grad_x_partial,
                          const T* x, const T* weight, const float* scale,
                          const int32_t* local_label, float d, int n, int h, int64_t rows,
                          int64_t valid, cudaStream_t stream) {
  constexpr DType t = DTypeOf<T>();
  const int r = static_cast<int>(rows), vld = static_cast<int>(valid);
  MarkPhase(stream, Phase::kOutSoftmax);
  VP_CUDA_RETURN_IF_ERROR(
      VocabSoftmaxBackward(probs, scale, local_label, d, n, rows, valid, stream));
  MarkPhase(stream, Phase::kOutGemm);
  if (valid > 0) {
    // ∇W_r (valid, h) += gradᵀ (valid, n) · X (n, h); padding rows are never written.
    if (absl::Status s = gemm.Gemm(true, false, vld, h, n, 1.0f, probs, r, x, h, 1.0f, weight_grad,
                                   h, t, DType::kF32, stream);
        !s.ok()) {
      return s;
    }
  }
  if (grad_x_partial != nullptr) {
    if (valid == 0) {
      VP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(grad_x_partial, 0, static_cast<size_t>(n) * h * sizeof(float), stream));
    } else if (absl::Status s = gemm.Gemm(false, false, n, h, vld, 1.0f, probs, r, weight, h, 0.0f,
                                          grad_x_partial, h, t, DType::kF32, stream);
               !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

#define VP_INSTANTIATE(T)                                                                          \
  template absl::Status LinearForward<T>(GemmRunner&, T*, const T*, const T*, const T*, int, int,  \
                                         int, cudaStream_t);                                       \
  template absl::Status LinearBackwardInput<T>(GemmRunner&, T*, const T*, const T*, int, int, int, \
                                               cudaStream_t);                                      \
  template absl::Status LinearGeluForward<T>(GemmRunner&, T*, T*, const T*, const T*, const T*,    \
                                             int, int, int, cudaStream_t);                         \
  template absl::Status LinearBackwardInputGelu<T>(GemmRunner&, T*, const T*, const T*, const T*,  \
                                                   int, int, int, cudaStream_t);                   \
  template absl::Status LinearBackwardWeight<T>(GemmRunner&, float*, float*, const T*, const T*,   \
                                                int, int, int, cudaStream_t);                      \
  template absl::Status LinearTForward<T>(GemmRunner&, T*, const T*, const T*, int, int, int,      \
                                          cudaStream_t);                                           \
  template absl::Status LinearResidualForward<T>(GemmRunner&, T*, const T*, const T*, const T*,    \
                                                 const T*, int, int, int, cudaStream_t);           \
  template absl::Status LinearTResidualForward<T>(GemmRunner&, T*, const T*, const T*, const T*,   \
                                                  int, int, int, cudaStream_t);                    \
  template absl::Status LinearTBackwardInput<T>(GemmRunner&, T*, const T*, const T*, int, int,     \
                                                int, cudaStream_t);                                \
  template absl::Status LinearTBackwardWeight<T>(GemmRunner&, float*, const T*, const T*, int,     \
                                                 int, int, cudaStream_t);                          \
  template absl::Status OutputLayerS<T>(GemmRunner&, T*, float*, float*, float*, float*, const T*, \
                                        const T*, const int32_t*, int, int, int64_t, int64_t,      \
                                        cudaStream_t);                                             \
  template absl::Status OutputLayerT<T>(GemmRunner&, T*, float*, float*, const T*, const T*,       \
                                        const float*, const int32_t*, float, int, int, int64_t,    \
                                        int64_t, cudaStream_t);
VP_INSTANTIATE(float)
VP_INSTANTIATE(bf16)
#undef VP_INSTANTIATE

}  // namespace vp::engine::cuda
