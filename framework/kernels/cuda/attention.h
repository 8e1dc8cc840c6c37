// The CUDA backend's own fused causal attention (flash-attention style: no T x T matrix in memory),
// the fallback where cuDNN's (sdpa_cudnn.h) is unavailable, and the fp32 path. Same layout and
// semantics as the CPU kernel (framework/kernels/attention.h; its `threads` field is ignored):
// element (b, t, h, d) of q lives at q[(b * T + t) * ldq + h * D + d], likewise k, v, out and the
// gradients with their row strides; causal; the per-head scale[H] (device fp32) multiplies q.k.
// Grouped-query and multi-query attention as on the CPU: k, v (and dk, dv) hold s.kv_heads() heads
// (a divisor of H; row strides ldk, ldv of at least Hkv * D), query head h reads k/v head
// h / (H / Hkv), and dk, dv sum their group's query heads. D is the shape's own (model.head_dim),
// not d_model / H. T is float or Bf16 (bf16 q/k/v/out and gradients, fp32 accumulation and
// softmax). Head dimensions 1..128. Deterministic: every sum has a fixed order (no floating-point
// atomics), so repeated calls give bitwise equal results. Plain C++ header (no CUDA headers).
#pragma once

#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"

namespace keel::kernels::cuda {

// The largest head dimension the fused kernels take (their per-thread accumulators are sized for
// it); a larger D throws keel::Error (kUsage).
constexpr int64_t kAttentionMaxHeadDim = 128;
// The largest head dimension attention_max_abs_logit takes: cuDNN's (sdpa_cudnn.h), whose
// attention it accompanies.
constexpr int64_t kMaxLogitMaxHeadDim = 256;

// out (=, stride ldo) = softmax(causal(scale[h] q.k)) v. lse[(b * H + h) * T + t] (=): the
// natural-log log-sum-exp of query row t's scaled logits, saved for the backward (no T x T
// probabilities). max_abs_logit: nullable device float; when given, *max_abs_logit (=) = max
// |scale[h] q.k| over the unmasked entries (0 when there are none).
template <typename T>
void attention_forward(Context& ctx, const AttentionShape& s, T* out, float* lse, const T* q,
                       const T* k, const T* v, const float* scale, float* max_abs_logit);

// dq, dk, dv (=, strides ldq, ldk, ldv; dk, dv of the Hkv k/v heads, each the sum over its
// group's query heads in increasing order); dscale[H] (+=, device fp32, nullable) the gradient of
// scale; dout has stride ldo; out and lse as the forward wrote them. dq, dk and dv may be views
// of one fused buffer (disjoint columns of the same rows), but must not alias q, k, v, dout or
// out: the dq pass reads k and v after the dk/dv pass has written. As in FlashAttention-2, the
// softmax
// backward's row term delta = rowsum(dout * out) comes from this out: for bf16 its rounding (2^-9)
// reaches dq, dk and dscale undamped at rows with few keys (up to ~2% of their scale), where the
// CPU kernel takes delta from its exact probabilities.
template <typename T>
void attention_backward(Context& ctx, const AttentionShape& s, T* dq, T* dk, T* dv, float* dscale,
                        const T* dout, const T* out, const float* lse, const T* q, const T* k,
                        const T* v, const float* scale);

// *max_abs_logit (=) = max |scale[h] q.k| over the unmasked entries, alone: for paths (cuDNN)
// that do not report it. Bitwise equal to the forward's value (where the forward takes D), except
// on the tensor cores (bf16, D a multiple of 16 up to 128, T a multiple of 16, row strides
// multiples of 8): another order of the sum over D. D up to kMaxLogitMaxHeadDim.
template <typename T>
void attention_max_abs_logit(Context& ctx, const AttentionShape& s, const T* q, const T* k,
                             const float* scale, float* max_abs_logit);

}  // namespace keel::kernels::cuda
