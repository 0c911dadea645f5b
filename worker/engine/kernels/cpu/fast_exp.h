// exp, tanh and sigmoid without a libm call, so the elementwise loops that use them vectorize
// (the transformer's GELU and attention softmax, SwiGLU, the output layer's softmax). A call to
// expf keeps a loop scalar: at h = 256 the GELU and softmax exps were ~10% of a layer's time.
//
// Every function is a pure function of its argument, evaluated the same way in a vector lane and
// in the scalar tail, so results do not depend on the thread count or on how a loop vectorizes.
// Files whose loops must vectorize compile with VP_VECTOR_LOOP_OPTIONS (worker/engine/
// CMakeLists.txt: -O3 -fno-trapping-math -ffp-contract=off, and why).
#pragma once

#include <bit>
#include <cstdint>

namespace vp::engine::cpu {

// exp(x) for x <= 0: the reduction x = k·ln2 + r, |r| <= ln2/2 (ln2 split in a high part exact
// in float and a low part), then Cephes' degree-6 polynomial for exp(r); relative error ~2e-7
// (float rounding). Inputs below -87, where exp underflows, return ~1e-38 rather than 0: every
// caller adds the result to something >= 1 or multiplies it by a bounded value.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  // k = round(x·log2 e) (x <= 0: truncating t − 0.5 rounds to nearest), |r| <= ~ln2/2.
  const int32_t ki = static_cast<int32_t>(x * 1.44269504088896341f - 0.5f);
  const float k = static_cast<float>(ki);
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (ki + 127) << 23;  // 2^k, k in [-126, 0]
  return y * std::bit_cast<float>(bits);
}

// tanh(u) = sign(u)·(1 − e)/(1 + e) with e = exp(−2|u|) <= 1: one exp of a non-positive
// argument, exact at the extremes (e underflows to ~1e-38: ±1) and within ~1 ulp of 1 near 0,
// far below what GELU's 0.5·x·(1 + tanh) can see.
inline float Tanh(float u) {
  const float a = u < 0.0f ? -u : u;
  const float e = ExpNonPositive(-2.0f * a);
  const float t = (1.0f - e) / (1.0f + e);
  return u < 0.0f ? -t : t;
}

// sigmoid(g) = 1/(1 + exp(−g)), through e = exp(−|g|) <= 1 so the exp never overflows:
// 1/(1 + e) for g >= 0, e/(1 + e) for g < 0.
inline float Sigmoid(float g) {
  const float e = ExpNonPositive(g < 0.0f ? g : -g);
  const float inv = 1.0f / (1.0f + e);
  return g < 0.0f ? e * inv : inv;
}

}  // namespace vp::engine::cpu
