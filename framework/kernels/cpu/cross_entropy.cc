// CPU cross-entropy + z-loss phases (see framework/kernels/cross_entropy.h). Rows are independent
// and parallel over OpenMP; each row's sum-exp is a SIMD reduction in T (float: relative error
// ~1e-7 x sqrt(V), far inside the parity test's 1e-5).
#include "framework/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "framework/kernels/fast_math.h"

namespace keel::kernels {

template <typename T>
void xent_row_max(const T* logits, int64_t N, int64_t V_local, int64_t v_valid_local, T* row_max) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * V_local;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t v = 0; v < v_valid_local; ++v) mx = std::max(mx, row[v]);
    row_max[n] = mx;
  }
}

template <typename T>
void xent_row_sumexp(const T* logits, const T* row_max, int64_t N, int64_t V_local,
                     int64_t v_valid_local, T* sumexp) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * V_local;
    const T mx = row_max[n];
    T acc = T(0);
#pragma omp simd reduction(+ : acc)
    for (int64_t v = 0; v < v_valid_local; ++v) acc += exp_t(row[v] - mx);
    sumexp[n] = acc;
  }
}

template <typename T>
void xent_target_logit(const T* logits, const int32_t* targets, int64_t N, int64_t V_local,
                       int64_t v_begin, T* target_logit) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t col = static_cast<int64_t>(targets[n]) - v_begin;
    target_logit[n] = (col >= 0 && col < V_local) ? logits[n * V_local + col] : T(0);
  }
}

template <typename T>
void xent_finish(const T* row_max, const T* sumexp, const T* target_logit, int64_t N, T* lse,
                 double sums[3]) {
  // Serial on purpose: the three double sums keep one order (n ascending) whatever the thread
  // count, and N log calls are negligible next to the sum-exp over the vocabulary.
  double ce = 0.0, z = 0.0, lz = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    const double l = xent_row_lse(row_max[n], sumexp[n]);
    lse[n] = static_cast<T>(l);  // after sumexp[n] is read: lse may alias sumexp
    ce += l - static_cast<double>(target_logit[n]);
    z += l * l;
    lz += l;
  }
  sums[0] = ce;
  sums[1] = z;
  sums[2] = lz;
}

template <typename T>
void xent_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t N,
                   int64_t V_local, int64_t v_valid_local, int64_t v_begin, T grad_scale,
                   T z_coef) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * V_local;
    T* drow = dlogits + n * V_local;
    const T l = lse[n];
    const T coef = grad_scale * (T(1) + T(2) * z_coef * l);
#pragma omp simd
    for (int64_t v = 0; v < v_valid_local; ++v) drow[v] = coef * exp_t(row[v] - l);
    for (int64_t v = v_valid_local; v < V_local; ++v) drow[v] = T(0);
    const int64_t col = static_cast<int64_t>(targets[n]) - v_begin;
    if (col >= 0 && col < V_local) drow[col] -= grad_scale;
  }
}

#define KEEL_INSTANTIATE(T)                                                                    \
  template void xent_row_max<T>(const T*, int64_t, int64_t, int64_t, T*);                      \
  template void xent_row_sumexp<T>(const T*, const T*, int64_t, int64_t, int64_t, T*);         \
  template void xent_target_logit<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, T*); \
  template void xent_finish<T>(const T*, const T*, const T*, int64_t, T*, double*);            \
  template void xent_backward<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t,     \
                                 int64_t, int64_t, T, T);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
