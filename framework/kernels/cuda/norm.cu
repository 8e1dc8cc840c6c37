// CUDA LayerNorm / RMSNorm / L2 over grouped, strided rows (framework/kernels/norm.h): one warp
// per (row, group), the CPU's two-pass statistics (mean, then the centred sum of squares) and its
// expression order. Parameter gradients: partial sums over chunks of rows, then one pass over the
// chunks (Note [fused-bias-grad] in internal.h), each in a fixed order, so results are
// deterministic. The kernels are templates on the activation types (float or __nv_bfloat16 for
// each of inp, out, dout and dinp); statistics, math, mean/rstd and gain/bias gradients are fp32 in
// both, so the bf16 forms differ from the fp32 ones only by the roundings of their bf16 loads and
// stores.
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

// TD, TG, TI: the types of dinp, dout and inp (a bf16 gradient of an fp32 input: Note
// [act-dtype]).
template <typename TD, typename TG, typename TI>
__global__ void norm_backward_dinp_kernel(NormOp op, NormShape s, TD* dinp, bool accumulate,
                                          const TG* dout, const TI* inp, const float* weight,
                                          const float* mean, const float* rstd) {
  const int64_t r = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= s.N * s.G) return;
  const int64_t n = r / s.G, g = r % s.G, Cg = s.Cg;
  const TI* x = inp + n * s.ld_in + g * Cg;
  const TG* dy = dout + n * s.ld_out + g * Cg;
  TD* dx = dinp + n * s.ld_in + g * Cg;
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
    dx[c] = from_f<TD>(accumulate ? to_f(dx[c]) + gi : gi);
  }
}

// The gain and bias gradients' extents in 32 bits (the host checks they fit: kMaxIndex32).
struct ParamGradShape {
  int G, Cg, ld_in, ld_out;
  int items;         // what a gain element sums over: N * G items (n, g) when shared, else N rows
  int wsize;         // gain elements: Cg when shared (w_group_stride 0), else G * Cg
  int rows;          // items per chunk (blockIdx.y)
  bool shared_gain;  // one gain for every group
};

// Gain element wi sums over every (n, g) that uses it: all groups when the gain is shared (item
// j = n * G + g), else its own group g = wi / Cg (item j = n). Note [fused-bias-grad]: blockIdx.x
// is a strip of 32 gain elements, blockIdx.y a chunk of s.rows items; the chunk's sums go to
// partial[chunk, wsize] (the gain's, then the bias's at partial + chunks * wsize), or with one
// chunk (partial null) into dweight and dbias (+=, each may be null). fp32 accumulation for
// any TG (dout) and TI (inp). An item's (n, g) advances by kColRows items without a division per
// item.
template <typename TG, typename TI>
__global__ void norm_param_grads_kernel(NormOp op, ParamGradShape s, float* dweight, float* dbias,
                                        float* partial, const TG* dout, const TI* inp,
                                        const float* mean, const float* rstd) {
  __shared__ float sum[kColRows][33];
  const int wi = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  const int j0 = static_cast<int>(blockIdx.y) * s.rows;
  const int j1 = s.rows < s.items - j0 ? j0 + s.rows : s.items;
  float accw = 0.0f, accb = 0.0f;
  if (wi < s.wsize) {
    const int j = j0 + static_cast<int>(threadIdx.y);
    const int c = s.shared_gain ? wi : wi % s.Cg;
    // Item j's (n, g) and the step of kColRows items in n and g.
    int n = s.shared_gain ? j / s.G : j, g = s.shared_gain ? j % s.G : wi / s.Cg;
    const int dn = s.shared_gain ? kColRows / s.G : kColRows;
    const int dg = s.shared_gain ? kColRows % s.G : 0;
    for (int i = j; i < j1; i += kColRows) {
      const int r = n * s.G + g;  // the row of mean and rstd
      const int col = g * s.Cg + c;
      const float mu = op == NormOp::kLayer ? mean[r] : 0.0f;
      const float dy = to_f(dout[static_cast<int64_t>(n) * s.ld_out + col]);
      accw += dy * ((to_f(inp[static_cast<int64_t>(n) * s.ld_in + col]) - mu) * rstd[r]);
      accb += dy;
      n += dn;
      g += dg;
      if (g >= s.G) {
        g -= s.G;
        ++n;
      }
    }
  }
  accw = column_block_sum(accw, sum);
  accb = column_block_sum(accb, sum);
  if (threadIdx.y == 0 && wi < s.wsize) {
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.y) * s.wsize + wi] = accw;
      partial[static_cast<int64_t>(gridDim.y + blockIdx.y) * s.wsize + wi] = accb;
    } else {
      if (dweight != nullptr) dweight[wi] += accw;
      if (dbias != nullptr) dbias[wi] += accb;
    }
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

template <typename TD, typename TG, typename TI>
void launch_norm_backward(Context& ctx, NormOp op, const NormShape& s, TD* dinp, bool accumulate,
                          float* dweight, float* dbias, const TG* dout, const TI* inp,
                          const float* weight, const float* mean, const float* rstd) {
  check_shape(s, "norm_backward");
  if (s.N == 0) return;
  if (dinp != nullptr) {
    norm_backward_dinp_kernel<TD, TG, TI>
        <<<row_blocks(s.N * s.G), 32 * kWarpsPerBlock, 0, ctx.stream()>>>(
            op, s, dinp, accumulate, dout, inp, weight, mean, rstd);
    KEEL_CUDA_LAUNCH_CHECK("norm_backward", "N=", s.N, " G=", s.G, " Cg=", s.Cg);
  }
  if (dweight != nullptr || dbias != nullptr) {
    KEEL_CHECK(s.N * s.G <= kMaxIndex32 && s.ld_in <= kMaxIndex32 && s.ld_out <= kMaxIndex32,
               kUsage, "cuda norm_backward: N * G = ", s.N * s.G, " or ld_in=", s.ld_in,
               " ld_out=", s.ld_out, " past the gain gradients' 32-bit indices (", kMaxIndex32,
               ")");
    const bool shared_gain = s.w_group_stride == 0;
    const int64_t wsize = shared_gain ? s.Cg : s.G * s.Cg;
    const int64_t items = shared_gain ? s.N * s.G : s.N;
    const RowChunks k = row_chunks(items, wsize);
    auto* partial = k.count > 1
                        ? static_cast<float*>(ctx.scratch(sizeof(float) * 2 * k.count * wsize))
                        : nullptr;
    const ParamGradShape ps{static_cast<int>(s.G),     static_cast<int>(s.Cg),
                            static_cast<int>(s.ld_in), static_cast<int>(s.ld_out),
                            static_cast<int>(items),   static_cast<int>(wsize),
                            static_cast<int>(k.rows),  shared_gain};
    const dim3 grid(static_cast<unsigned>((wsize + 31) / 32), static_cast<unsigned>(k.count));
    norm_param_grads_kernel<TG, TI><<<grid, dim3(32, kColRows), 0, ctx.stream()>>>(
        op, ps, dweight, dbias, partial, dout, inp, mean, rstd);
    KEEL_CUDA_LAUNCH_CHECK("norm_param_grads", "N=", s.N, " G=", s.G, " Cg=", s.Cg,
                           " chunks=", k.count);
    if (partial != nullptr) {
      column_sum_partials_add(ctx, dweight, dbias, partial, k.count, wsize);
    }
  }
}

}  // namespace

template <typename TO, typename TI>
void norm_forward(Context& ctx, NormOp op, const NormShape& s, TO* out, const TI* inp,
                  const float* weight, const float* bias, float* mean, float* rstd, float eps) {
  launch_norm_forward(ctx, op, s, dev(out), dev(inp), weight, bias, mean, rstd, eps);
}

template <typename TD, typename TG, typename TI>
void norm_backward(Context& ctx, NormOp op, const NormShape& s, TD* dinp, bool accumulate,
                   float* dweight, float* dbias, const TG* dout, const TI* inp, const float* weight,
                   const float* mean, const float* rstd) {
  launch_norm_backward(ctx, op, s, dev(dinp), accumulate, dweight, dbias, dev(dout), dev(inp),
                       weight, mean, rstd);
}

// Every combination of float and Bf16 operands (ops.h).
#define KEEL_NORM_FORWARD(TO, TI)                                                        \
  template void norm_forward<TO, TI>(Context&, NormOp, const NormShape&, TO*, const TI*, \
                                     const float*, const float*, float*, float*, float);
#define KEEL_NORM_BACKWARD(TD, TG, TI)                                                           \
  template void norm_backward<TD, TG, TI>(Context&, NormOp, const NormShape&, TD*, bool, float*, \
                                          float*, const TG*, const TI*, const float*,            \
                                          const float*, const float*);
#define KEEL_NORM_BACKWARD_TI(TD, TG) \
  KEEL_NORM_BACKWARD(TD, TG, float)   \
  KEEL_NORM_BACKWARD(TD, TG, Bf16)
KEEL_NORM_FORWARD(float, float)
KEEL_NORM_FORWARD(float, Bf16)
KEEL_NORM_FORWARD(Bf16, float)
KEEL_NORM_FORWARD(Bf16, Bf16)
KEEL_NORM_BACKWARD_TI(float, float)
KEEL_NORM_BACKWARD_TI(float, Bf16)
KEEL_NORM_BACKWARD_TI(Bf16, float)
KEEL_NORM_BACKWARD_TI(Bf16, Bf16)
#undef KEEL_NORM_BACKWARD_TI
#undef KEEL_NORM_BACKWARD
#undef KEEL_NORM_FORWARD

}  // namespace keel::kernels::cuda
