// CUDA gated linear units (framework/kernels/glu.h): SwiGLU and GEGLU forward and backward,
// element-wise over flat buffers. The per-element math is the CPU's own __host__ __device__
// functions (silu_scalar, silu_grad_scalar, gelu_scalar, gelu_grad_scalar) in the CPU's expression
// order, so fp32 results differ from the CPU only by nvcc's FMA contraction; bf16 forms compute in
// fp32 and round once per output.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/gemm.h"
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
template <typename TO, typename TI, GluAct A>
__global__ void glu_backward_kernel(TO* dgate, TO* dup, const TI* dout, const TI* gate,
                                    const TI* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = to_f(gate[i]), u = to_f(up[i]), d = to_f(dout[i]);
    dgate[i] = from_f<TO>(d * u * act_grad<A>(g));
    dup[i] = from_f<TO>(d * act<A>(g));
  }
}
// Note [fused-bias-grad] (internal.h): the same values, and their column sums over this block's
// row chunk into partial[0, blockIdx.y, C] (dgate) and partial[1, blockIdx.y, C] (dup).
template <typename TO, GluAct A>
__global__ void glu_backward_bias_kernel(TO* dgate, TO* dup, float* partial, const float* dout,
                                         const float* gate, const float* up, int64_t N, int64_t C,
                                         int64_t rows) {
  __shared__ float s[kColRows][33];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows, r1 = r0 + rows < N ? r0 + rows : N;
  float acc_gate = 0.0f, acc_up = 0.0f;
  if (c < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const int64_t i = r * C + c;
      const float g = gate[i], u = up[i], d = dout[i];
      const float dg = d * u * act_grad<A>(g), du = d * act<A>(g);
      dgate[i] = from_f<TO>(dg);
      dup[i] = from_f<TO>(du);
      acc_gate += dg;
      acc_up += du;
    }
  }
  acc_gate = column_block_sum(acc_gate, s);
  acc_up = column_block_sum(acc_up, s);
  if (threadIdx.y == 0 && c < C) {
    partial[blockIdx.y * C + c] = acc_gate;
    partial[(gridDim.y + blockIdx.y) * C + c] = acc_up;
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

template <typename TO, typename TI>
void glu_backward_impl(Context& ctx, GluAct a, TO* dgate, TO* dup, const TI* dout, const TI* gate,
                       const TI* up, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda glu_backward: negative length ", n);
  if (n == 0) return;
  const unsigned blocks = grid_for(n, kThreads);
  if (a == GluAct::kSilu) {
    glu_backward_kernel<TO, TI, GluAct::kSilu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  } else {
    glu_backward_kernel<TO, TI, GluAct::kGelu>
        <<<blocks, kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  }
  KEEL_CUDA_LAUNCH_CHECK("glu_backward", "n=", n, a == GluAct::kSilu ? " silu" : " gelu");
}

template <typename TO>
void glu_backward_bias_impl(Context& ctx, GluAct a, TO* dgate, TO* dup, float* dgate_bias,
                            float* dup_bias, const float* dout, const float* gate, const float* up,
                            int64_t N, int64_t C) {
  KEEL_CHECK(N >= 0 && C >= 0, kUsage, "cuda glu_backward: bad shape N=", N, " C=", C);
  if (dgate_bias == nullptr && dup_bias == nullptr) {
    glu_backward_impl(ctx, a, dgate, dup, dout, gate, up, N * C);
    return;
  }
  if (N == 0 || C == 0) return;
  const RowChunks k = row_chunks(N);
  auto* partial = static_cast<float*>(ctx.scratch(sizeof(float) * 2 * k.count * C));
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(k.count));
  const dim3 block(32, kColRows);
  if (a == GluAct::kSilu) {
    glu_backward_bias_kernel<TO, GluAct::kSilu>
        <<<grid, block, 0, ctx.stream()>>>(dgate, dup, partial, dout, gate, up, N, C, k.rows);
  } else {
    glu_backward_bias_kernel<TO, GluAct::kGelu>
        <<<grid, block, 0, ctx.stream()>>>(dgate, dup, partial, dout, gate, up, N, C, k.rows);
  }
  KEEL_CUDA_LAUNCH_CHECK("glu_backward (bias)", "N=", N, " C=", C,
                         a == GluAct::kSilu ? " silu" : " gelu");
  if (dgate_bias != nullptr) column_sum_add(ctx, dgate_bias, partial, k.count, C, C);
  if (dup_bias != nullptr) column_sum_add(ctx, dup_bias, partial + k.count * C, k.count, C, C);
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
void glu_backward(Context& ctx, GluAct act, float* dgate, float* dup, float* dgate_bias,
                  float* dup_bias, const float* dout, const float* gate, const float* up, int64_t N,
                  int64_t C) {
  glu_backward_bias_impl(ctx, act, dgate, dup, dgate_bias, dup_bias, dout, gate, up, N, C);
}
void glu_backward(Context& ctx, GluAct act, Bf16* dgate, Bf16* dup, float* dgate_bias,
                  float* dup_bias, const float* dout, const float* gate, const float* up, int64_t N,
                  int64_t C) {
  glu_backward_bias_impl(ctx, act, dev(dgate), dev(dup), dgate_bias, dup_bias, dout, gate, up, N,
                         C);
}

}  // namespace keel::kernels::cuda
