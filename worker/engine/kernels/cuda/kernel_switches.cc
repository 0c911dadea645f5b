#include "worker/engine/kernels/cuda/kernel_switches.h"

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"

namespace vp::engine::cuda {
namespace {

// `variable` unset or empty (the default), or one of `names`.
absl::Status CheckOneOf(const char* variable, const std::vector<std::string_view>& names) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0' || absl::c_linear_search(names, std::string_view(env))) {
    return absl::OkStatus();
  }
  std::string expected;
  for (std::string_view name : names) {
    absl::StrAppend(&expected, expected.empty() ? "" : ", ",
                    absl::string_view(name.data(), name.size()));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      variable, ": unknown value \"", absl::CHexEscape(absl::string_view(env).substr(0, 40)),
      "\" (expected one of ", expected, ")"));
}

}  // namespace

absl::Status CheckKernelSwitches() {
  if (absl::Status st = CheckOneOf("VOCABPIPE_ATTENTION", AttentionKernelsNames()); !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckOneOf("VOCABPIPE_MEMORY_KERNELS", MemoryKernelsNames()); !st.ok()) {
    return st;
  }
  return CheckGemmEpilogueSwitch();
}

}  // namespace vp::engine::cuda
