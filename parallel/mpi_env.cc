// MPI initialisation and the node-local split (Note [fake nodes] in mpi_env.h).
#include "parallel/mpi_env.h"

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "framework/error.h"

namespace keel {

namespace {
void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    KEEL_FAIL(kComm, what, " failed: ", std::string(msg, len));
  }
}

// The split MPI_COMM_TYPE_SHARED gives (one node per host), with the nodes numbered in the order
// of their lowest world rank.
NodeSplit shared_memory_split(int world_rank) {
  MPI_Comm local;
  check_mpi(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &local),
      "MPI_Comm_split_type");
  NodeSplit s;
  MPI_Comm_size(local, &s.local_size);
  MPI_Comm_rank(local, &s.local_rank);
  // Each node's first rank numbers the nodes among themselves, then tells its node.
  MPI_Comm leaders;
  check_mpi(
      MPI_Comm_split(MPI_COMM_WORLD, s.local_rank == 0 ? 0 : MPI_UNDEFINED, world_rank, &leaders),
      "MPI_Comm_split (node leaders)");
  int numbering[2] = {0, 0};  // node, nodes
  if (leaders != MPI_COMM_NULL) {
    MPI_Comm_rank(leaders, &numbering[0]);
    MPI_Comm_size(leaders, &numbering[1]);
    MPI_Comm_free(&leaders);
  }
  check_mpi(MPI_Bcast(numbering, 2, MPI_INT, 0, local), "MPI_Bcast (node numbering)");
  MPI_Comm_free(&local);
  s.node = numbering[0];
  s.nodes = numbering[1];
  return s;
}
}  // namespace

int parse_fake_node_size(const std::string& value, int world_size) {
  // Digits only (no sign, no spaces, no suffix), so "4 " or "+4" or "4k" are not read as 4.
  bool digits = !value.empty() && value.size() <= 9;
  for (char c : value) digits = digits && c >= '0' && c <= '9';
  const long n = digits ? std::strtol(value.c_str(), nullptr, 10) : 0;
  KEEL_CHECK(n >= 1, kConfig, MpiEnv::kFakeNodeSizeVar, "=", clip_echo(value),
             " is not a positive integer (ranks per simulated node)");
  KEEL_CHECK(world_size % n == 0, kConfig, MpiEnv::kFakeNodeSizeVar, "=", n,
             " does not divide the ", world_size, " ranks of the job into whole simulated nodes");
  return static_cast<int>(n);
}

NodeSplit fake_node_split(int rank, int world_size, int node_size) {
  return {.node = rank / node_size,
          .nodes = world_size / node_size,
          .local_rank = rank % node_size,
          .local_size = node_size};
}

NodeSplit MpiEnv::split_world() {
  int world_size = 1, world_rank = 0;
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
  const char* fake = std::getenv(kFakeNodeSizeVar);
  if (fake == nullptr) return shared_memory_split(world_rank);
  return fake_node_split(world_rank, world_size, parse_fake_node_size(fake, world_size));
}

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  }
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), "MPI_Comm_rank");
  try {
    split_ = split_world();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kConfig) throw;
    split_error_ = e.what();  // raised by split() (Note [fake nodes])
  }
  char host[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  check_mpi(MPI_Get_processor_name(host, &len), "MPI_Get_processor_name");
  node_name_.assign(host, len);
  if (std::getenv(kFakeNodeSizeVar) != nullptr && split_error_.empty()) {
    node_name_ += "/fake-node-" + std::to_string(split_.node);
  }
}

MpiEnv::~MpiEnv() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

const NodeSplit& MpiEnv::split() const {
  KEEL_CHECK(split_error_.empty(), kConfig, split_error_);
  return split_;
}

const std::string& MpiEnv::node_name() const { return node_name_; }

bool MpiEnv::barrier_for(double seconds) {
  MPI_Request req;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) != MPI_SUCCESS) return false;
  const double deadline = MPI_Wtime() + seconds;
  int done = 0;
  while (!done && MPI_Wtime() < deadline) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return done != 0;
}

void MpiEnv::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

}  // namespace keel
