// The per-head attention scale folded into q for cuDNN's SDPA, and its gradient mapped back
// (Note [cudnn-sdpa-scale] in sdpa_cudnn.h). Element-wise passes over B * T * H * D elements; the
// dscale sum uses a fixed partition (kPartials blocks per head, summed in order), so it is
// reproducible run to run, unlike atomics.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/sdpa_cudnn.h"

namespace keel::kernels::cuda::cudnn {

namespace {

constexpr int kThreads = 256;
constexpr int kPartials = 128;  // blocks per head in the dscale sum: enough to fill the GPU

// qs[r, c] = bf16(scale[c / D] q[r * ldq + c]) over packs of W elements of a row (Note
// [vector-access], internal.h): W = 8 when qs and q are 16-byte aligned and C, D and ldq multiples
// of 8 (a pack then lies in one head), else 1. 32-bit indices (the host checks the extents).
template <int W>
__global__ void fold_kernel(__nv_bfloat16* qs, const __nv_bfloat16* q, const float* scale, int rows,
                            int C, int D, int ldq) {
  const int packs_per_row = C / W, packs = rows * packs_per_row;
  for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < packs;
       k += static_cast<int>(gridDim.x * blockDim.x)) {
    const int r = k / packs_per_row, c = (k - r * packs_per_row) * W;
    const float sh = scale[c / D];
    const Pack<__nv_bfloat16, W> x =
        *reinterpret_cast<const Pack<__nv_bfloat16, W>*>(q + static_cast<int64_t>(r) * ldq + c);
    Pack<__nv_bfloat16, W> y;
#pragma unroll
    for (int j = 0; j < W; ++j) y.v[j] = __float2bfloat16_rn(sh * __bfloat162float(x.v[j]));
    reinterpret_cast<Pack<__nv_bfloat16, W>*>(qs)[k] = y;
  }
}
__global__ void unfold_kernel(__nv_bfloat16* dq, const float* scale, int rows, int C, int D,
                              int64_t ldq) {
  const int n = rows * C;
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x)) {
    const int r = i / C, c = i - r * C;
    const int64_t at = r * ldq + c;
    dq[at] = __float2bfloat16_rn(scale[c / D] * __bfloat162float(dq[at]));
  }
}
// Block (p, h) sums dq' * q over the elements p * blockDim + t + j * kPartials * blockDim of head
// h's rows * D elements into partial[h * kPartials + p], then writes dq = scale[h] * dq' for the
// same elements.
__global__ void unfold_sum_kernel(__nv_bfloat16* dq, float* partial, const __nv_bfloat16* q,
                                  const float* scale, int rows, int D, int64_t ldq) {
  __shared__ float shared[32];
  const int h = static_cast<int>(blockIdx.y), n = rows * D;
  const float sh = scale[h];
  float acc = 0.0f;
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x)) {
    const int r = i / D, d = i - r * D;
    const int64_t at = r * ldq + h * D + d;
    const float g = __bfloat162float(dq[at]);
    acc += g * __bfloat162float(q[at]);
    dq[at] = __float2bfloat16_rn(sh * g);
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[h * gridDim.x + blockIdx.x] = acc;
}
__global__ void sum_partials_kernel(float* dscale, const float* partial, int64_t H, int parts) {
  const int64_t h = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (h >= H) return;
  double sum = 0.0;
  for (int p = 0; p < parts; ++p) sum += partial[h * parts + p];
  dscale[h] += static_cast<float>(sum);
}

std::string shape_string(const AttentionShape& s) {
  return keel::detail::concat("B=", s.B, " T=", s.T, " H=", s.H, " D=", s.D, " ldq=", s.ldq);
}

}  // namespace

void fold_head_scale(Context& ctx, const AttentionShape& s, Bf16* qs, const Bf16* q,
                     const float* scale) {
  const int64_t rows = s.B * s.T, C = s.H * s.D, n = rows * C;
  if (n <= 0) return;
  KEEL_CHECK(n <= kMaxIndex32 && s.ldq <= kMaxIndex32 && C <= s.ldq, kUsage,
             "cuda fold_head_scale: ", shape_string(s), " past the kernel's 32-bit indices (",
             kMaxIndex32, " elements) or H * D past ldq");
  const int r = static_cast<int>(rows), c = static_cast<int>(C), d = static_cast<int>(s.D),
            ld = static_cast<int>(s.ldq);
  if (aligned16(qs, q) && C % 8 == 0 && s.D % 8 == 0 && s.ldq % 8 == 0) {
    fold_kernel<8><<<grid_for(n / 8, kThreads), kThreads, 0, ctx.stream()>>>(dev(qs), dev(q), scale,
                                                                             r, c, d, ld);
  } else {
    fold_kernel<1>
        <<<grid_for(n, kThreads), kThreads, 0, ctx.stream()>>>(dev(qs), dev(q), scale, r, c, d, ld);
  }
  KEEL_CUDA_LAUNCH_CHECK("fold_head_scale", shape_string(s));
}

void unfold_head_scale_grad(Context& ctx, const AttentionShape& s, Bf16* dq, float* dscale,
                            const Bf16* q, const float* scale) {
  const int64_t rows = s.B * s.T, n = rows * s.H * s.D;
  if (n <= 0) return;
  KEEL_CHECK(n <= kMaxIndex32, kUsage, "cuda unfold_head_scale_grad: ", shape_string(s),
             " past the kernel's 32-bit indices (", kMaxIndex32, " elements)");
  const int r = static_cast<int>(rows), d = static_cast<int>(s.D);
  if (dscale == nullptr) {
    unfold_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        dev(dq), scale, r, static_cast<int>(s.H * s.D), d, s.ldq);
    KEEL_CUDA_LAUNCH_CHECK("unfold_head_scale_grad", shape_string(s));
    return;
  }
  // Partials live in a buffer from the allocator's cache; freeing it at return is safe because
  // its users are already enqueued on this stream (Note [cuda-stream-order]).
  DeviceBuffer partial = ctx.alloc(static_cast<size_t>(s.H) * kPartials * sizeof(float));
  const dim3 grid(kPartials, static_cast<unsigned>(s.H));
  unfold_sum_kernel<<<grid, kThreads, 0, ctx.stream()>>>(dev(dq), partial.as<float>(), dev(q),
                                                         scale, r, d, s.ldq);
  KEEL_CUDA_LAUNCH_CHECK("unfold_head_scale_grad (dscale sum)", shape_string(s));
  sum_partials_kernel<<<grid_for(s.H, 128), 128, 0, ctx.stream()>>>(dscale, partial.as<float>(),
                                                                    s.H, kPartials);
  KEEL_CUDA_LAUNCH_CHECK("unfold_head_scale_grad (dscale partials)", shape_string(s));
}

}  // namespace keel::kernels::cuda::cudnn
