// keel's NCCL communicator across ranks, on the CUDA emulator (one emulated GPU per rank, NCCL's
// calls over MPI: tests/cuda_emu/README.md), under mpiexec -n 2. The multi-GPU script checks whole
// jobs on tiny buffers; this checks the bf16 wire (Note [bf16 wire] in parallel/communicator.h)
// on buffers long enough for every branch of its casts (rows of 8192 columns, a partial last row):
// NcclCommunicator::all_reduce_bf16 of random values equals MpiCommunicator::all_reduce_bf16 of
// the same host values bit for bit (a bf16 sum of two values does not depend on the order), every
// element rounded (the inputs are not bf16 values), n * 2 bytes counted, for fp32 memory (rounded
// and widened around the sum) and for bf16 memory (summed in place); the fp32 all_reduce keeps
// its exact sums beside it.
//
// Also on 2 ranks: ncclCommSplit as the emulator does it (groups by color, ranks by key, ties by
// the parent's rank, NCCL_SPLIT_NOCOLOR out) through NcclCommunicator::split, and the launch
// order of Note [nccl launch order] (parallel/nccl_communicator.h): two communicators whose
// non-blocking all-reduces are enqueued on their own streams in crossed orders, or in the same
// order with nothing ordering them on the device, are reported by the emulated NCCL (the negative
// controls, counted with KEEL_CUDA_EMU_NCCL_ORDER=count); sharing a launch order, none is. And
// groups (Note [collective groups] in parallel/communicator.h): all-reduces inside a CommGroup
// start only when it closes, as one emulated ncclGroupEnd, with the sums of ungrouped calls.
#include "parallel/nccl_mpi.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/cuda/device.h"
#include "parallel/mpi_communicator.h"
#include "tests/gpu/gpu_test_util.h"

// The emulated NCCL's count of unordered starts (tests/cuda_emu/nccl.cc).
extern "C" int64_t keel_emu_nccl_unordered_starts();
extern "C" int64_t keel_emu_nccl_groups();
extern "C" int64_t keel_emu_nccl_grouped_calls();
namespace keel_emu {
bool set_deferred(bool on);  // tests/cuda_emu/emu.h (which is for translated CUDA sources)
}

namespace keel {
namespace {

int world(int* rank) {
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

TEST(NcclAcrossRanks, Bf16WireEqualsMpisBitForBit) {
  int rank = 0;
  if (world(&rank) != 2) GTEST_SKIP() << "runs on 2 ranks (mpiexec -n 2)";
  kernels::cuda::Context ctx(0);
  std::unique_ptr<NcclCommunicator> nccl =
      make_nccl_communicator(MPI_COMM_WORLD, "test", ctx, nullptr);
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MpiCommunicator host(dup, "host", nullptr);
  int64_t bytes = 0;
  for (int64_t n : {int64_t{1}, int64_t{8191}, int64_t{8192}, int64_t{8193}, int64_t{3 * 8192 + 5},
                    int64_t{100003}}) {
    const std::vector<float> x =
        gpu_test::random_vec(static_cast<size_t>(n), -3.0f, 3.0f, 7 + rank);
    std::vector<float> want = x;
    host.all_reduce_bf16(want.data(), n);
    kernels::cuda::DeviceBuffer d = kernels::cuda::upload(ctx, x);
    nccl->all_reduce_bf16(d.as<float>(), n);
    const std::vector<float> got = kernels::cuda::download<float>(ctx, d.data(), n);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << "n " << n;
    int64_t unrounded = 0;
    for (float v : got) unrounded += round_bf16(v) != v;
    EXPECT_EQ(unrounded, 0) << "n " << n << ": sums not in bf16";
    bytes += n * 2;
    EXPECT_EQ(nccl->bytes_moved(), bytes) << "n " << n;
    // bf16 memory summed in place: the same bits as MPI's sum of the same bf16 values.
    std::vector<Bf16> bits(x.size());
    for (size_t i = 0; i < x.size(); ++i) bits[i] = to_bf16(x[i]);
    std::vector<Bf16> want_bits = bits;
    host.all_reduce_bf16(want_bits.data(), n);
    kernels::cuda::DeviceBuffer db = kernels::cuda::upload(ctx, bits);
    nccl->all_reduce_bf16(db.as<Bf16>(), n);
    const std::vector<Bf16> got_bits = kernels::cuda::download<Bf16>(ctx, db.data(), n);
    ASSERT_EQ(std::memcmp(got_bits.data(), want_bits.data(), bits.size() * sizeof(Bf16)), 0)
        << "bf16 memory, n " << n;
    bytes += n * 2;
    EXPECT_EQ(nccl->bytes_moved(), bytes) << "bf16 memory, n " << n;
    // The fp32 wire beside it: a sum of two floats, exact to fp32 rounding on both transports.
    std::vector<float> want32 = x;
    host.all_reduce(want32.data(), n, ReduceOp::kSum);
    kernels::cuda::DeviceBuffer d32 = kernels::cuda::upload(ctx, x);
    nccl->all_reduce(d32.as<float>(), n, ReduceOp::kSum);
    EXPECT_EQ(kernels::cuda::download<float>(ctx, d32.data(), n), want32) << "n " << n;
    bytes += n * 4;
  }
}

// Each rank's value of `v` in `comm`'s rank order (an NCCL all-gather of one float).
std::vector<float> gather(NcclCommunicator& comm, kernels::cuda::Context& ctx, float v) {
  kernels::cuda::DeviceBuffer send = kernels::cuda::upload(ctx, std::vector<float>{v});
  kernels::cuda::DeviceBuffer recv = ctx.alloc(sizeof(float) * static_cast<size_t>(comm.size()));
  comm.all_gather(send.as<float>(), recv.as<float>(), 1);
  return kernels::cuda::download<float>(ctx, recv.data(), comm.size());
}

TEST(NcclSplit, GroupsByColorRanksByKey) {
  int rank = 0;
  if (world(&rank) != 2) GTEST_SKIP() << "runs on 2 ranks (mpiexec -n 2)";
  ASSERT_TRUE(NcclCommunicator::split_supported());
  kernels::cuda::Context ctx(0);
  std::unique_ptr<NcclCommunicator> all =
      make_nccl_communicator(MPI_COMM_WORLD, "world", ctx, nullptr);
  // One color, keys reversed: the new ranks are reversed.
  std::unique_ptr<NcclCommunicator> reversed = all->split(0, 1 - rank, "reversed");
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->size(), 2);
  EXPECT_EQ(reversed->rank(), 1 - rank);
  EXPECT_EQ(gather(*reversed, ctx, static_cast<float>(rank)), (std::vector<float>{1.0f, 0.0f}));
  // Equal keys: the parent's order.
  std::unique_ptr<NcclCommunicator> same = all->split(7, 0, "same");
  ASSERT_NE(same, nullptr);
  EXPECT_EQ(same->rank(), rank);
  EXPECT_EQ(gather(*same, ctx, static_cast<float>(rank)), (std::vector<float>{0.0f, 1.0f}));
  // A color each: groups of one.
  std::unique_ptr<NcclCommunicator> alone = all->split(rank, 0, "alone");
  ASSERT_NE(alone, nullptr);
  EXPECT_EQ(alone->size(), 1);
  EXPECT_EQ(alone->rank(), 0);
  EXPECT_EQ(gather(*alone, ctx, 5.0f), (std::vector<float>{5.0f}));
  // Rank 1 takes no part: null there, a group of one on rank 0.
  std::unique_ptr<NcclCommunicator> partial =
      all->split(rank == 1 ? NcclCommunicator::kNoColor : 3, 0, "partial");
  if (rank == 1) {
    EXPECT_EQ(partial, nullptr);
  } else {
    ASSERT_NE(partial, nullptr);
    EXPECT_EQ(partial->size(), 1);
  }
  // Split ones share their parent's launch order (Note [nccl launch order]).
  EXPECT_EQ(reversed->launch_order(), all->launch_order());
  EXPECT_EQ(same->launch_order(), all->launch_order());
}

// Each rank enqueues the non-blocking all-reduces of x (over `first`) and y (over `second`) in
// that order, waits for both and checks the sums; returns how many starts the emulated NCCL
// reported unordered meanwhile.
int64_t reduce_pair(NcclCommunicator& first, NcclCommunicator& second, float* x, float* y,
                    kernels::cuda::Context& ctx, int n) {
  const int64_t before = keel_emu_nccl_unordered_starts();
  std::unique_ptr<CommRequest> a = first.iall_reduce(first.name() == "x" ? x : y, n);
  std::unique_ptr<CommRequest> b = second.iall_reduce(second.name() == "x" ? x : y, n);
  a->wait();
  b->wait();
  EXPECT_EQ(kernels::cuda::download<float>(ctx, x, n), std::vector<float>(n, 3.0f));  // 1 + 2
  EXPECT_EQ(kernels::cuda::download<float>(ctx, y, n), std::vector<float>(n, 30.0f));
  return keel_emu_nccl_unordered_starts() - before;
}

TEST(NcclLaunchOrder, UnorderedCommunicatorsAreReportedOrderedOnesAreNot) {
  int rank = 0;
  if (world(&rank) != 2) GTEST_SKIP() << "runs on 2 ranks (mpiexec -n 2)";
  // Deferred (Note [cuda-emu-deferred]): no event record completes a collective by chance, so the
  // unordered schedules are reported every time.
  const bool was_deferred = keel_emu::set_deferred(true);
  ASSERT_EQ(setenv("KEEL_CUDA_EMU_NCCL_ORDER", "count", 1), 0);
  kernels::cuda::Context ctx(0);
  const int n = 1000;
  const float one = static_cast<float>(rank + 1);
  auto fresh = [&](float v) { return kernels::cuda::upload(ctx, std::vector<float>(n, v)); };
  {
    // Two communicators bootstrapped apart: each its own launch order.
    std::unique_ptr<NcclCommunicator> x = make_nccl_communicator(MPI_COMM_WORLD, "x", ctx, nullptr);
    std::unique_ptr<NcclCommunicator> y = make_nccl_communicator(MPI_COMM_WORLD, "y", ctx, nullptr);
    // Crossed: rank 0 starts x then y, rank 1 y then x.
    kernels::cuda::DeviceBuffer bx = fresh(one), by = fresh(10.0f * one);
    EXPECT_EQ(reduce_pair(rank == 0 ? *x : *y, rank == 0 ? *y : *x, bx.as<float>(), by.as<float>(),
                          ctx, n),
              1)
        << "a crossed order must be reported";
    // The same order on both ranks, but nothing ordering them on the device: a GPU may still run
    // them in either order.
    kernels::cuda::DeviceBuffer cx = fresh(one), cy = fresh(10.0f * one);
    EXPECT_EQ(reduce_pair(*x, *y, cx.as<float>(), cy.as<float>(), ctx, n), 1)
        << "concurrent collectives of two communicators must be reported";
  }
  {
    // Split from one communicator: a shared launch order serialises them, in the host's order.
    std::unique_ptr<NcclCommunicator> all =
        make_nccl_communicator(MPI_COMM_WORLD, "world", ctx, nullptr);
    std::unique_ptr<NcclCommunicator> x = all->split(0, rank, "x");
    std::unique_ptr<NcclCommunicator> y = all->split(0, rank, "y");
    kernels::cuda::DeviceBuffer bx = fresh(one), by = fresh(10.0f * one);
    EXPECT_EQ(reduce_pair(*x, *y, bx.as<float>(), by.as<float>(), ctx, n), 0);
    kernels::cuda::DeviceBuffer cx = fresh(one), cy = fresh(10.0f * one);
    EXPECT_EQ(reduce_pair(*y, *x, cx.as<float>(), cy.as<float>(), ctx, n), 0);
  }
  ASSERT_EQ(unsetenv("KEEL_CUDA_EMU_NCCL_ORDER"), 0);
  keel_emu::set_deferred(was_deferred);
}

TEST(NcclGroup, GroupedAllReducesStartWhenTheGroupClosesAsOne) {
  int rank = 0;
  if (world(&rank) != 2) GTEST_SKIP() << "runs on 2 ranks (mpiexec -n 2)";
  const bool was_deferred = keel_emu::set_deferred(true);
  kernels::cuda::Context ctx(0);
  std::unique_ptr<NcclCommunicator> comm =
      make_nccl_communicator(MPI_COMM_WORLD, "group", ctx, nullptr);
  const int n = 777;
  const std::vector<float> xs = gpu_test::random_vec(n, -3.0f, 3.0f, 11 + rank);
  const std::vector<float> ys = gpu_test::random_vec(n, -3.0f, 3.0f, 21 + rank);
  // Ungrouped, for the expected bits.
  kernels::cuda::DeviceBuffer x0 = kernels::cuda::upload(ctx, xs),
                              y0 = kernels::cuda::upload(ctx, ys);
  comm->all_reduce(x0.as<float>(), n, ReduceOp::kSum);
  comm->all_reduce(y0.as<float>(), n, ReduceOp::kMax);
  const std::vector<float> want_x = kernels::cuda::download<float>(ctx, x0.data(), n);
  const std::vector<float> want_y = kernels::cuda::download<float>(ctx, y0.data(), n);
  comm->reset_counters();
  const int64_t groups = keel_emu_nccl_groups(), grouped = keel_emu_nccl_grouped_calls();
  kernels::cuda::DeviceBuffer x = kernels::cuda::upload(ctx, xs),
                              y = kernels::cuda::upload(ctx, ys);
  {
    CommGroup outer(*comm);
    comm->all_reduce(x.as<float>(), n, ReduceOp::kSum);
    {
      CommGroup inner(*comm);  // nested: the same group
      comm->all_reduce(y.as<float>(), n, ReduceOp::kMax);
    }
    EXPECT_TRUE(comm->in_group());
    // Nothing has started: a synchronous download sees the inputs.
    EXPECT_EQ(kernels::cuda::download<float>(ctx, x.data(), n), xs);
    EXPECT_EQ(keel_emu_nccl_grouped_calls(), grouped);
    // The bf16 wire of fp32 memory would widen before the grouped sum ran: refused.
    EXPECT_THROW(comm->all_reduce_bf16(x.as<float>(), n), Error);
  }
  EXPECT_FALSE(comm->in_group());
  EXPECT_EQ(keel_emu_nccl_groups(), groups + 1);
  EXPECT_EQ(keel_emu_nccl_grouped_calls(), grouped + 2);
  EXPECT_EQ(comm->groups(), 1);
  EXPECT_EQ(comm->calls(), 2);
  const std::vector<float> got_x = kernels::cuda::download<float>(ctx, x.data(), n);
  const std::vector<float> got_y = kernels::cuda::download<float>(ctx, y.data(), n);
  EXPECT_EQ(std::memcmp(got_x.data(), want_x.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got_y.data(), want_y.data(), n * sizeof(float)), 0);
  keel_emu::set_deferred(was_deferred);
}

}  // namespace
}  // namespace keel
