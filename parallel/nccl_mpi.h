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
// `order`: the launch order to share with other communicators (null: its own).
std::unique_ptr<NcclCommunicator> make_nccl_communicator(
    MPI_Comm group, std::string name, kernels::cuda::Context& ctx, Watchdog* watchdog,
    std::shared_ptr<NcclLaunchOrder> order = nullptr);

// The tensor communicators of a TP x DP job (world = dp x tp, TP groups consecutive ranks, as
// parallel/topology.h): one NCCL communicator over `world` (one ncclUniqueId broadcast, one
// bootstrap), split with ncclCommSplit into this rank's TP group (color: the TP group's index,
// key: tp_rank) and DP group (color: the DP group's index, key: dp_rank), the world one then
// destroyed. The two share a launch order (Note [nccl launch order] in nccl_communicator.h).
// Groups of one get none (null; every rank agrees, as topo is the same everywhere). Without
// ncclCommSplit (NCCL < 2.18) each group is bootstrapped over its own MPI group (`tp_group`,
// `dp_group`, in the same rank order), still sharing one launch order. Collective over `world`,
// whose rank must be topo.world_rank.
struct NcclTensorGroups {
  std::unique_ptr<NcclCommunicator> tp, dp;
};
NcclTensorGroups make_nccl_tensor_groups(MPI_Comm world, MPI_Comm tp_group, MPI_Comm dp_group,
                                         const Topology& topo, kernels::cuda::Context& ctx,
                                         Watchdog* watchdog);

}  // namespace keel
