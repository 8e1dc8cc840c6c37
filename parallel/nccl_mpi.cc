// NCCL over MPI: device selection and the ncclUniqueId bootstrap (see nccl_mpi.h).
#include "parallel/nccl_mpi.h"

#include "framework/error.h"
#include "framework/kernels/cuda/device.h"
#include "parallel/device_map.h"
#include "parallel/topology.h"

namespace keel {

int select_device(const MpiEnv& mpi) { return device_for_rank(mpi, kernels::cuda::device_count()); }

std::unique_ptr<NcclCommunicator> make_nccl_communicator(MPI_Comm group, std::string name,
                                                         kernels::cuda::Context& ctx,
                                                         Watchdog* watchdog,
                                                         std::shared_ptr<NcclLaunchOrder> order) {
  int rank = 0, size = 1;
  KEEL_CHECK(
      MPI_Comm_rank(group, &rank) == MPI_SUCCESS && MPI_Comm_size(group, &size) == MPI_SUCCESS,
      kComm, "MPI_Comm_rank/MPI_Comm_size of the ", name, " group failed");
  NcclCommunicator::UniqueId id{};
  if (rank == 0) id = NcclCommunicator::make_unique_id();
  // A failure to make the id throws on rank 0 before the broadcast; an error on one rank ends
  // the whole job (keel-train's main calls MPI_Abort), which releases the others from MPI_Bcast.
  const int rc = MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, group);
  KEEL_CHECK(rc == MPI_SUCCESS, kComm, "MPI_Bcast of the ncclUniqueId over the ", name,
             " group failed (rank ", rank, " of ", size, ")");
  return std::make_unique<NcclCommunicator>(id, rank, size, std::move(name), ctx, watchdog,
                                            std::move(order));
}

NcclTensorGroups make_nccl_tensor_groups(MPI_Comm world, MPI_Comm tp_group, MPI_Comm dp_group,
                                         const Topology& topo, kernels::cuda::Context& ctx,
                                         Watchdog* watchdog) {
  NcclTensorGroups out;
  if (topo.tp == 1 && topo.dp == 1) return out;
  if (!NcclCommunicator::split_supported()) {
    // NCCL < 2.18: a bootstrap per group, one launch order for both.
    std::shared_ptr<NcclLaunchOrder> order;
    if (topo.tp > 1) {
      out.tp = make_nccl_communicator(tp_group, "tensor-parallel", ctx, watchdog);
      order = out.tp->launch_order();
    }
    if (topo.dp > 1) {
      out.dp = make_nccl_communicator(dp_group, "data-parallel", ctx, watchdog, order);
    }
    return out;
  }
  int world_rank = 0;
  KEEL_CHECK(MPI_Comm_rank(world, &world_rank) == MPI_SUCCESS, kComm,
             "MPI_Comm_rank of the world group failed");
  KEEL_CHECK(world_rank == topo.world_rank, kInternal, "world rank ", world_rank,
             " is not the topology's ", topo.world_rank);
  std::unique_ptr<NcclCommunicator> all = make_nccl_communicator(world, "world", ctx, watchdog);
  // Every rank takes part in both splits (a group of one on every rank, or on none).
  if (topo.tp > 1) {
    out.tp = all->split(tp_group_of(topo.world_rank, topo.tp), topo.tp_rank, "tensor-parallel");
  }
  if (topo.dp > 1) {
    out.dp = all->split(dp_group_of(topo.world_rank, topo.tp), topo.dp_rank, "data-parallel");
  }
  KEEL_CHECK(
      (out.tp == nullptr || (out.tp->size() == topo.tp && out.tp->rank() == topo.tp_rank)) &&
          (out.dp == nullptr || (out.dp->size() == topo.dp && out.dp->rank() == topo.dp_rank)),
      kInternal, "ncclCommSplit gave groups other than the topology's");
  return out;  // the world communicator is destroyed here: the split ones do not need it
}

}  // namespace keel
