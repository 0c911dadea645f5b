#include "worker/engine/init.h"

#include <cmath>
#include <numbers>

namespace vp::engine {
namespace {

// splitmix64's output function: a bijective 64-bit mixer with full avalanche.
constexpr uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

}  // namespace

uint64_t TensorId(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a offset basis
  for (const char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ULL;  // FNV prime
  }
  return Mix64(h);
}

void InitNormal(float* dst, size_t count, float stddev, uint64_t seed, uint64_t tensor_id,
                uint64_t first_index) {
  // The stream key depends on both seed and tensor; each element then hashes its own counter,
  // so no state is carried from one element to the next (slice independence).
  const uint64_t key = Mix64(Mix64(seed + kGolden) ^ tensor_id);
  for (size_t j = 0; j < count; ++j) {
    const uint64_t bits = Mix64(key + (first_index + j) * kGolden);
    // Two 32-bit uniforms; u1 in (0, 1] so log(u1) is finite.
    const double u1 = (static_cast<double>(bits >> 32) + 1.0) * 0x1p-32;
    const double u2 = static_cast<double>(bits & 0xffffffffULL) * 0x1p-32;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    dst[j] = static_cast<float>(stddev * z);
  }
}

void InitConstant(float* dst, size_t count, float value) {
  for (size_t j = 0; j < count; ++j) dst[j] = value;
}

}  // namespace vp::engine
