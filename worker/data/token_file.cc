#include "worker/data/token_file.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace vp::data {
namespace {

static_assert(std::endian::native == std::endian::little,
              "llm.c token files are little-endian; add byte swapping for this host");

std::string ErrnoText() { return std::error_code(errno, std::generic_category()).message(); }

int BytesPerToken(TokenFormat f) { return f == TokenFormat::kUint16V1 ? 2 : 4; }

}  // namespace

absl::StatusOr<TokenFileHeader> CheckTokenFileHeader(const std::string& path, const int32_t* h,
                                                     int64_t file_bytes) {
  TokenFileHeader header;
  header.magic = h[0];
  header.version = h[1];
  header.num_tokens = h[2];
  header.file_bytes = file_bytes;
  if (h[0] == kMagicV1) {
    header.format = TokenFormat::kUint16V1;
    if (h[1] != kVersionV1) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported version ", h[1],
                                                     " for magic ", kMagicV1, " (expected ",
                                                     kVersionV1, ", uint16 tokens)"));
    }
  } else if (h[0] == kMagicV7) {
    header.format = TokenFormat::kUint32V7;
    if (h[1] != kVersionV7) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported version ", h[1],
                                                     " for magic ", kMagicV7, " (expected ",
                                                     kVersionV7, ", uint32 tokens)"));
    }
  } else {
    // The file's own bytes are never shown: it may be any file the reader was pointed at.
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad magic (expected ", kMagicV1,
                                                   " for uint16 tokens or ", kMagicV7,
                                                   " for uint32 tokens); not an llm.c token file"));
  }
  header.bytes_per_token = BytesPerToken(header.format);
  header.vocab_bound = h[3];
  if (h[3] < 0 || (header.format == TokenFormat::kUint16V1 && h[3] > 65536)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": vocabulary bound ", h[3], " in header[3] is not in [0, ",
                     header.format == TokenFormat::kUint16V1 ? "65536" : "2^31", "]"));
  }
  if (header.num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": negative token count ", header.num_tokens, " in the header"));
  }
  const int64_t expected = kHeaderBytes + header.num_tokens * header.bytes_per_token;
  if (file_bytes < expected) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated: the header says ", header.num_tokens, " tokens (",
                     expected, " bytes with the header) but the file has ", file_bytes, " bytes"));
  }
  if (file_bytes > expected) {
    return absl::DataLossError(absl::StrCat(
        path, ": the file has ", file_bytes, " bytes but the header says ", header.num_tokens,
        " tokens (", expected, " bytes with the header); trailing data"));
  }
  return header;
}

namespace {

struct OpenFile {
  std::ifstream in;
  int64_t bytes = 0;
};

absl::StatusOr<TokenFileHeader> OpenAndReadHeader(const std::string& path, OpenFile* f) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) {
    return ec == std::errc::no_such_file_or_directory
               ? absl::NotFoundError(absl::StrCat(path, ": no such token file"))
               : absl::InvalidArgumentError(
                     absl::StrCat(path, ": cannot read token file: ", ec.message()));
  }
  f->bytes = static_cast<int64_t>(size);
  f->in.open(path, std::ios::binary);
  if (!f->in) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", ErrnoText()));
  }
  if (f->bytes < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", f->bytes,
                                            " bytes, too small for the 1024-byte header; not an "
                                            "llm.c token file"));
  }
  int32_t h[kHeaderInts];
  if (!f->in.read(reinterpret_cast<char*>(h), kHeaderBytes)) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read the header"));
  }
  return CheckTokenFileHeader(path, h, f->bytes);
}

}  // namespace

std::string FormatName(TokenFormat format) {
  switch (format) {
    case TokenFormat::kUint16V1:
      return "uint16, version 1";
    case TokenFormat::kUint32V7:
      return "uint32, version 7";
    case TokenFormat::kAuto:
      break;
  }
  return "auto";
}

absl::StatusOr<TokenFileHeader> ReadTokenFileHeader(const std::string& path) {
  OpenFile f;
  return OpenAndReadHeader(path, &f);
}

absl::StatusOr<TokenFile> TokenFile::Load(const std::string& path, int64_t vocab_size) {
  OpenFile f;
  absl::StatusOr<TokenFileHeader> header = OpenAndReadHeader(path, &f);
  if (!header.ok()) return header.status();
  TokenFile file;
  file.path_ = path;
  file.header_ = *header;
  const int64_t n = header->num_tokens;
  file.tokens_.resize(static_cast<size_t>(n));
  if (header->format == TokenFormat::kUint16V1) {
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    if (!f.in.read(reinterpret_cast<char*>(raw.data()), n * 2)) {
      return absl::DataLossError(absl::StrCat(path, ": short read of ", n, " tokens"));
    }
    std::copy(raw.begin(), raw.end(), file.tokens_.begin());
  } else if (!f.in.read(reinterpret_cast<char*>(file.tokens_.data()), n * 4)) {
    return absl::DataLossError(absl::StrCat(path, ": short read of ", n, " tokens"));
  }
  // Every id must index a row of the embedding; a bad id would read out of bounds later. A
  // recorded bound must hold too: readers of memory-mapped shards trust it instead of checking.
  const int64_t bound = header->vocab_bound;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t id = file.tokens_[static_cast<size_t>(i)];
    if (vocab_size > 0 && static_cast<int64_t>(id) >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": token ", i, " (byte offset ", kHeaderBytes + i * header->bytes_per_token,
          ") has id ", id, ", not < vocab size ", vocab_size));
    }
    if (bound > 0 && static_cast<int64_t>(id) >= bound) {
      return absl::DataLossError(absl::StrCat(
          path, ": token ", i, " (byte offset ", kHeaderBytes + i * header->bytes_per_token,
          ") has id ", id, ", not < the vocabulary bound ", bound, " its header records"));
    }
    file.max_id_ = std::max(file.max_id_, id);
  }
  return file;
}

TokenFile TokenFile::FromTokens(std::vector<uint32_t> tokens) {
  TokenFile file;
  file.header_.num_tokens = static_cast<int64_t>(tokens.size());
  file.header_.format = TokenFormat::kUint32V7;
  file.header_.magic = kMagicV7;
  file.header_.version = kVersionV7;
  file.header_.bytes_per_token = 4;
  file.tokens_ = std::move(tokens);
  for (uint32_t id : file.tokens_) file.max_id_ = std::max(file.max_id_, id);
  return file;
}

absl::Status TokenFile::Read(int64_t start, int64_t count, uint32_t* out) const {
  std::copy_n(tokens_.data() + start, count, out);
  return absl::OkStatus();
}

absl::StatusOr<TokenFormat> WriteTokenFile(const std::string& path,
                                           std::span<const uint32_t> tokens, TokenFormat format) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", n, " tokens do not fit the header's int32 count (at most 2147483647)"));
  }
  if (format == TokenFormat::kAuto) {
    const bool small =
        std::all_of(tokens.begin(), tokens.end(), [](uint32_t id) { return id < 65536; });
    format = small ? TokenFormat::kUint16V1 : TokenFormat::kUint32V7;
  } else if (format == TokenFormat::kUint16V1) {
    for (int64_t i = 0; i < n; ++i) {
      if (tokens[static_cast<size_t>(i)] >= 65536) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": token ", i, " has id ", tokens[static_cast<size_t>(i)],
                         ", which does not fit uint16 (version 1); use version 7"));
      }
    }
  }
  int32_t h[kHeaderInts] = {};
  h[0] = format == TokenFormat::kUint16V1 ? kMagicV1 : kMagicV7;
  h[1] = format == TokenFormat::kUint16V1 ? kVersionV1 : kVersionV7;
  h[2] = static_cast<int32_t>(n);
  // The vocabulary bound (max id + 1, at most 2^31 - 1): readers check it against the model's
  // vocabulary from the header alone.
  const uint32_t max_id = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  h[3] = tokens.empty() ? 0 : static_cast<int32_t>(std::min<uint64_t>(max_id + 1ull, INT32_MAX));

  // Write a temporary file and rename it into place, so a reader never sees half a file.
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": cannot create: ", ErrnoText()));
    }
    out.write(reinterpret_cast<const char*>(h), kHeaderBytes);
    if (format == TokenFormat::kUint16V1) {
      // Narrow in blocks to keep the temporary small.
      std::vector<uint16_t> block;
      constexpr size_t kBlock = 1 << 16;
      for (size_t i = 0; i < tokens.size(); i += kBlock) {
        const size_t len = std::min(kBlock, tokens.size() - i);
        block.assign(tokens.begin() + i, tokens.begin() + i + len);
        out.write(reinterpret_cast<const char*>(block.data()),
                  static_cast<std::streamsize>(len * 2));
      }
    } else {
      out.write(reinterpret_cast<const char*>(tokens.data()),
                static_cast<std::streamsize>(tokens.size() * 4));
    }
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp);
      return absl::InternalError(absl::StrCat(path, ": write failed: ", ErrnoText()));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    return absl::InternalError(absl::StrCat(path, ": cannot rename into place: ", ec.message()));
  }
  return format;
}

}  // namespace vp::data
