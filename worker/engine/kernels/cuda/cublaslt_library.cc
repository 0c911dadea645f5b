#include "worker/engine/kernels/cuda/cublaslt_library.h"

#include <vector>

namespace vp::engine::cuda {
namespace {

absl::StatusOr<CublasLt> Load() {
  absl::StatusOr<sharedlib::SharedLibrary> opened = sharedlib::SharedLibrary::Open(
      "cuBLASLt", std::vector<std::string>{VP_CUBLASLT_SONAME, VP_CUBLASLT_PATH});
  if (!opened.ok()) return opened.status();
  const sharedlib::SharedLibrary& lib = *opened;
  CublasLt table;
  table.library = lib.name();
  VP_CUBLASLT_FUNCTIONS(VP_SHAREDLIB_BIND)
  return table;
}

}  // namespace

absl::StatusOr<const CublasLt*> LoadCublasLt() {
  // A function-local constant: initialised once (thread-safe), immutable afterwards.
  static const absl::StatusOr<CublasLt> table = Load();
  if (!table.ok()) return table.status();
  return &*table;
}

}  // namespace vp::engine::cuda
