// CUDA cross-entropy with z-loss in the vocab-parallel phases (framework/kernels/cross_entropy.h):
// one block per row for the row statistics and the gradient, exp through the CPU's fast_expf
// (framework/kernels/fast_math.h), the loss finish in double as the CPU's xent_finish, and the
// upload of the batch's tokens and targets.
#include <cuda_runtime.h>

#include <cmath>

#include "framework/error.h"
#include "framework/kernels/cross_entropy.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/fast_math.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kRowThreads = 512;
// The row statistics take 1024 threads, so an SM holds 2 rows (2048 threads; the launch bounds
// keep the registers to that) rather than 4: the rows in flight in xent_row_max_sumexp (132 SMs x
// 2 x 100 KB at 124M in bf16, ~26 MB) stay well inside an H200's 60 MB L2 for the second pass.
// The separate kernels use the same partition, so the fused results are theirs bitwise.
constexpr int kRowStatThreads = 1024;

// T: float, or __nv_bfloat16 for logits stored in bf16 (Note [act-dtype]): every element is
// widened to fp32 as it is read and the arithmetic is the fp32 one. A row's maximum and sum-exp
// (against a given maximum) over one block; the fused kernel runs the same two functions.
template <typename T>
__device__ float block_row_max(const T* row, int64_t v_valid, float* shared) {
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < v_valid; v += blockDim.x) mx = fmaxf(mx, to_f(row[v]));
  return block_max(mx, shared);
}
template <typename T>
__device__ float block_row_sumexp(const T* row, float mx, int64_t v_valid, float* shared) {
  float acc = 0.0f;
  for (int64_t v = threadIdx.x; v < v_valid; v += blockDim.x) acc += exp_t(to_f(row[v]) - mx);
  return block_sum(acc, shared);
}

template <typename T>
__global__ void __launch_bounds__(kRowStatThreads, 2)
    row_max_kernel(const T* logits, int64_t V_local, int64_t v_valid, float* row_max) {
  __shared__ float shared[32];
  const float mx = block_row_max(logits + blockIdx.x * V_local, v_valid, shared);
  if (threadIdx.x == 0) row_max[blockIdx.x] = mx;
}

template <typename T>
__global__ void __launch_bounds__(kRowStatThreads, 2)
    row_sumexp_kernel(const T* logits, const float* row_max, int64_t V_local, int64_t v_valid,
                      float* sumexp) {
  __shared__ float shared[32];
  const float acc =
      block_row_sumexp(logits + blockIdx.x * V_local, row_max[blockIdx.x], v_valid, shared);
  if (threadIdx.x == 0) sumexp[blockIdx.x] = acc;
}

// block_max and block_sum give every thread the result and barrier before reusing `shared`.
template <typename T>
__global__ void __launch_bounds__(kRowStatThreads, 2)
    row_max_sumexp_kernel(const T* logits, int64_t V_local, int64_t v_valid, float* row_max,
                          float* sumexp) {
  __shared__ float shared[32];
  const T* row = logits + blockIdx.x * V_local;
  const float mx = block_row_max(row, v_valid, shared);
  const float acc = block_row_sumexp(row, mx, v_valid, shared);
  if (threadIdx.x == 0) {
    row_max[blockIdx.x] = mx;
    sumexp[blockIdx.x] = acc;
  }
}

template <typename T>
__global__ void target_logit_kernel(const T* logits, const int32_t* targets, int64_t N,
                                    int64_t V_local, int64_t v_begin, float* target_logit) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n >= N) return;
  const int64_t col = static_cast<int64_t>(targets[n]) - v_begin;
  target_logit[n] = (col >= 0 && col < V_local) ? to_f(logits[n * V_local + col]) : 0.0f;
}

__global__ void finish_kernel(const float* row_max, const float* sumexp, const float* target,
                              int64_t N, float* lse, double* sums) {
  // One block with a fixed thread count: each thread sums a fixed strided subset in increasing n,
  // then a fixed tree combines them, so the sums are bitwise reproducible run to run (they differ
  // from the CPU's serial order only by double rounding).
  __shared__ double shared[32];
  double ce = 0.0, z = 0.0, lz = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    const double l = xent_row_lse(row_max[n], sumexp[n]);
    const double t = target[n];  // read before lse[n] is written: lse may alias sumexp
    lse[n] = static_cast<float>(l);
    ce += l - t;
    z += l * l;
    lz += l;
  }
  ce = block_sum(ce, shared);
  z = block_sum(z, shared);
  lz = block_sum(lz, shared);
  if (threadIdx.x == 0) {
    sums[0] = ce;
    sums[1] = z;
    sums[2] = lz;
  }
}

// dlogits in T as well: the bf16 gradient is what the LM head's backward GEMMs read. Each element
// is read and written by one thread, so drow may alias row; the result of an element does not
// depend on the block's size.
template <typename T>
__device__ void block_row_xent_backward(T* drow, const T* row, float l, int32_t target,
                                        int64_t V_local, int64_t v_valid, int64_t v_begin,
                                        float grad_scale, float z_coef) {
  const float coef = grad_scale * (1.0f + 2.0f * z_coef * l);
  const int64_t col = static_cast<int64_t>(target) - v_begin;
  for (int64_t v = threadIdx.x; v < V_local; v += blockDim.x) {
    float d = v < v_valid ? coef * exp_t(to_f(row[v]) - l) : 0.0f;
    if (v == col) d -= grad_scale;
    drow[v] = from_f<T>(d);
  }
}

template <typename T>
__global__ void xent_backward_kernel(T* dlogits, const T* logits, const float* lse,
                                     const int32_t* targets, int64_t V_local, int64_t v_valid,
                                     int64_t v_begin, float grad_scale, float z_coef) {
  const int64_t n = blockIdx.x;
  block_row_xent_backward(dlogits + n * V_local, logits + n * V_local, lse[n], targets[n], V_local,
                          v_valid, v_begin, grad_scale, z_coef);
}

// xent_row_max_sumexp, then xent_backward with the log-sum-exp xent_finish will write for the row
// (the same function of the same statistics), over one row per block. block_sum's barriers come
// after every thread's last read of the row for the sum-exp, so the in-place writes come after.
template <typename T>
__global__ void __launch_bounds__(kRowStatThreads, 2)
    xent_fused_kernel(T* dlogits, const T* logits, const int32_t* targets, int64_t V_local,
                      int64_t v_valid, int64_t v_begin, float grad_scale, float z_coef,
                      float* row_max, float* sumexp) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  const T* row = logits + n * V_local;
  const float mx = block_row_max(row, v_valid, shared);
  const float se = block_row_sumexp(row, mx, v_valid, shared);
  if (threadIdx.x == 0) {
    row_max[n] = mx;
    sumexp[n] = se;
  }
  const float l = static_cast<float>(xent_row_lse(mx, se));
  block_row_xent_backward(dlogits + n * V_local, row, l, targets[n], V_local, v_valid, v_begin,
                          grad_scale, z_coef);
}

void check_rows(int64_t N, int64_t V_local, int64_t v_valid, const char* name) {
  KEEL_CHECK(N >= 0 && V_local >= 0 && v_valid >= 0 && v_valid <= V_local, kUsage, "cuda ", name,
             ": bad shape N=", N, " V_local=", V_local, " v_valid_local=", v_valid);
  KEEL_CHECK(N <= 0x7fffffff, kUsage, "cuda ", name, ": N=", N, " rows exceed the grid limit");
}

}  // namespace

template <typename T>
void xent_row_max(Context& ctx, const T* logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                  float* row_max) {
  check_rows(N, V_local, v_valid_local, "xent_row_max");
  if (N == 0) return;
  row_max_kernel<<<static_cast<unsigned>(N), kRowStatThreads, 0, ctx.stream()>>>(
      dev(logits), V_local, v_valid_local, row_max);
  KEEL_CUDA_LAUNCH_CHECK("xent_row_max", "N=", N, " V_local=", V_local);
}

template <typename T>
void xent_row_sumexp(Context& ctx, const T* logits, const float* row_max, int64_t N,
                     int64_t V_local, int64_t v_valid_local, float* sumexp) {
  check_rows(N, V_local, v_valid_local, "xent_row_sumexp");
  if (N == 0) return;
  row_sumexp_kernel<<<static_cast<unsigned>(N), kRowStatThreads, 0, ctx.stream()>>>(
      dev(logits), row_max, V_local, v_valid_local, sumexp);
  KEEL_CUDA_LAUNCH_CHECK("xent_row_sumexp", "N=", N, " V_local=", V_local);
}

template <typename T>
void xent_row_max_sumexp(Context& ctx, const T* logits, int64_t N, int64_t V_local,
                         int64_t v_valid_local, float* row_max, float* sumexp) {
  check_rows(N, V_local, v_valid_local, "xent_row_max_sumexp");
  if (N == 0) return;
  row_max_sumexp_kernel<<<static_cast<unsigned>(N), kRowStatThreads, 0, ctx.stream()>>>(
      dev(logits), V_local, v_valid_local, row_max, sumexp);
  KEEL_CUDA_LAUNCH_CHECK("xent_row_max_sumexp", "N=", N, " V_local=", V_local);
}

template <typename T>
void xent_fused(Context& ctx, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                int64_t V_local, int64_t v_valid_local, int64_t v_begin, float grad_scale,
                float z_coef, float* row_max, float* sumexp) {
  check_rows(N, V_local, v_valid_local, "xent_fused");
  if (N == 0) return;
  xent_fused_kernel<<<static_cast<unsigned>(N), kRowStatThreads, 0, ctx.stream()>>>(
      dev(dlogits), dev(logits), targets, V_local, v_valid_local, v_begin, grad_scale, z_coef,
      row_max, sumexp);
  KEEL_CUDA_LAUNCH_CHECK("xent_fused", "N=", N, " V_local=", V_local,
                         " v_valid_local=", v_valid_local);
}

template <typename T>
void xent_target_logit(Context& ctx, const T* logits, const int32_t* targets, int64_t N,
                       int64_t V_local, int64_t v_begin, float* target_logit) {
  check_rows(N, V_local, V_local, "xent_target_logit");
  if (N == 0) return;
  target_logit_kernel<<<grid_for(N, 256, int64_t{1} << 30), 256, 0, ctx.stream()>>>(
      dev(logits), targets, N, V_local, v_begin, target_logit);
  KEEL_CUDA_LAUNCH_CHECK("xent_target_logit", "N=", N, " V_local=", V_local);
}

void xent_finish(Context& ctx, const float* row_max, const float* sumexp, const float* target_logit,
                 int64_t N, float* lse, double* sums) {
  KEEL_CHECK(N >= 0, kUsage, "cuda xent_finish: negative N=", N);
  finish_kernel<<<1, 1024, 0, ctx.stream()>>>(row_max, sumexp, target_logit, N, lse, sums);
  KEEL_CUDA_LAUNCH_CHECK("xent_finish", "N=", N);
}

void load_tokens(Context& ctx, int32_t* dst, const int32_t* host_src, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda load_tokens: negative n=", n);
  ctx.copy_to_device(dst, host_src, static_cast<size_t>(n) * sizeof(int32_t));
}

template <typename T>
void xent_backward(Context& ctx, T* dlogits, const T* logits, const float* lse,
                   const int32_t* targets, int64_t N, int64_t V_local, int64_t v_valid_local,
                   int64_t v_begin, float grad_scale, float z_coef) {
  check_rows(N, V_local, v_valid_local, "xent_backward");
  if (N == 0 || V_local == 0) return;
  xent_backward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
      dev(dlogits), dev(logits), lse, targets, V_local, v_valid_local, v_begin, grad_scale, z_coef);
  KEEL_CUDA_LAUNCH_CHECK("xent_backward", "N=", N, " V_local=", V_local,
                         " v_valid_local=", v_valid_local);
}

#define KEEL_XENT_INSTANTIATE(T)                                                                 \
  template void xent_row_max<T>(Context&, const T*, int64_t, int64_t, int64_t, float*);          \
  template void xent_row_sumexp<T>(Context&, const T*, const float*, int64_t, int64_t, int64_t,  \
                                   float*);                                                      \
  template void xent_row_max_sumexp<T>(Context&, const T*, int64_t, int64_t, int64_t, float*,    \
                                       float*);                                                  \
  template void xent_fused<T>(Context&, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                              int64_t, float, float, float*, float*);                            \
  template void xent_target_logit<T>(Context&, const T*, const int32_t*, int64_t, int64_t,       \
                                     int64_t, float*);                                           \
  template void xent_backward<T>(Context&, T*, const T*, const float*, const int32_t*, int64_t,  \
                                 int64_t, int64_t, int64_t, float, float);
KEEL_XENT_INSTANTIATE(float)
KEEL_XENT_INSTANTIATE(Bf16)
#undef KEEL_XENT_INSTANTIATE

}  // namespace keel::kernels::cuda
