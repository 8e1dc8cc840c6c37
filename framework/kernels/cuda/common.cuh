// Device-side helpers shared by the CUDA backend's .cu files: fp32/bf16 loads and stores, the
// Bf16 <-> __nv_bfloat16 view, and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/internal.h"  // kColRows

namespace keel::kernels::cuda {

static_assert(sizeof(__nv_bfloat16) == sizeof(Bf16), "Bf16 must have __nv_bfloat16's layout");

// Host Bf16 buffers as CUDA's bf16 (same bits).
inline __nv_bfloat16* dev(Bf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* dev(const Bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
inline float* dev(float* p) { return p; }
inline const float* dev(const float* p) { return p; }

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024) in a fixed order; every
// thread gets the result. `shared` holds 32 values.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // shared may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}
__device__ inline float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// Note [fused-bias-grad] (internal.h): v summed over threadIdx.y for a block of (32, kColRows)
// threads, in a fixed order; thread (x, 0) gets column x's sum. `s` holds kColRows x 33 floats
// and may be reused once every thread has the result (a barrier precedes its first write).
__device__ inline float column_block_sum(float v, float (*s)[33]) {
  __syncthreads();  // s may still be read from a previous call
  s[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  for (int k = kColRows / 2; k > 0; k /= 2) {
    if (threadIdx.y < k) s[threadIdx.y][threadIdx.x] += s[threadIdx.y + k][threadIdx.x];
    __syncthreads();
  }
  return s[0][threadIdx.x];
}

// ---- flat element-wise maps (Note [vector-access] in internal.h) ----
// out[i] = f(a[i]) (or f(a[i], b[i])) over [0, n): n / W packs of W elements a thread-step, then
// the last n % W elements one per thread of the grid's first threads. out may alias an input: each
// element is read before it is written, by the same thread.
template <int W, typename TO, typename TA, typename F>
__device__ __forceinline__ void map_packs(TO* out, const TA* a, int n, F f) {
  const int id = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), packs = n / W;
  for (int k = id; k < packs; k += static_cast<int>(gridDim.x * blockDim.x)) {
    const Pack<TA, W> x = reinterpret_cast<const Pack<TA, W>*>(a)[k];
    Pack<TO, W> y;
#pragma unroll
    for (int j = 0; j < W; ++j) y.v[j] = f(x.v[j]);
    reinterpret_cast<Pack<TO, W>*>(out)[k] = y;
  }
  if (packs * W + id < n) out[packs * W + id] = f(a[packs * W + id]);
}
template <int W, typename TO, typename TA, typename TB, typename F>
__device__ __forceinline__ void map_packs(TO* out, const TA* a, const TB* b, int n, F f) {
  const int id = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), packs = n / W;
  for (int k = id; k < packs; k += static_cast<int>(gridDim.x * blockDim.x)) {
    const Pack<TA, W> x = reinterpret_cast<const Pack<TA, W>*>(a)[k];
    const Pack<TB, W> y = reinterpret_cast<const Pack<TB, W>*>(b)[k];
    Pack<TO, W> z;
#pragma unroll
    for (int j = 0; j < W; ++j) z.v[j] = f(x.v[j], y.v[j]);
    reinterpret_cast<Pack<TO, W>*>(out)[k] = z;
  }
  if (packs * W + id < n) out[packs * W + id] = f(a[packs * W + id], b[packs * W + id]);
}

}  // namespace keel::kernels::cuda
