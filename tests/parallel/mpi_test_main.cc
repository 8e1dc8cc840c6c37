// GoogleTest main for tests run under mpiexec: initialises MPI, runs every test on every rank,
// and fails every rank when any rank failed (so ctest sees the failure whichever rank had it).
// Output from ranks other than 0 is kept only for failures.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any && !failed) std::fprintf(stderr, "rank %d: passed, but another rank failed\n", rank);
  MPI_Finalize();
  return any;
}
