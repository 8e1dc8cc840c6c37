// CUDA element-wise kernels, reductions for the gradient norm, AdamW, the bias-add fallback and
// benchmark fills (see ops.h, gemm.h); column sums are in column_sum.cu, RoPE in rope.cu.
// Per-element math comes from the CPU headers' __host__ __device__ functions where they have one
// (gelu_scalar, philox_uniform).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/elementwise.h"
#include "framework/philox.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// ---- GELU, add: Note [vector-access] (internal.h) ----
// map_packs (common.cuh): packs of W elements, the tail one per thread. TO, TI: the output and
// input types (an fp32 input may be written in bf16: Note [act-dtype]).
template <int W, typename TO, typename TI>
__global__ void gelu_forward_kernel(TO* out, const TI* inp, int n) {
  map_packs<W>(out, inp, n, [](TI x) { return from_f<TO>(gelu_scalar<float>(to_f(x))); });
}
template <int W, typename TO, typename TI>
__global__ void gelu_backward_kernel(TO* dinp, const TI* inp, const TI* dout, int n) {
  map_packs<W>(dinp, inp, dout, n,
               [](TI x, TI d) { return from_f<TO>(to_f(d) * gelu_grad_scalar<float>(to_f(x))); });
}
// Note [fused-bias-grad]: the same values, and their column sums over this block's row chunk into
// partial[blockIdx.y, C]. Thread (x, y) takes columns W * (32 blockIdx.x + x) + [0, W) of rows
// r0 + y, r0 + y + kColRows, ...: each column's sum in the order of W = 1 (the host picks W = 4
// when C % 4 == 0 and the buffers are 16-byte aligned), so the partials are the same bits. dinp
// may alias dout (each element is read, then written, by one thread). TI: inp's and dout's type
// (bf16 for the MLP's bf16 pre-activation and hidden gradient: Note [act-dtype]), widened exactly.
template <int W, typename TO, typename TI>
__global__ void gelu_backward_bias_kernel(TO* dinp, float* partial, const TI* inp, const TI* dout,
                                          int N, int C, int rows) {
  __shared__ float s[kColRows][33];
  const int c = (static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x)) * W;
  const int r0 = static_cast<int>(blockIdx.y) * rows, r1 = rows < N - r0 ? r0 + rows : N;
  float acc[W];
#pragma unroll
  for (int j = 0; j < W; ++j) acc[j] = 0.0f;
  if (c < C) {  // C % W == 0: the whole pack is in the row
    for (int r = r0 + static_cast<int>(threadIdx.y); r < r1; r += kColRows) {
      const int64_t i = static_cast<int64_t>(r) * C + c;
      const Pack<TI, W> x = *reinterpret_cast<const Pack<TI, W>*>(inp + i);
      const Pack<TI, W> g = *reinterpret_cast<const Pack<TI, W>*>(dout + i);
      Pack<TO, W> y;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float d = to_f(g.v[j]) * gelu_grad_scalar<float>(to_f(x.v[j]));
        y.v[j] = from_f<TO>(d);
        acc[j] += d;
      }
      *reinterpret_cast<Pack<TO, W>*>(dinp + i) = y;
    }
  }
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float sum = column_block_sum(acc[j], s);
    if (threadIdx.y == 0 && c < C) partial[static_cast<int64_t>(blockIdx.y) * C + c + j] = sum;
  }
}
template <int W, typename T, typename TB>
__global__ void add_kernel(T* out, const T* a, const TB* b, int n) {
  map_packs<W>(out, a, b, n, [](T x, TB y) { return from_f<T>(to_f(x) + to_f(y)); });
}

// Blocks for n elements in packs of W (at least one, for the tail's n % W threads).
unsigned pack_blocks(int n, int W) { return grid_for(n / W, kThreads); }

template <typename TO, typename TI>
void gelu_forward_impl(Context& ctx, TO* out, const TI* inp, int64_t n) {
  constexpr int W = pack_width<TO, TI>();
  for_pieces(n, [&](int64_t at, int m) {
    TO* o = out + at;
    const TI* x = inp + at;
    if (aligned16(o, x)) {
      gelu_forward_kernel<W, TO, TI><<<pack_blocks(m, W), kThreads, 0, ctx.stream()>>>(o, x, m);
    } else {
      gelu_forward_kernel<1, TO, TI><<<pack_blocks(m, 1), kThreads, 0, ctx.stream()>>>(o, x, m);
    }
    KEEL_CUDA_LAUNCH_CHECK("gelu_forward", "n=", n);
  });
}
template <typename TO, typename TI>
void gelu_backward_impl(Context& ctx, TO* dinp, const TI* inp, const TI* dout, int64_t n) {
  constexpr int W = pack_width<TO, TI>();
  for_pieces(n, [&](int64_t at, int m) {
    TO* o = dinp + at;
    const TI *x = inp + at, *d = dout + at;
    if (aligned16(o, x, d)) {
      gelu_backward_kernel<W, TO, TI><<<pack_blocks(m, W), kThreads, 0, ctx.stream()>>>(o, x, d, m);
    } else {
      gelu_backward_kernel<1, TO, TI><<<pack_blocks(m, 1), kThreads, 0, ctx.stream()>>>(o, x, d, m);
    }
    KEEL_CUDA_LAUNCH_CHECK("gelu_backward", "n=", n);
  });
}
template <typename TO, typename TI>
void gelu_backward_bias_impl(Context& ctx, TO* dinp, float* dbias, const TI* inp, const TI* dout,
                             int64_t N, int64_t C) {
  KEEL_CHECK(N >= 0 && C >= 0, kUsage, "cuda gelu_backward: bad shape N=", N, " C=", C);
  if (dbias == nullptr) {
    gelu_backward_impl(ctx, dinp, inp, dout, N * C);
    return;
  }
  if (N == 0 || C == 0) return;
  KEEL_CHECK(N <= kMaxIndex32 && C <= kMaxIndex32, kUsage, "cuda gelu_backward: N=", N, " C=", C,
             " past the kernel's 32-bit indices (", kMaxIndex32, ")");
  const RowChunks k = row_chunks(N, C);
  auto* partial = static_cast<float*>(ctx.scratch(sizeof(float) * k.count * C));
  const int n = static_cast<int>(N), c = static_cast<int>(C), rows = static_cast<int>(k.rows);
  const dim3 block(32, kColRows);
  if (C % 4 == 0 && aligned16(dinp, inp, dout)) {
    const dim3 grid(static_cast<unsigned>((C / 4 + 31) / 32), static_cast<unsigned>(k.count));
    gelu_backward_bias_kernel<4, TO, TI>
        <<<grid, block, 0, ctx.stream()>>>(dinp, partial, inp, dout, n, c, rows);
  } else {
    const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(k.count));
    gelu_backward_bias_kernel<1, TO, TI>
        <<<grid, block, 0, ctx.stream()>>>(dinp, partial, inp, dout, n, c, rows);
  }
  KEEL_CUDA_LAUNCH_CHECK("gelu_backward (bias)", "N=", N, " C=", C);
  column_sum_partials_add(ctx, dbias, nullptr, partial, k.count, C);
}
template <typename T, typename TB>
void add_impl(Context& ctx, T* out, const T* a, const TB* b, int64_t n, const char* name) {
  constexpr int W = pack_width<T, TB>();
  for_pieces(n, [&](int64_t at, int m) {
    T* o = out + at;
    const T* x = a + at;
    const TB* y = b + at;
    if (aligned16(o, x, y)) {
      add_kernel<W, T, TB><<<pack_blocks(m, W), kThreads, 0, ctx.stream()>>>(o, x, y, m);
    } else {
      add_kernel<1, T, TB><<<pack_blocks(m, 1), kThreads, 0, ctx.stream()>>>(o, x, y, m);
    }
    KEEL_CUDA_LAUNCH_CHECK(name, "n=", n);
  });
}

// ---- sum of squares: fixed grid (a function of n only), per-block partials, one final block ----
constexpr int kSumBlocksMax = 1024;

__global__ void sum_squares_partial_kernel(const float* x, int64_t n, double* partial) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
__global__ void sum_partials_kernel(const double* partial, int count, double* out,
                                    bool accumulate) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *out = accumulate ? *out + acc : acc;
}
// ---- Note [multi-tensor norm] ----
// The global gradient norm over the optimizer's segments (sum_squares_segments) in
// ceil(segments / kNormSegmentsPerLaunch) + 1 launches, where sum_squares per tensor took two
// launches a parameter. The order of the sum depends on the segments' lengths alone, not on how
// many launches the table takes or how the GPU schedules the blocks:
// - each segment is cut into chunks of kNormChunk elements from its start (the last one ragged),
//   numbered in segment order, then chunk order;
// - chunk j's block: thread i (of kThreads) adds the squares of the chunk's elements i, i +
//   kThreads, ... in double, in ascending order; block_sum combines the threads' sums in its fixed
//   tree; the result is partial[j] (no atomics);
// - one block of kSumFinalThreads threads: thread i adds partial[i], partial[i + 1024], ... in
//   ascending order, block_sum combines them into *out.
// Every square is exact in double (a float's 24-bit mantissa squared), so the result is within
// depth * 2^-53 of the exact sum, relatively, for an addition tree `depth` deep: here at most
// kNormChunk / kThreads + 8 + chunks / 1024 + 10 (ops_test.cc checks the bound). sum_squares per
// tensor then accumulated in parameter order is another tree, so the two differ in the last bits.
// Long segments are split on the host at a multiple of kNormChunk (kNormPieceMax), which changes
// no chunk, so a table entry's length fits 32 bits.
constexpr int kNormSegmentsPerLaunch = 240;    // a 3848-byte table, in the 4 KiB of parameters
constexpr int64_t kNormChunk = 32 * kThreads;  // elements per block
constexpr int64_t kNormPieceMax = kNormChunk << 18;  // 2^31 elements
constexpr int kSumFinalThreads = 1024;
struct NormTable {
  int64_t offset[kNormSegmentsPerLaunch];
  unsigned n[kNormSegmentsPerLaunch];
  unsigned first_block[kNormSegmentsPerLaunch + 1];
  int count;
};
__global__ void __launch_bounds__(kThreads)
    sum_squares_segments_kernel(NormTable t, const float* x, double* partial) {
  __shared__ double shared[32];
  // This block's segment: the last k with first_block[k] <= blockIdx.x (a binary search).
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= blockIdx.x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t chunk = blockIdx.x - t.first_block[lo];
  const int64_t begin = t.offset[lo] + chunk * kNormChunk;
  const int64_t left = int64_t{t.n[lo]} - chunk * kNormChunk;
  const int64_t end = begin + (left < kNormChunk ? left : kNormChunk);
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = x[i];
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void clip_scale_kernel(const double* sum_sq, double max_norm, float* scale) {
  // keel::clip_scale (framework/optim/optimizer.cc), on the device.
  const double norm = sqrt(*sum_sq);
  *scale =
      (max_norm <= 0.0 || !(norm > max_norm)) ? 1.0f : static_cast<float>(max_norm / (norm + 1e-6));
}

// ---- AdamW: the CPU's float expression order (framework/kernels/cpu/adamw.cc) ----
// Element i's update, shared by the per-tensor and the segmented kernels, so both compute the
// same bits.
__device__ __forceinline__ void adamw_element(float* param, const float* grad, float* m, float* v,
                                              int64_t i, float lr, float b1, float b2, float eps,
                                              float wd, float scale, float c1, float c2) {
  const float g = grad[i] * scale;
  const float mi = b1 * m[i] + (1.0f - b1) * g;
  const float vi = b2 * v[i] + (1.0f - b2) * g * g;
  m[i] = mi;
  v[i] = vi;
  param[i] -= lr * ((mi * c1) / (sqrtf(vi * c2) + eps) + wd * param[i]);
}
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                             float lr, float b1, float b2, float eps, float wd, float gs,
                             const float* dev_gs, float c1, float c2) {
  const float scale = dev_gs != nullptr ? gs * *dev_gs : gs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    adamw_element(param, grad, m, v, i, lr, b1, b2, eps, wd, scale, c1, c2);
  }
}
// Segments of the flat arenas in one launch: the segments' table travels in the kernel's
// parameters (no upload, so no host wait), at most kAdamWSegmentsPerLaunch a launch (the table is
// 3 KiB of the 4 KiB parameter space). Segment k takes blocks [first_block[k], first_block[k + 1]),
// each over kAdamWChunk of its elements.
constexpr int kAdamWSegmentsPerLaunch = 128;
constexpr int64_t kAdamWChunk = 8 * kThreads;  // elements per block
struct AdamWTable {
  int64_t offset[kAdamWSegmentsPerLaunch];
  int64_t n[kAdamWSegmentsPerLaunch];
  float weight_decay[kAdamWSegmentsPerLaunch];
  unsigned first_block[kAdamWSegmentsPerLaunch + 1];
  int count;
};
__global__ void adamw_segments_kernel(AdamWTable t, float* param, const float* grad, float* m,
                                      float* v, float lr, float b1, float b2, float eps, float gs,
                                      const float* dev_gs, float c1, float c2) {
  // This block's segment: the last k with first_block[k] <= blockIdx.x (a binary search).
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= blockIdx.x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const float scale = dev_gs != nullptr ? gs * *dev_gs : gs;
  const int64_t begin = t.offset[lo] + int64_t{blockIdx.x - t.first_block[lo]} * kAdamWChunk;
  const int64_t left = t.offset[lo] + t.n[lo] - begin;
  const int64_t end = begin + (left < kAdamWChunk ? left : kAdamWChunk);
  const float wd = t.weight_decay[lo];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    adamw_element(param, grad, m, v, i, lr, b1, b2, eps, wd, scale, c1, c2);
  }
}

// Rows along the grid's y, columns along x (grid-stride both): no division; 32-bit extents, the
// row offset widened in its multiply.
template <typename T>
__global__ void add_bias_rows_kernel(T* C, const T* bias, int M, int N, int ldc) {
  for (int m = static_cast<int>(blockIdx.y); m < M; m += static_cast<int>(gridDim.y)) {
    T* row = C + static_cast<int64_t>(m) * ldc;
    for (int n = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); n < N;
         n += static_cast<int>(gridDim.x * blockDim.x)) {
      row[n] = from_f<T>(to_f(row[n]) + to_f(bias[n]));
    }
  }
}

template <typename T>
__global__ void fill_uniform_kernel(T* x, int64_t n, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const double u = philox_uniform(seed, 0, static_cast<uint64_t>(i));
    x[i] = from_f<T>(lo + (hi - lo) * static_cast<float>(u));
  }
}
template <typename T>
void fill_uniform_impl(Context& ctx, T* x, int64_t n, float lo, float hi, uint64_t seed) {
  if (n <= 0) return;
  fill_uniform_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream()>>>(x, n, lo, hi, seed);
  KEEL_CUDA_LAUNCH_CHECK("fill_uniform", "n=", n);
}

}  // namespace

void gelu_forward(Context& ctx, float* out, const float* inp, int64_t n) {
  gelu_forward_impl(ctx, out, inp, n);
}
void gelu_forward(Context& ctx, Bf16* out, const Bf16* inp, int64_t n) {
  gelu_forward_impl(ctx, dev(out), dev(inp), n);
}
void gelu_forward(Context& ctx, Bf16* out, const float* inp, int64_t n) {
  gelu_forward_impl(ctx, dev(out), inp, n);
}
void gelu_backward(Context& ctx, float* dinp, const float* inp, const float* dout, int64_t n) {
  gelu_backward_impl(ctx, dinp, inp, dout, n);
}
void gelu_backward(Context& ctx, Bf16* dinp, const Bf16* inp, const Bf16* dout, int64_t n) {
  gelu_backward_impl(ctx, dev(dinp), dev(inp), dev(dout), n);
}
void gelu_backward(Context& ctx, float* dinp, float* dbias, const float* inp, const float* dout,
                   int64_t N, int64_t C) {
  gelu_backward_bias_impl(ctx, dinp, dbias, inp, dout, N, C);
}
void gelu_backward(Context& ctx, Bf16* dinp, float* dbias, const float* inp, const float* dout,
                   int64_t N, int64_t C) {
  gelu_backward_bias_impl(ctx, dev(dinp), dbias, inp, dout, N, C);
}
void gelu_backward(Context& ctx, Bf16* dinp, float* dbias, const Bf16* inp, const Bf16* dout,
                   int64_t N, int64_t C) {
  gelu_backward_bias_impl(ctx, dev(dinp), dbias, dev(inp), dev(dout), N, C);
}
void add(Context& ctx, float* out, const float* a, const float* b, int64_t n) {
  add_impl(ctx, out, a, b, n, "add");
}
void add(Context& ctx, Bf16* out, const Bf16* a, const Bf16* b, int64_t n) {
  add_impl(ctx, dev(out), dev(a), dev(b), n, "add");
}
void add(Context& ctx, float* out, const float* a, const Bf16* b, int64_t n) {
  add_impl(ctx, out, a, dev(b), n, "add");
}
void add_inplace(Context& ctx, float* y, const float* x, int64_t n) {
  add_impl(ctx, y, y, x, n, "add_inplace");
}
void add_inplace(Context& ctx, Bf16* y, const Bf16* x, int64_t n) {
  add_impl(ctx, dev(y), dev(y), dev(x), n, "add_inplace");
}

void sum_squares(Context& ctx, const float* x, int64_t n, double* out, bool accumulate) {
  KEEL_CHECK(n >= 0, kUsage, "cuda sum_squares: negative length ", n);
  const int blocks = static_cast<int>(grid_for(n, kThreads, kSumBlocksMax));
  auto* partial = static_cast<double*>(ctx.scratch(sizeof(double) * kSumBlocksMax));
  if (n == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(partial, 0, sizeof(double), ctx.stream()), "sum_squares n=0");
  } else {
    sum_squares_partial_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(x, n, partial);
    KEEL_CUDA_LAUNCH_CHECK("sum_squares_partial", "n=", n, " blocks=", blocks);
  }
  sum_partials_kernel<<<1, 1024, 0, ctx.stream()>>>(partial, n == 0 ? 1 : blocks, out, accumulate);
  KEEL_CUDA_LAUNCH_CHECK("sum_squares_final", "n=", n, " blocks=", blocks);
}

void sum_squares_segments(Context& ctx, const float* x, const NormSegment* segments, int64_t count,
                          double* out) {
  KEEL_CHECK(count >= 0, kUsage, "cuda sum_squares_segments: count=", count);
  int64_t chunks = 0;  // over all segments: the partials' count
  for (int64_t k = 0; k < count; ++k) {
    const NormSegment& seg = segments[k];
    KEEL_CHECK(seg.offset >= 0 && seg.n >= 0, kUsage, "cuda sum_squares_segments: segment ", k,
               " offset=", seg.offset, " n=", seg.n);
    chunks += (seg.n + kNormChunk - 1) / kNormChunk;
  }
  KEEL_CHECK(chunks < (int64_t{1} << 31), kUsage, "cuda sum_squares_segments: ", chunks,
             " chunks exceed a grid");
  auto* partial = static_cast<double*>(ctx.scratch(sizeof(double) * (chunks > 0 ? chunks : 1)));
  if (chunks == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(partial, 0, sizeof(double), ctx.stream()),
                    "sum_squares_segments (no elements)");
  }
  NormTable t{};
  int64_t base = 0;    // partial index of this launch's first block
  int64_t blocks = 0;  // this launch's
  auto launch = [&] {
    if (t.count == 0) return;
    t.first_block[t.count] = static_cast<unsigned>(blocks);
    sum_squares_segments_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream()>>>(
        t, x, partial + base);
    KEEL_CUDA_LAUNCH_CHECK("sum_squares_segments", "segments=", t.count, " blocks=", blocks);
    base += blocks;
    t.count = 0;
    blocks = 0;
  };
  for (int64_t k = 0; k < count; ++k) {
    // A segment longer than kNormPieceMax in pieces of it: the same chunks, in the same order.
    for (int64_t at = 0; at < segments[k].n; at += kNormPieceMax) {
      const int64_t n = std::min(kNormPieceMax, segments[k].n - at);
      t.offset[t.count] = segments[k].offset + at;
      t.n[t.count] = static_cast<unsigned>(n);
      t.first_block[t.count] = static_cast<unsigned>(blocks);
      blocks += (n + kNormChunk - 1) / kNormChunk;
      if (++t.count == kNormSegmentsPerLaunch) launch();
    }
  }
  launch();
  sum_partials_kernel<<<1, kSumFinalThreads, 0, ctx.stream()>>>(
      partial, static_cast<int>(chunks > 0 ? chunks : 1), out, /*accumulate=*/false);
  KEEL_CUDA_LAUNCH_CHECK("sum_squares_segments (final)", "segments=", count, " chunks=", chunks);
}

void clip_scale_from_sum_squares(Context& ctx, const double* sum_sq, double max_norm,
                                 float* scale) {
  clip_scale_kernel<<<1, 1, 0, ctx.stream()>>>(sum_sq, max_norm, scale);
  KEEL_CUDA_LAUNCH_CHECK("clip_scale", "max_norm=", max_norm);
}

void adamw_update(Context& ctx, float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWStep& s, const float* device_grad_scale) {
  KEEL_CHECK(n >= 0 && s.t >= 1, kUsage, "cuda adamw_update: n=", n, " t=", s.t);
  if (n == 0) return;
  // Bias corrections on the host, exactly as the CPU kernel computes them.
  const float c1 = 1.0f / (1.0f - std::pow(s.beta1, static_cast<float>(s.t)));
  const float c2 = 1.0f / (1.0f - std::pow(s.beta2, static_cast<float>(s.t)));
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
      param, grad, m, v, n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.grad_scale,
      device_grad_scale, c1, c2);
  KEEL_CUDA_LAUNCH_CHECK("adamw_update", "n=", n, " t=", s.t);
}

void adamw_update_segments(Context& ctx, float* param, const float* grad, float* m, float* v,
                           const AdamWSegment* segments, int64_t count, const AdamWStep& s,
                           const float* device_grad_scale) {
  KEEL_CHECK(count >= 0 && s.t >= 1, kUsage, "cuda adamw_update_segments: count=", count,
             " t=", s.t);
  const float c1 = 1.0f / (1.0f - std::pow(s.beta1, static_cast<float>(s.t)));
  const float c2 = 1.0f / (1.0f - std::pow(s.beta2, static_cast<float>(s.t)));
  AdamWTable t{};
  int64_t blocks = 0;
  auto launch = [&] {
    if (t.count == 0) return;
    t.first_block[t.count] = static_cast<unsigned>(blocks);
    adamw_segments_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream()>>>(
        t, param, grad, m, v, s.lr, s.beta1, s.beta2, s.eps, s.grad_scale, device_grad_scale, c1,
        c2);
    KEEL_CUDA_LAUNCH_CHECK("adamw_update_segments", "segments=", t.count, " blocks=", blocks,
                           " t=", s.t);
    t.count = 0;
    blocks = 0;
  };
  constexpr int64_t kMaxBlocks = int64_t{1} << 31;  // gridDim.x's limit is 2^31 - 1
  for (int64_t k = 0; k < count; ++k) {
    const AdamWSegment& seg = segments[k];
    KEEL_CHECK(seg.offset >= 0 && seg.n >= 0, kUsage, "cuda adamw_update_segments: segment ", k,
               " offset=", seg.offset, " n=", seg.n);
    if (seg.n == 0) continue;
    const int64_t chunks = (seg.n + kAdamWChunk - 1) / kAdamWChunk;
    KEEL_CHECK(chunks < kMaxBlocks, kUsage, "cuda adamw_update_segments: segment ", k, " n=", seg.n,
               " exceeds a grid");
    if (blocks + chunks >= kMaxBlocks) launch();
    t.offset[t.count] = seg.offset;
    t.n[t.count] = seg.n;
    t.weight_decay[t.count] = seg.decay ? s.weight_decay : 0.0f;
    t.first_block[t.count] = static_cast<unsigned>(blocks);
    blocks += chunks;
    if (++t.count == kAdamWSegmentsPerLaunch) launch();
  }
  launch();
}

void add_bias_rows(Context& ctx, void* C, const void* bias, int64_t M, int64_t N, int64_t ldc,
                   DType t) {
  if (M == 0 || N == 0) return;
  KEEL_CHECK(M <= kMaxIndex32 && ldc <= kMaxIndex32 && N <= ldc, kUsage,
             "cuda add_bias_rows: M=", M, " N=", N, " ldc=", ldc,
             " past the kernel's 32-bit indices (", kMaxIndex32, ")");
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((N + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(M, 65535)));
  const int m = static_cast<int>(M), n = static_cast<int>(N), ld = static_cast<int>(ldc);
  if (t == DType::kF32) {
    add_bias_rows_kernel<<<grid, kThreads, 0, ctx.stream()>>>(
        static_cast<float*>(C), static_cast<const float*>(bias), m, n, ld);
  } else {
    add_bias_rows_kernel<<<grid, kThreads, 0, ctx.stream()>>>(
        static_cast<__nv_bfloat16*>(C), static_cast<const __nv_bfloat16*>(bias), m, n, ld);
  }
  KEEL_CUDA_LAUNCH_CHECK("add_bias_rows", "M=", M, " N=", N, " ldc=", ldc, " ", dtype_name(t));
}

void fill_uniform(Context& ctx, float* x, int64_t n, float lo, float hi, uint64_t seed) {
  fill_uniform_impl(ctx, x, n, lo, hi, seed);
}
void fill_uniform(Context& ctx, Bf16* x, int64_t n, float lo, float hi, uint64_t seed) {
  fill_uniform_impl(ctx, dev(x), n, lo, hi, seed);
}

}  // namespace keel::kernels::cuda
