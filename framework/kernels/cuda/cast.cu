// fp32 <-> bf16 conversion of strided row blocks, and bf16 row copies between strides: the casts
// of the BF16 execution precision (cuda/exec_context.cc), which rounds the inputs of matrix
// products and attention to bf16 (Note [cuda-exec-bf16]) where they are not stored in bf16 already
// (Note [act-dtype]).
#include <cuda_runtime.h>

#include <algorithm>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// Rows along the grid's y (grid-stride), columns along x: consecutive threads take consecutive
// packs of W columns (Note [vector-access], internal.h), then a row's last cols % W columns one
// each, so both sides are read and written coalesced within a row, and no thread divides. The host
// takes W = 8 when both base pointers are 16-byte aligned and both leading dimensions are
// multiples of 8, else W = 1; 32-bit extents (up to kMaxIndex32), the row offset widened in its
// multiply.
template <int W>
__global__ void to_bf16_kernel(__nv_bfloat16* out, int ld_out, const float* in, int ld_in, int rows,
                               int cols) {
  const int packs = cols / W, items = packs + cols % W;
  for (int r = static_cast<int>(blockIdx.y); r < rows; r += static_cast<int>(gridDim.y)) {
    const float* src = in + static_cast<int64_t>(r) * ld_in;
    __nv_bfloat16* dst = out + static_cast<int64_t>(r) * ld_out;
    for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < items;
         k += static_cast<int>(gridDim.x * blockDim.x)) {
      if (k < packs) {
        const Pack<float, W> x = reinterpret_cast<const Pack<float, W>*>(src)[k];
        Pack<__nv_bfloat16, W> y;
#pragma unroll
        for (int j = 0; j < W; ++j) y.v[j] = __float2bfloat16_rn(x.v[j]);
        reinterpret_cast<Pack<__nv_bfloat16, W>*>(dst)[k] = y;
      } else {
        const int c = packs * W + (k - packs);
        dst[c] = __float2bfloat16_rn(src[c]);
      }
    }
  }
}

template <int W>
__global__ void from_bf16_kernel(float* out, int ld_out, const __nv_bfloat16* in, int ld_in,
                                 int rows, int cols, bool accumulate) {
  const int packs = cols / W, items = packs + cols % W;
  for (int r = static_cast<int>(blockIdx.y); r < rows; r += static_cast<int>(gridDim.y)) {
    const __nv_bfloat16* src = in + static_cast<int64_t>(r) * ld_in;
    float* dst = out + static_cast<int64_t>(r) * ld_out;
    for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < items;
         k += static_cast<int>(gridDim.x * blockDim.x)) {
      if (k < packs) {
        const Pack<__nv_bfloat16, W> x = reinterpret_cast<const Pack<__nv_bfloat16, W>*>(src)[k];
        Pack<float, W> y;
        if (accumulate) y = reinterpret_cast<const Pack<float, W>*>(dst)[k];
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const float v = __bfloat162float(x.v[j]);
          y.v[j] = accumulate ? y.v[j] + v : v;
        }
        reinterpret_cast<Pack<float, W>*>(dst)[k] = y;
      } else {
        const int c = packs * W + (k - packs);
        const float v = __bfloat162float(src[c]);
        dst[c] = accumulate ? dst[c] + v : v;
      }
    }
  }
}

template <int W>
__global__ void copy_bf16_kernel(__nv_bfloat16* out, int ld_out, const __nv_bfloat16* in, int ld_in,
                                 int rows, int cols) {
  const int packs = cols / W, items = packs + cols % W;
  for (int r = static_cast<int>(blockIdx.y); r < rows; r += static_cast<int>(gridDim.y)) {
    const __nv_bfloat16* src = in + static_cast<int64_t>(r) * ld_in;
    __nv_bfloat16* dst = out + static_cast<int64_t>(r) * ld_out;
    for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < items;
         k += static_cast<int>(gridDim.x * blockDim.x)) {
      if (k < packs) {
        reinterpret_cast<Pack<__nv_bfloat16, W>*>(dst)[k] =
            reinterpret_cast<const Pack<__nv_bfloat16, W>*>(src)[k];
      } else {
        const int c = packs * W + (k - packs);
        dst[c] = src[c];
      }
    }
  }
}

// Blocks: x over a row's packs (at most 64), y over rows (at most 65535, the y dimension's limit).
dim3 rows_grid(int64_t rows, int64_t items) {
  const int64_t x = std::min<int64_t>((items + kThreads - 1) / kThreads, 64);
  const int64_t y = std::min<int64_t>(rows, 65535);
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

void check_rows(const char* name, int64_t ld_out, int64_t ld_in, int64_t rows, int64_t cols) {
  KEEL_CHECK(rows == 1 || (ld_out >= cols && ld_in >= cols), kUsage, "cuda ", name, ": cols=", cols,
             " past ld_out=", ld_out, " or ld_in=", ld_in);
  KEEL_CHECK(rows <= kMaxIndex32 && ld_out <= kMaxIndex32 && ld_in <= kMaxIndex32, kUsage, "cuda ",
             name, ": rows=", rows, " ld_out=", ld_out, " ld_in=", ld_in,
             " past the kernel's 32-bit indices (", kMaxIndex32, ")");
}

}  // namespace

void to_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const float* in, int64_t ld_in,
                  int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  check_rows("to_bf16_rows", ld_out, ld_in, rows, cols);
  const int r = static_cast<int>(rows), c = static_cast<int>(cols);
  const int lo = static_cast<int>(ld_out), li = static_cast<int>(ld_in);
  if (aligned16(out, in) && ld_out % 8 == 0 && ld_in % 8 == 0) {
    to_bf16_kernel<8>
        <<<rows_grid(rows, c / 8 + c % 8), kThreads, 0, ctx.stream()>>>(dev(out), lo, in, li, r, c);
  } else {
    to_bf16_kernel<1>
        <<<rows_grid(rows, c), kThreads, 0, ctx.stream()>>>(dev(out), lo, in, li, r, c);
  }
  KEEL_CUDA_LAUNCH_CHECK("to_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

void from_bf16_rows(Context& ctx, float* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  check_rows("from_bf16_rows", ld_out, ld_in, rows, cols);
  const int r = static_cast<int>(rows), c = static_cast<int>(cols);
  const int lo = static_cast<int>(ld_out), li = static_cast<int>(ld_in);
  if (aligned16(out, in) && ld_out % 8 == 0 && ld_in % 8 == 0) {
    from_bf16_kernel<8><<<rows_grid(rows, c / 8 + c % 8), kThreads, 0, ctx.stream()>>>(
        out, lo, dev(in), li, r, c, accumulate);
  } else {
    from_bf16_kernel<1>
        <<<rows_grid(rows, c), kThreads, 0, ctx.stream()>>>(out, lo, dev(in), li, r, c, accumulate);
  }
  KEEL_CUDA_LAUNCH_CHECK("from_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
                         " ld_out=", ld_out);
}

void copy_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  check_rows("copy_bf16_rows", ld_out, ld_in, rows, cols);
  const int r = static_cast<int>(rows), c = static_cast<int>(cols);
  const int lo = static_cast<int>(ld_out), li = static_cast<int>(ld_in);
  if (aligned16(out, in) && ld_out % 8 == 0 && ld_in % 8 == 0) {
    copy_bf16_kernel<8><<<rows_grid(rows, c / 8 + c % 8), kThreads, 0, ctx.stream()>>>(
        dev(out), lo, dev(in), li, r, c);
  } else {
    copy_bf16_kernel<1>
        <<<rows_grid(rows, c), kThreads, 0, ctx.stream()>>>(dev(out), lo, dev(in), li, r, c);
  }
  KEEL_CUDA_LAUNCH_CHECK("copy_bf16_rows", "rows=", rows, " cols=", cols, " ld_in=", ld_in,
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
