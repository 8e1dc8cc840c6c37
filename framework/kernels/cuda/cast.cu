// fp32 <-> bf16 conversion of strided row blocks: the casts of the BF16 execution precision
// (cuda/exec_context.cc), which rounds the inputs of matrix products and attention to bf16 and
// keeps every stored activation, weight and gradient in fp32.
#include <cuda_runtime.h>

#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// One grid-stride loop over rows x cols; consecutive threads take consecutive columns, so both
// sides are read and written coalesced within a row.
__global__ void to_bf16_kernel(__nv_bfloat16* out, int64_t ld_out, const float* in, int64_t ld_in,
                               int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    out[r * ld_out + c] = __float2bfloat16_rn(in[r * ld_in + c]);
  }
}

__global__ void from_bf16_kernel(float* out, int64_t ld_out, const __nv_bfloat16* in, int64_t ld_in,
                                 int64_t rows, int64_t cols, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float x = __bfloat162float(in[r * ld_in + c]);
    out[r * ld_out + c] = accumulate ? out[r * ld_out + c] + x : x;
  }
}

}  // namespace

void to_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const float* in, int64_t ld_in,
                  int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  to_bf16_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, ctx.stream()>>>(
      dev(out), ld_out, in, ld_in, rows, cols);
  KEEL_CUDA_LAUNCH_CHECK("to_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

void from_bf16_rows(Context& ctx, float* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  from_bf16_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, ctx.stream()>>>(
      out, ld_out, dev(in), ld_in, rows, cols, accumulate);
  KEEL_CUDA_LAUNCH_CHECK("from_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

}  // namespace keel::kernels::cuda
