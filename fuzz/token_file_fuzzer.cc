// The llm.c token file reader (worker/data/token_file.h) on arbitrary bytes: never crashes,
// never reads past the file, and an accepted file's ids are below the vocabulary.
#include <cstdint>
#include <cstdlib>

#include "fuzz/memfd_path.h"
#include "worker/data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vp::fuzz::MemFile file(data, size);
  if (!file.ok()) return 0;
  constexpr int64_t kVocab = 50257;
  absl::StatusOr<vp::data::TokenFile> tokens = vp::data::TokenFile::Load(file.path(), kVocab);
  if (!tokens.ok()) return 0;
  if (tokens->size() > 0 && tokens->max_id() >= kVocab) std::abort();
  if (tokens->size() > 0) {
    uint32_t first = 0;
    if (!tokens->Read(0, 1, &first).ok()) std::abort();  // an accepted file reads its first id
  }
  return 0;
}
