// The CUDA backend's fused causal attention, backward (attention.h): FlashAttention-2's (Dao 2023)
// on CUDA cores in fp32, for head dimensions up to 128, over the forward's tiles (attention.cu, the
// tiling in attention_internal.cuh).
//
// Backward, without atomics: delta = rowsum(dout * out) (FlashAttention-2's, from the out the
// forward wrote: bf16-rounded for bf16); one kernel per (b, k/v head, key tile) walks, for each
// query head of the group in increasing order, the query tiles from the diagonal down, recomputes
// P = exp(scale q.k - lse) and dS = P (dout.v - delta), accumulates dV = P^T dO and dK = (scale
// dS)^T Q over the whole group in registers (so a k/v head's gradient sums its query heads in a
// fixed order, with no partial buffers and no atomics) and sums dS * q.k (the scale gradient) per
// block and query head; a second kernel per (b, h, query tile) recomputes the same P and dS
// (bitwise: the same dot products in the same order) and accumulates dQ = scale dS K. A last small
// kernel sums the per-block scale-gradient partials per head in a fixed order. Every sum has a
// fixed order, so results are bitwise reproducible. With groups, the dK/dV grid has B * Hkv rather
// than B * H columns of blocks, each G times the work: at 124M-like shapes (B 16, T 1024) even
// multi-query attention gives 16 x 32 = 512 blocks.
#include <cuda_runtime.h>

#include <cstdint>

#include "framework/error.h"
#include "framework/kernels/cuda/attention.h"
#include "framework/kernels/cuda/attention_internal.cuh"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"

namespace keel::kernels::cuda {

namespace {

// delta[(b * H + h) * T + t] = sum_d dout * out over the row's head (one warp per row).
template <typename T>
__global__ void attention_delta_kernel(AttentionShape s, float* delta, const T* dout,
                                       const T* out) {
  const int64_t row = blockIdx.x * int64_t{kWarps} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= s.B * s.H * s.T) return;  // whole warps
  const int64_t t = row % s.T, bh = row / s.T, b = bh / s.H, h = bh % s.H;
  const T* dy = dout + (b * s.T + t) * s.ldo + h * s.D;
  const T* y = out + (b * s.T + t) * s.ldo + h * s.D;
  float acc = 0.0f;
  for (int64_t d = lane; d < s.D; d += 32) acc = fmaf(to_f(dy[d]), to_f(y[d]), acc);
  acc = warp_sum(acc);
  if (lane == 0) delta[row] = acc;
}

// dK, dV for one (b * Hkv + k/v head hk, key tile): the warp's 8 keys against the lanes' 32
// queries of each query tile from the diagonal to T, for each query head h of the group in turn.
// dscale_partial[(b * H + h) * tiles + key tile] = sum of dS * q.k over the block's part of head h
// (when not null).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(AttentionShape s, T* dk, T* dv, float* dscale_partial, const T* dout,
                          const float* lse, const float* delta, const T* q, const T* k, const T* v,
                          const float* scale) {
  extern __shared__ float4 smem_f4[];  // float4: 16-byte aligned, for row_dots
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int D = static_cast<int>(s.D), Dq = odd_stride(D);
  float* sK = smem;                // [kTile][D], this block's keys
  float* sV = sK + kTile * D;      // [kTile][D]
  float* sQ = sV + kTile * D;      // [kTile][Dq], the current query tile
  float* sdO = sQ + kTile * Dq;    // [kTile][Dq]
  float* sLse = sdO + kTile * Dq;  // [kTile]
  float* sDelta = sLse + kTile;    // [kTile]
  const int64_t Hkv = kv_heads_of(s), G = s.H / Hkv;
  const int64_t b = blockIdx.x / Hkv, hk = blockIdx.x % Hkv;
  const int64_t k0 = blockIdx.y * int64_t{kTile};  // key tile 0, the longest column, first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* kh = k + b * s.T * s.ldk + hk * s.D;
  const T* vh = v + b * s.T * s.ldv + hk * s.D;
  load_tile(sK, D, kh, s.ldk, k0, s.T, D);
  load_tile(sV, D, vh, s.ldv, k0, s.T, D);
  const float* krows = sK + warp * kRows * D;
  const float* vrows = sV + warp * kRows * D;

  float dk_acc[kRows][kCols], dv_acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kCols; ++i) dk_acc[r][i] = dv_acc[r][i] = 0.0f;
  }
  // The group's query heads in increasing order, all into the same dk_acc, dv_acc.
  for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
    const int64_t bh = b * s.H + h;
    const float sc = scale[h];
    const T* qh = q + b * s.T * s.ldq + h * s.D;
    const T* doh = dout + b * s.T * s.ldo + h * s.D;
    const float* lse_h = lse + bh * s.T;
    const float* delta_h = delta + bh * s.T;
    float dscale_acc = 0.0f;
    for (int64_t q0 = k0; q0 < s.T; q0 += kTile) {
      __syncthreads();  // the previous query tile is no longer read (and sK, sV are complete)
      load_tile(sQ, Dq, qh, s.ldq, q0, s.T, D);
      load_tile(sdO, Dq, doh, s.ldo, q0, s.T, D);
      if (threadIdx.x < kTile) {
        const int64_t t = q0 + threadIdx.x;
        sLse[threadIdx.x] = t < s.T ? lse_h[t] : 0.0f;
        sDelta[threadIdx.x] = t < s.T ? delta_h[t] : 0.0f;
      }
      __syncthreads();
      // The lane's query t against the warp's keys: q.k (the forward's order) and dout.v.
      const float* qrow = sQ + lane * Dq;
      const float* dorow = sdO + lane * Dq;
      float qk[kRows], dp[kRows], p[kRows], ds[kRows];
      row_dots(qk, krows, qrow, D);
      row_dots(dp, vrows, dorow, D);
      const int64_t t = q0 + lane;
      const float lse_t = sLse[lane], delta_t = sDelta[lane];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t key = k0 + warp * kRows + r;
        const bool valid = key <= t && t < s.T;
        p[r] = valid ? expf(sc * qk[r] - lse_t) : 0.0f;
        ds[r] = valid ? p[r] * (dp[r] - delta_t) : 0.0f;
        dscale_acc = fmaf(ds[r], qk[r], dscale_acc);
        ds[r] *= sc;  // dK takes scale dS: the group's heads may have different scales
      }
      // dV[key][d] += sum_j P[j][key] dO[j][d]; dK[key][d] += sum_j scale dS[j][key] Q[j][d].
      // Unrolled by 8: ptxas otherwise spills 20 bytes per thread here at its 168-register
      // allocation (tests/gpu/kernel_resources.py).
#pragma unroll 8
      for (int j = 0; j < kTile; ++j) {
        float qj[kCols], doj[kCols];
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
          const int d = lane + 32 * i;
          qj[i] = d < D ? sQ[j * Dq + d] : 0.0f;
          doj[i] = d < D ? sdO[j * Dq + d] : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float pj = __shfl_sync(kFullMask, p[r], j);
          const float dsj = __shfl_sync(kFullMask, ds[r], j);
#pragma unroll
          for (int i = 0; i < kCols; ++i) {
            dv_acc[r][i] = fmaf(pj, doj[i], dv_acc[r][i]);
            dk_acc[r][i] = fmaf(dsj, qj[i], dk_acc[r][i]);
          }
        }
      }
    }
    if (dscale_partial != nullptr) {  // block-uniform
      __shared__ float red[32];
      dscale_acc = block_sum(dscale_acc, red);
      if (threadIdx.x == 0) dscale_partial[bh * gridDim.y + blockIdx.y] = dscale_acc;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t key = k0 + warp * kRows + r;
    if (key >= s.T) continue;
    T* dkrow = dk + (b * s.T + key) * s.ldk + hk * s.D;
    T* dvrow = dv + (b * s.T + key) * s.ldv + hk * s.D;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int d = lane + 32 * i;
      if (d < D) {
        dkrow[d] = from_f<T>(dk_acc[r][i]);
        dvrow[d] = from_f<T>(dv_acc[r][i]);
      }
    }
  }
}

// dQ for one (b * H + h, query tile): the warp's 8 queries against the lanes' 32 keys of each key
// tile up to the diagonal. At least 3 blocks per SM (up to 170 registers), the occupancy it had at
// 140 registers before grouped-query attention: ptxas otherwise squeezes it to 128 registers and
// spills 8 bytes (tests/gpu/kernel_resources.py); with the hint it takes 154 and spills nothing.
template <typename T>
__global__ void __launch_bounds__(kThreads, 3)
    attention_dq_kernel(AttentionShape s, T* dq, const T* dout, const float* lse,
                        const float* delta, const T* q, const T* k, const T* v,
                        const float* scale) {
  extern __shared__ float4 smem_f4[];  // float4: 16-byte aligned, for row_dots
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int D = static_cast<int>(s.D), Dk = odd_stride(D);
  float* sQ = smem;             // [kTile][D], this block's queries
  float* sdO = sQ + kTile * D;  // [kTile][D]
  float* sK = sdO + kTile * D;  // [kTile][Dk], the current key tile
  float* sV = sK + kTile * Dk;  // [kTile][Dk]
  const int64_t bh = blockIdx.x, b = bh / s.H, h = bh % s.H;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * int64_t{kTile};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float sc = scale[h];
  const int64_t hk = kv_head_of(s, h);
  const T* kh = k + b * s.T * s.ldk + hk * s.D;
  const T* vh = v + b * s.T * s.ldv + hk * s.D;
  load_tile(sQ, D, q + b * s.T * s.ldq + h * s.D, s.ldq, q0, s.T, D);
  load_tile(sdO, D, dout + b * s.T * s.ldo + h * s.D, s.ldo, q0, s.T, D);
  float lse_r[kRows], delta_r[kRows], dq_acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t t = q0 + warp * kRows + r;
    lse_r[r] = t < s.T ? lse[bh * s.T + t] : 0.0f;
    delta_r[r] = t < s.T ? delta[bh * s.T + t] : 0.0f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) dq_acc[r][i] = 0.0f;
  }
  const float* qrows = sQ + warp * kRows * D;
  const float* dorows = sdO + warp * kRows * D;
  for (int64_t k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();
    load_tile(sK, Dk, kh, s.ldk, k0, s.T, D);
    load_tile(sV, Dk, vh, s.ldv, k0, s.T, D);
    __syncthreads();
    float qk[kRows], dp[kRows], ds[kRows];
    row_dots(qk, qrows, sK + lane * Dk, D);
    row_dots(dp, dorows, sV + lane * Dk, D);
    const int64_t key = k0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t t = q0 + warp * kRows + r;
      const bool valid = key <= t && t < s.T;
      const float p = valid ? expf(sc * qk[r] - lse_r[r]) : 0.0f;
      ds[r] = valid ? p * (dp[r] - delta_r[r]) : 0.0f;
    }
    // dQ[t][d] += sum_j dS[t][j] K[j][d], keys in increasing order.
    for (int j = 0; j < kTile; ++j) {
      float kj[kCols];
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int d = lane + 32 * i;
        kj[i] = d < D ? sK[j * Dk + d] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float dsj = __shfl_sync(kFullMask, ds[r], j);
#pragma unroll
        for (int i = 0; i < kCols; ++i) dq_acc[r][i] = fmaf(dsj, kj[i], dq_acc[r][i]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t t = q0 + warp * kRows + r;
    if (t >= s.T) continue;
    T* dqrow = dq + (b * s.T + t) * s.ldq + h * s.D;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int d = lane + 32 * i;
      if (d < D) dqrow[d] = from_f<T>(sc * dq_acc[r][i]);
    }
  }
}

// dscale[h] += sum over b and key tiles of partial[(b * H + h) * tiles + tile], in double, in a
// fixed order (one block per head).
__global__ void attention_dscale_kernel(const float* partial, int64_t B, int64_t H, int64_t tiles,
                                        float* dscale) {
  __shared__ double red[32];
  const int64_t h = blockIdx.x;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < B * tiles; i += blockDim.x) {
    const int64_t b = i / tiles, tile = i % tiles;
    acc += partial[(b * H + h) * tiles + tile];
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) dscale[h] += static_cast<float>(acc);
}

// ---- host side ----

// The dK/dV kernel's grid: one column of blocks per (b, k/v head).
dim3 kv_grid_of(const AttentionShape& s) {
  return dim3(static_cast<unsigned>(s.B * s.kv_heads()), static_cast<unsigned>(tiles_of(s)));
}

// Dynamic shared memory of each kernel for head dim D (fp32 words, as laid out in the kernels).
size_t dkdv_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + 2 * odd_stride(D) + 2); }
size_t dq_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + 2 * odd_stride(D)); }

template <typename T>
void backward_impl(Context& ctx, const AttentionShape& s, T* dq, T* dk, T* dv, float* dscale,
                   const T* dout, const T* out, const float* lse, const T* q, const T* k,
                   const T* v, const float* scale) {
  check_shape(s, "attention_backward");
  if (s.B == 0 || s.T == 0) return;
  const int64_t rows = s.B * s.H * s.T, tiles = tiles_of(s);
  // Scratch: delta[rows], then (for dscale) the per-block partials[B * H * tiles].
  const size_t delta_bytes = (sizeof(float) * rows + 255) / 256 * 256;
  const size_t partial_bytes = dscale != nullptr ? sizeof(float) * s.B * s.H * tiles : 0;
  char* scratch = static_cast<char*>(ctx.scratch(delta_bytes + partial_bytes));
  float* delta = reinterpret_cast<float*>(scratch);
  float* partial = dscale != nullptr ? reinterpret_cast<float*>(scratch + delta_bytes) : nullptr;

  attention_delta_kernel<T>
      <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, ctx.stream()>>>(
          s, delta, dout, out);
  KEEL_CUDA_LAUNCH_CHECK("attention_backward delta", "rows=", rows, " D=", s.D);

  const size_t smem_kv = dkdv_smem(s.D);
  allow_smem(attention_dkdv_kernel<T>, smem_kv, "attention_backward dkdv");
  attention_dkdv_kernel<T><<<kv_grid_of(s), kThreads, smem_kv, ctx.stream()>>>(
      s, dk, dv, partial, dout, lse, delta, q, k, v, scale);
  KEEL_CUDA_LAUNCH_CHECK("attention_backward dkdv", "B=", s.B, " T=", s.T, " H=", s.H,
                         " Hkv=", s.kv_heads(), " D=", s.D);

  const size_t smem_q = dq_smem(s.D);
  allow_smem(attention_dq_kernel<T>, smem_q, "attention_backward dq");
  attention_dq_kernel<T>
      <<<grid_of(s), kThreads, smem_q, ctx.stream()>>>(s, dq, dout, lse, delta, q, k, v, scale);
  KEEL_CUDA_LAUNCH_CHECK("attention_backward dq", "B=", s.B, " T=", s.T, " H=", s.H, " D=", s.D);

  if (dscale != nullptr) {
    attention_dscale_kernel<<<static_cast<unsigned>(s.H), 256, 0, ctx.stream()>>>(partial, s.B, s.H,
                                                                                  tiles, dscale);
    KEEL_CUDA_LAUNCH_CHECK("attention_backward dscale", "B=", s.B, " H=", s.H, " tiles=", tiles);
  }
}

}  // namespace

template <typename T>
void attention_backward(Context& ctx, const AttentionShape& s, T* dq, T* dk, T* dv, float* dscale,
                        const T* dout, const T* out, const float* lse, const T* q, const T* k,
                        const T* v, const float* scale) {
  backward_impl(ctx, s, dev(dq), dev(dk), dev(dv), dscale, dev(dout), dev(out), lse, dev(q), dev(k),
                dev(v), scale);
}

#define KEEL_INSTANTIATE(T)                                                                 \
  template void attention_backward<T>(Context&, const AttentionShape&, T*, T*, T*, float*,  \
                                      const T*, const T*, const float*, const T*, const T*, \
                                      const T*, const float*);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(Bf16)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels::cuda
