// AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments.
#pragma once

#include <cstdint>

namespace keel::kernels {

struct AdamWStep {
  float lr;
  float beta1, beta2, eps;
  float weight_decay;  // already 0 for tensors that take no decay
  float grad_scale;    // multiplies the gradient first (global-norm clipping)
  int64_t t;           // 1-based step, for bias correction
};

// m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (mhat / (sqrt(vhat) + eps) + wd p)
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWStep& step);

}  // namespace keel::kernels
