// The CUDA backend opens cuBLASLt, NCCL and cuDNN on first use, not at process start: this
// executable links the whole CUDA engine and the NCCL communicator, and no library is mapped
// until the backend asks for it. Device-free (dlopen needs no GPU), so it runs here and, in the GPU
// bundle, proves that the host's libraries export every function the backend calls.
#include <gtest/gtest.h>

#include <cstdio>

#include "worker/comm/nccl/nccl_library.h"
#include "worker/engine/kernels/cuda/cublaslt_library.h"
#include "worker/engine/kernels/cuda/cudnn_library.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/sharedlib/shared_library.h"

namespace vp::engine::cuda {
namespace {

using sharedlib::IsMapped;

// One test: the "not yet mapped" half is only true before anything in this process opened them.
TEST(VendorLibraries, OpenedOnFirstUseWithEveryFunction) {
  // Linked in, but not loaded: the program's start maps neither (the ~150 MiB cuBLASLt costs a
  // CPU job of a CUDA-enabled build nothing).
  EXPECT_FALSE(IsMapped("libcublasLt"));
  EXPECT_FALSE(IsMapped("libcublas."));
  EXPECT_FALSE(IsMapped("libnccl"));
  // Referencing the engine is not using it: GemmRunner's code is linked in this executable.
  EXPECT_NE(&GemmRunner::Create, nullptr);

  absl::StatusOr<const CublasLt*> lt = LoadCublasLt();
  ASSERT_TRUE(lt.ok()) << lt.status();
  EXPECT_TRUE(IsMapped("libcublasLt"));
  EXPECT_FALSE(IsMapped("libnccl"));
#define VP_EXPECT_BOUND(name) EXPECT_NE((*lt)->name, nullptr) << #name;
  VP_CUBLASLT_FUNCTIONS(VP_EXPECT_BOUND)
#undef VP_EXPECT_BOUND
  EXPECT_STREQ((*lt)->cublasLtGetStatusName(CUBLAS_STATUS_ALLOC_FAILED),
               "CUBLAS_STATUS_ALLOC_FAILED");
  // A second call returns the same table (opened once per process).
  EXPECT_EQ(*LoadCublasLt(), *lt);

  absl::StatusOr<const comm::Nccl*> nccl = comm::LoadNccl();
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_TRUE(IsMapped("libnccl"));
#define VP_EXPECT_BOUND(name) EXPECT_NE((*nccl)->name, nullptr) << #name;
  VP_NCCL_FUNCTIONS(VP_EXPECT_BOUND)
#undef VP_EXPECT_BOUND
  EXPECT_NE(std::string((*nccl)->ncclGetErrorString(ncclInvalidArgument)), "");
  EXPECT_EQ(*comm::LoadNccl(), *nccl);
  // cuDNN is opened by VOCABPIPE_ATTENTION=cudnn alone: neither library above pulls it in.
  EXPECT_FALSE(IsMapped("libcudnn"));
}

// cuDNN (optional: only VOCABPIPE_ATTENTION=cudnn needs it) exports every function the cuDNN
// attention calls, and reports a cuDNN 9 (the graph API's SDPA composition the graphs follow).
// In the GPU bundle this checks the host's copy (PyTorch's wheel) before any GPU test uses it.
TEST(VendorLibraries, CudnnOpenedOnFirstUseWithEveryFunction) {
  absl::StatusOr<const Cudnn*> dnn = LoadCudnn();
#if VP_HAVE_CUDNN
  ASSERT_TRUE(dnn.ok()) << dnn.status();
  EXPECT_TRUE(IsMapped("libcudnn"));
#define VP_EXPECT_BOUND(name) EXPECT_NE((*dnn)->name, nullptr) << #name;
  VP_CUDNN_FUNCTIONS(VP_EXPECT_BOUND)
#undef VP_EXPECT_BOUND
  const size_t version = (*dnn)->cudnnGetVersion();
  std::printf("cuDNN %zu from %s\n", version, (*dnn)->library.c_str());
  EXPECT_GE(version, 90000u);
  EXPECT_LT(version, 100000u);
  EXPECT_EQ(*LoadCudnn(), *dnn);
#else
  EXPECT_EQ(dnn.status().code(), absl::StatusCode::kUnavailable) << dnn.status();
#endif
}

}  // namespace
}  // namespace vp::engine::cuda
