// agree() (parallel/agree.h, Note [one rank decides]), over MPI under mpiexec -n 1, 2 and 4 and
// over the in-process ThreadWorld with 1 to 4 ranks:
//   - only the root calls decide(), and every rank returns its verdict bit for bit, for every
//     root: int64 values no float holds, enums, std::optional<int64_t> (empty and not), a small
//     struct, and void; in one broadcast of 16 + sizeof(verdict) bytes;
//   - a keel::Error on the root comes back on the root unchanged (message, kind, file) and on
//     every other rank as the same kind, "rank R could not <what> (see its message)"; another
//     exception type stays itself on the root and is kInternal elsewhere; the group is still in
//     step afterwards (the next agreement works);
//   - with no communicator or a group of one, decide() runs here and its exceptions pass as they
//     are, with nothing moved; a root outside the group is refused on every rank;
//   - every_rank() gives each rank the same table of every rank's int64 values, in rank order.
#include "parallel/agree.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel/mpi_communicator.h"
#include "tests/parallel/parallel_test_util.h"
#include "tests/parallel/thread_world.h"

namespace keel {
namespace {

using testing::mpi_env;
using testing::ThreadWorld;

enum class Verdict : int32_t { kFresh = 3, kResume = 7, kRewind = -2 };

struct Target {
  Verdict verdict;
  int64_t step;
};

int64_t big(int root) { return -((int64_t{1} << 60) + 12345 + root); }

// What every rank of `comm` checks; ThreadWorld runs it on each thread, MPI on each process.
void check_verdicts(Communicator& comm) {
  for (int root = 0; root < comm.size(); ++root) {
    const std::string at = "root " + std::to_string(root) + ", rank " + std::to_string(comm.rank());
    int calls = 0;
    comm.reset_counters();
    const int64_t v = agree(&comm, root, "decide", [&] {
      ++calls;
      return big(root);
    });
    EXPECT_EQ(v, big(root)) << at;
    EXPECT_EQ(calls, comm.rank() == root ? 1 : 0) << at;
    EXPECT_EQ(comm.calls(), comm.size() > 1 ? 1 : 0) << at;
    EXPECT_EQ(comm.bytes_moved(), comm.size() > 1 ? 16 + 8 : 0) << at;

    EXPECT_EQ(agree(&comm, root, "decide", [] { return Verdict::kRewind; }), Verdict::kRewind)
        << at;
    const std::optional<int64_t> none =
        agree(&comm, root, "decide", [] { return std::optional<int64_t>(); });
    EXPECT_FALSE(none.has_value()) << at;
    const std::optional<int64_t> some =
        agree(&comm, root, "decide", [&] { return std::optional<int64_t>(big(root)); });
    ASSERT_TRUE(some.has_value()) << at;
    EXPECT_EQ(*some, big(root)) << at;
    const Target t = agree(&comm, root, "decide", [&] {
      return Target{Verdict::kResume, 1000 + root};
    });
    EXPECT_EQ(t.verdict, Verdict::kResume) << at;
    EXPECT_EQ(t.step, 1000 + root) << at;
    calls = 0;
    agree(&comm, root, "decide", [&] { ++calls; });
    EXPECT_EQ(calls, comm.rank() == root ? 1 : 0) << at;
  }
}

// A keel::Error and a foreign exception on each root in turn, each followed by an agreement
// that must still line up.
void check_errors(Communicator& comm) {
  for (int root = 0; root < comm.size(); ++root) {
    const std::string at = "root " + std::to_string(root) + ", rank " + std::to_string(comm.rank());
    try {
      agree(&comm, root, "resume", []() -> int64_t { KEEL_FAIL(kData, "x/step_3: bad shard"); });
      ADD_FAILURE() << at << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData) << at;
      if (comm.rank() == root) {
        EXPECT_STREQ(e.what(), "x/step_3: bad shard") << at;
        EXPECT_STREQ(e.file(), __FILE__) << at;  // the root's own exception, rethrown
      } else {
        EXPECT_EQ(std::string(e.what()),
                  "rank " + std::to_string(root) + " could not resume (see its message)")
            << at;
      }
    }
    EXPECT_EQ(agree(&comm, root, "decide", [] { return int64_t{42}; }), 42) << at;

    try {
      agree(&comm, root, "pick a rewind target", [] { throw std::runtime_error("disk gone"); });
      ADD_FAILURE() << at << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(comm.rank(), root) << at << ": the root's runtime_error became " << e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kInternal) << at;
      EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(root) +
                                           " could not pick a rewind target (see its message)")
          << at;
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(comm.rank(), root) << at;
      EXPECT_STREQ(e.what(), "disk gone") << at;
    }
    EXPECT_EQ(agree(&comm, root, "decide", [] { return Verdict::kFresh; }), Verdict::kFresh) << at;
  }
}

MPI_Comm dup_world() {
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return c;
}

TEST(AgreeMpi, EveryRankLearnsTheRootsVerdict) {
  MpiCommunicator comm(dup_world(), "world", nullptr);
  check_verdicts(comm);
}

TEST(AgreeMpi, TheRootsErrorReachesEveryRankWithItsKind) {
  MpiCommunicator comm(dup_world(), "world", nullptr);
  check_errors(comm);
}

TEST(AgreeMpi, ARootOutsideTheGroupIsRefusedOnEveryRank) {
  MpiCommunicator comm(dup_world(), "world", nullptr);
  if (comm.size() == 1) GTEST_SKIP() << "a group of one decides here, whatever the root";
  int calls = 0;
  try {
    agree(&comm, comm.size(), "decide", [&] { return ++calls; });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("root " + std::to_string(comm.size())), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(comm.calls(), 0);
}

TEST(AgreeMpi, EveryRankSeesTheSameTable) {
  MpiCommunicator comm(dup_world(), "world", nullptr);
  const int size = comm.size(), rank = comm.rank();
  const std::vector<int64_t> table = every_rank(&comm, {big(rank), rank, -1});
  ASSERT_EQ(table.size(), static_cast<size_t>(3 * size));
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(table[3 * r], big(r));
    EXPECT_EQ(table[3 * r + 1], r);
    EXPECT_EQ(table[3 * r + 2], -1);
  }
  EXPECT_EQ(comm.bytes_moved(), size > 1 ? 3 * 8 * size : 0);
  EXPECT_EQ(every_rank(nullptr, {7, big(0)}), (std::vector<int64_t>{7, big(0)}));
}

TEST(Agree, OneProcessDecidesHereAndErrorsPassUnchanged) {
  SelfCommunicator self;
  for (Communicator* comm :
       {static_cast<Communicator*>(nullptr), static_cast<Communicator*>(&self)}) {
    EXPECT_EQ(agree(comm, 0, "decide", [] { return big(0); }), big(0));
    try {
      agree(comm, 0, "resume", []() -> int { KEEL_FAIL(kUsage, "--overwrite needed"); });
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUsage);
      EXPECT_STREQ(e.what(), "--overwrite needed");
    }
    EXPECT_THROW(agree(comm, 0, "resume", [] { throw std::logic_error("x"); }), std::logic_error);
  }
  EXPECT_EQ(self.calls(), 0);
}

TEST(Agree, ThreadWorldOfOneToFourRanks) {
  for (int size = 1; size <= 4; ++size) {
    ThreadWorld world(size);
    const std::vector<std::exception_ptr> errors = world.run([](Communicator& comm) {
      check_verdicts(comm);
      check_errors(comm);
    });
    for (int r = 0; r < size; ++r) EXPECT_FALSE(errors[r]) << "size " << size << ", rank " << r;
  }
}

TEST(Agree, ThreadWorldCollectivesMatchMpiCommunicatorsSemantics) {
  // The fake's own collectives, which agree() and the byte forms rest on in these tests.
  ThreadWorld world(3);
  const std::vector<std::exception_ptr> errors = world.run([](Communicator& comm) {
    const int r = comm.rank();
    std::vector<int64_t> mine = {big(r), r};
    std::vector<int64_t> all(6, 0);
    comm.all_gather_int64(mine.data(), all.data(), 2);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(all[2 * k], big(k));
      EXPECT_EQ(all[2 * k + 1], k);
    }
    std::vector<float> x = {1.0f + r, 0.5f * r};
    comm.all_reduce(x.data(), 2, ReduceOp::kSum);
    EXPECT_EQ(x[0], 6.0f);
    EXPECT_EQ(x[1], 1.5f);
    double m = r == 1 ? 9.0 : -1.0;
    comm.all_reduce(&m, 1, ReduceOp::kMax);
    EXPECT_EQ(m, 9.0);
    std::vector<float> part = {1.0f * r, 2.0f * r, 3.0f * r}, mine_sum(1);
    comm.reduce_scatter(part.data(), mine_sum.data(), 1);
    EXPECT_EQ(mine_sum[0], 3.0f * (r + 1));
    int64_t b = r == 2 ? big(2) : 0;
    comm.broadcast_int64(&b, 1, 2);
    EXPECT_EQ(b, big(2));
    EXPECT_EQ(comm.bytes_moved(), 3 * 2 * 8 + 2 * 4 + 8 + 3 * 4 + 8);
  });
  for (const std::exception_ptr& e : errors) EXPECT_FALSE(e);
}

}  // namespace
}  // namespace keel
