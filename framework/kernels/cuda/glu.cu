// CUDA gated linear units (framework/kernels/glu.h): SwiGLU and GEGLU forward and backward,
// element-wise over flat buffers. The per-element math is the CPU's own __host__ __device__
// functions (silu_scalar, silu_grad_scalar, gelu_scalar, gelu_grad_scalar) in the CPU's expression
// order, so fp32 results differ from the CPU only by nvcc's FMA contraction; bf16 forms compute in
// fp32 and round once per output.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/glu.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// The activation is a template parameter, as in cpu/glu.cc: one branch-free kernel per activation.
template <GluAct A>
__device__ __forceinline__ float act(float x) {
  if constexpr (A == GluAct::kSilu) {
    return silu_scalar<float>(x);
  } else {
    return gelu_scalar<float>(x);
  }
}
template <GluAct A>
__device__ __forceinline__ float act_grad(float x) {
  if constexpr (A == GluAct::kSilu) {
    return silu_grad_scalar<float>(x);
  } else {
    return gelu_grad_scalar<float>(x);
  }
}

// out may alias gate or up: each element is read before it is written, by the same thread.
// TO, TI: the output and input types (an fp32 input may be written in bf16: Note [act-dtype]).
template <typename TO, typename TI, GluAct A>
__global__ void glu_forward_kernel(TO* out, const TI* gate, const TI* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = from_f<TO>(act<A>(to_f(gate[i])) * to_f(up[i]));
  }
}
// dup may alias dout: every input of element i is read before dup[i] is written.
template <typename T, GluAct A>
__global__ void glu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                                    int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = to_f(gate[i]), u = to_f(up[i]), d = to_f(dout[i]);
    dgate[i] = from_f<T>(d * u * act_grad<A>(g));
    dup[i] = from_f<T>(d * act<A>(g));
  }
}

template <typename TO, typename TI>
void glu_forward_impl(Context& ctx, GluAct a, TO* out, const TI* gate, const TI* up, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda glu_forward: negative length ", n);
  if (n == 0) return;
  const unsigned blocks = grid_for(n, kThreads);
  if (a == GluAct::kSilu) {
    glu_forward_kernel<TO, TI, GluAct::kSilu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(out, gate, up, n);
  } else {
    glu_forward_kernel<TO, TI, GluAct::kGelu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(out, gate, up, n);
  }
  KEEL_CUDA_LAUNCH_CHECK("glu_forward", "n=", n, a == GluAct::kSilu ? " silu" : " gelu");
}

template <typename T>
void glu_backward_impl(Context& ctx, GluAct a, T* dgate, T* dup, const T* dout, const T* gate,
                       const T* up, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda glu_backward: negative length ", n);
  if (n == 0) return;
  const unsigned blocks = grid_for(n, kThreads);
  if (a == GluAct::kSilu) {
    glu_backward_kernel<T, GluAct::kSilu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  } else {
    glu_backward_kernel<T, GluAct::kGelu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  }
  KEEL_CUDA_LAUNCH_CHECK("glu_backward", "n=", n, a == GluAct::kSilu ? " silu" : " gelu");
}

}  // namespace

void glu_forward(Context& ctx, GluAct act, float* out, const float* gate, const float* up,
                 int64_t n) {
  glu_forward_impl(ctx, act, out, gate, up, n);
}
void glu_forward(Context& ctx, GluAct act, Bf16* out, const Bf16* gate, const Bf16* up, int64_t n) {
  glu_forward_impl(ctx, act, dev(out), dev(gate), dev(up), n);
}
void glu_forward(Context& ctx, GluAct act, Bf16* out, const float* gate, const float* up,
                 int64_t n) {
  glu_forward_impl(ctx, act, dev(out), gate, up, n);
}
void glu_backward(Context& ctx, GluAct act, float* dgate, float* dup, const float* dout,
                  const float* gate, const float* up, int64_t n) {
  glu_backward_impl(ctx, act, dgate, dup, dout, gate, up, n);
}
void glu_backward(Context& ctx, GluAct act, Bf16* dgate, Bf16* dup, const Bf16* dout,
                  const Bf16* gate, const Bf16* up, int64_t n) {
  glu_backward_impl(ctx, act, dev(dgate), dev(dup), dev(dout), dev(gate), dev(up), n);
}

}  // namespace keel::kernels::cuda
