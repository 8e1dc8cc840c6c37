// CUDA rotary position embedding (RoPE, framework/kernels/rope.h; ops.h): the cos/sin table on the
// device and the rotation of each head's pairs, forward and backward (the inverse rotation).
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// ---- RoPE: one thread per (row, head, pair); each pair is read before it is written ----
// TO, TI: the output and input types (an fp32 input may be written in bf16: Note [act-dtype]).
template <typename TO, typename TI>
__global__ void rope_kernel(const float* cos_t, const float* sin_t, int half, TO* out, const TI* in,
                            int T_, int H, int D, int64_t row_stride, int pos_offset, float sign,
                            int total) {
  for (int idx = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); idx < total;
       idx += static_cast<int>(gridDim.x * blockDim.x)) {
    const int rest = idx / half, i = idx - rest * half;
    const int r = rest / H, h = rest - r * H;
    const int p = r % T_ + pos_offset;
    const float ci = cos_t[p * half + i], si = sign * sin_t[p * half + i];
    const TI* xh = in + r * row_stride + h * D;
    TO* yh = out + r * row_stride + h * D;
    const float x1 = to_f(xh[i]), x2 = to_f(xh[i + half]);
    yh[i] = from_f<TO>(x1 * ci - x2 * si);
    yh[i + half] = from_f<TO>(x2 * ci + x1 * si);
  }
}
template <typename TO, typename TI>
void rope_impl(Context& ctx, const DeviceRopeTable& table, TO* out, const TI* in, int64_t B,
               int64_t T_, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset, float sign,
               const char* name) {
  const int64_t half = table.half_dim();
  KEEL_CHECK(D == 2 * half, kUsage, "rope: head_dim ", D, " does not match the table's ", 2 * half);
  KEEL_CHECK(B >= 0 && T_ >= 0 && H >= 0, kUsage, "rope: negative shape B=", B, " T=", T_,
             " H=", H);
  KEEL_CHECK(row_stride >= H * D, kUsage, "rope: row_stride ", row_stride, " < H * D = ", H * D);
  KEEL_CHECK(pos_offset >= 0 && pos_offset + T_ <= table.max_positions(), kUsage,
             "rope: positions [", pos_offset, ", ", pos_offset + T_, ") exceed the table's ",
             table.max_positions());
  const int64_t total = B * T_ * H * half;
  if (total == 0) return;
  KEEL_CHECK(total <= kMaxIndex32 && table.max_positions() * half <= kMaxIndex32, kUsage,
             "rope: ", total, " pairs or the table past the kernel's 32-bit indices (", kMaxIndex32,
             ")");
  rope_kernel<<<grid_for(total, kThreads), kThreads, 0, ctx.stream()>>>(
      table.cos(), table.sin(), static_cast<int>(half), dev(out), dev(in), static_cast<int>(T_),
      static_cast<int>(H), static_cast<int>(D), row_stride, static_cast<int>(pos_offset), sign,
      static_cast<int>(total));
  KEEL_CUDA_LAUNCH_CHECK(name, "B=", B, " T=", T_, " H=", H, " D=", D, " row_stride=", row_stride);
}

}  // namespace

DeviceRopeTable::DeviceRopeTable(Context& ctx, const RopeTable& table)
    : max_positions_(table.max_positions),
      half_dim_(table.half_dim),
      cos_(upload(ctx, table.cos)),
      sin_(upload(ctx, table.sin)) {
  KEEL_CHECK(table.cos.size() == static_cast<size_t>(max_positions_ * half_dim_) &&
                 table.sin.size() == table.cos.size(),
             kUsage, "rope: table arrays do not hold max_positions * half_dim values");
}

void rope_forward(Context& ctx, const DeviceRopeTable& table, float* y, const float* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_impl(ctx, table, y, x, B, T, H, D, row_stride, pos_offset, 1.0f, "rope_forward");
}
void rope_forward(Context& ctx, const DeviceRopeTable& table, Bf16* y, const Bf16* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_impl(ctx, table, y, x, B, T, H, D, row_stride, pos_offset, 1.0f, "rope_forward");
}
void rope_forward(Context& ctx, const DeviceRopeTable& table, Bf16* y, const float* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_impl(ctx, table, y, x, B, T, H, D, row_stride, pos_offset, 1.0f, "rope_forward");
}
void rope_backward(Context& ctx, const DeviceRopeTable& table, float* dx, const float* dy,
                   int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   int64_t pos_offset) {
  rope_impl(ctx, table, dx, dy, B, T, H, D, row_stride, pos_offset, -1.0f, "rope_backward");
}
void rope_backward(Context& ctx, const DeviceRopeTable& table, Bf16* dx, const Bf16* dy, int64_t B,
                   int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset) {
  rope_impl(ctx, table, dx, dy, B, T, H, D, row_stride, pos_offset, -1.0f, "rope_backward");
}

}  // namespace keel::kernels::cuda
