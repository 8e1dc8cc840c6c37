// What a multi-GPU MPI job needs from keel_nccl besides the communicator itself: this rank's GPU
// (parallel/device_map.h with the CUDA runtime's device count) and NCCL communicators bootstrapped
// over MPI (MPI stays the control plane: launch, set-up, agreement on errors and signals; NCCL
// carries the tensors). Part of keel_nccl, so CUDA/NCCL builds only.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "parallel/mpi_env.h"
#include "parallel/nccl_communicator.h"

namespace keel {

// The CUDA device index this rank uses (device_for_rank() with kernels::cuda::device_count());
// throws kLayout when the node has more ranks than GPUs.
int select_device(const MpiEnv& mpi);

// An NCCL communicator over the ranks of `group`, in its rank order: the group's rank 0 makes the
// ncclUniqueId and broadcasts it over `group` (MPI_Bcast, 128 bytes); every rank then joins
// (ncclCommInitRank, under the watchdog). Collective over `group`, which is not taken over
// (the caller keeps and frees it).
std::unique_ptr<NcclCommunicator> make_nccl_communicator(MPI_Comm group, std::string name,
                                                         kernels::cuda::Context& ctx,
                                                         Watchdog* watchdog);

}  // namespace keel
