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

// Flat kernels in packs of W elements, the last n % W one per thread of the grid's first threads
// (Note [vector-access], internal.h: W = pack_width when every operand is 16-byte aligned, else 1).
// out may alias gate or up: each element is read before it is written, by the same thread.
// TO, TI: the output and input types (an fp32 input may be written in bf16: Note [act-dtype]).
template <int W, typename TO, typename TI, GluAct A>
__global__ void glu_forward_kernel(TO* out, const TI* gate, const TI* up, int n) {
  map_packs<W>(out, gate, up, n, [](TI g, TI u) { return from_f<TO>(act<A>(to_f(g)) * to_f(u)); });
}
// dup may alias dout: every input of element i is read before dup[i] is written.
template <int W, typename TO, typename TI, GluAct A>
__global__ void glu_backward_kernel(TO* dgate, TO* dup, const TI* dout, const TI* gate,
                                    const TI* up, int n) {
  const auto f = [](TI gi, TI ui, TI di, TO& dg, TO& du) {
    const float g = to_f(gi), u = to_f(ui), d = to_f(di);
    dg = from_f<TO>(d * u * act_grad<A>(g));
    du = from_f<TO>(d * act<A>(g));
  };
  const int id = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), packs = n / W;
  for (int k = id; k < packs; k += static_cast<int>(gridDim.x * blockDim.x)) {
    const Pack<TI, W> g = reinterpret_cast<const Pack<TI, W>*>(gate)[k];
    const Pack<TI, W> u = reinterpret_cast<const Pack<TI, W>*>(up)[k];
    const Pack<TI, W> d = reinterpret_cast<const Pack<TI, W>*>(dout)[k];
    Pack<TO, W> dg, du;
#pragma unroll
    for (int j = 0; j < W; ++j) f(g.v[j], u.v[j], d.v[j], dg.v[j], du.v[j]);
    reinterpret_cast<Pack<TO, W>*>(dgate)[k] = dg;
    reinterpret_cast<Pack<TO, W>*>(dup)[k] = du;
  }
  const int i = packs * W + id;
  if (i < n) f(gate[i], up[i], dout[i], dgate[i], dup[i]);
}
// Note [fused-bias-grad] (internal.h): the same values, and their column sums over this block's
// row chunk into partial[0, blockIdx.y, C] (dgate) and partial[1, blockIdx.y, C] (dup). Thread
// (x, y) takes columns W * (32 blockIdx.x + x) + [0, W) (W = 4 when C % 4 == 0 and the buffers
// are 16-byte aligned, else 1) of rows r0 + y, r0 + y + kColRows, ...: each column's order is
// W = 1's, so the partials are the same bits.
template <int W, typename TO, GluAct A>
__global__ void glu_backward_bias_kernel(TO* dgate, TO* dup, float* partial, const float* dout,
                                         const float* gate, const float* up, int N, int C,
                                         int rows) {
  __shared__ float s[kColRows][33];
  const int c = (static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x)) * W;
  const int r0 = static_cast<int>(blockIdx.y) * rows, r1 = rows < N - r0 ? r0 + rows : N;
  float acc_gate[W], acc_up[W];
#pragma unroll
  for (int j = 0; j < W; ++j) acc_gate[j] = acc_up[j] = 0.0f;
  if (c < C) {  // C % W == 0: the whole pack is in the row
    for (int r = r0 + static_cast<int>(threadIdx.y); r < r1; r += kColRows) {
      const int64_t i = static_cast<int64_t>(r) * C + c;
      const Pack<float, W> g = *reinterpret_cast<const Pack<float, W>*>(gate + i);
      const Pack<float, W> u = *reinterpret_cast<const Pack<float, W>*>(up + i);
      const Pack<float, W> d = *reinterpret_cast<const Pack<float, W>*>(dout + i);
      Pack<TO, W> dg_out, du_out;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float dg = d.v[j] * u.v[j] * act_grad<A>(g.v[j]), du = d.v[j] * act<A>(g.v[j]);
        dg_out.v[j] = from_f<TO>(dg);
        du_out.v[j] = from_f<TO>(du);
        acc_gate[j] += dg;
        acc_up[j] += du;
      }
      *reinterpret_cast<Pack<TO, W>*>(dgate + i) = dg_out;
      *reinterpret_cast<Pack<TO, W>*>(dup + i) = du_out;
    }
  }
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float sum_gate = column_block_sum(acc_gate[j], s);
    const float sum_up = column_block_sum(acc_up[j], s);
    if (threadIdx.y == 0 && c < C) {
      partial[static_cast<int64_t>(blockIdx.y) * C + c + j] = sum_gate;
      partial[static_cast<int64_t>(gridDim.y + blockIdx.y) * C + c + j] = sum_up;
    }
  }
}

// Blocks for n elements in packs of W (at least one, for the tail's n % W threads).
unsigned pack_blocks(int n, int W) { return grid_for(n / W, kThreads); }

template <int W, typename TO, typename TI>
void glu_forward_launch(Context& ctx, GluAct a, TO* out, const TI* gate, const TI* up, int n) {
  if (a == GluAct::kSilu) {
    glu_forward_kernel<W, TO, TI, GluAct::kSilu>
        <<<pack_blocks(n, W), kThreads, 0, ctx.stream()>>>(out, gate, up, n);
  } else {
    glu_forward_kernel<W, TO, TI, GluAct::kGelu>
        <<<pack_blocks(n, W), kThreads, 0, ctx.stream()>>>(out, gate, up, n);
  }
}
template <typename TO, typename TI>
void glu_forward_impl(Context& ctx, GluAct a, TO* out, const TI* gate, const TI* up, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda glu_forward: negative length ", n);
  for_pieces(n, [&](int64_t at, int m) {
    if (aligned16(out + at, gate + at, up + at)) {
      glu_forward_launch<pack_width<TO, TI>()>(ctx, a, out + at, gate + at, up + at, m);
    } else {
      glu_forward_launch<1>(ctx, a, out + at, gate + at, up + at, m);
    }
    KEEL_CUDA_LAUNCH_CHECK("glu_forward", "n=", n, a == GluAct::kSilu ? " silu" : " gelu");
  });
}

template <int W, typename TO, typename TI>
void glu_backward_launch(Context& ctx, GluAct a, TO* dgate, TO* dup, const TI* dout, const TI* gate,
                         const TI* up, int n) {
  if (a == GluAct::kSilu) {
    glu_backward_kernel<W, TO, TI, GluAct::kSilu>
        <<<pack_blocks(n, W), kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  } else {
    glu_backward_kernel<W, TO, TI, GluAct::kGelu>
        <<<pack_blocks(n, W), kThreads, 0, ctx.stream()>>>(dgate, dup, dout, gate, up, n);
  }
}
template <typename TO, typename TI>
void glu_backward_impl(Context& ctx, GluAct a, TO* dgate, TO* dup, const TI* dout, const TI* gate,
                       const TI* up, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda glu_backward: negative length ", n);
  for_pieces(n, [&](int64_t at, int m) {
    if (aligned16(dgate + at, dup + at, dout + at, gate + at, up + at)) {
      glu_backward_launch<pack_width<TO, TI>()>(ctx, a, dgate + at, dup + at, dout + at, gate + at,
                                                up + at, m);
    } else {
      glu_backward_launch<1>(ctx, a, dgate + at, dup + at, dout + at, gate + at, up + at, m);
    }
    KEEL_CUDA_LAUNCH_CHECK("glu_backward", "n=", n, a == GluAct::kSilu ? " silu" : " gelu");
  });
}

template <int W, typename TO>
void glu_backward_bias_launch(Context& ctx, GluAct a, TO* dgate, TO* dup, float* partial,
                              const float* dout, const float* gate, const float* up, int N, int C,
                              const RowChunks& k) {
  const dim3 grid(static_cast<unsigned>((C / W + 31) / 32), static_cast<unsigned>(k.count));
  const dim3 block(32, kColRows);
  const int rows = static_cast<int>(k.rows);
  if (a == GluAct::kSilu) {
    glu_backward_bias_kernel<W, TO, GluAct::kSilu>
        <<<grid, block, 0, ctx.stream()>>>(dgate, dup, partial, dout, gate, up, N, C, rows);
  } else {
    glu_backward_bias_kernel<W, TO, GluAct::kGelu>
        <<<grid, block, 0, ctx.stream()>>>(dgate, dup, partial, dout, gate, up, N, C, rows);
  }
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
  KEEL_CHECK(N <= kMaxIndex32 && C <= kMaxIndex32, kUsage, "cuda glu_backward: N=", N, " C=", C,
             " past the kernel's 32-bit indices (", kMaxIndex32, ")");
  const RowChunks k = row_chunks(N);
  auto* partial = static_cast<float*>(ctx.scratch(sizeof(float) * 2 * k.count * C));
  const int n = static_cast<int>(N), c = static_cast<int>(C);
  if (C % 4 == 0 && aligned16(dgate, dup, dout, gate, up)) {
    glu_backward_bias_launch<4>(ctx, a, dgate, dup, partial, dout, gate, up, n, c, k);
  } else {
    glu_backward_bias_launch<1>(ctx, a, dgate, dup, partial, dout, gate, up, n, c, k);
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
