// CUDA forms of attention's per-head logit scales and their gradient (framework/kernels/
// attention.h): the L2 QK-norm gain is a device parameter, so the layer reads and updates it
// through these tiny kernels instead of host loops. H is the local head count (tens): the
// kernels are launch-bound, and the shared-gain gradient runs on one thread to keep the CPU's
// order of additions.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void attention_scales_kernel(float* out, const float* gain, int64_t H, bool shared_gain,
                                        float default_scale) {
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h >= H) return;
  out[h] = gain ? gain[shared_gain ? 0 : h] : default_scale;
}

__global__ void scale_grad_per_head_kernel(float* grad, const float* dscale, int64_t H) {
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h < H) grad[h] += dscale[h];
}

// One thread: grad[0] += dscale[0], then dscale[1], ... (the CPU's sequence of float additions).
__global__ void scale_grad_shared_kernel(float* grad, const float* dscale, int64_t H) {
  float g = grad[0];
  for (int64_t h = 0; h < H; ++h) g += dscale[h];
  grad[0] = g;
}

void check_heads(int64_t H, const char* name) {
  KEEL_CHECK(H >= 0 && H <= 0x7fffffff, kUsage, "cuda ", name, ": bad head count H=", H);
}

}  // namespace

void attention_scales(Context& ctx, float* out, const float* gain, int64_t H, bool shared_gain,
                      float default_scale) {
  check_heads(H, "attention_scales");
  if (H == 0) return;
  attention_scales_kernel<<<grid_for(H, kThreads), kThreads, 0, ctx.stream()>>>(
      out, gain, H, shared_gain, default_scale);
  KEEL_CUDA_LAUNCH_CHECK("attention_scales", "H=", H, " shared_gain=", shared_gain);
}

void scale_grad_accumulate(Context& ctx, float* grad, const float* dscale, int64_t H,
                           bool shared_gain) {
  check_heads(H, "scale_grad_accumulate");
  if (H == 0) return;
  if (shared_gain) {
    scale_grad_shared_kernel<<<1, 1, 0, ctx.stream()>>>(grad, dscale, H);
  } else {
    scale_grad_per_head_kernel<<<grid_for(H, kThreads), kThreads, 0, ctx.stream()>>>(grad, dscale,
                                                                                     H);
  }
  KEEL_CUDA_LAUNCH_CHECK("scale_grad_accumulate", "H=", H, " shared_gain=", shared_gain);
}

}  // namespace keel::kernels::cuda
