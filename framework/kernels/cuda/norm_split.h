// CUDA forms of the split norm (framework/kernels/norm.h, "Split form"): a norm whose row is
// sharded over tensor-parallel ranks reduces its part of every row, the caller all-reduces the
// per-row [rows, 2] statistics, then applies. fp32 math, with the CPU kernels' semantics
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

// Activation operands (inp, out; dinp, dout) are float or Bf16 in any combination (all are
// instantiated in norm_split.cu): a bf16 operand is widened exactly on its load, a bf16 output is
// the fp32 result rounded once (accumulate rounds the sum once; Note [act-dtype]).

// stats[r, 0] = sum_c x, stats[r, 1] = sum_c x^2 over this rank's part of row r (=).
template <typename TI>
void norm_partial_stats(Context& ctx, const NormShape& s, const TI* inp, float* stats);

// From all-reduced stats (Cg_total: the full row length across ranks): mean (nullable), rstd
// (=), then out (=) as norm_forward.
template <typename TO, typename TI>
void norm_forward_from_stats(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                             const float* stats, TO* out, const TI* inp, const float* weight,
                             const float* bias, float* mean, float* rstd, float eps);

// part[r, 0] = sum_c dn, part[r, 1] = sum_c dn * xhat over this rank's part (=), dn = dy * w
// (dy without a weight); mean is nullable (then 0: RMS and L2).
template <typename TG, typename TI>
void norm_backward_partials(Context& ctx, const NormShape& s, const TG* dout, const TI* inp,
                            const float* weight, const float* mean, const float* rstd, float* part);

// dinp (= or += per accumulate; skipped when null) from all-reduced partials; dweight, dbias +=
// (each may be null), the gain gradients of norm_backward (they need no row statistic).
template <typename TD, typename TG, typename TI>
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, TD* dinp, bool accumulate, float* dweight,
                                 float* dbias, const TG* dout, const TI* inp, const float* weight,
                                 const float* mean, const float* rstd);

}  // namespace keel::kernels::cuda
