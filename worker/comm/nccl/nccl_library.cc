#include "worker/comm/nccl/nccl_library.h"

#include <type_traits>
#include <vector>

#include "worker/sharedlib/shared_library.h"

namespace vp::comm {
namespace {

absl::StatusOr<Nccl> Load() {
  absl::StatusOr<sharedlib::SharedLibrary> lib = sharedlib::SharedLibrary::Open(
      "NCCL", std::vector<std::string>{VP_NCCL_SONAME, VP_NCCL_PATH});
  if (!lib.ok()) return lib.status();
  Nccl nccl;
  nccl.library = lib->name();
#define VP_NCCL_BIND(name)                                                     \
  {                                                                            \
    auto f = lib->Function<std::remove_pointer_t<decltype(nccl.name)>>(#name); \
    if (!f.ok()) return f.status();                                            \
    nccl.name = *f;                                                            \
  }
  VP_NCCL_FUNCTIONS(VP_NCCL_BIND)
#undef VP_NCCL_BIND
  return nccl;
}

}  // namespace

absl::StatusOr<const Nccl*> LoadNccl() {
  // A function-local constant: initialised once (thread-safe), immutable afterwards.
  static const absl::StatusOr<Nccl> table = Load();
  if (!table.ok()) return table.status();
  return &*table;
}

}  // namespace vp::comm
