// A SentencePiece tokenizer (Debian's libsentencepiece) set up so that text round-trips byte
// for byte: identity normalization, no dummy prefix, whitespace kept, byte fallback for
// characters outside the vocabulary. Id 0 is <unk> (never produced: byte fallback covers every
// byte), id 1 is the end-of-text token <|endoftext|> that starts every document (llm.c's EOT),
// then 256 byte pieces <0x00>..<0xFF>, then the learned pieces. docs/formats.md §2.2.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/data/sentencepiece_bridge.h"

namespace vp::data {

inline constexpr char kEotPiece[] = "<|endoftext|>";

struct TokenizerTrainOptions {
  std::string model_type = "bpe";  // bpe or unigram
  int vocab_size = 0;              // >= kMinTokenizerVocab
  int threads = 1;
};
inline constexpr int kMinTokenizerVocab = 300;  // unk + EOT + 256 bytes + some pieces

class Tokenizer {
 public:
  // Trains on `documents` and returns the model (the bytes of a tokenizer.model file).
  static absl::StatusOr<std::string> Train(const std::vector<std::string_view>& documents,
                                           const TokenizerTrainOptions& options);
  // Loads a serialized model; `name` (a path) starts every error. A model that does not have
  // the EOT token or does not round-trip text exactly is refused.
  static absl::StatusOr<Tokenizer> FromModel(std::string_view model, const std::string& name);
  static absl::StatusOr<Tokenizer> Load(const std::string& path);

  int vocab_size() const { return vocab_size_; }
  uint32_t eot_id() const { return eot_id_; }

  // The ids of `text` (valid UTF-8), without EOT.
  absl::StatusOr<std::vector<uint32_t>> Encode(std::string_view text) const;
  // The text of `ids`; EOT tokens decode to nothing. Ids must be < vocab_size().
  absl::StatusOr<std::string> Decode(std::span<const uint32_t> ids) const;

 private:
  Tokenizer() = default;
  std::string name_;
  spbridge::Processor sp_;
  int vocab_size_ = 0;
  uint32_t eot_id_ = 0;
  std::vector<int> marker_bytes_;  // byte ids of U+2581, which SentencePiece decodes as ' '
};

// When the folder of the data path `data_path` (a token file's or a glob's folder, or the folder
// itself: DataFolder) holds a tokenizer.model (as `vocabpipe data tokenize` writes it), the model's
// vocabulary must be exactly the tokenizer's: ids past it would never occur, and a smaller one
// cannot hold the data's ids. The error names model.vocab_size and the tokenizer's path and size.
// No tokenizer.model: nothing to check.
absl::Status CheckDataTokenizer(const std::string& data_path, int64_t model_vocab_size);

// What can be known of a job's token files without reading their tokens: every shard the
// entries name ({data.path} or data.paths: files, folders, globs) with its header against its
// size, one token width, a recorded vocabulary bound within model_vocab_size
// (CheckTokenShardEntries), and the tokenizer beside the first (CheckDataTokenizer).
// InvalidArgument starting with `field`, naming the shard, never quoting a file. Checked before a
// job's ranks start (at submit, and by the worker daemon before it forks), so a bad file fails
// the job once instead of at every restart. Ids of shards without a recorded bound are checked
// by the rank as it reads them.
absl::Status CheckDataFiles(const std::vector<std::string>& entries, int64_t model_vocab_size,
                            const std::string& field);

// Checks that `text` is valid UTF-8 (no overlong forms, surrogates or values > U+10FFFF).
// Returns the byte offset of the first invalid sequence, or -1.
int64_t FirstInvalidUtf8(std::string_view text);

}  // namespace vp::data
