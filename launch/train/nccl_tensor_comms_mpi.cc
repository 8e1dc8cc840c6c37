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
    TensorComms comms;
    if (topo.tp > 1) {
      comms.tp =
          make_nccl_communicator(dist.tp_mpi_comm(), "tensor-parallel", ctx, &dist.watchdog());
    }
    if (topo.dp > 1) {
      comms.dp = make_nccl_communicator(dist.dp_mpi_comm(), "data-parallel", ctx, &dist.watchdog());
    }
    return comms;
  };
}

}  // namespace keel
#endif
