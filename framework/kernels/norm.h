// Row normalisations used by block norms and QK-norm: LayerNorm, RMSNorm and L2.
// Rows are grouped: N tokens x G groups x Cg channels; element (n, g, c) lives at
// x[n * ld + g * Cg + c]. A group is one attention head for per-head QK-norm (G = n_heads,
// Cg = head_dim), or the whole row for block norms and PROJECTION-scope QK-norm (G = 1).
// The gain/bias element for (g, c) is weight[g * w_group_stride + c]: stride 0 shares one
// [Cg] gain across groups (HEAD_SHARED), stride Cg gives each group its own (HEAD).
#pragma once

#include <cstdint>

namespace keel::kernels {

enum class NormOp {
  kLayer,  // (x - mean) * rstd * w + b,   rstd = 1/sqrt(var + eps)
  kRms,    // x * rstd * w,                 rstd = 1/sqrt(mean(x^2) + eps)
  kL2,     // x * rstd,                     rstd = 1/sqrt(sum(x^2) + eps); no gain
};

struct NormShape {
  int64_t N;               // rows (tokens)
  int64_t G;               // groups per row
  int64_t Cg;              // channels per group
  int64_t ld_in;           // row stride of the input
  int64_t ld_out;          // row stride of the output / its gradient
  int64_t w_group_stride;  // 0: gain shared by groups; Cg: a gain per group
};

// out = norm(inp) (=). mean, rstd: [N * G] saved for backward (mean unused except kLayer).
// weight may be null only for kL2; bias may be null (then no bias).
template <typename T>
void norm_forward(NormOp op, const NormShape& s, T* out, const T* inp, const T* weight,
                  const T* bias, T* mean, T* rstd, T eps);

// dinp (= or += per accumulate) from dout; dweight, dbias += (each may be null).
// dinp uses ld_in as its row stride; dout uses ld_out.
template <typename T>
void norm_backward(NormOp op, const NormShape& s, T* dinp, bool accumulate, T* dweight, T* dbias,
                   const T* dout, const T* inp, const T* weight, const T* mean, const T* rstd);

}  // namespace keel::kernels

// ---- Split form, for a norm whose row is sharded across ranks (PROJECTION-scope QK-norm under
// tensor parallelism): each rank reduces its part of every row, the caller all-reduces the
// per-row statistics ([rows, 2] floats: B x T x 2, never the activations), then applies.
// Cg_total is the full row length across ranks. kLayer uses var = E[x^2] - mean^2 (one
// all-reduce instead of two; inputs here are q/k projections with |mean| << std).
namespace keel::kernels {

// stats[r, 0] = sum_c x, stats[r, 1] = sum_c x^2 over this rank's part of row r (=).
template <typename T>
void norm_partial_stats(const NormShape& s, const T* inp, T* stats);

// From all-reduced stats: mean, rstd (=), then out (=) as norm_forward.
template <typename T>
void norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total, const T* stats,
                             T* out, const T* inp, const T* weight, const T* bias, T* mean, T* rstd,
                             T eps);

// part[r, 0] = sum_c dn, part[r, 1] = sum_c dn * xhat over this rank's part (=), dn = dy * w.
template <typename T>
void norm_backward_partials(const NormShape& s, const T* dout, const T* inp, const T* weight,
                            const T* mean, const T* rstd, T* part);

// dinp (= or +=) from all-reduced partials; dweight, dbias += (each may be null).
template <typename T>
void norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total, const T* part,
                                 T* dinp, bool accumulate, T* dweight, T* dbias, const T* dout,
                                 const T* inp, const T* weight, const T* mean, const T* rstd);

}  // namespace keel::kernels
