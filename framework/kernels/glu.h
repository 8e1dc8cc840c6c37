// Gated linear units for gated MLPs (Shazeer 2020, "GLU Variants Improve Transformer"):
//   out = act(gate) * up,  act = SiLU (SwiGLU: Llama, OLMo 2, Qwen3) or tanh-GELU (GEGLU: Gemma).
// gate and up are the two column-parallel projections of the block input; the product feeds the
// down projection. The tanh-GELU is elementwise.h's gelu_scalar, so GELU and GEGLU share one
// formula (and one float fast path).
#pragma once

#include <cstdint>

#include "framework/kernels/elementwise.h"
#include "framework/kernels/fast_math.h"

namespace keel::kernels {

enum class GluAct {
  kSilu,  // x * sigmoid(x)
  kGelu,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
};

// Shared per-element math (host and device); float uses fast_expf, double libm (exp_t).
template <typename T>
KEEL_HD inline T silu_scalar(T x) {
  return x / (T(1) + exp_t(-x));
}
// d/dx x sigmoid(x) = s (1 + x (1 - s)), s = sigmoid(x).
template <typename T>
KEEL_HD inline T silu_grad_scalar(T x) {
  const T s = T(1) / (T(1) + exp_t(-x));
  return s * (T(1) + x * (T(1) - s));
}

// out[n] = act(gate[n]) * up[n] (=). out may be gate or up (in place).
template <typename T>
void glu_forward(GluAct act, T* out, const T* gate, const T* up, int64_t n);

// dgate[n] = dout[n] * up[n] * act'(gate[n]),  dup[n] = dout[n] * act(gate[n])  (both =).
// dup may be dout (in place); dgate must not alias dout, gate or up.
template <typename T>
void glu_backward(GluAct act, T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                  int64_t n);

}  // namespace keel::kernels
