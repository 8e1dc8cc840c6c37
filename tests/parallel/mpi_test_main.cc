// GoogleTest main for tests run under mpiexec: initialises MPI, runs every test on every rank,
// and fails every rank when any rank failed (so ctest sees the failure whichever rank had it).
// Ranks other than 0 print only their failures.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {
// Ranks other than 0 drop gtest's default printer (one copy of the progress lines is enough) but
// still print every failure, tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "rank %d: %s:%d: Failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    }
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any && !failed) std::fprintf(stderr, "rank %d: passed, but another rank failed\n", rank);
  MPI_Finalize();
  return any;
}
