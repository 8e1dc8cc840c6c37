// TP x DP topology over MPI_Comm_split.
#include "parallel/topology.h"

#include <mpi.h>

#include "framework/error.h"
#include "parallel/mpi_communicator.h"

namespace keel {

Distributed::Distributed(const MpiEnv& mpi, int tp, double timeout_s) {
  const int world = mpi.world_size(), rank = mpi.world_rank();
  KEEL_CHECK(tp >= 1, kConfig, "parallel.tp=", tp, " must be at least 1");
  KEEL_CHECK(world % tp == 0, kLayout, "parallel.tp=", tp, " does not divide the ", world,
             " ranks of the job (world = dp x tp)");
  watchdog_ = std::make_unique<Watchdog>(timeout_s, rank);
  MPI_Comm world_dup, tp_comm, dp_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &world_dup);
  // TP: ranks [k tp, (k + 1) tp) together; DP: ranks with the same rank % tp together.
  MPI_Comm_split(MPI_COMM_WORLD, rank / tp, rank, &tp_comm);
  MPI_Comm_split(MPI_COMM_WORLD, rank % tp, rank, &dp_comm);
  world_ = std::make_unique<MpiCommunicator>(world_dup, "world", watchdog_.get());
  tp_ = std::make_unique<MpiCommunicator>(tp_comm, "tensor-parallel", watchdog_.get());
  dp_ = std::make_unique<MpiCommunicator>(dp_comm, "data-parallel", watchdog_.get());
  topo_.world_size = world;
  topo_.world_rank = rank;
  topo_.tp = tp;
  topo_.tp_rank = tp_->rank();
  topo_.dp = world / tp;
  topo_.dp_rank = dp_->rank();
  topo_.tp_comm = tp_.get();
  topo_.dp_comm = dp_.get();
  topo_.world_comm = world_.get();
}

}  // namespace keel
