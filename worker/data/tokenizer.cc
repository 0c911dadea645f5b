#include "worker/data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/data/token_file.h"
#include "worker/data/token_shards.h"

namespace vp::data {
namespace {

// SentencePiece escapes ' ' as U+2581 (LOWER ONE EIGHTH BLOCK) and decodes U+2581 as ' ', so
// a literal U+2581 in the text is encoded as its three UTF-8 bytes instead.
constexpr std::string_view kMarker = "\xE2\x96\x81";

// A probe every loaded model must round-trip: whitespace runs, tabs, newlines, leading spaces,
// digits, non-ASCII and the marker itself.
constexpr std::string_view kProbe =
    "  Two  spaces,\ttab\n\n\nnew lines; 2024 \xC3\xA9t\xC3\xA9 "
    "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x8E\x89 \xE2\x96\x81 end ";

}  // namespace

int64_t FirstInvalidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    uint32_t cp = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return static_cast<int64_t>(i);
    }
    if (i + len > n) return static_cast<int64_t>(i);
    for (int k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return static_cast<int64_t>(i);
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return static_cast<int64_t>(i);
    }
    i += len;
  }
  return -1;
}

absl::StatusOr<std::string> Tokenizer::Train(const std::vector<std::string_view>& documents,
                                             const TokenizerTrainOptions& options) {
  if (options.model_type != "bpe" && options.model_type != "unigram") {
    return absl::InvalidArgumentError(
        absl::StrCat("--model-type: expected bpe or unigram, got \"", options.model_type, "\""));
  }
  if (options.vocab_size < kMinTokenizerVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size: must be >= ", kMinTokenizerVocab,
                     " (unk, EOT and 256 byte tokens come first; got ", options.vocab_size, ")"));
  }
  if (documents.empty()) return absl::InvalidArgumentError("no documents to train on");
  spbridge::TrainParams params;
  params.model_type = options.model_type;
  params.vocab_size = options.vocab_size;
  params.threads = std::max(1, options.threads);
  params.eot_piece = kEotPiece;
  std::string model;
  const std::string error = spbridge::Train(documents, params, &model);
  if (!error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--vocab-size ", options.vocab_size,
                                                   ": sentencepiece training failed: ", error));
  }
  return model;
}

absl::StatusOr<Tokenizer> Tokenizer::FromModel(std::string_view model, const std::string& name) {
  Tokenizer t;
  t.name_ = name;
  if (const std::string error = t.sp_.Load(model); !error.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not a SentencePiece model (", error, ")"));
  }
  t.vocab_size_ = t.sp_.PieceSize();
  const int eot = t.sp_.PieceToId(kEotPiece);
  if (eot == t.sp_.UnkId() || !t.sp_.IsControl(eot)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the model has no control token ", kEotPiece,
                     " (train it with `vocabpipe data train-tokenizer`)"));
  }
  t.eot_id_ = static_cast<uint32_t>(eot);
  for (size_t k = 0; k < kMarker.size(); ++k) {
    const int id =
        t.sp_.PieceToId(absl::StrFormat("<0x%02X>", static_cast<unsigned char>(kMarker[k])));
    if (id == t.sp_.UnkId() || !t.sp_.IsByte(id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name,
          ": the model has no byte-fallback pieces, so text would not round-trip exactly "
          "(train it with `vocabpipe data train-tokenizer`)"));
    }
    t.marker_bytes_.push_back(id);
  }
  absl::StatusOr<std::vector<uint32_t>> ids = t.Encode(kProbe);
  if (!ids.ok()) return ids.status();
  absl::StatusOr<std::string> back = t.Decode(*ids);
  if (!back.ok()) return back.status();
  if (*back != kProbe) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     ": the model does not round-trip text exactly (it normalizes text or adds a "
                     "dummy prefix; train it with `vocabpipe data train-tokenizer`)"));
  }
  return t;
}

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open the tokenizer"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromModel(ss.str(), path);
}

absl::StatusOr<std::vector<uint32_t>> Tokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> out;
  std::vector<int> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t marker = text.find(kMarker, pos);
    const size_t end = marker == std::string_view::npos ? text.size() : marker;
    if (end > pos) {
      ids.clear();
      if (const std::string error = sp_.Encode(text.substr(pos, end - pos), &ids); !error.empty()) {
        return absl::InternalError(absl::StrCat(name_, ": encoding failed: ", error));
      }
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (marker == std::string_view::npos) break;
    out.insert(out.end(), marker_bytes_.begin(), marker_bytes_.end());
    pos = marker + kMarker.size();
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const uint32_t> ids) const {
  std::vector<int> v;
  v.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= static_cast<uint32_t>(vocab_size_)) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " has id ", ids[i],
                                                     ", outside the tokenizer's vocabulary of ",
                                                     vocab_size_, " (", name_, ")"));
    }
    v.push_back(static_cast<int>(ids[i]));
  }
  std::string text;
  if (const std::string error = sp_.Decode(v, &text); !error.empty()) {
    return absl::InternalError(absl::StrCat(name_, ": decoding failed: ", error));
  }
  return text;
}

absl::Status CheckDataTokenizer(const std::string& data_path, int64_t model_vocab_size) {
  const std::filesystem::path model =
      std::filesystem::path(DataFolder(data_path)) / "tokenizer.model";
  std::error_code ec;
  if (!std::filesystem::exists(model, ec)) return absl::OkStatus();
  absl::StatusOr<Tokenizer> tok = Tokenizer::Load(model.string());
  if (!tok.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.path: the tokenizer beside the data is unusable: ", tok.status().message()));
  }
  if (tok->vocab_size() != model_vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab_size: ", model_vocab_size,
                     " does not match the tokenizer beside the data (", model.string(), " has ",
                     tok->vocab_size(), " tokens); set model.vocab_size: ", tok->vocab_size()));
  }
  return absl::OkStatus();
}

absl::Status CheckDataFiles(const std::vector<std::string>& entries, int64_t model_vocab_size,
                            const std::string& field) {
  if (entries.empty() || entries.front().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no token files"));
  }
  // The shards' headers (messages start with the field and name the shard).
  if (auto shards = CheckTokenShardEntries(field, entries, model_vocab_size); !shards.ok()) {
    return absl::InvalidArgumentError(shards.status().message());
  }
  if (absl::Status st = CheckDataTokenizer(entries.front(), model_vocab_size); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " (", entries.front(), "): ", st.message()));
  }
  return absl::OkStatus();
}

}  // namespace vp::data
