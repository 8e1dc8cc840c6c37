// The NCCL tensor communicators a device run's Trainer uses (TrainerOptions::make_tensor_comms):
// the TP and DP groups over NCCL on the run's CUDA stream. Declared only in builds with NCCL
// (KEEL_HAVE_NCCL, from keel_nccl); without it the Trainer stages its collectives over MPI.
#pragma once

#if KEEL_HAVE_NCCL
#include <functional>

#include "framework/kernels/cuda/device.h"
#include "framework/kernels/exec_context.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"

namespace keel {

class Distributed;  // parallel/topology.h (which includes MPI's headers; this file does not)

// keel-train's: each group's NCCL communicator bootstrapped over its MPI group in `dist` (groups
// of one get none: their MPI group is a no-op already); every communicator is an abort hook of
// dist's watchdog. `exec` must be the CUDA execution context.
std::function<TensorComms(kernels::ExecContext& exec, const Topology& topo)> nccl_tensor_comms(
    Distributed& dist);

// Groups of one over NCCL without MPI (the GPU check's 1-rank NCCL job, with
// TrainerOptions::tensor_comms_for_one_rank).
TensorComms one_rank_nccl_comms(kernels::ExecContext& exec);

// The CUDA context of `exec` (kInternal error naming it otherwise).
kernels::cuda::Context& nccl_cuda_context(kernels::ExecContext& exec);

}  // namespace keel
#endif
