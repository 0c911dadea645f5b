#include "worker/engine/kernels/cuda/cublaslt_library.h"

#include <type_traits>
#include <vector>

#include "worker/sharedlib/shared_library.h"

namespace vp::engine::cuda {
namespace {

absl::StatusOr<CublasLt> Load() {
  absl::StatusOr<sharedlib::SharedLibrary> lib =
      sharedlib::SharedLibrary::Open("cuBLASLt", std::vector<std::string>{
                                                     VP_CUBLASLT_SONAME,
                                                     VP_CUBLASLT_PATH,
                                                 });
  if (!lib.ok()) return lib.status();
  CublasLt lt;
  lt.library = lib->name();
#define VP_CUBLASLT_BIND(name)                                               \
  {                                                                          \
    auto f = lib->Function<std::remove_pointer_t<decltype(lt.name)>>(#name); \
    if (!f.ok()) return f.status();                                          \
    lt.name = *f;                                                            \
  }
  VP_CUBLASLT_FUNCTIONS(VP_CUBLASLT_BIND)
#undef VP_CUBLASLT_BIND
  return lt;
}

}  // namespace

absl::StatusOr<const CublasLt*> LoadCublasLt() {
  // A function-local constant: initialised once (thread-safe), immutable afterwards.
  static const absl::StatusOr<CublasLt> table = Load();
  if (!table.ok()) return table.status();
  return &*table;
}

}  // namespace vp::engine::cuda
