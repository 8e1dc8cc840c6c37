// CPU rotary position embedding (OpenMP over rows). See rope.h, Note [rope-convention].
#include "framework/kernels/rope.h"

#include <cmath>

#include "framework/error.h"

namespace keel::kernels {

RopeTable make_rope_table(int64_t max_positions, int64_t head_dim, double theta) {
  KEEL_CHECK(max_positions > 0, kUsage, "rope: max_positions must be positive, got ",
             max_positions);
  KEEL_CHECK(head_dim > 0 && head_dim % 2 == 0, kUsage,
             "rope: head_dim must be positive and even, got ", head_dim);
  KEEL_CHECK(theta > 0.0, kUsage, "rope: theta must be positive, got ", theta);
  RopeTable table;
  table.max_positions = max_positions;
  table.half_dim = head_dim / 2;
  const size_t n = static_cast<size_t>(max_positions * table.half_dim);
  table.cos.resize(n);
  table.sin.resize(n);
  for (int64_t i = 0; i < table.half_dim; ++i) {
    const double inv_freq =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    for (int64_t p = 0; p < max_positions; ++p) {
      const double angle = static_cast<double>(p) * inv_freq;
      table.cos[p * table.half_dim + i] = static_cast<float>(std::cos(angle));
      table.sin[p * table.half_dim + i] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

namespace {

// sign = +1: forward rotation; sign = -1: its transpose (backward).
template <typename Real>
void rope_apply(const RopeTable& table, Real* out, const Real* in, int64_t B, int64_t T, int64_t H,
                int64_t D, int64_t row_stride, int64_t pos_offset, Real sign) {
  const int64_t half = table.half_dim;
  KEEL_CHECK(D == 2 * half, kUsage, "rope: head_dim ", D, " does not match the table's ", 2 * half);
  KEEL_CHECK(B >= 0 && T >= 0 && H >= 0, kUsage, "rope: negative shape B=", B, " T=", T, " H=", H);
  KEEL_CHECK(row_stride >= H * D, kUsage, "rope: row_stride ", row_stride, " < H * D = ", H * D);
  KEEL_CHECK(pos_offset >= 0 && pos_offset + T <= table.max_positions, kUsage, "rope: positions [",
             pos_offset, ", ", pos_offset + T, ") exceed the table's ", table.max_positions);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < B * T; ++r) {
    const int64_t p = r % T + pos_offset;
    const float* c = table.cos.data() + p * half;
    const float* s = table.sin.data() + p * half;
    const Real* x = in + r * row_stride;
    Real* y = out + r * row_stride;
    for (int64_t h = 0; h < H; ++h) {
      const Real* xh = x + h * D;
      Real* yh = y + h * D;
      // Each pair is read before either of its outputs is written, so out == in is safe.
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const Real x1 = xh[i], x2 = xh[i + half];
        const Real ci = static_cast<Real>(c[i]), si = sign * static_cast<Real>(s[i]);
        yh[i] = x1 * ci - x2 * si;
        yh[i + half] = x2 * ci + x1 * si;
      }
    }
  }
}

}  // namespace

template <typename Real>
void rope_forward(const RopeTable& table, Real* y, const Real* x, int64_t B, int64_t T, int64_t H,
                  int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_apply<Real>(table, y, x, B, T, H, D, row_stride, pos_offset, Real(1));
}

template <typename Real>
void rope_backward(const RopeTable& table, Real* dx, const Real* dy, int64_t B, int64_t T,
                   int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_apply<Real>(table, dx, dy, B, T, H, D, row_stride, pos_offset, Real(-1));
}

#define KEEL_INSTANTIATE(Real)                                                              \
  template void rope_forward<Real>(const RopeTable&, Real*, const Real*, int64_t, int64_t,  \
                                   int64_t, int64_t, int64_t, int64_t);                     \
  template void rope_backward<Real>(const RopeTable&, Real*, const Real*, int64_t, int64_t, \
                                    int64_t, int64_t, int64_t, int64_t);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
