// From text files to llm.c token shards (docs/formats.md §2.2).
//
// Documents: every file is split into paragraphs at blank lines; a document is one paragraph
// together with the newlines that end it (a run of two or more '\n'), so the documents of a
// file concatenate back to the file exactly. Every document's tokens start with the EOT token,
// as in llm.c. Split: document i (counted over all files, in the order given) goes to
// validation when floor((i + 1) * f) > floor(i * f), f the validation fraction: exactly
// floor(N * f) of N documents, spread evenly, independent of the number of threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/tokenizer.h"

namespace vp::data {

// Reads a text file; refuses an empty file and bytes that are not UTF-8 (the error names the
// file and the byte offset, never the contents).
absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// The documents of a text (views into it); concatenated they are the text.
std::vector<std::string_view> SplitDocuments(std::string_view text);

// Whether document `index` goes to the validation split.
bool IsValidationDocument(int64_t index, double val_fraction);

struct TokenizeOptions {
  std::string out_dir;
  std::string name;                  // shard names NAME_{train,val}_NNNNNN.bin
  double val_fraction = 0.1;         // in [0, 0.5]
  int threads = 1;                   // >= 1
  int64_t shard_tokens = 100000000;  // tokens per shard (llm.c: 10^8)
  // Called after every file and batch of documents with (bytes done, bytes total).
  std::function<void(int64_t, int64_t)> progress;
};

struct TokenizeSummary {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t train_documents = 0;
  int64_t val_documents = 0;
  int64_t bytes = 0;  // text bytes read
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;           // both counts include one EOT per document
  std::vector<std::string> shards;  // paths written, val first
  int bytes_per_token_on_disk = 0;  // 2 (uint16, version 1) or 4 (uint32, version 7)
};

// Tokenizes `files` into shards under options.out_dir and copies the tokenizer model there as
// tokenizer.model. `model` is the tokenizer's serialized model.
absl::StatusOr<TokenizeSummary> TokenizeFiles(const std::vector<std::string>& files,
                                              const Tokenizer& tokenizer, std::string_view model,
                                              const TokenizeOptions& options);

}  // namespace vp::data
