// Builds the TP x DP topology over MPI: world = dp x tp; TP groups are consecutive ranks (so a
// TP group shares a node and, later, NVLink); DP groups stride by tp. Owns the communicators.
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/mpi_env.h"
#include "parallel/watchdog.h"

namespace keel {

class Distributed {
 public:
  // Throws kLayout (identically on every rank, before any collective) when world_size is not a
  // multiple of tp.
  Distributed(const MpiEnv& mpi, int tp, double timeout_s);
  const Topology& topology() const { return topo_; }
  Watchdog& watchdog() { return *watchdog_; }

 private:
  std::unique_ptr<Watchdog> watchdog_;
  std::unique_ptr<Communicator> world_, tp_, dp_;
  Topology topo_;
};

}  // namespace keel
