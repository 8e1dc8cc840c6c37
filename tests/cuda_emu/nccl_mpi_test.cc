// keel's NCCL communicator across ranks, on the CUDA emulator (one emulated GPU per rank, NCCL's
// calls over MPI: tests/cuda_emu/README.md), under mpiexec -n 2. The multi-GPU script checks whole
// jobs on tiny buffers; this checks the bf16 wire (Note [bf16 wire] in parallel/communicator.h)
// on buffers long enough for every branch of its casts (rows of 8192 columns, a partial last row):
// NcclCommunicator::all_reduce_bf16 of random values equals MpiCommunicator::all_reduce_bf16 of
// the same host values bit for bit (a bf16 sum of two values does not depend on the order), every
// element rounded (the inputs are not bf16 values), n * 2 bytes counted, for fp32 memory (rounded
// and widened around the sum) and for bf16 memory (summed in place); the fp32 all_reduce keeps
// its exact sums beside it.
#include "parallel/nccl_mpi.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "framework/kernels/cuda/device.h"
#include "parallel/mpi_communicator.h"
#include "tests/gpu/gpu_test_util.h"

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

}  // namespace
}  // namespace keel
