// The safetensors loader (worker/runtime/safetensors.h) on arbitrary bytes: never crashes,
// never allocates beyond the file, and accepted tensors hold exactly their shape's elements.
#include <cstdint>
#include <cstdlib>

#include "fuzz/memfd_path.h"
#include "worker/runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vp::fuzz::MemFile file(data, size);
  if (!file.ok()) return 0;
  absl::StatusOr<vp::runtime::SafetensorsFile> st = vp::runtime::ReadSafetensors(file.path());
  if (!st.ok()) return 0;
  for (const auto& [name, t] : st->tensors) {
    if (static_cast<size_t>(t.numel()) != t.data.size()) std::abort();
    (void)vp::runtime::CheckedTensor(file.path(), *st, name, t.shape);
  }
  return 0;
}
