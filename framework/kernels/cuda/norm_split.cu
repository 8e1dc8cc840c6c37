// CUDA split-form norms (norm_split.h): one warp per (row, group) as in norm.cu, fp32 math (the
// backward's dout and dinp may be bf16 memory: Note [act-dtype]), with the
// CPU kernels' expressions (framework/kernels/cpu/norm.cc). The statistics -> (mean, rstd) step
// runs in double exactly as the CPU's does (IEEE division and square root on both), so given the
// same all-reduced statistics both produce the same mean and rstd. The gain gradients are those
// of norm_backward (they depend on mean and rstd only, not on how they were reduced), so they are
// norm.cu's deterministic kernel, reached through norm_backward without a dinp.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/norm_split.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

template <typename TI>
__global__ void partial_stats_kernel(NormShape s, const TI* inp, float* stats) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;  // the whole warp leaves together
  const TI* x = inp + (r / s.G) * s.ld_in + (r % s.G) * s.Cg;
  float sum = 0.0f, sumsq = 0.0f;
  for (int64_t c = lane; c < s.Cg; c += 32) {
    sum += to_f(x[c]);
    sumsq += to_f(x[c]) * to_f(x[c]);
  }
  sum = warp_sum(sum);
  sumsq = warp_sum(sumsq);
  if (lane == 0) {
    stats[2 * r] = sum;
    stats[2 * r + 1] = sumsq;
  }
}

// TO: float, or __nv_bfloat16 for an output stored in bf16 (Note [act-dtype]): the fp32 value
// rounded once.
template <typename TO, typename TI>
__global__ void forward_from_stats_kernel(NormOp op, NormShape s, int64_t Cg_total,
                                          const float* stats, TO* out, const TI* inp,
                                          const float* weight, const float* bias, float* mean,
                                          float* rstd, float eps) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;
  const int64_t n = r / s.G, g = r % s.G;
  const TI* x = inp + n * s.ld_in + g * s.Cg;
  TO* y = out + n * s.ld_out + g * s.Cg;
  const float* w = weight != nullptr ? weight + g * s.w_group_stride : nullptr;
  const float* b = bias != nullptr ? bias + g * s.w_group_stride : nullptr;
  const double inv_n = 1.0 / static_cast<double>(Cg_total);
  const double m = op == NormOp::kLayer ? stats[2 * r] * inv_n : 0.0;
  const double ex2 = stats[2 * r + 1] * inv_n;
  double denom = op == NormOp::kL2 ? static_cast<double>(stats[2 * r + 1]) : ex2 - m * m;
  denom = denom > 0.0 ? denom : 0.0;  // E[x^2] - mean^2 may round below zero
  const float rs = static_cast<float>(1.0 / sqrt(denom + static_cast<double>(eps)));
  const float mu = static_cast<float>(m);
  for (int64_t c = lane; c < s.Cg; c += 32) {
    float v = (to_f(x[c]) - mu) * rs;
    if (w != nullptr) v *= w[c];
    if (b != nullptr) v += b[c];
    y[c] = from_f<TO>(v);
  }
  if (lane == 0) {
    if (mean != nullptr) mean[r] = mu;
    rstd[r] = rs;
  }
}

// TG: dout's type, TD: dinp's (float, or __nv_bfloat16 for a gradient stored in bf16: Note
// [act-dtype]; a bf16 dout widened exactly, a bf16 dinp the fp32 result rounded once).
template <typename TG, typename TI>
__global__ void backward_partials_kernel(NormShape s, const TG* dout, const TI* inp,
                                         const float* weight, const float* mean, const float* rstd,
                                         float* part) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;
  const int64_t n = r / s.G, g = r % s.G;
  const TI* x = inp + n * s.ld_in + g * s.Cg;
  const TG* dy = dout + n * s.ld_out + g * s.Cg;
  const float* w = weight != nullptr ? weight + g * s.w_group_stride : nullptr;
  const float mu = mean != nullptr ? mean[r] : 0.0f;
  const float rs = rstd[r];
  float sum_dn = 0.0f, sum_dn_xhat = 0.0f;
  for (int64_t c = lane; c < s.Cg; c += 32) {
    const float dn = w != nullptr ? to_f(dy[c]) * w[c] : to_f(dy[c]);
    sum_dn += dn;
    sum_dn_xhat += dn * ((to_f(x[c]) - mu) * rs);
  }
  sum_dn = warp_sum(sum_dn);
  sum_dn_xhat = warp_sum(sum_dn_xhat);
  if (lane == 0) {
    part[2 * r] = sum_dn;
    part[2 * r + 1] = sum_dn_xhat;
  }
}

template <typename TD, typename TG, typename TI>
__global__ void backward_from_partials_kernel(NormOp op, NormShape s, int64_t Cg_total,
                                              const float* part, TD* dinp, bool accumulate,
                                              const TG* dout, const TI* inp, const float* weight,
                                              const float* mean, const float* rstd) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;
  const int64_t n = r / s.G, g = r % s.G;
  const TI* x = inp + n * s.ld_in + g * s.Cg;
  const TG* dy = dout + n * s.ld_out + g * s.Cg;
  TD* dx = dinp + n * s.ld_in + g * s.Cg;
  const float* w = weight != nullptr ? weight + g * s.w_group_stride : nullptr;
  const float mu = op == NormOp::kLayer ? mean[r] : 0.0f;
  const float rs = rstd[r];
  const float inv_c = 1.0f / static_cast<float>(Cg_total);
  const float a = op == NormOp::kLayer ? part[2 * r] * inv_c : 0.0f;
  const float bcoef = op == NormOp::kL2 ? part[2 * r + 1] : part[2 * r + 1] * inv_c;
  for (int64_t c = lane; c < s.Cg; c += 32) {
    const float dn = w != nullptr ? to_f(dy[c]) * w[c] : to_f(dy[c]);
    const float gi = rs * (dn - a - (to_f(x[c]) - mu) * rs * bcoef);
    dx[c] = from_f<TD>(accumulate ? to_f(dx[c]) + gi : gi);
  }
}

void check_shape(const NormShape& s, int64_t Cg_total, const char* name) {
  KEEL_CHECK(s.N >= 0 && s.G >= 1 && s.Cg >= 1 && s.ld_in >= s.G * s.Cg && s.ld_out >= s.G * s.Cg &&
                 (s.w_group_stride == 0 || s.w_group_stride == s.Cg) && Cg_total >= s.Cg,
             kUsage, "cuda ", name, ": bad shape N=", s.N, " G=", s.G, " Cg=", s.Cg,
             " ld_in=", s.ld_in, " ld_out=", s.ld_out, " w_group_stride=", s.w_group_stride,
             " Cg_total=", Cg_total);
}

unsigned row_blocks(const NormShape& s) {
  return static_cast<unsigned>((s.N * s.G + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

constexpr int kThreads = 32 * kWarpsPerBlock;

}  // namespace

template <typename TI>
void norm_partial_stats(Context& ctx, const NormShape& s, const TI* inp, float* stats) {
  check_shape(s, s.Cg, "norm_partial_stats");
  if (s.N == 0) return;
  partial_stats_kernel<<<row_blocks(s), kThreads, 0, ctx.stream()>>>(s, dev(inp), stats);
  KEEL_CUDA_LAUNCH_CHECK("norm_partial_stats", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
}

template <typename TO, typename TI>
void norm_forward_from_stats(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                             const float* stats, TO* out, const TI* inp, const float* weight,
                             const float* bias, float* mean, float* rstd, float eps) {
  check_shape(s, Cg_total, "norm_forward_from_stats");
  if (s.N == 0) return;
  forward_from_stats_kernel<<<row_blocks(s), kThreads, 0, ctx.stream()>>>(
      op, s, Cg_total, stats, dev(out), dev(inp), weight, bias, mean, rstd, eps);
  KEEL_CUDA_LAUNCH_CHECK("norm_forward_from_stats", "N=", s.N, " G=", s.G, " Cg=", s.Cg,
                         " Cg_total=", Cg_total);
}

template <typename TG, typename TI>
void norm_backward_partials(Context& ctx, const NormShape& s, const TG* dout, const TI* inp,
                            const float* weight, const float* mean, const float* rstd,
                            float* part) {
  check_shape(s, s.Cg, "norm_backward_partials");
  if (s.N == 0) return;
  backward_partials_kernel<<<row_blocks(s), kThreads, 0, ctx.stream()>>>(s, dev(dout), dev(inp),
                                                                         weight, mean, rstd, part);
  KEEL_CUDA_LAUNCH_CHECK("norm_backward_partials", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
}

template <typename TD, typename TG, typename TI>
void norm_backward_from_partials(Context& ctx, NormOp op, const NormShape& s, int64_t Cg_total,
                                 const float* part, TD* dinp, bool accumulate, float* dweight,
                                 float* dbias, const TG* dout, const TI* inp, const float* weight,
                                 const float* mean, const float* rstd) {
  check_shape(s, Cg_total, "norm_backward_from_partials");
  KEEL_CHECK(op != NormOp::kLayer || mean != nullptr, kUsage,
             "cuda norm_backward_from_partials: LayerNorm needs the saved mean");
  if (s.N == 0) return;
  if (dinp != nullptr) {
    backward_from_partials_kernel<<<row_blocks(s), kThreads, 0, ctx.stream()>>>(
        op, s, Cg_total, part, dev(dinp), accumulate, dev(dout), dev(inp), weight, mean, rstd);
    KEEL_CUDA_LAUNCH_CHECK("norm_backward_from_partials", "N=", s.N, " G=", s.G, " Cg=", s.Cg,
                           " Cg_total=", Cg_total);
  }
  if (dweight != nullptr || dbias != nullptr) {
    norm_backward(ctx, op, s, /*dinp=*/static_cast<float*>(nullptr), /*accumulate=*/false, dweight,
                  dbias, dout, inp, weight, mean, rstd);
  }
}

// Every combination of float and Bf16 operands (norm_split.h).
#define KEEL_SPLIT_TI(TI)                                                                         \
  template void norm_partial_stats<TI>(Context&, const NormShape&, const TI*, float*);            \
  template void norm_forward_from_stats<float, TI>(Context&, NormOp, const NormShape&, int64_t,   \
                                                   const float*, float*, const TI*, const float*, \
                                                   const float*, float*, float*, float);          \
  template void norm_forward_from_stats<Bf16, TI>(Context&, NormOp, const NormShape&, int64_t,    \
                                                  const float*, Bf16*, const TI*, const float*,   \
                                                  const float*, float*, float*, float);
#define KEEL_SPLIT_TG_TI(TG, TI)                                                                  \
  template void norm_backward_partials<TG, TI>(Context&, const NormShape&, const TG*, const TI*,  \
                                               const float*, const float*, const float*, float*); \
  template void norm_backward_from_partials<float, TG, TI>(                                       \
      Context&, NormOp, const NormShape&, int64_t, const float*, float*, bool, float*, float*,    \
      const TG*, const TI*, const float*, const float*, const float*);                            \
  template void norm_backward_from_partials<Bf16, TG, TI>(                                        \
      Context&, NormOp, const NormShape&, int64_t, const float*, Bf16*, bool, float*, float*,     \
      const TG*, const TI*, const float*, const float*, const float*);
KEEL_SPLIT_TI(float)
KEEL_SPLIT_TI(Bf16)
KEEL_SPLIT_TG_TI(float, float)
KEEL_SPLIT_TG_TI(float, Bf16)
KEEL_SPLIT_TG_TI(Bf16, float)
KEEL_SPLIT_TG_TI(Bf16, Bf16)
#undef KEEL_SPLIT_TG_TI
#undef KEEL_SPLIT_TI

}  // namespace keel::kernels::cuda
