// The worker daemons a local `vocabpipe run` starts register with the device their job runs on:
// a cuda job's daemons get cuda:N (without it they registered as cpu workers and the
// coordinator, which places a cuda job on cuda workers only, left the job PENDING forever).
// The rule is the rank's own (launch::PickCudaDevice), checked here without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "client/launcher.h"
#include "worker/launch/job_rank.h"

namespace vp::cli {
namespace {

vocabpipe::v1::JobSpec Spec(const std::string& device) {
  vocabpipe::v1::JobSpec spec;
  spec.set_device(device);
  spec.mutable_parallel()->set_pipeline(4);
  return spec;
}

TEST(LocalDaemonDevice, ACpuJobGetsCpuDaemons) {
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(LocalDaemonDevice(Spec("cpu"), r, 0).value(), "cpu");
    EXPECT_EQ(LocalDaemonDevice(Spec("cpu"), r, 8).value(), "cpu");
  }
}

TEST(LocalDaemonDevice, ACudaJobSpreadsItsDaemonsOverTheGpus) {
  // One GPU: every rank shares it (the ranks then talk through host-staged Gloo).
  for (int r = 0; r < 4; ++r) EXPECT_EQ(LocalDaemonDevice(Spec("cuda"), r, 1).value(), "cuda:0");
  // Two GPUs: rank % 2.
  EXPECT_EQ(LocalDaemonDevice(Spec("cuda"), 0, 2).value(), "cuda:0");
  EXPECT_EQ(LocalDaemonDevice(Spec("cuda"), 1, 2).value(), "cuda:1");
  EXPECT_EQ(LocalDaemonDevice(Spec("cuda"), 2, 2).value(), "cuda:0");
  EXPECT_EQ(LocalDaemonDevice(Spec("cuda"), 3, 2).value(), "cuda:1");
}

TEST(LocalDaemonDevice, ACudaNJobPinsEveryDaemonToThatGpu) {
  for (int r = 0; r < 4; ++r) EXPECT_EQ(LocalDaemonDevice(Spec("cuda:1"), r, 2).value(), "cuda:1");
}

TEST(LocalDaemonDevice, ACudaJobWithoutAGpuOrWithAMissingOneIsRefused) {
  auto none = LocalDaemonDevice(Spec("cuda"), 0, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(none.status()));
  EXPECT_NE(none.status().message().find("no CUDA device"), std::string::npos);
  auto missing = LocalDaemonDevice(Spec("cuda:3"), 0, 2);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(missing.status()));
  EXPECT_NE(missing.status().message().find("cuda:3 does not exist"), std::string::npos);
}

TEST(PickCudaDevice, AnExplicitRequestWinsOverTheSpecAndTheRank) {
  EXPECT_EQ(launch::PickCudaDevice("cuda:1", 0, 0, 2).value(), 0);
  EXPECT_EQ(launch::PickCudaDevice("cuda", 3, 1, 2).value(), 1);
  EXPECT_FALSE(launch::PickCudaDevice("cuda", 0, 2, 2).ok());
}

}  // namespace
}  // namespace vp::cli
