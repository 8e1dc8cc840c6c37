// The bf16 sum as an MPI reduction (Note [bf16 wire] in parallel/communicator.h): MPI has no
// bf16 type, so bf16 values travel as MPI_UINT16_T and this user operation adds them as NCCL's
// bf16 sum does, in fp32 with the result rounded to bf16 (nearest even). Header-only, so the CUDA
// emulator's NCCL (tests/cuda_emu/nccl.cc) sums bf16 the same way.
#pragma once

#include <mpi.h>

#include "framework/kernels/cuda/bf16.h"

namespace keel {

inline void bf16_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const Bf16* a = static_cast<const Bf16*>(in);
  Bf16* b = static_cast<Bf16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

// Created on first use (after MPI_Init) and kept for the process: MPI frees it at finalize.
inline MPI_Op bf16_sum_op() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    MPI_Op_create(&bf16_sum_fn, /*commute=*/1, &o);
    return o;
  }();
  return op;
}

}  // namespace keel
