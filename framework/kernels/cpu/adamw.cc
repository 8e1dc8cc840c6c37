// CPU AdamW update (OpenMP + SIMD over the flat parameter arena).
#include "framework/kernels/adamw.h"

#include <cmath>

namespace keel::kernels {

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWStep& s) {
  const float c1 = 1.0f / (1.0f - std::pow(s.beta1, static_cast<float>(s.t)));
  const float c2 = 1.0f / (1.0f - std::pow(s.beta2, static_cast<float>(s.t)));
  const float b1 = s.beta1, b2 = s.beta2, lr = s.lr, eps = s.eps, wd = s.weight_decay;
  const float gs = s.grad_scale;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * gs;
    const float mi = b1 * m[i] + (1.0f - b1) * g;
    const float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    param[i] -= lr * ((mi * c1) / (std::sqrt(vi * c2) + eps) + wd * param[i]);
  }
}

}  // namespace keel::kernels
