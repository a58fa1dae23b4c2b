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
// with -fno-trapping-math, which the build passes (paged_attention.compiler_flags).
inline float fast_exp(float x) {
  x = std::max(x, -87.33654f);
  x = std::min(x, 88.72283f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

}  // namespace raydecode
