// Shared by the CUDA backend's fused attention kernels, attention.cu (forward, max |logit|) and
// attention_backward.cu (see attention.h): the tiling's constants, the tile loads and the q.k dot
// products (one order for every kernel, so the backward's recomputed logits are bitwise the
// forward's), the grouped-query head mapping, and the host side's shape check and grid. Device
// functions only: __shared__ declarations and launches stay in the .cu files (the emulator
// translates those, not the headers they include: tests/cuda_emu/translate.py).
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
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "framework/error.h"
#include "framework/kernels/cuda/attention.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"

namespace keel::kernels::cuda {

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

inline int64_t tiles_of(const AttentionShape& s) { return (s.T + kTile - 1) / kTile; }

// max_d: the largest head dim the kernel takes (kAttentionMaxHeadDim for the fused kernels).
inline void check_shape(const AttentionShape& s, const char* name,
                        int64_t max_d = kAttentionMaxHeadDim) {
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

inline dim3 grid_of(const AttentionShape& s) {
  return dim3(static_cast<unsigned>(s.B * s.H), static_cast<unsigned>(tiles_of(s)));
}

// Up to 66 KiB of dynamic shared memory at D = 128: above the 48 KiB a kernel gets without
// opting in.
template <typename Kernel>
void allow_smem(Kernel* kernel, size_t bytes, const char* name) {
  KEEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)),
                  name, " shared_bytes=", bytes);
}

}  // namespace keel::kernels::cuda
