// safetensors files (the Hugging Face format): an 8-byte little-endian header length, a JSON
// header naming each tensor's dtype, shape and byte range, then the raw little-endian data.
// vocabpipe writes F32 tensors only; the reader validates everything it is handed, since a
// checkpoint is external input (truncated files, overlapping ranges, bad shapes are errors).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/safefs/dir.h"

namespace vp::runtime {

struct TensorView {
  std::string name;
  std::vector<int64_t> shape;   // row-major
  const float* data = nullptr;  // product(shape) floats
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t numel() const;
};

// Writes atomically: to a fresh `path.tmp` (never through a link), fsync, then rename over
// `path`.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// The same inside a run folder: `name` in `dir`, never through a link (safefs/dir.h). The
// write goes to a fresh temporary (O_EXCL), is fsynced and renamed over `name`.
absl::Status WriteSafetensorsAt(const safefs::Dir& dir, const std::string& name,
                                const std::vector<TensorView>& tensors,
                                const std::map<std::string, std::string>& metadata = {});
absl::StatusOr<SafetensorsFile> ReadSafetensorsAt(const safefs::Dir& dir, const std::string& name);

// The tensor `name` of a file read from `path`, checked for loading into a model: present,
// of exactly `shape`, every value finite. Errors name the file and the tensor.
absl::StatusOr<const Tensor*> CheckedTensor(const std::string& path, const SafetensorsFile& file,
                                            const std::string& name,
                                            const std::vector<int64_t>& shape);

// Streaming access, for files larger than the memory one should spend on them.
//
// One tensor of a file as its header describes it: shape and the absolute byte range of its data.
struct TensorEntry {
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // file offset of the first byte
  uint64_t bytes = 0;  // 4 · numel (F32)
  int64_t numel() const { return static_cast<int64_t>(bytes / sizeof(float)); }
};

// A safetensors file opened for reading in pieces: the header is read and validated exactly as
// ReadSafetensors validates it (same rules, same errors); the data stays on disk and is read by
// pread into the caller's memory. The file stays open (by handle) as long as the reader lives.
class SafetensorsReader {
 public:
  static absl::StatusOr<SafetensorsReader> Open(const std::string& path);
  // `name` in `dir`, never through a link (safefs/dir.h).
  static absl::StatusOr<SafetensorsReader> OpenAt(const safefs::Dir& dir, const std::string& name);

  SafetensorsReader(SafetensorsReader&&) noexcept = default;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept = default;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorEntry* Find(const std::string& name) const;

  // Floats [first, first + count) of `e` into dst (which holds count floats).
  absl::Status Read(const TensorEntry& e, uint64_t first, uint64_t count, float* dst) const;
  // Raw bytes [offset, offset + bytes) of `e`'s data into dst.
  absl::Status ReadBytes(const TensorEntry& e, uint64_t offset, uint64_t bytes, void* dst) const;
  // Every float of [first, first + count) of `e` is finite; read in bounded chunks (at most
  // kCheckChunkBytes resident). DataLoss "PATH: tensor NAME holds NaN or Inf" otherwise.
  absl::Status CheckFinite(const std::string& name, const TensorEntry& e, uint64_t first,
                           uint64_t count) const;
  static constexpr size_t kCheckChunkBytes = 8 << 20;

 private:
  SafetensorsReader(safefs::UniqueFd fd, std::string path)
      : fd_(std::move(fd)), path_(std::move(path)) {}
  safefs::UniqueFd fd_;
  std::string path_;
  std::map<std::string, TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
  friend absl::StatusOr<SafetensorsReader> OpenReader(safefs::UniqueFd fd, std::string path);
};

// The entry `name` of `file`, checked for loading like CheckedTensor (present, exactly `shape`)
// except for the values, which the caller checks on the part it reads (CheckFinite).
absl::StatusOr<const TensorEntry*> CheckedEntry(const SafetensorsReader& file,
                                                const std::string& name,
                                                const std::vector<int64_t>& shape);

// A tensor of a file to be written: its name and shape (F32).
struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t bytes() const;
};

// Writes a safetensors file whose data arrives in pieces: Begin writes the header (the same
// bytes WriteSafetensorsAt writes for the same tensors, in the same order, and metadata), Append
// the data section in order, Commit checks that exactly the header's bytes came, fsyncs and
// renames the temporary over `name`. A writer destroyed before Commit removes its temporary.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const safefs::Dir& dir, std::string name);
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  absl::Status Begin(const std::vector<TensorLayout>& tensors,
                     const std::map<std::string, std::string>& metadata = {});
  absl::Status Append(const void* data, size_t bytes);
  absl::Status Commit();

 private:
  const safefs::Dir& dir_;
  std::string name_, tmp_;
  safefs::UniqueFd fd_;
  uint64_t expected_ = 0, written_ = 0;
  bool committed_ = false;
};

}  // namespace vp::runtime
