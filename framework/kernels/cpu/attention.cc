// CPU causal attention. One OpenMP task per (batch, head); inside it, row blocks of kBlock
// queries see only keys [0, block end), so the GEMMs skip the masked upper triangle (about half
// the FLOPs of full T x T products). GEMMs inside the parallel region run single-threaded.
// The backward runs one task per (batch, k/v head) over the query heads of its group in
// increasing order, so dk and dv sum the group in a fixed order (one head: multi-head attention).
#include "framework/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "framework/kernels/fast_math.h"
#include "framework/kernels/gemm.h"

namespace keel::kernels {

namespace {
constexpr int64_t kBlock = 64;
}

template <typename T>
void attention_forward(const AttentionShape& s, T* out, T* probs, const T* q, const T* k,
                       const T* v, const T* scale, T* max_abs_logit) {
  const int64_t B = s.B, TT = s.T, H = s.H, D = s.D, G = H / s.kv_heads();
  T max_logit = T(0);
#pragma omp parallel for schedule(static) reduction(max : max_logit)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H, hk = h / G;
    const T* qb = q + b * TT * s.ldq + h * D;
    const T* kb = k + b * TT * s.ldk + hk * D;
    const T* vb = v + b * TT * s.ldv + hk * D;
    T* ob = out + b * TT * s.ldo + h * D;
    T* P = probs + bh * TT * TT;
    const T sc = scale[h];
    for (int64_t r0 = 0; r0 < TT; r0 += kBlock) {
      const int64_t r1 = std::min(TT, r0 + kBlock);
      // S[r0:r1, 0:r1] = sc * Q[r0:r1] K[0:r1]^T
      gemm<T>(false, true, r1 - r0, r1, D, sc, qb + r0 * s.ldq, s.ldq, kb, s.ldk, T(0), P + r0 * TT,
              TT);
      for (int64_t t = r0; t < r1; ++t) {
        T* row = P + t * TT;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t u = 0; u <= t; ++u) {
          mx = std::max(mx, row[u]);
          max_logit = std::max(max_logit, std::abs(row[u]));
        }
        T sum = T(0);
        for (int64_t u = 0; u <= t; ++u) {
          row[u] = exp_t(row[u] - mx);
          sum += row[u];
        }
        const T inv = T(1) / sum;
        for (int64_t u = 0; u <= t; ++u) row[u] *= inv;
        std::fill(row + t + 1, row + TT, T(0));
      }
      // O[r0:r1] = P[r0:r1, 0:r1] V[0:r1]
      gemm<T>(false, false, r1 - r0, D, r1, T(1), P + r0 * TT, TT, vb, s.ldv, T(0), ob + r0 * s.ldo,
              s.ldo);
    }
  }
  if (max_abs_logit) *max_abs_logit = max_logit;
}

int64_t attention_workspace_elems(const AttentionShape& s, int threads) {
  return static_cast<int64_t>(threads) * 2 * s.T * s.T + s.B * s.H;
}

template <typename T>
void attention_backward(const AttentionShape& s, T* dq, T* dk, T* dv, T* dscale, const T* dout,
                        const T* probs, const T* q, const T* k, const T* v, const T* scale,
                        T* workspace) {
  const int64_t B = s.B, TT = s.T, H = s.H, D = s.D, Hkv = s.kv_heads(), G = H / Hkv;
  const int threads = s.threads > 0 ? s.threads : omp_get_max_threads();
  T* partials = workspace + static_cast<int64_t>(threads) * 2 * TT * TT;  // [B * H] dscale terms
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bk = 0; bk < B * Hkv; ++bk) {
    const int64_t b = bk / Hkv, hk = bk % Hkv;
    T* dS = workspace + static_cast<int64_t>(omp_get_thread_num()) * 2 * TT * TT;
    T* QK = dS + TT * TT;
    const T* kb = k + b * TT * s.ldk + hk * D;
    const T* vb = v + b * TT * s.ldv + hk * D;
    T* dkb = dk + b * TT * s.ldk + hk * D;
    T* dvb = dv + b * TT * s.ldv + hk * D;
    // The group's query heads in turn: the first writes dk, dv (=), the others add to them.
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
      const int64_t bh = b * H + h;
      const T beta = h == hk * G ? T(0) : T(1);
      const T* qb = q + b * TT * s.ldq + h * D;
      const T* dob = dout + b * TT * s.ldo + h * D;
      T* dqb = dq + b * TT * s.ldq + h * D;
      const T* P = probs + bh * TT * TT;
      const T sc = scale[h];
      double dscale_acc = 0.0;
      for (int64_t r0 = 0; r0 < TT; r0 += kBlock) {
        const int64_t r1 = std::min(TT, r0 + kBlock);
        // dP[r0:r1, 0:r1] = dO[r0:r1] V[0:r1]^T
        gemm<T>(false, true, r1 - r0, r1, D, T(1), dob + r0 * s.ldo, s.ldo, vb, s.ldv, T(0),
                dS + r0 * TT, TT);
        if (dscale) {
          gemm<T>(false, true, r1 - r0, r1, D, T(1), qb + r0 * s.ldq, s.ldq, kb, s.ldk, T(0),
                  QK + r0 * TT, TT);
        }
        // dS = P * (dP - sum_u P dP): softmax backward, row by row.
        for (int64_t t = r0; t < r1; ++t) {
          T* drow = dS + t * TT;
          const T* prow = P + t * TT;
          T dot = T(0);
          for (int64_t u = 0; u <= t; ++u) dot += prow[u] * drow[u];
          for (int64_t u = 0; u <= t; ++u) drow[u] = prow[u] * (drow[u] - dot);
          std::fill(drow + t + 1, drow + r1, T(0));
          if (dscale) {
            const T* qkrow = QK + t * TT;
            for (int64_t u = 0; u <= t; ++u) dscale_acc += static_cast<double>(drow[u]) * qkrow[u];
          }
        }
        // dQ[r0:r1] = sc * dS[r0:r1, 0:r1] K[0:r1]
        gemm<T>(false, false, r1 - r0, D, r1, sc, dS + r0 * TT, TT, kb, s.ldk, T(0),
                dqb + r0 * s.ldq, s.ldq);
      }
      // Column blocks: keys [c0, c1) are seen by queries [c0, T) only.
      for (int64_t c0 = 0; c0 < TT; c0 += kBlock) {
        const int64_t c1 = std::min(TT, c0 + kBlock);
        // dV[c0:c1] = P[c0:T, c0:c1]^T dO[c0:T];  dK[c0:c1] = sc * dS[c0:T, c0:c1]^T Q[c0:T]
        gemm<T>(true, false, c1 - c0, D, TT - c0, T(1), P + c0 * TT + c0, TT, dob + c0 * s.ldo,
                s.ldo, beta, dvb + c0 * s.ldv, s.ldv);
        gemm<T>(true, false, c1 - c0, D, TT - c0, sc, dS + c0 * TT + c0, TT, qb + c0 * s.ldq, s.ldq,
                beta, dkb + c0 * s.ldk, s.ldk);
      }
      partials[bh] = static_cast<T>(dscale_acc);
    }
  }
  if (dscale) {
    for (int64_t bh = 0; bh < B * H; ++bh) dscale[bh % H] += partials[bh];
  }
}

template <typename T>
void attention_scales(T* out, const T* gain, int64_t H, bool shared_gain, T default_scale) {
  for (int64_t h = 0; h < H; ++h) out[h] = gain ? gain[shared_gain ? 0 : h] : default_scale;
}

template <typename T>
void scale_grad_accumulate(T* grad, const T* dscale, int64_t H, bool shared_gain) {
  for (int64_t h = 0; h < H; ++h) grad[shared_gain ? 0 : h] += dscale[h];
}

#define KEEL_INSTANTIATE(T)                                                                       \
  template void attention_forward<T>(const AttentionShape&, T*, T*, const T*, const T*, const T*, \
                                     const T*, T*);                                               \
  template void attention_backward<T>(const AttentionShape&, T*, T*, T*, T*, const T*, const T*,  \
                                      const T*, const T*, const T*, const T*, T*);                \
  template void attention_scales<T>(T*, const T*, int64_t, bool, T);                              \
  template void scale_grad_accumulate<T>(T*, const T*, int64_t, bool);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
