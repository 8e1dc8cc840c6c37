// MPI initialisation and node-local rank discovery.
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
}  // namespace

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  }
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), "MPI_Comm_rank");
  MPI_Comm local;
  check_mpi(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL, &local),
      "MPI_Comm_split_type");
  MPI_Comm_size(local, &local_size_);
  MPI_Comm_rank(local, &local_rank_);
  MPI_Comm_free(&local);
}

MpiEnv::~MpiEnv() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

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
