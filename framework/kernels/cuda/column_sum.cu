// CUDA column sums (Note [fused-bias-grad] in internal.h): a linear layer's bias gradient
// (column_sum_add, ops.h; glu.cu sums its row-chunk partials through it too) and the final pass
// over the row-chunk partials of GELU's fused bias gradient (elementwise.cu) and of the norms' gain
// and bias gradients (norm.cu) (column_sum_partials_add, internal.h).
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

// ---- column sums (Note [fused-bias-grad]): 32-column strips x row chunks ----
// The column sums of rows [blockIdx.y * rows, + rows) of x into partial[blockIdx.y, C], or with one
// chunk (partial null) added to out. 32-bit indices (the host checks N, C, ld <= kMaxIndex32).
template <typename T>
__global__ void column_sum_add_kernel(float* out, float* partial, const T* x, int N, int C, int ld,
                                      int rows) {
  __shared__ float s[kColRows][33];
  const int c = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  const int r0 = static_cast<int>(blockIdx.y) * rows, r1 = rows < N - r0 ? r0 + rows : N;
  float acc = 0.0f;
  if (c < C) {
    for (int r = r0 + static_cast<int>(threadIdx.y); r < r1; r += kColRows) {
      acc += to_f(x[static_cast<int64_t>(r) * ld + c]);
    }
  }
  acc = column_block_sum(acc, s);
  if (threadIdx.y == 0 && c < C) {
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.y) * C + c] = acc;
    } else {
      out[c] += acc;
    }
  }
}
// The final pass: out[c] += the column sums of partial[chunks, C] (blockIdx.y 0), out2[c] += those
// of the next [chunks, C] (blockIdx.y 1); a null output's blocks leave at once.
__global__ void column_sum_partials_kernel(float* out, float* out2, const float* partial,
                                           int chunks, int C) {
  __shared__ float s[kColRows][33];
  float* o = blockIdx.y == 0 ? out : out2;
  if (o == nullptr) return;  // the whole block leaves together
  const float* p = partial + static_cast<int64_t>(blockIdx.y) * chunks * C;
  const int c = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  float acc = 0.0f;
  if (c < C) {
    for (int k = static_cast<int>(threadIdx.y); k < chunks; k += kColRows) {
      acc += p[static_cast<int64_t>(k) * C + c];
    }
  }
  acc = column_block_sum(acc, s);
  if (threadIdx.y == 0 && c < C) o[c] += acc;
}
template <typename T>
void column_sum_add_impl(Context& ctx, float* out, const T* x, int64_t N, int64_t C, int64_t ld) {
  KEEL_CHECK(N >= 0 && C >= 0 && ld >= C, kUsage, "cuda column_sum_add: bad shape N=", N, " C=", C,
             " ld=", ld);
  if (N == 0 || C == 0) return;
  KEEL_CHECK(N <= kMaxIndex32 && ld <= kMaxIndex32, kUsage, "cuda column_sum_add: N=", N,
             " ld=", ld, " past the kernel's 32-bit indices (", kMaxIndex32, ")");
  const RowChunks k = row_chunks(N, C);
  auto* partial =
      k.count > 1 ? static_cast<float*>(ctx.scratch(sizeof(float) * k.count * C)) : nullptr;
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(k.count));
  column_sum_add_kernel<<<grid, dim3(32, kColRows), 0, ctx.stream()>>>(
      out, partial, x, static_cast<int>(N), static_cast<int>(C), static_cast<int>(ld),
      static_cast<int>(k.rows));
  KEEL_CUDA_LAUNCH_CHECK("column_sum_add", "N=", N, " C=", C, " ld=", ld, " chunks=", k.count);
  if (partial != nullptr) column_sum_partials_add(ctx, out, nullptr, partial, k.count, C);
}

}  // namespace

void column_sum_add(Context& ctx, float* out, const float* x, int64_t N, int64_t C, int64_t ld) {
  column_sum_add_impl(ctx, out, x, N, C, ld);
}
void column_sum_add(Context& ctx, float* out, const Bf16* x, int64_t N, int64_t C, int64_t ld) {
  column_sum_add_impl(ctx, out, dev(x), N, C, ld);
}

void column_sum_partials_add(Context& ctx, float* out, float* out2, const float* partial,
                             int64_t chunks, int64_t C) {
  KEEL_CHECK(chunks >= 1 && C >= 1 && chunks * C <= kMaxIndex32, kUsage,
             "cuda column_sum_partials_add: chunks=", chunks, " C=", C);
  if (out == nullptr && out2 == nullptr) return;
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), out2 != nullptr ? 2u : 1u);
  column_sum_partials_kernel<<<grid, dim3(32, kColRows), 0, ctx.stream()>>>(
      out, out2, partial, static_cast<int>(chunks), static_cast<int>(C));
  KEEL_CUDA_LAUNCH_CHECK("column_sum_partials_add", "chunks=", chunks, " C=", C);
}

}  // namespace keel::kernels::cuda
