// TP x DP topology over MPI_Comm_split.
#include "parallel/topology.h"

#include <mpi.h>

#include <cstdio>
#include <map>

#include "framework/error.h"
#include "parallel/mpi_communicator.h"

namespace keel {

std::vector<int> tp_group_ranks(int world_rank, int tp, int world) {
  KEEL_ASSERT(tp >= 1 && world % tp == 0 && world_rank >= 0 && world_rank < world);
  std::vector<int> ranks;
  for (int r = tp_group_of(world_rank, tp) * tp; ranks.size() < static_cast<size_t>(tp); ++r) {
    ranks.push_back(r);
  }
  return ranks;
}

std::vector<int> dp_group_ranks(int world_rank, int tp, int world) {
  KEEL_ASSERT(tp >= 1 && world % tp == 0 && world_rank >= 0 && world_rank < world);
  std::vector<int> ranks;
  for (int r = dp_group_of(world_rank, tp); r < world; r += tp) ranks.push_back(r);
  return ranks;
}

std::string tp_placement_warning(const std::vector<int>& node_of, int tp) {
  const int world = static_cast<int>(node_of.size());
  std::map<int, int> ranks_on;  // node -> ranks on it
  for (int n : node_of) ++ranks_on[n];
  int spanning = 0;
  std::string first;
  for (int g = 0; g < world / tp; ++g) {
    const int lo = g * tp, hi = lo + tp - 1;
    const int node = node_of[lo];
    if (tp > ranks_on[node]) continue;  // cannot fit in a node: spanning is unavoidable
    int other = node;
    for (int r = lo; r <= hi && other == node; ++r) other = node_of[r];
    if (other == node) continue;
    if (spanning++ == 0) {
      first = detail::concat("the tensor-parallel group of world ranks ", lo, "..", hi,
                             " spans nodes ", node, " and ", other, " (parallel.tp=", tp, ", node ",
                             node, " runs ", ranks_on[node], " ranks)");
    }
  }
  if (spanning == 0) return "";
  return detail::concat(
      first, spanning > 1 ? detail::concat(", as do ", spanning - 1, " more groups") : "",
      ": its all-reduces cross the network on every layer; place ranks by slot (mpirun "
      "--map-by slot, srun --distribution=block) and use a parallel.tp that divides the ranks "
      "per node");
}

Distributed::Distributed(const MpiEnv& mpi, int tp, double timeout_s) {
  const int world = mpi.world_size(), rank = mpi.world_rank();
  KEEL_CHECK(tp >= 1, kConfig, "parallel.tp=", tp, " must be at least 1");
  KEEL_CHECK(world % tp == 0, kLayout, "parallel.tp=", tp, " does not divide the ", world,
             " ranks of the job (world = dp x tp)");
  // Before any collective: throws for an invalid KEEL_FAKE_NODE_SIZE, alike on every rank.
  const int node = mpi.node();
  watchdog_ = std::make_unique<Watchdog>(timeout_s, rank);
  MPI_Comm world_dup, tp_comm, dp_comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &world_dup);
  // TP: ranks [k tp, (k + 1) tp) together; DP: ranks with the same rank % tp together.
  MPI_Comm_split(MPI_COMM_WORLD, tp_group_of(rank, tp), rank, &tp_comm);
  MPI_Comm_split(MPI_COMM_WORLD, dp_group_of(rank, tp), rank, &dp_comm);
  world_mpi_ = world_dup;
  tp_mpi_ = tp_comm;
  dp_mpi_ = dp_comm;
  world_ = std::make_unique<MpiCommunicator>(world_dup, "world", watchdog_.get());
  tp_ = std::make_unique<MpiCommunicator>(tp_comm, "tensor-parallel", watchdog_.get());
  dp_ = std::make_unique<MpiCommunicator>(dp_comm, "data-parallel", watchdog_.get());
  if (tp > 1) {
    std::vector<int> node_of(static_cast<size_t>(world));
    MPI_Allgather(&node, 1, MPI_INT, node_of.data(), 1, MPI_INT, MPI_COMM_WORLD);
    placement_warning_ = tp_placement_warning(node_of, tp);
    if (rank == 0 && !placement_warning_.empty()) {
      std::fprintf(stderr, "keel: warning: %s\n", placement_warning_.c_str());
      std::fflush(stderr);
    }
  }
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
