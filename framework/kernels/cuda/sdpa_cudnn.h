// Causal multi-head attention through cuDNN's fused scaled-dot-product attention (flash attention,
// forward and backward), built with the cuDNN frontend's graph API. Same layout and semantics as
// the CPU kernel (framework/kernels/attention.h) and the CUDA backend's own fused kernel
// (attention.h), which is the fallback where this one is unavailable: element (b, t, h, d) of q
// lives at q[(b * T + t) * ldq + h * D + d], likewise k, v, out and the gradients with their row
// strides; grouped-query attention with k, v, dk, dv of s.kv_heads() heads (query head h reads
// k/v head h / (H / Hkv)); bf16 in and out, fp32 softmax and accumulation. Plain C++ header (no
// CUDA or cuDNN headers), so callers compile without the frontend.
//
// Note [cudnn-sdpa-scale]: cuDNN takes one scalar attn_scale for all heads, keel a per-head
// scale[H] (1/sqrt(D), or the learned QK-norm scale) as a device array. The forward runs cuDNN on a
// scaled copy q' = scale[h] * q (rounded to bf16) with attn_scale 1; the backward rebuilds q', runs
// cuDNN's backward on it and maps its gradient back: dq = scale[h] * dq', dscale[h] += sum dq' . q.
//
// Plans are built once per shape (on its first call, or by sdpa_available) and cached per
// Context; the cudnnHandle of a Context is made on first use and bound to its stream.
#pragma once

#include <string>

#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"

namespace keel::kernels::cuda::cudnn {

// True when cuDNN runs this shape on ctx's device; false with the reason in *why (nullable)
// otherwise: "built without the cuDNN frontend", a shape cuDNN does not take (D not a multiple of
// 8 or above 256: cuDNN 9 on Hopper, bf16, forward and backward, see shape_problem in
// sdpa_cudnn.cc; Hkv not dividing H; row strides not multiples of 8), the frontend's own refusal
// (e.g. D above 128 before Hopper) when it builds the forward and backward plans (which are then
// cached for the calls that follow), or a plan's workspace above the limit (an eighth of the
// device's memory, or KEEL_CUDNN_WORKSPACE_LIMIT_MB).
bool sdpa_available(Context& ctx, const AttentionShape& s, std::string* why);

// out (=, stride ldo) = softmax(causal(scale[h] q.k)) v; lse[(b * H + h) * T + t] (=) is the
// natural-log log-sum-exp of row t's scaled logits, max + log(sum exp(x - max)) (cuDNN's softmax
// stats), saved for the backward. scale[H] is a device fp32 array. Throws keel::Error (kInternal)
// naming the failed call and the shape when cuDNN fails or the shape is unavailable.
void sdpa_forward(Context& ctx, const AttentionShape& s, Bf16* out, float* lse, const Bf16* q,
                  const Bf16* k, const Bf16* v, const float* scale);

// dq, dk, dv (=, strides ldq, ldk, ldv; dk, dv of the Hkv k/v heads, each summed over its group's
// query heads); dscale[H] (+=, device fp32, nullable); dout has stride ldo; out and lse as the
// forward wrote them.
void sdpa_backward(Context& ctx, const AttentionShape& s, Bf16* dq, Bf16* dk, Bf16* dv,
                   float* dscale, const Bf16* dout, const Bf16* out, const float* lse,
                   const Bf16* q, const Bf16* k, const Bf16* v, const float* scale);

// Whether this build has the cuDNN frontend (found at configure time: KEEL_HAVE_CUDNN_FRONTEND).
bool have_frontend();
// "cuDNN 9.19.0 (frontend 1.32.0)" (the loaded cuDNN), or "built without the cuDNN frontend".
std::string library_version();

// ---- the per-head scale fold of Note [cudnn-sdpa-scale] (sdpa_fold.cu; public for tests) ----
// qs[(b * T + t) * H * D + h * D + d] = bf16(scale[h] * q[(b * T + t) * ldq + h * D + d]) (=):
// q' in dense rows of H * D.
void fold_head_scale(Context& ctx, const AttentionShape& s, Bf16* qs, const Bf16* q,
                     const float* scale);
// In place on dq (stride ldq), which holds dq' = dL/dq' on entry: dscale[h] += sum over b, t, d
// of dq' * q in fp32 with a fixed partition (reproducible run to run; skipped when dscale is
// null), then dq = bf16(scale[h] * dq').
void unfold_head_scale_grad(Context& ctx, const AttentionShape& s, Bf16* dq, float* dscale,
                            const Bf16* q, const float* scale);

}  // namespace keel::kernels::cuda::cudnn
