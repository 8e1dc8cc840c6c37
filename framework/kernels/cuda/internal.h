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

// ---- Note [fused-bias-grad] ----
// The element-wise backward kernels whose output is a linear layer's output gradient
// (gelu_backward, glu_backward) also sum that output's columns: the layer's bias gradient, in fp32
// before the output is rounded to bf16, without reading the output again. [N, C] is cut into
// 32-column strips (blockIdx.x) and row chunks (blockIdx.y), a block of (32, kColRows) threads
// each; a block writes its chunk's column sums to partial[chunk, C] (Context scratch), and
// column_sum_add adds the partials' column sums to the bias gradient. The chunks are a function of
// N alone, so the sums are bitwise reproducible run to run.
constexpr int kColRows = 8;
struct RowChunks {
  int64_t count;  // chunks (gridDim.y), at most 128
  int64_t rows;   // rows per chunk (the last may have fewer)
};
inline RowChunks row_chunks(int64_t N) {
  constexpr int64_t kMaxChunks = 128, kMinRows = 64;
  int64_t rows = (N + kMaxChunks - 1) / kMaxChunks;
  if (rows < kMinRows) rows = kMinRows;
  return {(N + rows - 1) / rows, rows};
}

}  // namespace keel::kernels::cuda
