#include "worker/engine/kernels/cuda/cudnn_library.h"

#include <vector>

#include "absl/status/status.h"

namespace vp::engine::cuda {
namespace {

absl::StatusOr<Cudnn> Load() {
#if VP_HAVE_CUDNN
  absl::StatusOr<sharedlib::SharedLibrary> opened = sharedlib::SharedLibrary::Open(
      "cuDNN", std::vector<std::string>{VP_CUDNN_SONAME, VP_CUDNN_PATH});
  if (!opened.ok()) return opened.status();
  const sharedlib::SharedLibrary& lib = *opened;
  Cudnn table;
  table.library = lib.name();
  VP_CUDNN_FUNCTIONS(VP_SHAREDLIB_BIND)
  return table;
#else
  return absl::UnavailableError("cuDNN: this build found no cuDNN headers (cudnn_graph.h)");
#endif
}

}  // namespace

absl::StatusOr<const Cudnn*> LoadCudnn() {
  // A function-local constant: initialised once (thread-safe), immutable afterwards.
  static const absl::StatusOr<Cudnn> table = Load();
  if (!table.ok()) return table.status();
  return &*table;
}

}  // namespace vp::engine::cuda
