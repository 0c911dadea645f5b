// Process-start settings for the CUDA runtime, applied by every vocabpipe executable's main()
// (and the CUDA test main) before anything can initialise CUDA.
//
// CUDA_MODULE_LOADING=EAGER: with lazy loading (the CUDA 12+ default) a kernel's module is loaded
// at its first launch, and loading a module may wait for the whole device to be idle. In step 0
// an NCCL kernel of another stream can be spinning on a peer that is itself waiting for this
// rank's next kernel, which is blocked behind that load: a hang. Eager loading does all loads at
// context creation, before any NCCL kernel runs. The variable is read when the CUDA driver
// initialises, so it must be set before the first CUDA call; rank processes started by a
// launcher or a worker daemon inherit it. An explicit other value is overridden (the returned
// string says so) because lazy loading is not safe with the communication threads.
#pragma once

#include <cstdlib>
#include <string>

namespace vp::launch {

inline constexpr char kCudaModuleLoadingVariable[] = "CUDA_MODULE_LOADING";
inline constexpr char kCudaModuleLoadingValue[] = "EAGER";

// Sets CUDA_MODULE_LOADING=EAGER in this process's environment. Returns "" when the variable
// was unset or already EAGER, else a one-line note naming the value it replaced.
inline std::string PrepareCudaEnvironment() {
  const char* old = std::getenv(kCudaModuleLoadingVariable);
  std::string note;
  if (old != nullptr && std::string(old) != kCudaModuleLoadingValue) {
    note = std::string(kCudaModuleLoadingVariable) + "=" + old + " replaced by " +
           kCudaModuleLoadingValue + " (lazy module loading can hang NCCL in step 0)";
  }
  setenv(kCudaModuleLoadingVariable, kCudaModuleLoadingValue, /*overwrite=*/1);
  return note;
}

}  // namespace vp::launch
