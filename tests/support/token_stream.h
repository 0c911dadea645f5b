// The token stream the PyTorch references (tests/e2e/reference/*.py) read: an llm.c version-1
// token file, written here byte by byte so the tests stay independent of the data module's
// writer, and the order in which a run cuts it into microbatches (reference_io.py's batch()).
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/runtime/trainer.h"

namespace vp::testing {

// A 1024-byte header (magic 20240520, version 1, token count) and the uint16 tokens.
inline void WriteUint16TokenFile(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
}

// Microbatch j of step `step` with b sequences of s tokens out of m per step: sequence t is
// sample k = (step·m + j)·b + t, tokens [k·s, k·s + s] of the stream (wrapping around), the
// last s of them the targets.
inline runtime::BatchFn StreamBatches(std::vector<uint16_t> tokens, int b, int m, int s) {
  auto stream = std::make_shared<const std::vector<uint16_t>>(std::move(tokens));
  return [stream, b, m, s](int64_t step, int j, int32_t* inputs, int32_t* targets) {
    const std::vector<uint16_t>& t = *stream;
    for (int r = 0; r < b; ++r) {
      const int64_t k = (step * m + j) * b + r;
      for (int i = 0; i < s; ++i) {
        inputs[r * s + i] = t[(k * s + i) % t.size()];
        targets[r * s + i] = t[(k * s + i + 1) % t.size()];
      }
    }
    return absl::OkStatus();
  };
}

}  // namespace vp::testing
