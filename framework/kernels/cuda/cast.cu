// fp32 <-> bf16 conversion of strided row blocks: the casts of the BF16 execution precision
// (cuda/exec_context.cc), which rounds the inputs of matrix products and attention to bf16 and
// keeps every stored activation, weight and gradient in fp32.
#include <cuda_runtime.h>

#include <algorithm>

#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// Rows along the grid's y (grid-stride), columns along x: consecutive threads take consecutive
// columns, so both sides are read and written coalesced within a row, and no thread divides.
__global__ void to_bf16_kernel(__nv_bfloat16* out, int64_t ld_out, const float* in, int64_t ld_in,
                               int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < cols;
         c += int64_t{gridDim.x} * blockDim.x) {
      out[r * ld_out + c] = __float2bfloat16_rn(in[r * ld_in + c]);
    }
  }
}

__global__ void from_bf16_kernel(float* out, int64_t ld_out, const __nv_bfloat16* in, int64_t ld_in,
                                 int64_t rows, int64_t cols, bool accumulate) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < cols;
         c += int64_t{gridDim.x} * blockDim.x) {
      const float x = __bfloat162float(in[r * ld_in + c]);
      out[r * ld_out + c] = accumulate ? out[r * ld_out + c] + x : x;
    }
  }
}

dim3 rows_grid(int64_t rows, int64_t cols) {
  const int64_t x = std::min<int64_t>((cols + kThreads - 1) / kThreads, 64);
  const int64_t y = std::min<int64_t>(rows, 65535);  // the y dimension's limit
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

}  // namespace

void to_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const float* in, int64_t ld_in,
                  int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  to_bf16_kernel<<<rows_grid(rows, cols), kThreads, 0, ctx.stream()>>>(dev(out), ld_out, in, ld_in,
                                                                       rows, cols);
  KEEL_CUDA_LAUNCH_CHECK("to_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

void from_bf16_rows(Context& ctx, float* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  from_bf16_kernel<<<rows_grid(rows, cols), kThreads, 0, ctx.stream()>>>(
      out, ld_out, dev(in), ld_in, rows, cols, accumulate);
  KEEL_CUDA_LAUNCH_CHECK("from_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

namespace {

// A flat cast as row blocks of up to 8192 columns (plus a last partial row), so the cast kernels'
// grid spreads over rows as well as columns.
template <typename Cast>
void flat_rows(int64_t n, Cast cast) {
  if (n <= 0) return;
  const int64_t cols = std::min<int64_t>(n, 8192), rows = n / cols, rest = n - rows * cols;
  cast(0, rows, cols);
  if (rest > 0) cast(rows * cols, 1, rest);
}

}  // namespace

void to_bf16(Context& ctx, Bf16* out, const float* in, int64_t n) {
  flat_rows(n, [&](int64_t off, int64_t rows, int64_t cols) {
    to_bf16_rows(ctx, out + off, cols, in + off, cols, rows, cols);
  });
}

void from_bf16(Context& ctx, float* out, const Bf16* in, int64_t n) {
  flat_rows(n, [&](int64_t off, int64_t rows, int64_t cols) {
    from_bf16_rows(ctx, out + off, cols, in + off, cols, rows, cols, false);
  });
}

}  // namespace keel::kernels::cuda
