// Row-major GEMMs on cuBLASLt, with the same argument convention as cpu::Gemm:
//   C (m, n) = alpha · op(A) · op(B) + beta · C,  op(A) (m, k), op(B) (k, n).
// Types: A and B both fp32 or both bf16; C fp32 or bf16. Compute is always fp32
// (CUBLAS_COMPUTE_32F: no TF32, so the fp32 path matches the CPU engine to rounding).
// beta = 1 with an fp32 C is how W passes accumulate weight gradients across microbatches.
//
// Each distinct shape (transposes, m, n, k, leading dimensions, types) gets a plan — matmul
// descriptor, three layouts and the heuristic's algorithm — built once and cached; pipeline
// shapes are static, so after the first step every call is a cache hit. Not thread-safe: one
// GemmRunner per stream/thread. cuBLASLt needs 16-byte aligned pointers: keep shard rows and
// buffer offsets multiples of 8 elements.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/engine/kernels/cuda/cublaslt_library.h"

namespace vp::engine::cuda {

enum class DType { kF32, kBF16 };

class GemmRunner {
 public:
  static constexpr size_t kDefaultWorkspace = size_t{32} << 20;  // Hopper wants 32 MiB

  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(
      size_t workspace_bytes = kDefaultWorkspace);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const void* a,
                    int lda, const void* b, int ldb, float beta, void* c, int ldc, DType ab_type,
                    DType c_type, cudaStream_t stream);

  // The same with bias (n elements of c_type, device) added to every row of C in the GEMM's
  // epilogue (CUBLASLT_EPILOGUE_BIAS: in fp32, before C is rounded). Unimplemented when
  // cuBLASLt has no algorithm with the epilogue for the shape; the caller then adds the bias
  // itself.
  absl::Status GemmBias(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const void* a,
                        int lda, const void* b, int ldb, float beta, void* c, int ldc,
                        DType ab_type, DType c_type, const void* bias, cudaStream_t stream);

  // GELU's forward in the epilogue (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, the tanh form): pre (m × n,
  // row stride ldc, c_type) = op(A)·op(B) + bias and C = gelu(pre), both from the fp32
  // accumulator (alpha 1, beta 0). Unimplemented when cuBLASLt has no such algorithm for the
  // shape or pre is not 256-byte aligned (the alignment the plan's algorithm was chosen for); the
  // caller then runs the GEMM and the GELU kernel itself.
  absl::Status GemmBiasGelu(bool trans_a, bool trans_b, int m, int n, int k, const void* a, int lda,
                            const void* b, int ldb, void* c, int ldc, DType ab_type, DType c_type,
                            const void* bias, void* pre, cudaStream_t stream);

  // GELU's gradient in the epilogue (CUBLASLT_EPILOGUE_DGELU): C = (op(A)·op(B)) ∘ gelu'(pre),
  // pre (m × n, row stride ldc, c_type) the forward's GELU input (alpha 1, beta 0).
  // Unimplemented as GemmBiasGelu.
  absl::Status GemmGeluGrad(bool trans_a, bool trans_b, int m, int n, int k, const void* a, int lda,
                            const void* b, int ldb, void* c, int ldc, DType ab_type, DType c_type,
                            const void* pre, cudaStream_t stream);

  // A product written onto the residual stream: C = op(A)·op(B) (+ bias) + residual, residual
  // (m × n, row stride ldc, c_type) read as cuBLASLt's C matrix with beta 1 and C written as its
  // D, all from the fp32 accumulator with one rounding; residual must not alias c (in-place needs
  // no C matrix: Gemm with beta 1). With a bias, the CUBLASLT_EPILOGUE_BIAS plan, Unimplemented
  // as in GemmBias.
  absl::Status GemmResidual(bool trans_a, bool trans_b, int m, int n, int k, const void* a, int lda,
                            const void* b, int ldb, const void* residual, void* c, int ldc,
                            DType ab_type, DType c_type, const void* bias, cudaStream_t stream);

  size_t cached_plans() const { return plans_.size(); }

 private:
  // The GELU epilogues' plans assume their GELU input matrix is aligned so (GemmBiasGelu).
  static constexpr uintptr_t kAuxAlignment = 256;
  // What the epilogue adds to the product.
  enum class Epilogue { kNone, kBias, kBiasGeluAux, kGeluGrad };
  // trans_a, trans_b, m, n, k, lda, ldb, ldc, ab type, c type, epilogue.
  using Key = std::tuple<bool, bool, int, int, int, int, int, int, int, int, Epilogue>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  explicit GemmRunner(const CublasLt* lt) : lt_(lt) {}
  absl::StatusOr<Plan*> GetPlan(const Key& key);
  // Every entry point's shape checks (an empty product does nothing), then Run. c_in is what
  // beta scales (cuBLASLt's C), c what is written (its D); the same layout, usually one matrix.
  absl::Status RunChecked(Epilogue epilogue, bool trans_a, bool trans_b, int m, int n, int k,
                          float alpha, const void* a, int lda, const void* b, int ldb, float beta,
                          const void* c_in, void* c, int ldc, DType ab_type, DType c_type,
                          const void* bias, const void* aux, cudaStream_t stream);
  absl::Status Run(const Key& key, float alpha, const void* a, const void* b, float beta,
                   const void* c_in, void* c, const void* bias, const void* aux,
                   cudaStream_t stream);
  void Destroy(Plan& plan);

  const CublasLt* lt_;  // the process's cuBLASLt (never unloaded)
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

// VOCABPIPE_GEMM_EPILOGUE is a list of bias, gelu and residual separated by ',' or '+' (gelu and
// residual each imply bias; all means the three; other words are ignored), read at every call.
// Opt-in until measured on a GPU.
// True for bias, gelu or residual: LinearForward adds its bias in the GEMM's cuBLASLt epilogue
// instead of a separate kernel.
bool FusedBiasEpilogue();
// True for gelu: also LinearGeluForward's GELU and LinearBackwardInputGelu's GELU gradient in the
// epilogue.
bool FusedGeluEpilogue();
// True for residual: Linear(T)ResidualForward read the residual stream as the GEMM's C matrix
// (GemmResidual) instead of adding it with a separate kernel.
bool FusedResidualEpilogue();
// OK when every word of VOCABPIPE_GEMM_EPILOGUE (or its absence) is one of the above or `all`;
// InvalidArgument naming the variable and the first unknown word otherwise.
absl::Status CheckGemmEpilogueSwitch();

// Linear layer, weight in Conv1D layout [in, out] (the CPU engine's layout), T float or bf16.
// out = inp · weight (+ bias).
template <typename T>
absl::Status LinearForward(GemmRunner& gemm, T* out,  // (n, out_dim)
                           const T* inp,              // (n, in_dim)
                           const T* weight,           // (in_dim, out_dim)
                           const T* bias,             // (out_dim) or null
                           int n, int in_dim, int out_dim, cudaStream_t stream);
// GPT-2's c_fc and its GELU: pre = inp · weight + bias, out = gelu(pre) (tanh form). One GEMM
// with VOCABPIPE_GEMM_EPILOGUE=gelu where cuBLASLt allows, else LinearForward and GeluForward.
template <typename T>
absl::Status LinearGeluForward(GemmRunner& gemm, T* out,  // (n, out_dim)  gelu(pre)
                               T* pre,                    // (n, out_dim)  the GELU's input
                               const T* inp,              // (n, in_dim)
                               const T* weight,           // (in_dim, out_dim)
                               const T* bias,             // (out_dim) or null
                               int n, int in_dim, int out_dim, cudaStream_t stream);
// B part through the GELU that feeds this layer: dpre = (dout · weightᵀ) ∘ gelu'(pre)
// (overwrites). One GEMM with VOCABPIPE_GEMM_EPILOGUE=gelu where cuBLASLt allows, else
// LinearBackwardInput and GeluBackward.
template <typename T>
absl::Status LinearBackwardInputGelu(GemmRunner& gemm, T* dpre,  // (n, in_dim)
                                     const T* dout,              // (n, out_dim)
                                     const T* weight,            // (in_dim, out_dim)
                                     const T* pre,               // (n, in_dim)
                                     int n, int in_dim, int out_dim, cudaStream_t stream);
// A product that writes the residual stream (GPT-2's c_proj layers): out = residual + inp · weight
// (+ bias); residual must not alias out or inp. One GEMM with VOCABPIPE_GEMM_EPILOGUE=residual
// where cuBLASLt allows, else LinearForward and ResidualForward.
template <typename T>
absl::Status LinearResidualForward(GemmRunner& gemm, T* out,  // (n, out_dim)
                                   const T* inp,              // (n, in_dim)
                                   const T* weight,           // (in_dim, out_dim)
                                   const T* bias,             // (out_dim) or null
                                   const T* residual,         // (n, out_dim)
                                   int n, int in_dim, int out_dim, cudaStream_t stream);
// B part: dinp = dout · weightᵀ (overwrites).
template <typename T>
absl::Status LinearBackwardInput(GemmRunner& gemm, T* dinp,  // (n, in_dim)
                                 const T* dout,              // (n, out_dim)
                                 const T* weight,            // (in_dim, out_dim)
                                 int n, int in_dim, int out_dim, cudaStream_t stream);
// W part: dweight += inpᵀ · dout, dbias += Σ_rows dout (fp32 gradients; dbias may be null).
template <typename T>
absl::Status LinearBackwardWeight(GemmRunner& gemm, float* dweight,  // (in_dim, out_dim)
                                  float* dbias,                      // (out_dim) or null
                                  const T* dout,                     // (n, out_dim)
                                  const T* inp,                      // (n, in_dim)
                                  int n, int in_dim, int out_dim, cudaStream_t stream);

// Linear layer with the weight in nn.Linear layout [out, in] and no bias (Llama; mirrors
// cpu::LinearT*): out = inp · weightᵀ.
template <typename T>
absl::Status LinearTForward(GemmRunner& gemm, T* out,  // (n, out_dim)
                            const T* inp,              // (n, in_dim)
                            const T* weight,           // (out_dim, in_dim)
                            int n, int in_dim, int out_dim, cudaStream_t stream);
// The same onto the residual stream (Llama's o_proj and down_proj): out = residual + inp · weightᵀ,
// as LinearResidualForward.
template <typename T>
absl::Status LinearTResidualForward(GemmRunner& gemm, T* out,  // (n, out_dim)
                                    const T* inp,              // (n, in_dim)
                                    const T* weight,           // (out_dim, in_dim)
                                    const T* residual,         // (n, out_dim)
                                    int n, int in_dim, int out_dim, cudaStream_t stream);
// B part: dinp = dout · weight (overwrites).
template <typename T>
absl::Status LinearTBackwardInput(GemmRunner& gemm, T* dinp,  // (n, in_dim)
                                  const T* dout,              // (n, out_dim)
                                  const T* weight,            // (out_dim, in_dim)
                                  int n, int in_dim, int out_dim, cudaStream_t stream);
// W part: dweight += doutᵀ · inp (fp32, accumulates).
template <typename T>
absl::Status LinearTBackwardWeight(GemmRunner& gemm, float* dweight,  // (out_dim, in_dim)
                                   const T* dout,                     // (n, out_dim)
                                   const T* inp,                      // (n, in_dim)
                                   int n, int in_dim, int out_dim, cudaStream_t stream);

// Output layer passes on device (see worker/engine/vocab/output_layer.h for the math). The
// shard holds `rows` rows of which the first `valid` are real; local_label as in kernels.h.
//
// S: Y (n, valid) = X · W_rᵀ by cuBLASLt (T inputs, fp32 accumulation, T output), then the
// row statistics and P' in place. Algorithm 2 (a_out non-null): A (n, h) = P' · W_r in fp32.
template <typename T>
absl::Status OutputLayerS(GemmRunner& gemm, T* probs,  // (n, rows)
                          float* local_max,            // (n)
                          float* local_sum,            // (n)
                          float* label_logit,          // (n)
                          float* a_out,                // (n, h) or null
                          const T* x,                  // (n, h)
                          const T* weight,             // (rows, h)
                          const int32_t* local_label,  // (n)
                          int n, int h, int64_t rows, int64_t valid, cudaStream_t stream);
// T: probs → d·(softmax − onehot) in place, ∇W_r (valid, h) += gradᵀ · X in fp32; Algorithm 1
// (grad_x_partial non-null): ∇X' (n, h) = grad · W_r in fp32 (overwrites).
template <typename T>
absl::Status OutputLayerT(GemmRunner& gemm, T* probs,  // (n, rows)
                          float* weight_grad,          // (rows, h)
                          float* grad_x_partial,       // (n, h) or null
                          const T* x,                  // (n, h)
                          const T* weight,             // (rows, h)
                          const float* scale,          // (n) from C1
                          const int32_t* local_label,  // (n)
                          float d, int n, int h, int64_t rows, int64_t valid, cudaStream_t stream);

}  // namespace vp::engine::cuda
