// The CUDA backend opens cuBLASLt and NCCL on first use, not at process start: this executable
// links the whole CUDA engine and the NCCL communicator, and neither library is mapped until
// the backend asks for it. Device-free (dlopen needs no GPU), so it runs here and, in the GPU
// bundle, proves that the host's libraries export every function the backend calls.
#include <gtest/gtest.h>

#include "worker/comm/nccl/nccl_library.h"
#include "worker/engine/kernels/cuda/cublaslt_library.h"
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
}

}  // namespace
}  // namespace vp::engine::cuda
