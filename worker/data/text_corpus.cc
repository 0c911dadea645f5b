#include "worker/data/text_corpus.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/data/token_file.h"

namespace vp::data {
namespace {

// Collects one split's tokens and writes a shard every `shard_tokens` tokens.
class ShardWriter {
 public:
  ShardWriter(const TokenizeOptions& options, std::string split, TokenFormat format)
      : options_(options), split_(std::move(split)), format_(format) {}

  absl::Status Add(std::span<const uint32_t> tokens) {
    while (!tokens.empty()) {
      const size_t room = static_cast<size_t>(options_.shard_tokens) - buffer_.size();
      const size_t take = std::min(room, tokens.size());
      buffer_.insert(buffer_.end(), tokens.begin(), tokens.begin() + take);
      tokens = tokens.subspan(take);
      if (buffer_.size() == static_cast<size_t>(options_.shard_tokens)) {
        if (absl::Status s = Flush(); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Flush() {
    if (buffer_.empty()) return absl::OkStatus();
    const std::string path =
        (std::filesystem::path(options_.out_dir) /
         absl::StrFormat("%s_%s_%06d.bin", options_.name, split_, written_.size()))
            .string();
    absl::StatusOr<TokenFormat> f = WriteTokenFile(path, buffer_, format_);
    if (!f.ok()) return f.status();
    written_.push_back(path);
    buffer_.clear();
    return absl::OkStatus();
  }

  const std::vector<std::string>& written() const { return written_; }

 private:
  const TokenizeOptions& options_;
  std::string split_;
  TokenFormat format_;
  std::vector<uint32_t> buffer_;
  std::vector<std::string> written_;
};

}  // namespace

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, not a text file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        path, ": cannot open: ", std::error_code(errno, std::generic_category()).message()));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = std::move(ss).str();
  if (text.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": empty file (no text to use)"));
  }
  if (const int64_t bad = FirstInvalidUtf8(text); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not UTF-8 text: invalid byte sequence at byte offset ", bad,
                     " (convert the file to UTF-8, e.g. with iconv)"));
  }
  return text;
}

std::vector<std::string_view> SplitDocuments(std::string_view text) {
  std::vector<std::string_view> docs;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n\n", start);
    if (end == std::string_view::npos) {
      end = text.size();
    } else {
      while (end < text.size() && text[end] == '\n') ++end;
    }
    docs.push_back(text.substr(start, end - start));
    start = end;
  }
  return docs;
}

bool IsValidationDocument(int64_t index, double val_fraction) {
  return std::floor(static_cast<double>(index + 1) * val_fraction) >
         std::floor(static_cast<double>(index) * val_fraction);
}

absl::StatusOr<TokenizeSummary> TokenizeFiles(const std::vector<std::string>& files,
                                              const Tokenizer& tokenizer, std::string_view model,
                                              const TokenizeOptions& options) {
  if (files.empty()) return absl::InvalidArgumentError("no text files given");
  if (!(options.val_fraction >= 0 && options.val_fraction <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--val-fraction: must be in [0, 0.5] (got ", options.val_fraction, ")"));
  }
  if (options.shard_tokens < 1 || options.shard_tokens > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard-tokens: must be in [1, 2147483647] (got ", options.shard_tokens, ")"));
  }
  TokenizeSummary summary;
  // Check every file (readable, non-empty, UTF-8) before writing anything, one file in memory
  // at a time; the sizes feed the progress bar.
  int64_t total_bytes = 0, total_docs = 0;
  for (const std::string& f : files) {
    absl::StatusOr<std::string> text = ReadTextFile(f);
    if (!text.ok()) return text.status();
    total_bytes += static_cast<int64_t>(text->size());
    total_docs += static_cast<int64_t>(SplitDocuments(*text).size());
  }
  int64_t val_docs = 0;
  for (int64_t i = 0; i < total_docs; ++i) {
    val_docs += IsValidationDocument(i, options.val_fraction) ? 1 : 0;
  }
  if (options.val_fraction > 0 && val_docs == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--val-fraction: ", options.val_fraction, " of ", total_docs,
        " documents is no document; give more text (documents are separated by blank lines) or "
        "--val-fraction 0"));
  }
  if (val_docs == total_docs) {
    return absl::InvalidArgumentError("no document left for training (too few documents)");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.out_dir, ": cannot create the output folder: ", ec.message()));
  }
  const TokenFormat format =
      tokenizer.vocab_size() <= 65536 ? TokenFormat::kUint16V1 : TokenFormat::kUint32V7;
  summary.bytes_per_token_on_disk = format == TokenFormat::kUint16V1 ? 2 : 4;
  ShardWriter train(options, "train", format);
  ShardWriter val(options, "val", format);
  const int threads = std::max(1, options.threads);
  int64_t doc_index = 0;
  int64_t done_bytes = 0;
  for (const std::string& path : files) {
    absl::StatusOr<std::string> text = ReadTextFile(path);
    if (!text.ok()) return text.status();
    const std::vector<std::string_view> docs = SplitDocuments(*text);
    // Encode the documents of this file on `threads` threads, in batches so that progress
    // moves and memory stays bounded by one batch's tokens.
    constexpr size_t kBatch = 4096;
    for (size_t first = 0; first < docs.size(); first += kBatch) {
      const size_t count = std::min(kBatch, docs.size() - first);
      std::vector<std::vector<uint32_t>> encoded(count);
      std::vector<absl::Status> errors(static_cast<size_t>(threads));
      std::atomic<size_t> next{0};
      auto work = [&](int t) {
        for (size_t i = next++; i < count; i = next++) {
          absl::StatusOr<std::vector<uint32_t>> ids = tokenizer.Encode(docs[first + i]);
          if (!ids.ok()) {
            errors[static_cast<size_t>(t)] = ids.status();
            return;
          }
          encoded[i].reserve(ids->size() + 1);
          encoded[i].push_back(tokenizer.eot_id());
          encoded[i].insert(encoded[i].end(), ids->begin(), ids->end());
        }
      };
      {
        std::vector<std::jthread> pool;
        for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
        work(0);
      }
      for (const absl::Status& s : errors) {
        if (!s.ok()) return s;
      }
      for (size_t i = 0; i < count; ++i) {
        const bool is_val = IsValidationDocument(doc_index, options.val_fraction);
        const int64_t n = static_cast<int64_t>(encoded[i].size());
        if (absl::Status s = (is_val ? val : train).Add(encoded[i]); !s.ok()) return s;
        (is_val ? summary.val_tokens : summary.train_tokens) += n;
        (is_val ? summary.val_documents : summary.train_documents) += 1;
        done_bytes += static_cast<int64_t>(docs[first + i].size());
        ++doc_index;
      }
      if (options.progress) options.progress(done_bytes, total_bytes);
    }
    summary.bytes += static_cast<int64_t>(text->size());
    ++summary.files;
  }
  summary.documents = doc_index;
  if (absl::Status s = val.Flush(); !s.ok()) return s;
  if (absl::Status s = train.Flush(); !s.ok()) return s;
  summary.shards = val.written();
  summary.shards.insert(summary.shards.end(), train.written().begin(), train.written().end());
  const std::string model_path =
      (std::filesystem::path(options.out_dir) / "tokenizer.model").string();
  {
    std::ofstream out(model_path, std::ios::binary | std::ios::trunc);
    out.write(model.data(), static_cast<std::streamsize>(model.size()));
    if (!out) {
      return absl::InvalidArgumentError(absl::StrCat(model_path, ": cannot write"));
    }
  }
  return summary;
}

}  // namespace vp::data
