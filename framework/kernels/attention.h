// Causal multi-head self-attention on already projected (and QK-normalised) q, k, v.
// q element (b, t, h, d) lives at q[(b * T + t) * ldq + h * D + d]; likewise k, v, out and their
// gradients with their own row strides. scale[h] multiplies q.k for head h (1/sqrt(D), or the
// learned L2 QK-norm scale). probs[B, H, T, T] holds the softmax (zero above the diagonal).
// Grouped-query attention: k and v hold Hkv heads (Hkv divides H); query head h reads k/v head
// h / (H / Hkv), and dk, dv of a k/v head sum its group's query heads.
#pragma once

#include <cstdint>

namespace keel::kernels {

struct AttentionShape {
  int64_t B, T, H, D;
  int64_t ldq, ldk, ldv, ldo;
  int threads = 0;  // OpenMP threads the backward may use (its workspace is sized for them);
                    // 0: omp_get_max_threads() at call time
  int64_t Hkv = 0;  // k/v heads; 0: H (multi-head attention)
  int64_t kv_heads() const { return Hkv > 0 ? Hkv : H; }
};

// out = softmax(causal(scale * q k^T)) v (=). *max_abs_logit = largest |scale * q.k| over the
// unmasked entries (the number QK-norm keeps bounded).
template <typename T>
void attention_forward(const AttentionShape& s, T* out, T* probs, const T* q, const T* k,
                       const T* v, const T* scale, T* max_abs_logit);

// Elements of workspace attention_backward needs for `threads` OpenMP threads.
int64_t attention_workspace_elems(const AttentionShape& s, int threads);

// dq, dk, dv (=) with strides ldq, ldk, ldv; dscale[H] += (skipped when null); dout has ldo.
template <typename T>
void attention_backward(const AttentionShape& s, T* dq, T* dk, T* dv, T* dscale, const T* dout,
                        const T* probs, const T* q, const T* k, const T* v, const T* scale,
                        T* workspace);

// The per-head logit scale attention reads: out[h] (=) = gain[shared_gain ? 0 : h] (the learned
// L2 QK-norm scale, a parameter) when gain is not null, else default_scale (1/sqrt(D)), for
// h < H. A kernel rather than a host loop so the gain is read where it lives (device memory on
// CUDA).
template <typename T>
void attention_scales(T* out, const T* gain, int64_t H, bool shared_gain, T default_scale);

// The scale parameter's gradient from attention_backward's dscale[H]: for h = 0, 1, .., H-1 in
// turn, grad[shared_gain ? 0 : h] += dscale[h] (a shared gain sums all heads in increasing h).
template <typename T>
void scale_grad_accumulate(T* grad, const T* dscale, int64_t H, bool shared_gain);

}  // namespace keel::kernels
