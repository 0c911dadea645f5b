// main() of the CUDA test executables: the process-start CUDA settings every vocabpipe
// executable applies (worker/launch/cuda_environment.h), then GoogleTest.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "worker/launch/cuda_environment.h"

int main(int argc, char** argv) {
  if (const std::string note = vp::launch::PrepareCudaEnvironment(); !note.empty()) {
    std::fprintf(stderr, "%s\n", note.c_str());
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
