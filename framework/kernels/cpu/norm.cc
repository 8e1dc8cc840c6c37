// CPU LayerNorm / RMSNorm / L2 over grouped, strided rows (see framework/kernels/norm.h).
// Row math runs in T with SIMD reductions; parameter gradients are summed per channel block in
// a fixed order so results do not depend on the thread count.
#include "framework/kernels/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace keel::kernels {

namespace {
// Parameter gradients: partition the gain index space into channel blocks; each block is owned
// by one thread and summed over rows (and over groups when the gain is shared).
template <typename T>
void norm_param_grads(NormOp op, const NormShape& s, T* dweight, T* dbias, const T* dout,
                      const T* inp, const T* mean, const T* rstd) {
  if (!dweight && !dbias) return;
  const bool shared = s.w_group_stride == 0;
  const int64_t wsize = shared ? s.Cg : s.G * s.Cg;
  constexpr int64_t kBlock = 32;
  const int64_t nblocks = (wsize + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t w0 = blk * kBlock, w1 = std::min(wsize, w0 + kBlock);
    T accw[kBlock] = {}, accb[kBlock] = {};
    const int64_t g_begin = shared ? 0 : w0 / s.Cg;
    const int64_t g_end = shared ? s.G : (w1 - 1) / s.Cg + 1;
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t g = g_begin; g < g_end; ++g) {
        const int64_t r = n * s.G + g;
        const T mu = op == NormOp::kLayer ? mean[r] : T(0);
        const T rs = rstd[r];
        const T* x = inp + n * s.ld_in + g * s.Cg;
        const T* dy = dout + n * s.ld_out + g * s.Cg;
        const int64_t base = shared ? 0 : g * s.Cg;  // gain index of channel 0 of this group
        const int64_t c0 = std::max<int64_t>(w0 - base, 0);
        const int64_t c1 = std::min<int64_t>(w1 - base, s.Cg);
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t wi = base + c - w0;
          accw[wi] += dy[c] * ((x[c] - mu) * rs);
          accb[wi] += dy[c];
        }
      }
    }
    for (int64_t i = w0; i < w1; ++i) {
      if (dweight) dweight[i] += accw[i - w0];
      if (dbias) dbias[i] += accb[i - w0];
    }
  }
}

}  // namespace

template <typename T>
void norm_forward(NormOp op, const NormShape& s, T* out, const T* inp, const T* weight,
                  const T* bias, T* mean, T* rstd, T eps) {
  const int64_t rows = s.N * s.G;
  const int64_t Cg = s.Cg;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r / s.G, g = r % s.G;
    const T* x = inp + n * s.ld_in + g * Cg;
    T* y = out + n * s.ld_out + g * Cg;
    const T* w = weight ? weight + g * s.w_group_stride : nullptr;
    const T* b = bias ? bias + g * s.w_group_stride : nullptr;
    T mu = T(0);
    if (op == NormOp::kLayer) {
#pragma omp simd reduction(+ : mu)
      for (int64_t c = 0; c < Cg; ++c) mu += x[c];
      mu /= static_cast<T>(Cg);
    }
    T ss = T(0);
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < Cg; ++c) ss += (x[c] - mu) * (x[c] - mu);
    const T denom = op == NormOp::kL2 ? ss : ss / static_cast<T>(Cg);
    const T rs = T(1) / std::sqrt(denom + eps);
    if (w && b) {
#pragma omp simd
      for (int64_t c = 0; c < Cg; ++c) y[c] = (x[c] - mu) * rs * w[c] + b[c];
    } else if (w) {
#pragma omp simd
      for (int64_t c = 0; c < Cg; ++c) y[c] = (x[c] - mu) * rs * w[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < Cg; ++c) y[c] = (x[c] - mu) * rs;
    }
    if (mean) mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T>
void norm_backward(NormOp op, const NormShape& s, T* dinp, bool accumulate, T* dweight, T* dbias,
                   const T* dout, const T* inp, const T* weight, const T* mean, const T* rstd) {
  const int64_t rows = s.N * s.G;
  const int64_t Cg = s.Cg;
  const T inv_c = T(1) / static_cast<T>(Cg);
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = r / s.G, g = r % s.G;
      const T* x = inp + n * s.ld_in + g * Cg;
      const T* dy = dout + n * s.ld_out + g * Cg;
      T* dx = dinp + n * s.ld_in + g * Cg;
      const T* w = weight ? weight + g * s.w_group_stride : nullptr;
      const T mu = op == NormOp::kLayer ? mean[r] : T(0);
      const T rs = rstd[r];
      // dn = dy * w ; xhat = (x - mu) * rs
      T sum_dn = T(0), sum_dn_xhat = T(0);
#pragma omp simd reduction(+ : sum_dn, sum_dn_xhat)
      for (int64_t c = 0; c < Cg; ++c) {
        const T dn = w ? dy[c] * w[c] : dy[c];
        sum_dn += dn;
        sum_dn_xhat += dn * ((x[c] - mu) * rs);
      }
      // LayerNorm: dx = rs (dn - mean(dn) - xhat mean(dn xhat)); RMS: no mean(dn) term;
      // L2: the statistics are sums, not means.
      const T a = op == NormOp::kLayer ? sum_dn * inv_c : T(0);
      const T bcoef = op == NormOp::kL2 ? sum_dn_xhat : sum_dn_xhat * inv_c;
      if (accumulate) {
#pragma omp simd
        for (int64_t c = 0; c < Cg; ++c) {
          const T dn = w ? dy[c] * w[c] : dy[c];
          dx[c] += rs * (dn - a - (x[c] - mu) * rs * bcoef);
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < Cg; ++c) {
          const T dn = w ? dy[c] * w[c] : dy[c];
          dx[c] = rs * (dn - a - (x[c] - mu) * rs * bcoef);
        }
      }
    }
  }
  norm_param_grads(op, s, dweight, dbias, dout, inp, mean, rstd);
}

template <typename T>
void norm_partial_stats(const NormShape& s, const T* inp, T* stats) {
  const int64_t rows = s.N * s.G;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = inp + (r / s.G) * s.ld_in + (r % s.G) * s.Cg;
    T sum = T(0), sumsq = T(0);
#pragma omp simd reduction(+ : sum, sumsq)
    for (int64_t c = 0; c < s.Cg; ++c) {
      sum += x[c];
      sumsq += x[c] * x[c];
    }
    stats[2 * r] = sum;
    stats[2 * r + 1] = sumsq;
  }
}

template <typename T>
void norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total, const T* stats,
                             T* out, const T* inp, const T* weight, const T* bias, T* mean, T* rstd,
                             T eps) {
  const int64_t rows = s.N * s.G;
  const double inv_n = 1.0 / static_cast<double>(Cg_total);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r / s.G, g = r % s.G;
    const T* x = inp + n * s.ld_in + g * s.Cg;
    T* y = out + n * s.ld_out + g * s.Cg;
    const T* w = weight ? weight + g * s.w_group_stride : nullptr;
    const T* b = bias ? bias + g * s.w_group_stride : nullptr;
    const double m = op == NormOp::kLayer ? stats[2 * r] * inv_n : 0.0;
    const double ex2 = stats[2 * r + 1] * inv_n;
    double denom = op == NormOp::kL2 ? static_cast<double>(stats[2 * r + 1]) : ex2 - m * m;
    denom = std::max(denom, 0.0);
    const T rs = static_cast<T>(1.0 / std::sqrt(denom + static_cast<double>(eps)));
    const T mu = static_cast<T>(m);
    for (int64_t c = 0; c < s.Cg; ++c) {
      T v = (x[c] - mu) * rs;
      if (w) v *= w[c];
      if (b) v += b[c];
      y[c] = v;
    }
    if (mean) mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T>
void norm_backward_partials(const NormShape& s, const T* dout, const T* inp, const T* weight,
                            const T* mean, const T* rstd, T* part) {
  const int64_t rows = s.N * s.G;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = r / s.G, g = r % s.G;
    const T* x = inp + n * s.ld_in + g * s.Cg;
    const T* dy = dout + n * s.ld_out + g * s.Cg;
    const T* w = weight ? weight + g * s.w_group_stride : nullptr;
    const T mu = mean ? mean[r] : T(0);
    const T rs = rstd[r];
    T sum_dn = T(0), sum_dn_xhat = T(0);
#pragma omp simd reduction(+ : sum_dn, sum_dn_xhat)
    for (int64_t c = 0; c < s.Cg; ++c) {
      const T dn = w ? dy[c] * w[c] : dy[c];
      sum_dn += dn;
      sum_dn_xhat += dn * ((x[c] - mu) * rs);
    }
    part[2 * r] = sum_dn;
    part[2 * r + 1] = sum_dn_xhat;
  }
}

template <typename T>
void norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total, const T* part,
                                 T* dinp, bool accumulate, T* dweight, T* dbias, const T* dout,
                                 const T* inp, const T* weight, const T* mean, const T* rstd) {
  const int64_t rows = s.N * s.G;
  const T inv_c = T(1) / static_cast<T>(Cg_total);
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = r / s.G, g = r % s.G;
      const T* x = inp + n * s.ld_in + g * s.Cg;
      const T* dy = dout + n * s.ld_out + g * s.Cg;
      T* dx = dinp + n * s.ld_in + g * s.Cg;
      const T* w = weight ? weight + g * s.w_group_stride : nullptr;
      const T mu = op == NormOp::kLayer ? mean[r] : T(0);
      const T rs = rstd[r];
      const T a = op == NormOp::kLayer ? part[2 * r] * inv_c : T(0);
      const T bcoef = op == NormOp::kL2 ? part[2 * r + 1] : part[2 * r + 1] * inv_c;
      for (int64_t c = 0; c < s.Cg; ++c) {
        const T dn = w ? dy[c] * w[c] : dy[c];
        const T gi = rs * (dn - a - (x[c] - mu) * rs * bcoef);
        dx[c] = accumulate ? dx[c] + gi : gi;
      }
    }
  }
  norm_param_grads(op, s, dweight, dbias, dout, inp, mean, rstd);
}

#define KEEL_INSTANTIATE(T)                                                                      \
  template void norm_forward<T>(NormOp, const NormShape&, T*, const T*, const T*, const T*, T*,  \
                                T*, T);                                                          \
  template void norm_backward<T>(NormOp, const NormShape&, T*, bool, T*, T*, const T*, const T*, \
                                 const T*, const T*, const T*);                                  \
  template void norm_partial_stats<T>(const NormShape&, const T*, T*);                           \
  template void norm_forward_from_stats<T>(NormOp, const NormShape&, int64_t, const T*, T*,      \
                                           const T*, const T*, const T*, T*, T*, T);             \
  template void norm_backward_partials<T>(const NormShape&, const T*, const T*, const T*,        \
                                          const T*, const T*, T*);                               \
  template void norm_backward_from_partials<T>(NormOp, const NormShape&, int64_t, const T*, T*,  \
                                               bool, T*, T*, const T*, const T*, const T*,       \
                                               const T*, const T*);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
