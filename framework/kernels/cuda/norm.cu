// CUDA LayerNorm / RMSNorm / L2 over grouped, strided rows (framework/kernels/norm.h): one warp
// per (row, group), the CPU's two-pass statistics (mean, then the centred sum of squares) and its
// expression order. Parameter gradients: one thread column per gain element and 32 row lanes,
// summed in a fixed order, so results are deterministic. The kernels are templates on the
// activation type (float or __nv_bfloat16: bf16 inputs, outputs, dout and dinp); statistics, math,
// mean/rstd and gain/bias gradients are fp32 in both, so the bf16 forms differ from the fp32 ones
// only by the roundings of their bf16 loads and stores.
#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// TO, TI: the output and input types (an fp32 input may be written in bf16: Note [act-dtype]).
template <typename TO, typename TI>
__global__ void norm_forward_kernel(NormOp op, NormShape s, TO* out, const TI* inp,
                                    const float* weight, const float* bias, float* mean,
                                    float* rstd, float eps) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;  // the whole warp leaves together
  const int64_t n = r / s.G, g = r % s.G, Cg = s.Cg;
  const TI* x = inp + n * s.ld_in + g * Cg;
  TO* y = out + n * s.ld_out + g * Cg;
  const float* w = weight != nullptr ? weight + g * s.w_group_stride : nullptr;
  const float* b = bias != nullptr ? bias + g * s.w_group_stride : nullptr;
  float mu = 0.0f;
  if (op == NormOp::kLayer) {
    float acc = 0.0f;
    for (int64_t c = lane; c < Cg; c += 32) acc += to_f(x[c]);
    mu = warp_sum(acc) / static_cast<float>(Cg);
  }
  float ss = 0.0f;
  for (int64_t c = lane; c < Cg; c += 32) ss += (to_f(x[c]) - mu) * (to_f(x[c]) - mu);
  ss = warp_sum(ss);
  const float denom = op == NormOp::kL2 ? ss : ss / static_cast<float>(Cg);
  const float rs = 1.0f / sqrtf(denom + eps);
  for (int64_t c = lane; c < Cg; c += 32) {
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

template <typename T>
__global__ void norm_backward_dinp_kernel(NormOp op, NormShape s, T* dinp, bool accumulate,
                                          const T* dout, const T* inp, const float* weight,
                                          const float* mean, const float* rstd) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;
  const int64_t n = r / s.G, g = r % s.G, Cg = s.Cg;
  const T* x = inp + n * s.ld_in + g * Cg;
  const T* dy = dout + n * s.ld_out + g * Cg;
  T* dx = dinp + n * s.ld_in + g * Cg;
  const float* w = weight != nullptr ? weight + g * s.w_group_stride : nullptr;
  const float mu = op == NormOp::kLayer ? mean[r] : 0.0f;
  const float rs = rstd[r];
  float sum_dn = 0.0f, sum_dn_xhat = 0.0f;
  for (int64_t c = lane; c < Cg; c += 32) {
    const float dn = w != nullptr ? to_f(dy[c]) * w[c] : to_f(dy[c]);
    sum_dn += dn;
    sum_dn_xhat += dn * ((to_f(x[c]) - mu) * rs);
  }
  sum_dn = warp_sum(sum_dn);
  sum_dn_xhat = warp_sum(sum_dn_xhat);
  const float inv_c = 1.0f / static_cast<float>(Cg);
  const float a = op == NormOp::kLayer ? sum_dn * inv_c : 0.0f;
  const float bcoef = op == NormOp::kL2 ? sum_dn_xhat : sum_dn_xhat * inv_c;
  for (int64_t c = lane; c < Cg; c += 32) {
    const float dn = w != nullptr ? to_f(dy[c]) * w[c] : to_f(dy[c]);
    const float gi = rs * (dn - a - (to_f(x[c]) - mu) * rs * bcoef);
    dx[c] = from_f<T>(accumulate ? to_f(dx[c]) + gi : gi);
  }
}

// Gain element wi sums over every (n, g) that uses it: all groups when the gain is shared
// (w_group_stride 0), else its own group g = wi / Cg. fp32 accumulation for either T.
template <typename T>
__global__ void norm_param_grads_kernel(NormOp op, NormShape s, float* dweight, float* dbias,
                                        const T* dout, const T* inp, const float* mean,
                                        const float* rstd) {
  __shared__ float tw[32][33], tb[32][33];
  const bool shared_gain = s.w_group_stride == 0;
  const int64_t wsize = shared_gain ? s.Cg : s.G * s.Cg;
  const int64_t wi = blockIdx.x * int64_t{32} + threadIdx.x;
  float accw = 0.0f, accb = 0.0f;
  if (wi < wsize) {
    const int64_t c = shared_gain ? wi : wi % s.Cg;
    const int64_t items = shared_gain ? s.N * s.G : s.N;
    for (int64_t j = threadIdx.y; j < items; j += 32) {
      const int64_t n = shared_gain ? j / s.G : j;
      const int64_t g = shared_gain ? j % s.G : wi / s.Cg;
      const int64_t r = n * s.G + g;
      const float mu = op == NormOp::kLayer ? mean[r] : 0.0f;
      const float dy = to_f(dout[n * s.ld_out + g * s.Cg + c]);
      accw += dy * ((to_f(inp[n * s.ld_in + g * s.Cg + c]) - mu) * rstd[r]);
      accb += dy;
    }
  }
  tw[threadIdx.y][threadIdx.x] = accw;
  tb[threadIdx.y][threadIdx.x] = accb;
  __syncthreads();
  for (int half = 16; half > 0; half /= 2) {
    if (threadIdx.y < half) {
      tw[threadIdx.y][threadIdx.x] += tw[threadIdx.y + half][threadIdx.x];
      tb[threadIdx.y][threadIdx.x] += tb[threadIdx.y + half][threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.y == 0 && wi < wsize) {
    if (dweight != nullptr) dweight[wi] += tw[0][threadIdx.x];
    if (dbias != nullptr) dbias[wi] += tb[0][threadIdx.x];
  }
}

void check_shape(const NormShape& s, const char* name) {
  KEEL_CHECK(s.N >= 0 && s.G >= 1 && s.Cg >= 1 && s.ld_in >= s.G * s.Cg && s.ld_out >= s.G * s.Cg &&
                 (s.w_group_stride == 0 || s.w_group_stride == s.Cg),
             kUsage, "cuda ", name, ": bad shape N=", s.N, " G=", s.G, " Cg=", s.Cg,
             " ld_in=", s.ld_in, " ld_out=", s.ld_out, " w_group_stride=", s.w_group_stride);
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// The forms' shared launches; T is float or __nv_bfloat16.
template <typename TO, typename TI>
void launch_norm_forward(Context& ctx, NormOp op, const NormShape& s, TO* out, const TI* inp,
                         const float* weight, const float* bias, float* mean, float* rstd,
                         float eps) {
  check_shape(s, "norm_forward");
  KEEL_CHECK(op == NormOp::kL2 || weight != nullptr, kUsage,
             "cuda norm_forward: LayerNorm and RMSNorm need a weight");
  if (s.N == 0) return;
  norm_forward_kernel<TO, TI><<<row_blocks(s.N * s.G), 32 * kWarpsPerBlock, 0, ctx.stream()>>>(
      op, s, out, inp, weight, bias, mean, rstd, eps);
  KEEL_CUDA_LAUNCH_CHECK("norm_forward", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
}

template <typename T>
void launch_norm_backward(Context& ctx, NormOp op, const NormShape& s, T* dinp, bool accumulate,
                          float* dweight, float* dbias, const T* dout, const T* inp,
                          const float* weight, const float* mean, const float* rstd) {
  check_shape(s, "norm_backward");
  if (s.N == 0) return;
  if (dinp != nullptr) {
    norm_backward_dinp_kernel<T><<<row_blocks(s.N * s.G), 32 * kWarpsPerBlock, 0, ctx.stream()>>>(
        op, s, dinp, accumulate, dout, inp, weight, mean, rstd);
    KEEL_CUDA_LAUNCH_CHECK("norm_backward", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
  }
  if (dweight != nullptr || dbias != nullptr) {
    const int64_t wsize = s.w_group_stride == 0 ? s.Cg : s.G * s.Cg;
    norm_param_grads_kernel<T>
        <<<static_cast<unsigned>((wsize + 31) / 32), dim3(32, 32), 0, ctx.stream()>>>(
            op, s, dweight, dbias, dout, inp, mean, rstd);
    KEEL_CUDA_LAUNCH_CHECK("norm_param_grads", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
  }
}

}  // namespace

void norm_forward(Context& ctx, NormOp op, const NormShape& s, float* out, const float* inp,
                  const float* weight, const float* bias, float* mean, float* rstd, float eps) {
  launch_norm_forward(ctx, op, s, out, inp, weight, bias, mean, rstd, eps);
}

void norm_forward(Context& ctx, NormOp op, const NormShape& s, Bf16* out, const Bf16* inp,
                  const float* weight, const float* bias, float* mean, float* rstd, float eps) {
  launch_norm_forward(ctx, op, s, dev(out), dev(inp), weight, bias, mean, rstd, eps);
}

void norm_forward(Context& ctx, NormOp op, const NormShape& s, Bf16* out, const float* inp,
                  const float* weight, const float* bias, float* mean, float* rstd, float eps) {
  launch_norm_forward(ctx, op, s, dev(out), inp, weight, bias, mean, rstd, eps);
}

void norm_backward(Context& ctx, NormOp op, const NormShape& s, float* dinp, bool accumulate,
                   float* dweight, float* dbias, const float* dout, const float* inp,
                   const float* weight, const float* mean, const float* rstd) {
  launch_norm_backward(ctx, op, s, dinp, accumulate, dweight, dbias, dout, inp, weight, mean, rstd);
}

void norm_backward(Context& ctx, NormOp op, const NormShape& s, Bf16* dinp, bool accumulate,
                   float* dweight, float* dbias, const Bf16* dout, const Bf16* inp,
                   const float* weight, const float* mean, const float* rstd) {
  launch_norm_backward(ctx, op, s, dev(dinp), accumulate, dweight, dbias, dev(dout), dev(inp),
                       weight, mean, rstd);
}

}  // namespace keel::kernels::cuda
