// NCCL tensor communicators bootstrapped over MPI (nccl_tensor_comms.h): keel-train's.
#include "launch/train/nccl_tensor_comms.h"

#if KEEL_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#include "parallel/nccl_mpi.h"
#include "parallel/topology.h"

namespace keel {

std::function<TensorComms(kernels::ExecContext& exec, const Topology& topo)> nccl_tensor_comms(
    Distributed& dist) {
  return [&dist](kernels::ExecContext& exec, const Topology& topo) {
    kernels::cuda::Context& ctx = nccl_cuda_context(exec);
    // One world communicator split into TP and DP, which share a launch order (nccl_mpi.h).
    NcclTensorGroups groups = make_nccl_tensor_groups(
        dist.world_mpi_comm(), dist.tp_mpi_comm(), dist.dp_mpi_comm(), topo, ctx, &dist.watchdog());
    TensorComms comms;
    comms.tp = std::move(groups.tp);
    comms.dp = std::move(groups.dp);
    return comms;
  };
}

}  // namespace keel
#endif
