// Element-wise ops: GELU (tanh approximation, as GPT-2), residual add, scaling.
#pragma once

#include <cmath>
#include <cstdint>

#include "framework/kernels/fast_math.h"
#include "framework/philox.h"

namespace keel::kernels {

// Shared per-element math (host and device). float uses the vectorisable fast_tanhf; double
// (gradient checks) uses libm.
KEEL_HD inline float tanh_t(float x) { return fast_tanhf(x); }
KEEL_HD inline double tanh_t(double x) { return std::tanh(x); }

template <typename T>
KEEL_HD inline T gelu_scalar(T x) {
  const T k = T(0.7978845608028654);  // sqrt(2 / pi)
  return T(0.5) * x * (T(1) + tanh_t(k * (x + T(0.044715) * x * x * x)));
}
template <typename T>
KEEL_HD inline T gelu_grad_scalar(T x) {
  const T k = T(0.7978845608028654);
  const T u = k * (x + T(0.044715) * x * x * x);
  const T th = tanh_t(u);
  const T sech2 = T(1) - th * th;
  return T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * k * (T(1) + T(3 * 0.044715) * x * x);
}

// out[n] = gelu(inp[n]) (=)
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
// dinp[n] = dout[n] * gelu'(inp[n]) (=)
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);
// out[n] = a[n] + b[n] (=)
template <typename T>
void add(T* out, const T* a, const T* b, int64_t n);
// y[n] += x[n]
template <typename T>
void add_inplace(T* y, const T* x, int64_t n);

// Sum of squares with a fixed chunking, so the result is bitwise independent of thread count.
template <typename T>
double sum_squares(const T* x, int64_t n);

}  // namespace keel::kernels
