// MPI lifetime for a process: MPI_Init_thread on construction (MPI_THREAD_FUNNELED: only the main
// thread calls MPI; OpenMP workers never do), MPI_Finalize on destruction, and the world size,
// rank and node-local split (which ranks share a node: they share its cores, and each picks one
// of its GPUs by its node-local rank, parallel/device_map.h).
//
// Note [fake nodes]: the node-local split comes from MPI_COMM_TYPE_SHARED (ranks that can share
// memory, i.e. one host). KEEL_FAKE_NODE_SIZE=N in the environment replaces it by consecutive
// "nodes" of N ranks (ranks [k N, (k + 1) N) form node k), so a multi-node layout (device mapping,
// TP groups inside nodes) can be run and tested on one machine. A value that is not a positive
// integer or does not divide the world size is a config error naming the variable (exit 2).
// MpiEnv's constructor does not throw it: MPI is up and the world is known, and the error is
// raised by the first call of local_rank(), local_size(), node() or nodes(), from inside the
// program's run, where rank 0 alone prints it (a throw from the constructor would reach main
// before it knows its rank, and every rank would print it).
#pragma once

#include <string>

namespace keel {

// Where a rank sits among the nodes of the job.
struct NodeSplit {
  int node = 0;        // index of this rank's node, 0 .. nodes - 1, in the order of world ranks
  int nodes = 1;       // nodes in the job
  int local_rank = 0;  // rank among the ranks of its node
  int local_size = 1;  // ranks on its node
};

// Pure parts of Note [fake nodes], for tests.
// KEEL_FAKE_NODE_SIZE's value -> N; throws kConfig naming the variable when `value` is not a
// positive integer or N does not divide `world_size`.
int parse_fake_node_size(const std::string& value, int world_size);
// The split of world rank `rank` of `world_size` into consecutive nodes of `node_size` ranks
// (`node_size` divides `world_size`).
NodeSplit fake_node_split(int rank, int world_size, int node_size);

class MpiEnv {
 public:
  static constexpr const char* kFakeNodeSizeVar = "KEEL_FAKE_NODE_SIZE";

  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  int world_size() const { return world_size_; }
  int world_rank() const { return world_rank_; }
  // The node-local split; these throw kConfig for an invalid KEEL_FAKE_NODE_SIZE (Note [fake
  // nodes]).
  int local_rank() const { return split().local_rank; }
  int local_size() const { return split().local_size; }
  int node() const { return split().node; }
  int nodes() const { return split().nodes; }
  const NodeSplit& split() const;
  // "gpu-a17" (the processor name MPI reports), or "gpu-a17/fake-node-1" under
  // KEEL_FAKE_NODE_SIZE: for messages that name a node.
  const std::string& node_name() const;

  // The node-local split of MPI_COMM_WORLD as the environment says now (Note [fake nodes]).
  // Collective over MPI_COMM_WORLD without KEEL_FAKE_NODE_SIZE (every rank calls it); throws
  // kConfig for an invalid KEEL_FAKE_NODE_SIZE. The constructor calls it once.
  static NodeSplit split_world();

  // Waits (non-blocking barrier, polled) until every rank arrives or `seconds` pass; true when
  // all arrived. Lets rank 0 finish printing an error every rank found before any rank exits
  // (the launcher kills the job at the first non-zero exit).
  static bool barrier_for(double seconds);
  // Ends every rank of the job at once (for a fatal error seen by only some ranks).
  [[noreturn]] static void abort(int code);

 private:
  int world_size_ = 1, world_rank_ = 0;
  NodeSplit split_;
  std::string node_name_;
  std::string split_error_;  // KEEL_FAKE_NODE_SIZE's config error, raised by split()
};

}  // namespace keel
