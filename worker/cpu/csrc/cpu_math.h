// Scalar math shared by the CPU kernels (paged_attention.cpp, layer_ops.cpp).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace raydecode {

// exp (the softmax's, SiLU's), written so the compiler vectorizes loops over it: Cody-Waite
// range reduction and a degree-6 polynomial (relative error below 2e-7 over the float
// range; exp(-inf) = 0). GCC only vectorizes the clamps (and so any loop calling this)
// with -fno-trapping-math, which the build passes (worker/cpu/kernels.py: compiler_flags).
// Its constants, shared with the vector versions (paged_attention.cpp: exp8, exp16).
namespace exp_const {
constexpr float kMin = -87.33654f, kMax = 88.72283f;  // the clamp
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = hi + lo
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;  // highest degree first
}  // namespace exp_const

inline float fast_exp(float x) {
  using namespace exp_const;
  x = std::max(x, kMin);
  x = std::min(x, kMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// bfloat16 <-> float written out as bit operations (the same results as c10's
// conversions: round to nearest even, NaN to the quiet NaN 0x7FC0) so loops over them
// vectorize: c10's float-to-bf16 branches on isnan and its conversions are opaque
// calls to the vectorizer, which left every bf16 loop in these kernels scalar (and far
// slower than its float32 twin).
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float v);

template <>
inline float from_float<float>(float v) {
  return v;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = v != v ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

}  // namespace raydecode
