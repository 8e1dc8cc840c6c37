// CPU element-wise kernels (OpenMP).
#include "framework/kernels/elementwise.h"

#include <algorithm>
#include <vector>

namespace keel::kernels {

template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_scalar<T>(inp[i]);
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * gelu_grad_scalar<T>(inp[i]);
}

template <typename T>
void add(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void add_inplace(T* y, const T* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
double sum_squares(const T* x, int64_t n) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i1 = std::min(n, (c + 1) * kChunk);
    double acc = 0.0;
    for (int64_t i = c * kChunk; i < i1; ++i) acc += static_cast<double>(x[i]) * x[i];
    partial[c] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

#define KEEL_INSTANTIATE(T)                                        \
  template void gelu_forward<T>(T*, const T*, int64_t);            \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t); \
  template void add<T>(T*, const T*, const T*, int64_t);           \
  template void add_inplace<T>(T*, const T*, int64_t);             \
  template double sum_squares<T>(const T*, int64_t);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
