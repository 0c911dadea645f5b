// The safetensors loader (worker/runtime/safetensors.h) on arbitrary bytes: never crashes,
// never allocates beyond the file, and accepted tensors hold exactly their shape's elements.
// The streaming reader (SafetensorsReader: header only, data by pread) accepts exactly the files
// the whole-file reader accepts and reads the same values.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fuzz/memfd_path.h"
#include "worker/runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vp::fuzz::MemFile file(data, size);
  if (!file.ok()) return 0;
  absl::StatusOr<vp::runtime::SafetensorsFile> st = vp::runtime::ReadSafetensors(file.path());
  absl::StatusOr<vp::runtime::SafetensorsReader> reader =
      vp::runtime::SafetensorsReader::Open(file.path());
  if (st.ok() != reader.ok()) std::abort();
  if (!st.ok()) return 0;
  if (reader->tensors().size() != st->tensors.size()) std::abort();
  for (const auto& [name, t] : st->tensors) {
    const vp::runtime::TensorEntry* e = reader->Find(name);
    if (e == nullptr || e->shape != t.shape || e->numel() != t.numel()) std::abort();
    std::vector<float> back(t.data.size());
    if (!reader->Read(*e, 0, back.size(), back.data()).ok()) std::abort();
    if (!back.empty() && std::memcmp(back.data(), t.data.data(), back.size() * 4) != 0) {
      std::abort();
    }
  }
  for (const auto& [name, t] : st->tensors) {
    if (static_cast<size_t>(t.numel()) != t.data.size()) std::abort();
    (void)vp::runtime::CheckedTensor(file.path(), *st, name, t.shape);
  }
  return 0;
}
