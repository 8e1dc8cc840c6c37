// CPU gated linear units (OpenMP + SIMD over elements). See glu.h.
#include "framework/kernels/glu.h"

namespace keel::kernels {

namespace {

// The activation is a template parameter so each loop body is branch-free and vectorises.
template <typename T, GluAct A>
KEEL_HD inline T act(T x) {
  if constexpr (A == GluAct::kSilu) {
    return silu_scalar<T>(x);
  } else {
    return gelu_scalar<T>(x);
  }
}
template <typename T, GluAct A>
KEEL_HD inline T act_grad(T x) {
  if constexpr (A == GluAct::kSilu) {
    return silu_grad_scalar<T>(x);
  } else {
    return gelu_grad_scalar<T>(x);
  }
}

template <typename T, GluAct A>
void forward_impl(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = act<T, A>(gate[i]) * up[i];
}

template <typename T, GluAct A>
void backward_impl(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // Every input of element i is read before dup[i] (which may be dout[i]) is written.
    const T g = gate[i], u = up[i], d = dout[i];
    dgate[i] = d * u * act_grad<T, A>(g);
    dup[i] = d * act<T, A>(g);
  }
}

}  // namespace

template <typename T>
void glu_forward(GluAct a, T* out, const T* gate, const T* up, int64_t n) {
  if (a == GluAct::kSilu) {
    forward_impl<T, GluAct::kSilu>(out, gate, up, n);
  } else {
    forward_impl<T, GluAct::kGelu>(out, gate, up, n);
  }
}

template <typename T>
void glu_backward(GluAct a, T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                  int64_t n) {
  if (a == GluAct::kSilu) {
    backward_impl<T, GluAct::kSilu>(dgate, dup, dout, gate, up, n);
  } else {
    backward_impl<T, GluAct::kGelu>(dgate, dup, dout, gate, up, n);
  }
}

#define KEEL_INSTANTIATE(T)                                              \
  template void glu_forward<T>(GluAct, T*, const T*, const T*, int64_t); \
  template void glu_backward<T>(GluAct, T*, T*, const T*, const T*, const T*, int64_t);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
