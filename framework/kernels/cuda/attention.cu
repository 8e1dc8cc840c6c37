// The CUDA backend's fused causal attention (attention.h): FlashAttention-2 (Dao 2023) on CUDA
// cores in fp32, for head dimensions up to 128; the forward and max |logit| here, the backward in
// attention_backward.cu, the tiling they share in attention_internal.cuh.
//
// Forward: one block per (b, h, query tile), key tiles from 0 to the diagonal tile (the causal
// mask skips the rest), online softmax (running max m, running sum l, output rescaled by
// exp(m_old - m_new)); writes out and lse = m + log l. Max |logit| combines blocks with an integer
// atomicMax on the float's bits (exact and order-independent for non-negative floats).
//
// Max |logit| alone (what the cuDNN path reports beside cuDNN's attention, Note [cuda-exec-bf16]):
// for bf16 q and k in 16-row-aligned layouts, on the tensor cores (WMMA m16n16k16, fp32
// accumulation) rather than on the CUDA cores in fp32 as the fused kernels are; otherwise the
// forward's tiles and dot products without the softmax, bitwise the forward's value.
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "framework/error.h"
#include "framework/kernels/cuda/attention.h"
#include "framework/kernels/cuda/attention_internal.cuh"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"

namespace keel::kernels::cuda {

namespace {

// Folds a block's non-negative maximum into *out: a float's bits order like an int's for
// non-negative values, so an integer atomicMax is exact and independent of block order.
__device__ void block_max_into(float v, float* out) {
  __shared__ float red[32];
  v = block_max(v, red);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(v));
}

// ---- forward: one block per (b * H + h, query tile); query tiles in decreasing order, so the
// longest rows start first ----
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(AttentionShape s, T* out, float* lse, const T* q, const T* k,
                             const T* v, const float* scale, float* max_abs_logit) {
  extern __shared__ float4 smem_f4[];  // float4: 16-byte aligned, for row_dots
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int D = static_cast<int>(s.D), Dk = odd_stride(D);
  float* sQ = smem;             // [kTile][D]
  float* sK = sQ + kTile * D;   // [kTile][Dk]
  float* sV = sK + kTile * Dk;  // [kTile][D]
  const int64_t bh = blockIdx.x, b = bh / s.H, h = bh % s.H;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * int64_t{kTile};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float sc = scale[h];
  const int64_t hk = kv_head_of(s, h);
  const T* qh = q + b * s.T * s.ldq + h * s.D;
  const T* kh = k + b * s.T * s.ldk + hk * s.D;
  const T* vh = v + b * s.T * s.ldv + hk * s.D;
  load_tile(sQ, D, qh, s.ldq, q0, s.T, D);

  float m[kRows], l[kRows], o[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kCols; ++i) o[r][i] = 0.0f;
  }
  float amax = 0.0f;
  for (int64_t k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // the previous tile's sK, sV are no longer read
    load_tile(sK, Dk, kh, s.ldk, k0, s.T, D);
    load_tile(sV, D, vh, s.ldv, k0, s.T, D);
    __syncthreads();
    float x[kRows], p[kRows];
    row_dots(x, sQ + warp * kRows * D, sK + lane * Dk, D);
    const int64_t key = k0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t t = q0 + warp * kRows + r;
      const bool valid = key <= t && t < s.T;
      x[r] *= sc;
      if (valid) amax = fmaxf(amax, fabsf(x[r]));
      // Online softmax. A row beyond T has no valid entry: its max stays -inf, and corr = 1
      // keeps its (unwritten) state finite. Every row < T has key 0 in the first tile.
      const float m_new = fmaxf(m[r], warp_max(valid ? x[r] : -INFINITY));
      const float corr = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
      p[r] = valid ? expf(x[r] - m_new) : 0.0f;
      l[r] = l[r] * corr + warp_sum(p[r]);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < kCols; ++i) o[r][i] *= corr;
    }
    // o[r][d] += sum_j p[r](lane j) * V[j][d], keys in increasing order.
    for (int j = 0; j < kTile; ++j) {
      float vj[kCols];
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int d = lane + 32 * i;
        vj[i] = d < D ? sV[j * D + d] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float pj = __shfl_sync(kFullMask, p[r], j);
#pragma unroll
        for (int i = 0; i < kCols; ++i) o[r][i] = fmaf(pj, vj[i], o[r][i]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t t = q0 + warp * kRows + r;
    if (t >= s.T) continue;
    const float inv = 1.0f / l[r];
    T* orow = out + (b * s.T + t) * s.ldo + h * s.D;
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int d = lane + 32 * i;
      if (d < D) orow[d] = from_f<T>(o[r][i] * inv);
    }
    if (lane == 0) lse[bh * s.T + t] = m[r] + logf(l[r]);
  }
  if (max_abs_logit != nullptr) block_max_into(amax, max_abs_logit);
}

// ---- max |scale q.k| alone: the forward's tiles and dot products without the softmax ----
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_max_logit_kernel(AttentionShape s, const T* q, const T* k, const float* scale,
                               float* max_abs_logit) {
  extern __shared__ float4 smem_f4[];  // float4: 16-byte aligned, for row_dots
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int D = static_cast<int>(s.D), Dk = odd_stride(D);
  float* sQ = smem;            // [kTile][D]
  float* sK = sQ + kTile * D;  // [kTile][Dk]
  const int64_t bh = blockIdx.x, b = bh / s.H, h = bh % s.H;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * int64_t{kTile};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float sc = scale[h];
  const T* kh = k + b * s.T * s.ldk + kv_head_of(s, h) * s.D;
  load_tile(sQ, D, q + b * s.T * s.ldq + h * s.D, s.ldq, q0, s.T, D);
  float amax = 0.0f;
  for (int64_t k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();
    load_tile(sK, Dk, kh, s.ldk, k0, s.T, D);
    __syncthreads();
    float x[kRows];
    row_dots(x, sQ + warp * kRows * D, sK + lane * Dk, D);
    const int64_t key = k0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t t = q0 + warp * kRows + r;
      if (key <= t && t < s.T) amax = fmaxf(amax, fabsf(sc * x[r]));
    }
  }
  block_max_into(amax, max_abs_logit);
}

// ---- max |scale q.k| on the tensor cores (bf16 q, k; see can_use_tensor_cores) ----
//
// One block per (b * H + h, 64-query tile), longest rows first; warp w owns queries q0 + 16 w ..
// + 15, holds their q as D / 16 A fragments, and walks the keys up to its last query 16 at a time:
// one 16 x 16 score tile per step (fp32 accumulation over D), stored to the warp's shared tile,
// masked (key <= query) and folded into the lane's max. Tiles past T are skipped: T % 16 == 0.
constexpr int kTcRows = 16;                     // WMMA tile edge
constexpr int kTcQueryTile = kTcRows * kWarps;  // queries per block

__global__ void __launch_bounds__(kThreads)
    attention_max_logit_tc_kernel(AttentionShape s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const float* scale, float* max_abs_logit) {
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(32) float tiles[kWarps][kTcRows * kTcRows];
  const int64_t bh = blockIdx.x, b = bh / s.H, h = bh % s.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = (gridDim.y - 1 - blockIdx.y) * int64_t{kTcQueryTile} + warp * kTcRows;
  const int kd = static_cast<int>(s.D / kTcRows);
  const float sc = scale[h];
  float amax = 0.0f;
  if (q0 < s.T) {  // warp-uniform
    wmma::fragment<wmma::matrix_a, kTcRows, kTcRows, kTcRows, __nv_bfloat16, wmma::row_major>
        a[kAttentionMaxHeadDim / kTcRows];
    const __nv_bfloat16* qrow = q + (b * s.T + q0) * s.ldq + h * s.D;
    // Loops over a[] unrolled to its full size with the bound as a guard: constant indices keep
    // the fragments in registers (a run-time index would put a[] in local memory).
#pragma unroll
    for (int i = 0; i < kAttentionMaxHeadDim / kTcRows; ++i) {
      if (i < kd) wmma::load_matrix_sync(a[i], qrow + i * kTcRows, static_cast<unsigned>(s.ldq));
    }
    float* tile = tiles[warp];
    for (int64_t k0 = 0; k0 <= q0; k0 += kTcRows) {
      wmma::fragment<wmma::accumulator, kTcRows, kTcRows, kTcRows, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      // B = K^T: element (d, key) at k[key * ldk + d], i.e. column-major with ldm = ldk.
      const __nv_bfloat16* kcol = k + (b * s.T + k0) * s.ldk + kv_head_of(s, h) * s.D;
#pragma unroll
      for (int i = 0; i < kAttentionMaxHeadDim / kTcRows; ++i) {
        if (i >= kd) break;
        wmma::fragment<wmma::matrix_b, kTcRows, kTcRows, kTcRows, __nv_bfloat16, wmma::col_major>
            bk;
        wmma::load_matrix_sync(bk, kcol + i * kTcRows, static_cast<unsigned>(s.ldk));
        wmma::mma_sync(acc, a[i], bk, acc);
      }
      wmma::store_matrix_sync(tile, acc, kTcRows, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < kTcRows * kTcRows; e += 32) {
        const int64_t t = q0 + e / kTcRows, key = k0 + e % kTcRows;
        if (key <= t) amax = fmaxf(amax, fabsf(sc * tile[e]));
      }
      __syncwarp();  // the tile is read before the next store
    }
  }
  block_max_into(amax, max_abs_logit);
}

// The tensor-core form's requirements: bf16, D a multiple of 16, T a multiple of 16 (whole
// tiles), row strides a multiple of 8 elements and q, k 32-byte aligned (WMMA's loads).
// D at most 128: the A fragments a[] are sized for it (cuDNN's larger head dims take the CUDA-core
// form).
bool can_use_tensor_cores(const AttentionShape& s, const void* q, const void* k) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; };
  return s.D % kTcRows == 0 && s.D <= kAttentionMaxHeadDim && s.T % kTcRows == 0 &&
         s.ldq % 8 == 0 && s.ldk % 8 == 0 && aligned(q) && aligned(k);
}

// ---- host side ----

// Dynamic shared memory of each kernel for head dim D (fp32 words, as laid out in the kernels).
size_t forward_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + odd_stride(D)); }
size_t max_logit_smem(int64_t D) { return sizeof(float) * kTile * (D + odd_stride(D)); }

template <typename T>
void forward_impl(Context& ctx, const AttentionShape& s, T* out, float* lse, const T* q, const T* k,
                  const T* v, const float* scale, float* max_abs_logit) {
  check_shape(s, "attention_forward");
  if (max_abs_logit != nullptr) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(max_abs_logit, 0, sizeof(float), ctx.stream()),
                    "attention_forward max_abs_logit");
  }
  if (s.B == 0 || s.T == 0) return;
  const size_t smem = forward_smem(s.D);
  allow_smem(attention_forward_kernel<T>, smem, "attention_forward");
  attention_forward_kernel<T>
      <<<grid_of(s), kThreads, smem, ctx.stream()>>>(s, out, lse, q, k, v, scale, max_abs_logit);
  KEEL_CUDA_LAUNCH_CHECK("attention_forward", "B=", s.B, " T=", s.T, " H=", s.H, " D=", s.D);
}

template <typename T>
void max_logit_impl(Context& ctx, const AttentionShape& s, const T* q, const T* k,
                    const float* scale, float* max_abs_logit) {
  check_shape(s, "attention_max_abs_logit", kMaxLogitMaxHeadDim);
  KEEL_CHECK(max_abs_logit != nullptr, kUsage, "cuda attention_max_abs_logit: null output");
  KEEL_CUDA_CHECK(cudaMemsetAsync(max_abs_logit, 0, sizeof(float), ctx.stream()),
                  "attention_max_abs_logit");
  if (s.B == 0 || s.T == 0) return;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (can_use_tensor_cores(s, q, k)) {
      const dim3 grid(static_cast<unsigned>(s.B * s.H),
                      static_cast<unsigned>((s.T + kTcQueryTile - 1) / kTcQueryTile));
      attention_max_logit_tc_kernel<<<grid, kThreads, 0, ctx.stream()>>>(s, q, k, scale,
                                                                         max_abs_logit);
      KEEL_CUDA_LAUNCH_CHECK("attention_max_abs_logit (tensor cores)", "B=", s.B, " T=", s.T,
                             " H=", s.H, " D=", s.D);
      return;
    }
  }
  const size_t smem = max_logit_smem(s.D);
  allow_smem(attention_max_logit_kernel<T>, smem, "attention_max_abs_logit");
  attention_max_logit_kernel<T>
      <<<grid_of(s), kThreads, smem, ctx.stream()>>>(s, q, k, scale, max_abs_logit);
  KEEL_CUDA_LAUNCH_CHECK("attention_max_abs_logit", "B=", s.B, " T=", s.T, " H=", s.H, " D=", s.D);
}

}  // namespace

template <typename T>
void attention_forward(Context& ctx, const AttentionShape& s, T* out, float* lse, const T* q,
                       const T* k, const T* v, const float* scale, float* max_abs_logit) {
  forward_impl(ctx, s, dev(out), lse, dev(q), dev(k), dev(v), scale, max_abs_logit);
}

template <typename T>
void attention_max_abs_logit(Context& ctx, const AttentionShape& s, const T* q, const T* k,
                             const float* scale, float* max_abs_logit) {
  max_logit_impl(ctx, s, dev(q), dev(k), scale, max_abs_logit);
}

#define KEEL_INSTANTIATE(T)                                                                     \
  template void attention_forward<T>(Context&, const AttentionShape&, T*, float*, const T*,     \
                                     const T*, const T*, const float*, float*);                 \
  template void attention_max_abs_logit<T>(Context&, const AttentionShape&, const T*, const T*, \
                                           const float*, float*);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(Bf16)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels::cuda
