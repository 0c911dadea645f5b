#include "worker/runtime/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace vp::runtime {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // as the reference implementation caps it

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0) return absl::InternalError(absl::StrCat(path, ": write failed: ", strerror(errno)));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// The header bytes of a file holding `tensors` in this order: the 8-byte length, then the
// JSON header padded with spaces so that the data section starts 8-byte aligned.
absl::StatusOr<std::string> HeaderBytes(const std::string& path,
                                        const std::vector<TensorLayout>& tensors,
                                        const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const TensorLayout& t : tensors) {
    if (header.contains(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": duplicate tensor name ", t.name));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(t.name, ": negative dimension"));
    }
    const uint64_t bytes = t.bytes();
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  const uint64_t n = text.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<unsigned char>(n >> (8 * i)));
  return out + text;
}

// The file's bytes: header length, header, then every tensor's data.
absl::Status WriteContent(int fd, const std::string& path, const std::vector<TensorView>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  std::vector<TensorLayout> layout;
  for (const TensorView& t : tensors) layout.push_back({t.name, t.shape});
  auto header = HeaderBytes(path, layout, metadata);
  if (!header.ok()) return header.status();
  absl::Status st = WriteAll(fd, header->data(), header->size(), path);
  for (size_t i = 0; i < tensors.size() && st.ok(); ++i) {
    st = WriteAll(fd, tensors[i].data, layout[i].bytes(), path);
  }
  if (st.ok() && ::fsync(fd) != 0) st = absl::InternalError(absl::StrCat(path, ": fsync failed"));
  return st;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string tmp = path + ".tmp";
  // A fresh temporary (a stale one is removed first): O_EXCL never writes through a link.
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", strerror(errno)));
  absl::Status st = WriteContent(fd, tmp, tensors, metadata);
  ::close(fd);
  if (!st.ok()) {
    std::remove(tmp.c_str());
    return st;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensorsAt(const safefs::Dir& dir, const std::string& name,
                                const std::vector<TensorView>& tensors,
                                const std::map<std::string, std::string>& metadata) {
  const std::string tmp = safefs::Dir::TempName(name);
  absl::Status st;
  {
    auto fd = dir.OpenFile(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (!fd.ok()) return fd.status();
    st = WriteContent(fd->get(), dir.PathOf(name), tensors, metadata);
  }
  if (st.ok()) st = dir.Rename(tmp, name);
  if (!st.ok()) dir.Remove(tmp).IgnoreError();
  return st;
}

namespace {

absl::StatusOr<SafetensorsFile> ReadContent(int fd, const std::string& path);

}  // namespace

absl::StatusOr<SafetensorsFile> ReadSafetensorsAt(const safefs::Dir& dir, const std::string& name) {
  auto fd = dir.OpenFile(name, O_RDONLY);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) {
      return absl::NotFoundError(absl::StrCat(dir.PathOf(name), ": cannot open"));
    }
    return fd.status();
  }
  return ReadContent(fd->get(), dir.PathOf(name));
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  auto out = ReadContent(fd, path);
  ::close(fd);
  return out;
}

namespace {

absl::Status ReadAt(int fd, void* data, size_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::DataLossError("short read");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

struct ParsedHeader {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
};

// The header of the open file: every entry validated against the file's size, no data read.
absl::StatusOr<ParsedHeader> ParseHeader(int fd, const std::string& path) {
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    return absl::InternalError(absl::StrCat(path, ": cannot stat: ", strerror(errno)));
  }
  const uint64_t file_size = static_cast<uint64_t>(sb.st_size);
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: ", file_size,
                                            " bytes, shorter than the 8-byte header length"));
  }
  unsigned char len_le[8];
  if (!ReadAt(fd, len_le, 8, 0).ok())
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_le[i]) << (8 * i);
  if (header_len > kMaxHeaderBytes || 8 + header_len > file_size) {
    return absl::DataLossError(absl::StrCat(path, ": header length ", header_len,
                                            " does not fit in the file (", file_size, " bytes)"));
  }
  std::string text(header_len, '\0');
  if (!ReadAt(fd, text.data(), header_len, 8).ok()) {
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  }
  json header = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": header is not a JSON object"));
  }
  const uint64_t data_size = file_size - 8 - header_len;
  ParsedHeader out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  int index = -1;
  for (auto& [name, entry] : header.items()) {
    ++index;
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::DataLossError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (auto& [k, v] : entry.items()) {
        if (!v.is_string()) {
          return absl::DataLossError(
              absl::StrCat(path, ": __metadata__ holds a value that is not a string"));
        }
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    // Entries are named by their place in the header: the file's own text is never echoed.
    const std::string where = absl::StrCat(path, ": header entry #", index);
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      return absl::DataLossError(absl::StrCat(where, ": needs dtype, shape and data_offsets"));
    }
    if (entry["dtype"] != "F32") {
      return absl::InvalidArgumentError(absl::StrCat(where, ": dtype is not supported (F32 only)"));
    }
    TensorEntry t;
    uint64_t numel = 1;
    if (!entry["shape"].is_array() || entry["shape"].size() > 8) {
      return absl::DataLossError(absl::StrCat(where, ": shape must be a list of at most 8 sizes"));
    }
    for (const json& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return absl::DataLossError(absl::StrCat(where, ": shape sizes must be integers >= 0"));
      }
      t.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(numel, d.get<uint64_t>(), &numel) ||
          numel > data_size / sizeof(float)) {
        return absl::DataLossError(absl::StrCat(where, ": shape holds more elements than the ",
                                                data_size, "-byte data section"));
      }
    }
    const json& offs = entry["data_offsets"];
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() ||
        !offs[1].is_number_unsigned()) {
      return absl::DataLossError(absl::StrCat(where, ": data_offsets must be two integers >= 0"));
    }
    const uint64_t begin = offs[0].get<uint64_t>(), end = offs[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return absl::DataLossError(absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                              ") outside the ", data_size, "-byte data section"));
    }
    if (end - begin != numel * sizeof(float)) {
      return absl::DataLossError(absl::StrCat(where, ": ", end - begin, " bytes for shape [",
                                              absl::StrJoin(t.shape, ","), "] of F32"));
    }
    ranges.emplace_back(begin, end);
    t.begin = 8 + header_len + begin;
    t.bytes = end - begin;
    out.tensors.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::DataLossError(absl::StrCat(path, ": tensor data ranges overlap"));
    }
  }
  return out;
}

absl::StatusOr<SafetensorsFile> ReadContent(int fd, const std::string& path) {
  auto header = ParseHeader(fd, path);
  if (!header.ok()) return header.status();
  SafetensorsFile out;
  out.metadata = std::move(header->metadata);
  for (auto& [name, e] : header->tensors) {
    Tensor t;
    t.shape = e.shape;
    t.data.resize(e.bytes / sizeof(float));
    if (!ReadAt(fd, t.data.data(), e.bytes, e.begin).ok()) {
      return absl::DataLossError(absl::StrCat(path, ": tensor data: short read"));
    }
    out.tensors.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace

absl::StatusOr<const Tensor*> CheckedTensor(const std::string& path, const SafetensorsFile& file,
                                            const std::string& name,
                                            const std::vector<int64_t>& shape) {
  auto it = file.tensors.find(name);
  if (it == file.tensors.end()) {
    return absl::NotFoundError(absl::StrCat(path, ": tensor ", name, " is missing"));
  }
  if (it->second.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor ", name, " has shape [", absl::StrJoin(it->second.shape, ","),
                     "], expected [", absl::StrJoin(shape, ","), "]"));
  }
  for (float x : it->second.data) {
    if (!std::isfinite(x)) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, " holds NaN or Inf"));
    }
  }
  return &it->second;
}

}  // namespace vp::runtime

namespace vp::runtime {

uint64_t TensorLayout::bytes() const {
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  return numel * sizeof(float);
}

absl::StatusOr<SafetensorsReader> OpenReader(safefs::UniqueFd fd, std::string path) {
  auto header = ParseHeader(fd.get(), path);
  if (!header.ok()) return header.status();
  SafetensorsReader r(std::move(fd), std::move(path));
  r.tensors_ = std::move(header->tensors);
  r.metadata_ = std::move(header->metadata);
  return r;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::Open(const std::string& path) {
  safefs::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  return OpenReader(std::move(fd), path);
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::OpenAt(const safefs::Dir& dir,
                                                            const std::string& name) {
  auto fd = dir.OpenFile(name, O_RDONLY);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) {
      return absl::NotFoundError(absl::StrCat(dir.PathOf(name), ": cannot open"));
    }
    return fd.status();
  }
  return OpenReader(std::move(*fd), dir.PathOf(name));
}

const TensorEntry* SafetensorsReader::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsReader::ReadBytes(const TensorEntry& e, uint64_t offset, uint64_t bytes,
                                          void* dst) const {
  if (offset > e.bytes || bytes > e.bytes - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": read past a tensor's data"));
  }
  if (!ReadAt(fd_.get(), dst, bytes, e.begin + offset).ok()) {
    return absl::DataLossError(absl::StrCat(path_, ": short read"));
  }
  return absl::OkStatus();
}

absl::Status SafetensorsReader::Read(const TensorEntry& e, uint64_t first, uint64_t count,
                                     float* dst) const {
  return ReadBytes(e, first * sizeof(float), count * sizeof(float), dst);
}

absl::Status SafetensorsReader::CheckFinite(const std::string& name, const TensorEntry& e,
                                            uint64_t first, uint64_t count) const {
  const uint64_t chunk = kCheckChunkBytes / sizeof(float);
  std::vector<float> buf(std::min<uint64_t>(count, chunk));
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min<uint64_t>(count - done, chunk);
    if (auto st = Read(e, first + done, n, buf.data()); !st.ok()) return st;
    for (uint64_t i = 0; i < n; ++i) {
      if (!std::isfinite(buf[i])) {
        return absl::DataLossError(absl::StrCat(path_, ": tensor ", name, " holds NaN or Inf"));
      }
    }
    done += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<const TensorEntry*> CheckedEntry(const SafetensorsReader& file,
                                                const std::string& name,
                                                const std::vector<int64_t>& shape) {
  const TensorEntry* e = file.Find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), ": tensor ", name, " is missing"));
  }
  if (e->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor ", name, " has shape [",
                                                   absl::StrJoin(e->shape, ","), "], expected [",
                                                   absl::StrJoin(shape, ","), "]"));
  }
  return e;
}

SafetensorsWriter::SafetensorsWriter(const safefs::Dir& dir, std::string name)
    : dir_(dir), name_(std::move(name)), tmp_(safefs::Dir::TempName(name_)) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_.valid() && !committed_) {
    fd_ = safefs::UniqueFd();
    dir_.Remove(tmp_).IgnoreError();
  }
}

absl::Status SafetensorsWriter::Begin(const std::vector<TensorLayout>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  if (fd_.valid()) return absl::FailedPreconditionError("SafetensorsWriter: Begin called twice");
  auto header = HeaderBytes(dir_.PathOf(name_), tensors, metadata);
  if (!header.ok()) return header.status();
  // A fresh temporary (O_EXCL): never written through a link.
  auto fd = dir_.OpenFile(tmp_, O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (!fd.ok()) return fd.status();
  fd_ = std::move(*fd);
  expected_ = 0;
  for (const TensorLayout& t : tensors) expected_ += t.bytes();
  return WriteAll(fd_.get(), header->data(), header->size(), dir_.PathOf(tmp_));
}

absl::Status SafetensorsWriter::Append(const void* data, size_t bytes) {
  if (!fd_.valid() || committed_) {
    return absl::FailedPreconditionError("SafetensorsWriter: Append outside Begin..Commit");
  }
  if (bytes > expected_ - written_) {
    return absl::InternalError(
        absl::StrCat(dir_.PathOf(name_), ": more data than the header's tensors hold"));
  }
  written_ += bytes;
  return WriteAll(fd_.get(), data, bytes, dir_.PathOf(tmp_));
}

absl::Status SafetensorsWriter::Commit() {
  if (!fd_.valid() || committed_) {
    return absl::FailedPreconditionError("SafetensorsWriter: Commit without Begin");
  }
  if (written_ != expected_) {
    return absl::InternalError(absl::StrCat(dir_.PathOf(name_), ": ", written_,
                                            " data bytes written, the header lists ", expected_));
  }
  if (::fsync(fd_.get()) != 0) {
    return absl::InternalError(absl::StrCat(dir_.PathOf(tmp_), ": fsync failed"));
  }
  fd_ = safefs::UniqueFd();
  if (auto st = dir_.Rename(tmp_, name_); !st.ok()) {
    dir_.Remove(tmp_).IgnoreError();
    return st;
  }
  committed_ = true;
  return absl::OkStatus();
}

}  // namespace vp::runtime
