// NCCL over MPI: device selection and the ncclUniqueId bootstrap (see nccl_mpi.h).
#include "parallel/nccl_mpi.h"

#include "framework/error.h"
#include "framework/kernels/cuda/device.h"
#include "parallel/device_map.h"

namespace keel {

int select_device(const MpiEnv& mpi) { return device_for_rank(mpi, kernels::cuda::device_count()); }

std::unique_ptr<NcclCommunicator> make_nccl_communicator(MPI_Comm group, std::string name,
                                                         kernels::cuda::Context& ctx,
                                                         Watchdog* watchdog) {
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
  return std::make_unique<NcclCommunicator>(id, rank, size, std::move(name), ctx, watchdog);
}

}  // namespace keel
