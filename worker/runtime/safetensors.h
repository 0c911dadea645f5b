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

}  // namespace vp::runtime
