#include "worker/comm/nccl/nccl_library.h"

#include <vector>

namespace vp::comm {
namespace {

absl::StatusOr<Nccl> Load() {
  absl::StatusOr<sharedlib::SharedLibrary> opened = sharedlib::SharedLibrary::Open(
      "NCCL", std::vector<std::string>{VP_NCCL_SONAME, VP_NCCL_PATH});
  if (!opened.ok()) return opened.status();
  const sharedlib::SharedLibrary& lib = *opened;
  Nccl table;
  table.library = lib.name();
  VP_NCCL_FUNCTIONS(VP_SHAREDLIB_BIND)
  return table;
}

}  // namespace

absl::StatusOr<const Nccl*> LoadNccl() {
  // A function-local constant: initialised once (thread-safe), immutable afterwards.
  static const absl::StatusOr<Nccl> table = Load();
  if (!table.ok()) return table.status();
  return &*table;
}

}  // namespace vp::comm
