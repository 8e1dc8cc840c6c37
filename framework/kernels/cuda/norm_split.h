// CUDA forms of the split norm (framework/kernels/norm.h, "Split form"): a norm whose row is
// sharded over tensor-parallel ranks reduces its part of every row, the caller all-reduces the
// per-row [rows, 2] statistics, then applies. fp32 only, with the CPU kernels' semantics
// (framework/kernels/cpu/norm.cc): kLayer uses var = E[x^2] - mean^2, the statistics are turned
// into mean and rstd in double. One warp per (row, group), every sum in a fixed order (no
// floating-point atomics): results are bitwise reproducible run to run. Device pointers; the work
// runs on ctx's stream. Plain C++ header (no CUDA headers).
#pragma once

#include <cstdint>

#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/norm.h"

namespace keel::kernels::cuda {

// stats[r, 0] = sum_c x, stats[r, 1] = sum_c x^2 over this rank's part of row r (=).
void norm_partial_stats(Context& ctx, const NormShape& s, const float* inp, float* stats);

// From all-reduced stats (Cg_total: the full row length across ranks): mean (nullable), rstd
// (=), then out (=) as norm_forward.
// The Bf16 form writes the fp32 output rounded once (Note [act-dtype]).
void norm_forward_from_stats(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                             const float* stats, float* out, const float* inp, const float* weight,
                             const float* bias, float* mean, float* rstd, float eps);
void norm_forward_from_stats(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                             const float* stats, Bf16* out, const float* inp, const float* weight,
                             const float* bias, float* mean, float* rstd, float eps);

// part[r, 0] = sum_c dn, part[r, 1] = sum_c dn * xhat over this rank's part (=), dn = dy * w
// (dy without a weight); mean is nullable (then 0: RMS and L2).
void norm_backward_partials(Context& ctx, const NormShape& s, const float* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, float* part);
void norm_backward_partials(Context& ctx, const NormShape& s, const Bf16* dout, const float* inp,
                            const float* weight, const float* mean, const float* rstd, float* part);

// dinp (= or += per accumulate; skipped when null) from all-reduced partials; dweight, dbias +=
// (each may be null), the gain gradients of norm_backward (they need no row statistic).
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, float* dinp, bool accumulate, float* dweight,
                                 float* dbias, const float* dout, const float* inp,
                                 const float* weight, const float* mean, const float* rstd);
// dinp and dout in bf16 on either side (Note [act-dtype]): a bf16 dout widened exactly, a bf16
// dinp the fp32 result rounded once (accumulate rounds the sum once).
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, Bf16* dinp, bool accumulate, float* dweight,
                                 float* dbias, const float* dout, const float* inp,
                                 const float* weight, const float* mean, const float* rstd);
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, float* dinp, bool accumulate, float* dweight,
                                 float* dbias, const Bf16* dout, const float* inp,
                                 const float* weight, const float* mean, const float* rstd);
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, Bf16* dinp, bool accumulate, float* dweight,
                                 float* dbias, const Bf16* dout, const float* inp,
                                 const float* weight, const float* mean, const float* rstd);

}  // namespace keel::kernels::cuda
