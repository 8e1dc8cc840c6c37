// The CUDA backend's fused causal attention (attention.h): FlashAttention-2 (Dao 2023) on CUDA
// cores in fp32, for head dimensions up to 128.
//
// Tiling. A tile is kTile = 32 rows (queries or keys); a block has 4 warps of 8 rows each. Rows
// of the current tiles are staged in shared memory as fp32 (bf16 inputs are widened exactly on the
// load), zero beyond T. A warp's 32 lanes are the 32 rows of the other tile: for a q.k dot product
// a lane reads its own row (row stride D | 1, odd, so the 32 lanes hit 32 different banks) and the
// warp's 8 rows are broadcast reads (float4 when D % 4 == 0). For the products with V, dO, Q or K
// that follow, a lane owns the columns d = lane + 32 i (i < 4) of each of the warp's 8 rows and
// takes the other tile's weights from its lanes by shuffles, in increasing row order.
//
// Grouped-query attention (AttentionShape::Hkv < H): query head h reads k/v head h / G, G = H /
// Hkv, at row strides ldk, ldv of at least Hkv * D. Only the dK/dV kernel's grid is by k/v head.
//
// Forward: one block per (b, h, query tile), key tiles from 0 to the diagonal tile (the causal
// mask skips the rest), online softmax (running max m, running sum l, output rescaled by
// exp(m_old - m_new)); writes out and lse = m + log l.
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
// fixed order, so results are bitwise reproducible; max |logit| combines blocks with an integer
// atomicMax on the float's bits (exact and order-independent for non-negative floats). With
// groups, the dK/dV grid has B * Hkv rather than B * H columns of blocks, each G times the work:
// at 124M-like shapes (B 16, T 1024) even multi-query attention gives 16 x 32 = 512 blocks.
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
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"

namespace keel::kernels::cuda {

namespace {

constexpr int kTile = 32;                                           // rows per query or key tile
constexpr int kWarps = 4;                                           // warps per block
constexpr int kThreads = 32 * kWarps;                               // threads per block
constexpr int kRows = kTile / kWarps;                               // tile rows per warp
constexpr int kCols = static_cast<int>(kAttentionMaxHeadDim / 32);  // head columns per lane
constexpr unsigned kFullMask = 0xffffffffu;

// Shared-memory row stride for tiles a lane reads row-wise: odd, so lane i's element d (word
// i * stride + d) falls in a different bank for each of the 32 lanes.
__host__ __device__ inline int odd_stride(int D) { return D | 1; }

// Rows [row0, row0 + kTile) of one head's slice (element (t, d) at src[t * ld + d]) into
// dst[r * lds + d] as fp32; rows at or beyond T read as zero. Consecutive threads take consecutive
// d, so the global reads of a row coalesce.
template <typename T>
__device__ void load_tile(float* dst, int lds, const T* src, int64_t ld, int64_t row0, int64_t T_,
                          int D) {
  for (int i = threadIdx.x; i < kTile * D; i += kThreads) {
    const int r = i / D, d = i - r * D;
    const int64_t t = row0 + r;
    dst[r * lds + d] = t < T_ ? to_f(src[t * ld + d]) : 0.0f;
  }
}

// acc[r] = sum_d rows[r * D + d] * lane_row[d] for the warp's kRows rows (the same for every
// lane: broadcast reads) and the lane's own row, fmaf in increasing d. Every q.k is computed here
// in this order, so the backward's recomputed logits and the standalone max |logit| are bitwise
// the forward's. When D % 4 == 0 the broadcast rows are read as float4 (16-byte aligned: every
// tile starts at a multiple of 4 words), a quarter of the shared-memory load instructions.
__device__ __forceinline__ void row_dots(float (&acc)[kRows], const float* rows,
                                         const float* lane_row, int D) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  if (D % 4 == 0) {
    for (int d = 0; d < D; d += 4) {
      const float x0 = lane_row[d], x1 = lane_row[d + 1], x2 = lane_row[d + 2],
                  x3 = lane_row[d + 3];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 w = *reinterpret_cast<const float4*>(rows + r * D + d);
        acc[r] = fmaf(w.x, x0, acc[r]);
        acc[r] = fmaf(w.y, x1, acc[r]);
        acc[r] = fmaf(w.z, x2, acc[r]);
        acc[r] = fmaf(w.w, x3, acc[r]);
      }
    }
  } else {
    for (int d = 0; d < D; ++d) {
      const float x = lane_row[d];
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = fmaf(rows[r * D + d], x, acc[r]);
    }
  }
}

// AttentionShape::kv_heads() for device code (the header's member is host-only).
__host__ __device__ inline int64_t kv_heads_of(const AttentionShape& s) {
  return s.Hkv > 0 ? s.Hkv : s.H;
}

// The k/v head query head h reads: h / G with G = H / Hkv query heads per group. In 32 bits
// (check_shape holds B * H below 2^31): 64-bit integer division is a software routine on a GPU.
__host__ __device__ inline int64_t kv_head_of(const AttentionShape& s, int64_t h) {
  const int H = static_cast<int>(s.H), Hkv = static_cast<int>(kv_heads_of(s));
  return static_cast<int>(h) / (H / Hkv);
}

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

// ---- backward ----

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

int64_t tiles_of(const AttentionShape& s) { return (s.T + kTile - 1) / kTile; }

// max_d: the largest head dim the kernel takes (kAttentionMaxHeadDim for the fused kernels).
void check_shape(const AttentionShape& s, const char* name, int64_t max_d = kAttentionMaxHeadDim) {
  KEEL_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 1 && s.D >= 1, kUsage, "cuda ", name,
             ": bad shape B=", s.B, " T=", s.T, " H=", s.H, " D=", s.D);
  const int64_t Hkv = s.kv_heads();
  KEEL_CHECK(Hkv >= 1 && s.H % Hkv == 0, kUsage, "cuda ", name, ": k/v heads Hkv=", Hkv,
             " must divide the H=", s.H, " query heads");
  KEEL_CHECK(s.D <= max_d, kUsage, "cuda ", name, ": head dim D=", s.D, " exceeds the limit of ",
             max_d);
  const int64_t HD = s.H * s.D, KD = Hkv * s.D;
  KEEL_CHECK(s.ldq >= HD && s.ldo >= HD && s.ldk >= KD && s.ldv >= KD, kUsage, "cuda ", name,
             ": row strides ldq=", s.ldq, " ldo=", s.ldo, " (at least H * D = ", HD,
             "), ldk=", s.ldk, " ldv=", s.ldv, " (at least Hkv * D = ", KD, ")");
  // The delta kernel's grid is one block per kWarps rows of B * H * T.
  KEEL_CHECK(s.B * s.H * s.T / kWarps < INT32_MAX, kUsage, "cuda ", name,
             ": B * H * T = ", s.B * s.H * s.T, " rows is too many for one launch");
  KEEL_CHECK(s.B * s.H <= INT32_MAX && tiles_of(s) <= 65535, kUsage, "cuda ", name,
             ": grid too large for B * H = ", s.B * s.H, " (at most 2^31 - 1) or T = ", s.T,
             " (at most ", int64_t{65535} * kTile, ")");
}

dim3 grid_of(const AttentionShape& s) {
  return dim3(static_cast<unsigned>(s.B * s.H), static_cast<unsigned>(tiles_of(s)));
}

// The dK/dV kernel's grid: one column of blocks per (b, k/v head).
dim3 kv_grid_of(const AttentionShape& s) {
  return dim3(static_cast<unsigned>(s.B * s.kv_heads()), static_cast<unsigned>(tiles_of(s)));
}

// Dynamic shared memory of each kernel for head dim D (fp32 words, as laid out in the kernels).
size_t forward_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + odd_stride(D)); }
size_t max_logit_smem(int64_t D) { return sizeof(float) * kTile * (D + odd_stride(D)); }
size_t dkdv_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + 2 * odd_stride(D) + 2); }
size_t dq_smem(int64_t D) { return sizeof(float) * kTile * (2 * D + 2 * odd_stride(D)); }

// Up to 66 KiB of dynamic shared memory at D = 128: above the 48 KiB a kernel gets without
// opting in.
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes, const char* name) {
  KEEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)),
                  name, " shared_bytes=", bytes);
}

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
void attention_forward(Context& ctx, const AttentionShape& s, T* out, float* lse, const T* q,
                       const T* k, const T* v, const float* scale, float* max_abs_logit) {
  forward_impl(ctx, s, dev(out), lse, dev(q), dev(k), dev(v), scale, max_abs_logit);
}

template <typename T>
void attention_backward(Context& ctx, const AttentionShape& s, T* dq, T* dk, T* dv, float* dscale,
                        const T* dout, const T* out, const float* lse, const T* q, const T* k,
                        const T* v, const float* scale) {
  backward_impl(ctx, s, dev(dq), dev(dk), dev(dv), dscale, dev(dout), dev(out), lse, dev(q), dev(k),
                dev(v), scale);
}

template <typename T>
void attention_max_abs_logit(Context& ctx, const AttentionShape& s, const T* q, const T* k,
                             const float* scale, float* max_abs_logit) {
  max_logit_impl(ctx, s, dev(q), dev(k), scale, max_abs_logit);
}

#define KEEL_INSTANTIATE(T)                                                                     \
  template void attention_forward<T>(Context&, const AttentionShape&, T*, float*, const T*,     \
                                     const T*, const T*, const float*, float*);                 \
  template void attention_backward<T>(Context&, const AttentionShape&, T*, T*, T*, float*,      \
                                      const T*, const T*, const float*, const T*, const T*,     \
                                      const T*, const float*);                                  \
  template void attention_max_abs_logit<T>(Context&, const AttentionShape&, const T*, const T*, \
                                           const float*, float*);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(Bf16)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels::cuda
