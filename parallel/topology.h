// Builds the TP x DP topology over MPI: world = dp x tp; TP groups are consecutive ranks (so a
// TP group shares a node and, on GPUs, its NVLink, when the launcher places ranks by slot and tp
// divides the ranks per node); DP groups stride by tp. Owns the communicators.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/mpi_env.h"
#include "parallel/watchdog.h"

namespace keel {

// Pure: the groups Distributed splits the world into, as functions of the world rank.
// TP group g = ranks [g tp, (g + 1) tp); DP group j = ranks j, j + tp, j + 2 tp, ...
inline int tp_group_of(int world_rank, int tp) { return world_rank / tp; }
inline int dp_group_of(int world_rank, int tp) { return world_rank % tp; }
// The world ranks of `world_rank`'s TP (DP) group in group-rank order (tp divides world).
std::vector<int> tp_group_ranks(int world_rank, int tp, int world);
std::vector<int> dp_group_ranks(int world_rank, int tp, int world);
// Pure: "" when every TP group that fits in a node (tp <= the ranks on its first rank's node)
// stays inside one node; otherwise a one-line warning naming the first group that spans nodes
// and how many do. node_of[r] is world rank r's node index (MpiEnv::node()).
std::string tp_placement_warning(const std::vector<int>& node_of, int tp);

class Distributed {
 public:
  // Throws kLayout (identically on every rank, before any collective) when world_size is not a
  // multiple of tp, and kConfig for an invalid KEEL_FAKE_NODE_SIZE. Rank 0 prints
  // tp_placement_warning() to stderr when it is not empty (a TP group across nodes is correct
  // but sends every layer's all-reduces over the network).
  Distributed(const MpiEnv& mpi, int tp, double timeout_s);
  const Topology& topology() const { return topo_; }
  Watchdog& watchdog() { return *watchdog_; }
  // tp_placement_warning() of this job (the same on every rank).
  const std::string& placement_warning() const { return placement_warning_; }
  // The MPI communicators behind the TP, DP and world groups (the world one is a duplicate of
  // MPI_COMM_WORLD), e.g. to bootstrap an NCCL communicator on the same group and group ranks
  // (nccl_mpi.h). Owned by the group's communicator: valid while this Distributed lives, never
  // to be freed; collectives on them are outside the watchdog and the byte counters.
  MPI_Comm tp_mpi_comm() const { return tp_mpi_; }
  MPI_Comm dp_mpi_comm() const { return dp_mpi_; }
  MPI_Comm world_mpi_comm() const { return world_mpi_; }

 private:
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<Communicator> world_, tp_, dp_;
  Topology topo_;
  std::string placement_warning_;
  MPI_Comm world_mpi_ = MPI_COMM_NULL, tp_mpi_ = MPI_COMM_NULL, dp_mpi_ = MPI_COMM_NULL;
};

}  // namespace keel
