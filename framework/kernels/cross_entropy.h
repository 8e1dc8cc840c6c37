// Cross-entropy with z-loss over (possibly vocab-sharded) logits, in phases so a vocab-parallel
// caller can all-reduce the row statistics between them (Megatron's three small all-reduces):
//   row_max (all-reduce max) -> row_sumexp (all-reduce sum) -> lse = max + log(sumexp)
//   target_logit (all-reduce sum)            loss_n = lse_n - target_n,  z_n = lse_n^2
// Logits are [N, V_local] for vocab rows [v_begin, v_begin + V_local); columns at or past
// v_valid_local are padding and never predicted (excluded from max/sum-exp, zero gradient).
#pragma once

#include <cmath>
#include <cstdint>

#include "framework/philox.h"  // KEEL_HD

namespace keel::kernels {

// A row's log-sum-exp from its complete statistics, in double: xent_finish's l, which every form
// (CPU, CUDA, the fused ones) computes through this one function.
KEEL_HD inline double xent_row_lse(double row_max, double sumexp) { return row_max + log(sumexp); }

template <typename T>
void xent_row_max(const T* logits, int64_t N, int64_t V_local, int64_t v_valid_local, T* row_max);

template <typename T>
void xent_row_sumexp(const T* logits, const T* row_max, int64_t N, int64_t V_local,
                     int64_t v_valid_local, T* sumexp);

// target_logit[n] = logits[n, targets[n] - v_begin] if the target is in range, else 0.
template <typename T>
void xent_target_logit(const T* logits, const int32_t* targets, int64_t N, int64_t V_local,
                       int64_t v_begin, T* target_logit);

// The finish after the row statistics are complete (all-reduced): per row n, in double,
//   l = row_max[n] + log(sumexp[n]),  lse[n] = l (rounded to T; lse may alias sumexp),
// and sums (=) sums[0] = sum_n (l - target_logit[n]) (cross-entropy), sums[1] = sum_n l^2
// (z-loss), sums[2] = sum_n l (the logged log Z), accumulated in double in increasing n: one
// fixed order, so the loss is bitwise reproducible. On the CPU every pointer, sums included, is
// host memory; the CUDA form (cuda/ops.h) takes device memory for all of them.
template <typename T>
void xent_finish(const T* row_max, const T* sumexp, const T* target_logit, int64_t N, T* lse,
                 double sums[3]);

// Gradient of  grad_scale * sum_n [(lse_n - target_n) + z_coef * lse_n^2]  w.r.t. the logits:
//   dlogits = grad_scale * (p * (1 + 2 z_coef lse) - onehot(target)),  p = exp(logit - lse).
// dlogits may alias logits (=).
template <typename T>
void xent_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t N,
                   int64_t V_local, int64_t v_valid_local, int64_t v_begin, T grad_scale, T z_coef);

}  // namespace keel::kernels
