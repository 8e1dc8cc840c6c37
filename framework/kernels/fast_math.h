// Vectorisable float approximations of exp and tanh for the element-wise kernels (libm's scalar
// tanhf made GELU the most expensive op of a training step; see docs/performance.md).
// Accuracy: fast_expf relative error < 2e-7 on [-87, 88]; fast_tanhf absolute error < 2e-7.
// Shared by the CPU and CUDA backends (__host__ __device__).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "framework/philox.h"  // KEEL_HD

namespace keel::kernels {

KEEL_HD inline float fast_expf(float x) {
  // Value selects, not std::min/max on references, so GCC if-converts and vectorises the loop
  // (with -fno-trapping-math; see CMakeLists.txt).
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // x = n ln2 + r, |r| <= ln2 / 2; n rounded by the 1.5 * 2^23 trick (no floorf call)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;  // Cody-Waite split of ln2
  r = r - n * -2.12194440e-4f;
  // exp(r) by its degree-6 Taylor polynomial (Horner); truncation error < 1.3e-7 for |r| < 0.35
  float p = 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // scale by 2^n through the exponent bits
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// tanh(x) = (e - 1) / (e + 1), e = exp(2x), x clamped to [-9, 9] (tanh(9) = 1 - 3e-8).
KEEL_HD inline float fast_tanhf(float x) {
  float a = x < -9.0f ? -9.0f : x;
  a = a > 9.0f ? 9.0f : a;
  const float e = fast_expf(2.0f * a);
  return (e - 1.0f) / (e + 1.0f);
}

// Type-dispatched exp for templated kernels: the fast path for float, libm for double.
KEEL_HD inline float exp_t(float x) { return fast_expf(x); }
KEEL_HD inline double exp_t(double x) { return std::exp(x); }
}  // namespace keel::kernels
