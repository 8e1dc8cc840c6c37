// AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments, and the segment
// tables through which the optimizer updates, and takes the global gradient norm of, the flat
// arenas in one call per step (ExecContext::adamw_update_segments, sum_squares_segments).
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

// One parameter (or the slice of one a ZeRO-1 shard owns) in the optimizer's flat arenas: its
// param, grad, m and v are the n elements at `offset` of four arrays. decay: whether it takes
// AdamWStep::weight_decay (else 0).
struct AdamWSegment {
  int64_t offset;
  int64_t n;
  bool decay;
};

// A run of n elements at `offset` of a flat array: one term of the global gradient norm.
struct NormSegment {
  int64_t offset;
  int64_t n;
};

}  // namespace keel::kernels
