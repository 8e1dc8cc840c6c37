// Internal helpers of the CUDA backend shared between its source files.
#pragma once

#include <cstdint>

#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/gemm.h"

namespace keel::kernels::cuda {

// C[m, n] += bias[n] for m < M, n < N (row stride ldc); C and bias have type t. The fallback when
// cuBLASLt has no fused-bias algorithm for a GEMM.
void add_bias_rows(Context& ctx, void* C, const void* bias, int64_t M, int64_t N, int64_t ldc,
                   DType t);

// Blocks for a grid-stride loop over n elements with `threads` threads per block.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65536) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace keel::kernels::cuda
