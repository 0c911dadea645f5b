// Deterministic, slice-independent parameter initialisation.
//
// Element i of a named tensor is a pure function of (seed, tensor id, i): a counter-based
// generator (splitmix64 finaliser over the key) feeds Box–Muller. A rank that owns rows
// [r0, r1) of a vocabulary shard, or the layers of one pipeline stage, therefore draws exactly
// the values the 1-rank model has there, so a p-rank run can be compared with the 1-rank run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace vp::engine {

// A stable 64-bit hash of a tensor's Hugging Face name (e.g. "transformer.h.3.attn.c_proj.weight").
// FNV-1a followed by a splitmix64 finaliser; identical on every platform and run.
uint64_t TensorId(std::string_view name);

// dst[j] = stddev * N(0,1) sample number (first_index + j) of tensor `tensor_id` under `seed`,
// for j in [0, count).
void InitNormal(float* dst,  // (count)
                size_t count, float stddev, uint64_t seed, uint64_t tensor_id,
                uint64_t first_index);

// dst[j] = value for j in [0, count) (LayerNorm weights 1, biases 0).
void InitConstant(float* dst, size_t count, float value);

}  // namespace vp::engine
