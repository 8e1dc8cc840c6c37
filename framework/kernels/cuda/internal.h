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

// The largest extent (rows, columns, leading dimension) a kernel indexes in 32 bits: half of
// INT32_MAX, so a loop's last step past it cannot overflow. Element offsets are widened to 64 bits
// in the multiply (row * ld), which costs one wide multiply-add, not the 64-bit division and
// remainder of all-64-bit index math.
constexpr int64_t kMaxIndex32 = int64_t{1} << 30;

// ---- Note [vector-access] ----
// The element-wise kernels move 16 bytes per load and store where they can: fp32 as 4 floats
// (float4), bf16 as 8 (uint4), a kernel mixing the two in packs of 8 elements (two 16-byte fp32
// accesses, one bf16). A kernel takes W elements a thread-step as Pack<T, W> when the host finds
// every operand 16-byte aligned (aligned16) and, for row blocks, every leading dimension a multiple
// of W; the last n % W elements (of a flat buffer or of each row) go one at a time in the same
// launch. Otherwise the same kernel runs with W = 1. Each element gets the same arithmetic either
// way, so the results are bitwise identical. The row-chunked bias gradients (Note
// [fused-bias-grad]: gelu_backward_bias_kernel, glu_backward_bias_kernel) take W = 4 columns a
// thread when C % 4 == 0, each column summed in W = 1's order. Indices are 32-bit (extents up to
// kMaxIndex32); flat buffers longer than that run in pieces of kMaxIndex32 elements (for_pieces).
template <typename T, int W>
struct alignas(sizeof(T) * W < 16 ? sizeof(T) * W : 16) Pack {
  T v[W];
};
// Elements per pack for a kernel over element types A and B: 16 bytes of the narrower.
template <typename A, typename B = A>
constexpr int pack_width() {
  return static_cast<int>(16 / (sizeof(A) < sizeof(B) ? sizeof(A) : sizeof(B)));
}
template <typename... T>
bool aligned16(const T*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}
// launch(offset, count) over [0, n) in pieces of at most kMaxIndex32 elements (a multiple of 16,
// so a piece keeps its buffers' alignment): one piece unless n passes 2^30.
template <typename Launch>
void for_pieces(int64_t n, Launch launch) {
  for (int64_t at = 0; at < n; at += kMaxIndex32) {
    launch(at, static_cast<int>(n - at < kMaxIndex32 ? n - at : kMaxIndex32));
  }
}

// Blocks for a grid-stride loop over n elements with `threads` threads per block.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65536) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

// ---- Note [fused-bias-grad] ----
// Column sums over all of a step's rows: a linear layer's bias gradient (column_sum_add, and fused
// into the element-wise backward kernels whose output is the layer's output gradient,
// gelu_backward and glu_backward, in fp32 before that output is rounded to bf16, without reading
// it again) and the norms' gain and bias gradients (norm.cu). [N, C] is cut into 32-column strips
// (blockIdx.x) and row chunks (blockIdx.y), a block of (32, kColRows) threads each; a block writes
// its chunk's column sums to partial[chunk, C] (Context scratch), and column_sum_partials_add adds
// the partials' column sums to the gradient (+=) in one small launch. A width-sized grid alone
// (C / 32 blocks: 2 for a 64-wide QK-norm gain) would leave most of the GPU idle while it reads
// N * C elements; the chunks make strips x chunks fill it (ctest cuda_emu.StepBudget's
// RowReductionsFillAnH200 holds these kernels to an H200's 132 SMs). The chunks are a function of
// N and C alone, never of the device, so the sums are bitwise reproducible run to run and machine
// to machine; no floating-point atomics.
constexpr int kColRows = 8;
struct RowChunks {
  int64_t count;  // chunks (gridDim.y), at most 512; 1 when N <= 128
  int64_t rows;   // rows per chunk (the last may have fewer)
};
// Chunks for column sums of [N, C]. Target: as many 256-thread blocks as an H200 holds resident
// (132 SMs x 2048 threads / 256 = 1056; llm.c's matmul_backward_bias sizes its row split the same
// way), in chunks of at least 16 rows (two per thread), at most 512 chunks (the final pass reads
// chunks x C floats). At most 128 rows make one chunk: column_sum_add then runs in one pass
// without scratch, which glu.cu relies on when it sums its scratch partials through it.
inline RowChunks row_chunks(int64_t N, int64_t C) {
  constexpr int64_t kOnePassRows = 128, kTargetBlocks = 132 * 2048 / 256, kMaxChunks = 512,
                    kMinRows = 16;
  if (N <= kOnePassRows) return {1, N < 1 ? 1 : N};
  const int64_t strips = (C + 31) / 32;
  int64_t want = (kTargetBlocks + strips - 1) / strips;
  if (want > kMaxChunks) want = kMaxChunks;
  int64_t rows = (N + want - 1) / want;
  if (rows < kMinRows) rows = kMinRows;
  return {(N + rows - 1) / rows, rows};
}
// glu.cu's chunks (at most 128, of at least 64 rows), until it passes C to the form above.
inline RowChunks row_chunks(int64_t N) {
  constexpr int64_t kMaxChunks = 128, kMinRows = 64;
  int64_t rows = (N + kMaxChunks - 1) / kMaxChunks;
  if (rows < kMinRows) rows = kMinRows;
  return {(N + rows - 1) / rows, rows};
}
// out[c] += sum over k < chunks of partial[k * C + c] for c < C, and out2 likewise from the next
// chunks x C partials (partial + chunks * C); either may be null (skipped). Fixed order, one
// launch, no scratch (partial may be the Context's scratch).
void column_sum_partials_add(Context& ctx, float* out, float* out2, const float* partial,
                             int64_t chunks, int64_t C);

}  // namespace keel::kernels::cuda
