// The NCCL communicator (parallel/nccl_communicator.h) as a group of one, without MPI: the id is
// made in-process and the one rank joins it. Every collective's result is checked on device
// buffers against what the interface defines (for one rank: all-reduce, broadcast and barrier
// leave the data as it was, all-gather and reduce-scatter copy their block), outputs poisoned
// first so an unwritten element fails, and the byte counters against Communicator's formula (0 for
// a group of one: the same counters as MpiCommunicator, so a 1-rank NCCL job reports what the
// same job without NCCL does). The error-message format is checked without a GPU. Multi-rank
// NCCL runs (TP2, DP2, TP2 x DP2 against one GPU) need MPI and several GPUs: issue 11's next part.
//
// Built into keel_gpu_tests only when keel_nccl exists (KEEL_HAVE_NCCL); otherwise one test says
// why there is nothing to run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "framework/error.h"
#include "tests/gpu/gpu_test_util.h"

#if KEEL_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif

namespace keel::gpu_test {
namespace {

#if KEEL_HAVE_NCCL

TEST(NcclMessages, NameTheCallGroupRankCountAndStep) {
  // ncclUnhandledCudaError = 1, ncclInvalidArgument = 4 in every NCCL 2.x.
  const std::string m = NcclCommunicator::error_message(1, "ncclAllReduce", "tensor-parallel", 3, 8,
                                                        1048576, 12, "peer 5 unreachable");
  EXPECT_EQ(m.rfind("ncclAllReduce over the tensor-parallel group (rank 3 of 8, 1048576 elements) "
                    "at step 12 failed: ",
                    0),
            0u)
      << m;
  EXPECT_NE(m.find("(peer 5 unreachable)"), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  const std::string s =
      NcclCommunicator::error_message(4, "ncclBroadcast", "world", 0, 2, 1, 0, "");
  EXPECT_EQ(s.rfind("ncclBroadcast over the world group (rank 0 of 2, 1 element) failed: ", 0), 0u)
      << s;
  EXPECT_EQ(s.find("step"), std::string::npos) << "no step before the first: " << s;
  // Set-up calls have no element count.
  const std::string i =
      NcclCommunicator::error_message(1, "ncclCommInitRank", "data-parallel", 5, 16, -1, 0, "");
  EXPECT_EQ(i.rfind("ncclCommInitRank over the data-parallel group (rank 5 of 16) failed: ", 0), 0u)
      << i;
}

class NcclTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    comm_ = std::make_unique<NcclCommunicator>(NcclCommunicator::make_unique_id(), 0, 1, "world",
                                               ctx(), nullptr);
  }
  NcclCommunicator& comm() { return *comm_; }

 private:
  std::unique_ptr<NcclCommunicator> comm_;
};

TEST_F(NcclTest, AllReduceOfOneRankKeepsTheDataAndCountsNothing) {
  const int64_t n = 100003;  // not a multiple of any vector width
  const std::vector<float> x = random_vec(n, -2.0f, 2.0f, 1);
  cuda::DeviceBuffer d = cuda::upload(ctx(), x);
  comm().all_reduce(d.as<float>(), n, ReduceOp::kSum);
  EXPECT_TRUE(identical(get<float>(d, n), x));
  comm().all_reduce(d.as<float>(), n, ReduceOp::kMax);
  EXPECT_TRUE(identical(get<float>(d, n), x));
  // Note [bf16 wire]: a group of one neither moves nor rounds (x is not bf16-exact).
  comm().all_reduce_bf16(d.as<float>(), n);
  EXPECT_TRUE(identical(get<float>(d, n), x));
  std::vector<double> xd(n);
  for (int64_t i = 0; i < n; ++i) xd[i] = static_cast<double>(x[i]) * 1e-3 + 1e-12 * i;
  cuda::DeviceBuffer dd = cuda::upload(ctx(), xd);
  comm().all_reduce(dd.as<double>(), n, ReduceOp::kSum);
  EXPECT_EQ(cuda::download<double>(ctx(), dd.data(), n), xd);
  comm().all_reduce(dd.as<double>(), n, ReduceOp::kMax);
  EXPECT_EQ(cuda::download<double>(ctx(), dd.data(), n), xd);
  // Communicator's formula: a group of one moves nothing (as MpiCommunicator and
  // SelfCommunicator count it).
  EXPECT_EQ(comm().bytes_moved(), 0);
  EXPECT_EQ(comm().calls(), 0);
}

TEST_F(NcclTest, AllGatherAndReduceScatterCopyTheBlock) {
  const int64_t n = 4099;
  const std::vector<float> x = random_vec(n, 0.5f, 3.0f, 2);
  cuda::DeviceBuffer send = cuda::upload(ctx(), x);
  cuda::DeviceBuffer recv = poisoned<float>(n);
  comm().all_gather(send.as<float>(), recv.as<float>(), n);
  EXPECT_TRUE(identical(get<float>(recv, n), x));
  cuda::DeviceBuffer out = poisoned<float>(n);
  comm().reduce_scatter(send.as<float>(), out.as<float>(), n);
  EXPECT_TRUE(identical(get<float>(out, n), x));
  // In place (ZeRO-1's parameters): this rank's block already sits at its slot.
  comm().all_gather(recv.as<float>(), recv.as<float>(), n);
  EXPECT_TRUE(identical(get<float>(recv, n), x));
  EXPECT_EQ(comm().bytes_moved(), 0);
}

TEST_F(NcclTest, BroadcastBarrierAndNonBlockingAllReduce) {
  const int64_t n = 777;
  const std::vector<float> x = random_vec(n, -1.0f, 1.0f, 3);
  cuda::DeviceBuffer d = cuda::upload(ctx(), x);
  comm().broadcast(d.as<float>(), n, 0);
  EXPECT_TRUE(identical(get<float>(d, n), x));
  comm().barrier();
  std::unique_ptr<CommRequest> req = comm().iall_reduce(d.as<float>(), n);
  req->wait();
  EXPECT_TRUE(req->test());
  req->wait();  // idempotent
  EXPECT_TRUE(identical(get<float>(d, n), x));
  // A request left to its destructor completes too; the stream orders later work after it.
  { auto pending = comm().iall_reduce(d.as<float>(), n); }
  EXPECT_TRUE(identical(get<float>(d, n), x));
  EXPECT_EQ(comm().bytes_moved(), 0);
  EXPECT_EQ(comm().calls(), 0);
}

TEST_F(NcclTest, AnInvalidRootThrowsNamingTheGroup) {
  cuda::DeviceBuffer d = poisoned<float>(4);
  try {
    comm().broadcast(d.as<float>(), 4, 1);
    FAIL() << "root 1 of a group of one was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("broadcast over the world group: root 1 of 1"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(NcclTest, AbortEndsTheCommunicator) {
  EXPECT_FALSE(comm().aborted());
  comm().abort();
  comm().abort();  // idempotent
  EXPECT_TRUE(comm().aborted());
  cuda::DeviceBuffer d = poisoned<float>(8);
  try {
    comm().all_reduce(d.as<float>(), 8, ReduceOp::kSum);
    FAIL() << "a collective on an aborted communicator returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kComm);
    const std::string m = e.what();
    EXPECT_NE(m.find("all_reduce over the world group (rank 0 of 1, 8 elements)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("aborted"), std::string::npos) << m;
  }
}

// A peer's failure that NCCL reports asynchronously while this rank waits (its proxy thread sees
// the connection drop; the collective itself never completes): the wait aborts the communicator
// and throws one line naming the collective, the group and NCCL's words, instead of waiting for
// the watchdog. On the emulator, whose NCCL injects that failure; a GPU cannot provoke it alone.
TEST_F(NcclTest, AnAsynchronousErrorAbortsAndNamesTheCollective) {
#if !KEEL_CUDA_EMULATOR
  GTEST_SKIP() << "needs a peer's failure, which the emulated NCCL injects "
                  "(KEEL_CUDA_EMU_NCCL_ASYNC_ERROR); one GPU cannot provoke it";
#else
  setenv("KEEL_CUDA_EMU_NCCL_ASYNC_ERROR", "1", 1);
  NcclCommunicator failing(NcclCommunicator::make_unique_id(), 0, 1, "tensor-parallel", ctx(),
                           nullptr);
  unsetenv("KEEL_CUDA_EMU_NCCL_ASYNC_ERROR");
  cuda::DeviceBuffer d = cuda::upload(ctx(), random_vec(8, -1, 1, 70));
  try {
    failing.all_reduce(d.as<float>(), 8, ReduceOp::kSum);
    FAIL() << "a collective whose peer failed returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kComm);
    const std::string m = e.what();
    EXPECT_NE(m.find("all_reduce over the tensor-parallel group (rank 0 of 1, 8 elements) failed: "
                     "remote process exited or there was a network error"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("asynchronous NCCL error; communicator aborted: emulated: a peer's "
                     "connection failed"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_TRUE(failing.aborted());
  // The abort stopped the collective: the stream drains, and the test's own communicator works.
  ctx().synchronize();
  comm().all_reduce(d.as<float>(), 8, ReduceOp::kSum);
#endif
}

// Note [nccl non-blocking]: a collective NCCL never finishes (a peer that never connects: it
// stays ncclInProgress) holds nothing the abort path needs, so abort() from another thread, which
// is what the watchdog's hook does, ends it and the waiting call throws instead of hanging. On the
// emulator, whose NCCL keeps such a call in progress (KEEL_CUDA_EMU_NCCL_ASYNC_ERROR=in_progress).
// A watchdog with a long timeout guards the test: a call the abort did not end would end the
// process with its line rather than hang.
TEST_F(NcclTest, AbortFromAnotherThreadEndsACallInProgress) {
#if !KEEL_CUDA_EMULATOR
  GTEST_SKIP() << "needs a collective NCCL never finishes, which the emulated NCCL injects "
                  "(KEEL_CUDA_EMU_NCCL_ASYNC_ERROR=in_progress)";
#else
  Watchdog guard(120.0, 0);
  setenv("KEEL_CUDA_EMU_NCCL_ASYNC_ERROR", "in_progress", 1);
  NcclCommunicator stuck(NcclCommunicator::make_unique_id(), 0, 1, "data-parallel", ctx(), &guard);
  unsetenv("KEEL_CUDA_EMU_NCCL_ASYNC_ERROR");
  cuda::DeviceBuffer d = cuda::upload(ctx(), random_vec(8, -1, 1, 71));
  std::thread aborter([&stuck] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    stuck.abort();
  });
  try {
    stuck.all_reduce(d.as<float>(), 8, ReduceOp::kSum);
    FAIL() << "a collective that never finished returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kComm);
    const std::string m = e.what();
    EXPECT_NE(m.find("ncclAllReduce over the data-parallel group (rank 0 of 1, 8 elements)"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("aborted (ncclCommAbort)"), std::string::npos) << m;
  }
  aborter.join();
  EXPECT_TRUE(stuck.aborted());
  // The abort abandoned the collective: the stream drains, and the test's own communicator works.
  ctx().synchronize();
  comm().all_reduce(d.as<float>(), 8, ReduceOp::kSum);
#endif
}

#else

TEST(Nccl, NotBuilt) {
  GTEST_SKIP() << "keel_gpu_tests was built without keel_nccl (NCCL not found, or the binary does "
                  "not link keel_nccl): nothing to test";
}

#endif

}  // namespace
}  // namespace keel::gpu_test
