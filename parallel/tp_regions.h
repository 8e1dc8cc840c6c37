// Megatron's tensor-parallel region operations (mappings.py), as explicit forward/backward
// conjugate pairs for keel's hand-written backward passes:
//   copy_to_tp:     forward identity,   backward all-reduce  (entering a column-parallel region:
//                   the input is replicated, each rank's input gradient is partial)
//   reduce_from_tp: forward all-reduce, backward identity    (leaving a row-parallel region:
//                   each rank's output is a partial sum, the output gradient is replicated)
// Every TP collective of the model goes through these (plus the vocab-parallel loss's row
// statistics), so the communication formula in README.md is read off their call sites. The sums
// move bf16 for bf16 memory, and for fp32 memory with `bf16_wire` (Note [bf16 wire] in
// parallel/communicator.h).
#pragma once

#include <cstdint>

#include "framework/kernels/exec_context.h"
#include "parallel/communicator.h"

namespace keel::tp_region {

// Sums activations (or their gradients) over the TP group.
inline void sum_activations(Communicator& tp, kernels::ActOut x, int64_t n, bool bf16_wire) {
  if (x.dtype == DType::kBF16) {
    tp.all_reduce_bf16(static_cast<Bf16*>(x.data), n);
  } else if (bf16_wire) {
    tp.all_reduce_bf16(static_cast<float*>(x.data), n);
  } else {
    tp.all_reduce(static_cast<float*>(x.data), n, ReduceOp::kSum);
  }
}

// copy_to_tp: nothing to do forward.
inline void copy_to_tp_forward(Communicator&, float*, int64_t) {}
// copy_to_tp backward: sum the partial input gradients of all TP ranks.
inline void copy_to_tp_backward(Communicator& tp, kernels::ActOut grad, int64_t n, bool bf16_wire) {
  sum_activations(tp, grad, n, bf16_wire);
}
// reduce_from_tp forward: sum the partial outputs of all TP ranks.
inline void reduce_from_tp_forward(Communicator& tp, kernels::ActOut out, int64_t n,
                                   bool bf16_wire) {
  sum_activations(tp, out, n, bf16_wire);
}
// reduce_from_tp: nothing to do backward.
inline void reduce_from_tp_backward(Communicator&, float*, int64_t) {}

// Sequence parallelism (Note [sequence parallel] in layers/gpt.h) replaces the pair above with
// Megatron's other two (mappings.py), conjugate in the same way, over token rows in fp32:
//   gather_from_sp:      forward all-gather,     backward reduce-scatter (entering a sublayer)
//   reduce_scatter_to_sp: forward reduce-scatter, backward all-gather    (leaving a sublayer)
// In keel's explicit backward each direction is a call of one of these two. `n` is the element
// count of one rank's rows (rows(B) x C); `all` holds tp x n, rank r's rows at [r n, (r + 1) n).
inline void gather_rows(Communicator& tp, const float* mine, float* all, int64_t n) {
  tp.all_gather(mine, all, n);
}
// mine[n] = the sum over TP ranks of their partial[rank() n, (rank() + 1) n).
inline void scatter_rows(Communicator& tp, const float* partial, float* mine, int64_t n) {
  tp.reduce_scatter(partial, mine, n);
}

}  // namespace keel::tp_region
