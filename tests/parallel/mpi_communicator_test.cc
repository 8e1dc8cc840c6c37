// MpiCommunicator (parallel/mpi_communicator.cc), under mpiexec -n 1, 2 and 4:
//   - the chunked paths (buffers longer than max_count elements, per rank's block for all-gather
//     and reduce-scatter; 2^30 elements in production) give bit for bit what the single-call
//     paths give, and exactly the analytic result, for all_reduce (float and double, sum and
//     max), all_gather (in place and not), reduce_scatter, broadcast (every root) and
//     iall_reduce, at chunk limits 7 and 1 and sizes around them (0, below, equal, one over, a
//     multiple, not a multiple);
//   - the same for all_reduce_bf16 (Note [bf16 wire]), and its rounding on each rank;
//   - the byte forms (all_gather_bytes, broadcast_bytes and their int64 wrappers, for control
//     values: parallel/agree.h) move int64 values no float holds exactly (above 2^53, negative,
//     every byte distinct) bit for bit, chunked (limits 7 and 1 count bytes) or not, in place
//     or not, from every root;
//   - bytes_moved and calls do not depend on the chunking (one call, the logical payload);
//   - an MPI error comes back as kComm naming the MPI call, the group and the step (the
//     communicator sets MPI_ERRORS_RETURN), and a bad chunk limit is refused.
// The values are small multiples of 1/2, so every sum is exact whatever order MPI adds in.
#include "parallel/mpi_communicator.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "parallel/watchdog.h"
#include "tests/parallel/parallel_test_util.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::mpi_env;

const int64_t kSizes[] = {0, 1, 6, 7, 8, 14, 15, 50};
const int64_t kChunks[] = {7, 1};

// Element i of rank r's buffer: exact in float, distinct per rank and element.
float value(int r, int64_t i) { return 0.5f * static_cast<float>(r + 1) + static_cast<float>(i); }

MPI_Comm dup_world() {
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return c;
}

// One communicator with the production chunk limit and one with a small one, over the world.
struct Pair {
  explicit Pair(int64_t chunk)
      : plain(dup_world(), "plain", nullptr), chunked(dup_world(), "chunked", nullptr, chunk) {}
  MpiCommunicator plain;
  MpiCommunicator chunked;
};

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_same_counters(const Pair& p, int64_t bytes, const std::string& what) {
  EXPECT_EQ(p.chunked.bytes_moved(), p.plain.bytes_moved()) << what;
  EXPECT_EQ(p.chunked.calls(), p.plain.calls()) << what;
  EXPECT_EQ(p.chunked.bytes_moved(), bytes) << what;
}

TEST(MpiCommunicator, ChunkedAllReduceEqualsUnchunked) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    ASSERT_EQ(p.chunked.max_count(), chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        std::vector<float> a(n), b(n), want(n);
        std::vector<double> ad(n), bd(n), wantd(n);
        for (int64_t i = 0; i < n; ++i) {
          a[i] = b[i] = value(rank, i);
          ad[i] = bd[i] = 0.25 * value(rank, i);
          float w = 0.0f;
          for (int r = 0; r < size; ++r) w = op == ReduceOp::kSum ? w + value(r, i) : value(r, i);
          want[i] = w;  // the max is the last rank's: value grows with r
          wantd[i] = 0.25 * w;
        }
        p.plain.reset_counters();
        p.chunked.reset_counters();
        p.plain.all_reduce(a.data(), n, op);
        p.chunked.all_reduce(b.data(), n, op);
        EXPECT_TRUE(same_bits(a, b)) << what;
        EXPECT_TRUE(same_bits(b, want)) << what;
        p.plain.all_reduce(ad.data(), n, op);
        p.chunked.all_reduce(bd.data(), n, op);
        EXPECT_TRUE(same_bits(ad, bd)) << what;
        EXPECT_TRUE(same_bits(bd, wantd)) << what;
        const int64_t payload = size > 1 ? n * (4 + 8) : 0;
        expect_same_counters(p, payload, what);
      }
    }
  }
}

// Note [bf16 wire]: values exact in bf16 (multiples of 1/2 below 16) sum exactly, chunked or not,
// for 2 bytes an element; values that are not are rounded on each rank before the sum (1 + 2^-10
// is 1 in bf16, so every rank adds 1); a group of one leaves them unrounded.
TEST(MpiCommunicator, Bf16WireAllReduce) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  auto exact = [](int r, int64_t i) { return 0.5f * static_cast<float>(r + 1) + (i % 8); };
  const float off_grid = 1.0f + std::ldexp(1.0f, -10);
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      std::vector<float> a(n), b(n), want(n), r(n, off_grid);
      for (int64_t i = 0; i < n; ++i) {
        a[i] = b[i] = exact(rank, i);
        want[i] = 0.0f;
        for (int k = 0; k < size; ++k) want[i] += exact(k, i);
      }
      p.plain.reset_counters();
      p.chunked.reset_counters();
      p.plain.all_reduce_bf16(a.data(), n);
      p.chunked.all_reduce_bf16(b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << what;
      EXPECT_TRUE(same_bits(b, want)) << what;
      expect_same_counters(p, size > 1 ? n * 2 : 0, what);
      p.chunked.all_reduce_bf16(r.data(), n);
      const float r_want = size > 1 ? static_cast<float>(size) : off_grid;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(r[i], r_want) << what << ", element " << i;
    }
  }
}

TEST(MpiCommunicator, ChunkedIallReduceEqualsUnchunked) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      std::vector<float> a(n), b(n), want(n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        a[i] = b[i] = value(rank, i);
        for (int r = 0; r < size; ++r) want[i] += value(r, i);
      }
      p.plain.reset_counters();
      p.chunked.reset_counters();
      auto ra = p.plain.iall_reduce(a.data(), n);
      auto rb = p.chunked.iall_reduce(b.data(), n);
      rb->wait();
      ra->wait();
      rb->wait();  // idempotent
      EXPECT_TRUE(rb->test()) << what;
      EXPECT_TRUE(same_bits(a, b)) << what;
      EXPECT_TRUE(same_bits(b, want)) << what;
      expect_same_counters(p, size > 1 ? n * 4 : 0, what);
    }
  }
}

TEST(MpiCommunicator, ChunkedAllGatherEqualsUnchunked) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      std::vector<float> send(n), want(size * n);
      for (int64_t i = 0; i < n; ++i) send[i] = value(rank, i);
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < n; ++i) want[r * n + i] = value(r, i);
      }
      p.plain.reset_counters();
      p.chunked.reset_counters();
      // Out of place.
      std::vector<float> a(size * n, nan), b(size * n, nan);
      p.plain.all_gather(send.data(), a.data(), n);
      p.chunked.all_gather(send.data(), b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << what << ", out of place";
      EXPECT_TRUE(same_bits(b, want)) << what << ", out of place";
      // In place: this rank's block already at its slot (ZeRO-1 parameters).
      std::vector<float> c(size * n, nan), d(size * n, nan);
      std::copy(send.begin(), send.end(), c.begin() + rank * n);
      std::copy(send.begin(), send.end(), d.begin() + rank * n);
      p.plain.all_gather(c.data() + rank * n, c.data(), n);
      p.chunked.all_gather(d.data() + rank * n, d.data(), n);
      EXPECT_TRUE(same_bits(c, d)) << what << ", in place";
      EXPECT_TRUE(same_bits(d, want)) << what << ", in place";
      expect_same_counters(p, size > 1 ? 2 * size * n * 4 : 0, what);
    }
  }
}

TEST(MpiCommunicator, ChunkedReduceScatterEqualsUnchunked) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      std::vector<float> send(size * n), want(n, 0.0f);
      for (int64_t j = 0; j < size * n; ++j) send[j] = value(rank, j);
      for (int64_t i = 0; i < n; ++i) {
        for (int r = 0; r < size; ++r) want[i] += value(r, rank * n + i);
      }
      p.plain.reset_counters();
      p.chunked.reset_counters();
      std::vector<float> a(n, nan), b(n, nan);
      p.plain.reduce_scatter(send.data(), a.data(), n);
      p.chunked.reduce_scatter(send.data(), b.data(), n);
      EXPECT_TRUE(same_bits(a, b)) << what;
      EXPECT_TRUE(same_bits(b, want)) << what;
      expect_same_counters(p, size > 1 ? size * n * 4 : 0, what);
    }
  }
}

TEST(MpiCommunicator, ChunkedBroadcastEqualsUnchunked) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int root = 0; root < size; ++root) {
      for (int64_t n : kSizes) {
        const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n) +
                                 ", root " + std::to_string(root);
        std::vector<float> a(n), b(n), want(n);
        for (int64_t i = 0; i < n; ++i) {
          a[i] = b[i] = value(rank, i);  // only the root's survive
          want[i] = value(root, i);
        }
        p.plain.reset_counters();
        p.chunked.reset_counters();
        p.plain.broadcast(a.data(), n, root);
        p.chunked.broadcast(b.data(), n, root);
        EXPECT_TRUE(same_bits(a, b)) << what;
        EXPECT_TRUE(same_bits(b, want)) << what;
        expect_same_counters(p, size > 1 ? n * 4 : 0, what);
      }
    }
  }
}

// Element i of rank r's int64 buffer: above 2^53 (no float or double holds it), negative for odd
// i, every byte distinct per rank and element.
int64_t value64(int r, int64_t i) {
  const int64_t v = (int64_t{1} << 60) + (int64_t{r} << 40) + i * 0x0101010101 + 0x123;
  return i % 2 ? -v : v;
}

TEST(MpiCommunicator, ChunkedByteAllGatherIsExact) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int64_t n : kSizes) {
      const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n);
      std::vector<int64_t> send(n), want(size * n);
      for (int64_t i = 0; i < n; ++i) send[i] = value64(rank, i);
      for (int r = 0; r < size; ++r) {
        for (int64_t i = 0; i < n; ++i) want[r * n + i] = value64(r, i);
      }
      p.plain.reset_counters();
      p.chunked.reset_counters();
      std::vector<int64_t> a(size * n, -1), b(size * n, -1);
      p.plain.all_gather_int64(send.data(), a.data(), n);
      p.chunked.all_gather_int64(send.data(), b.data(), n);
      EXPECT_TRUE(same_bits(a, want)) << what << ", out of place";
      EXPECT_TRUE(same_bits(b, want)) << what << ", out of place";
      // In place, as bytes: this rank's block already at its slot.
      std::vector<int64_t> c(size * n, -1), d(size * n, -1);
      std::copy(send.begin(), send.end(), c.begin() + rank * n);
      std::copy(send.begin(), send.end(), d.begin() + rank * n);
      p.plain.all_gather_bytes(c.data() + rank * n, c.data(), n * 8);
      p.chunked.all_gather_bytes(d.data() + rank * n, d.data(), n * 8);
      EXPECT_TRUE(same_bits(c, want)) << what << ", in place";
      EXPECT_TRUE(same_bits(d, want)) << what << ", in place";
      expect_same_counters(p, size > 1 ? 2 * size * n * 8 : 0, what);
    }
  }
}

TEST(MpiCommunicator, ChunkedByteBroadcastIsExact) {
  const int size = mpi_env().world_size(), rank = mpi_env().world_rank();
  for (int64_t chunk : kChunks) {
    Pair p(chunk);
    for (int root = 0; root < size; ++root) {
      for (int64_t n : kSizes) {
        const std::string what = "chunk " + std::to_string(chunk) + ", n " + std::to_string(n) +
                                 ", root " + std::to_string(root);
        std::vector<int64_t> a(n), want(n);
        for (int64_t i = 0; i < n; ++i) {
          a[i] = value64(rank, i);  // only the root's survive
          want[i] = value64(root, i);
        }
        // An odd byte count: the chunks need not align with anything.
        std::vector<unsigned char> b(3 * n + 1), wantb(b.size());
        for (size_t i = 0; i < b.size(); ++i) {
          b[i] = static_cast<unsigned char>(rank * 37 + i);
          wantb[i] = static_cast<unsigned char>(root * 37 + i);
        }
        p.plain.reset_counters();
        p.chunked.reset_counters();
        p.plain.broadcast_int64(a.data(), n, root);
        p.chunked.broadcast_bytes(b.data(), static_cast<int64_t>(b.size()), root);
        EXPECT_TRUE(same_bits(a, want)) << what;
        EXPECT_TRUE(same_bits(b, wantb)) << what;
        EXPECT_EQ(p.plain.bytes_moved(), size > 1 ? n * 8 : 0) << what;
        EXPECT_EQ(p.chunked.bytes_moved(), size > 1 ? 3 * n + 1 : 0) << what;
        EXPECT_EQ(p.chunked.calls(), size > 1 ? 1 : 0) << what;
      }
    }
  }
}

TEST(MpiCommunicator, MpiErrorNamesTheCallGroupAndStep) {
  const int size = mpi_env().world_size();
  if (size < 2) GTEST_SKIP() << "a group of one makes no MPI call";
  Watchdog watchdog(0.0, mpi_env().world_rank());  // disabled; only carries the step
  watchdog.set_step(5);
  MpiCommunicator comm(dup_world(), "test", &watchdog);
  std::vector<float> x(4, 1.0f);
  // Root out of range: every rank's MPI finds it alike, so every rank throws (no hang).
  const std::string msg =
      testing::error_of(ErrorKind::kComm, [&] { comm.broadcast(x.data(), 4, size); });
  EXPECT_NE(msg.find("MPI_Bcast over the test group at step 5 failed: "), std::string::npos) << msg;
  // Still usable afterwards.
  comm.all_reduce(x.data(), 4, ReduceOp::kSum);
  EXPECT_EQ(x[3], static_cast<float>(size));
}

TEST(MpiCommunicator, ChunkLimitOutOfRangeIsRefused) {
  for (int64_t bad : {int64_t{0}, int64_t{-3}, int64_t{INT_MAX} + 1}) {
    const std::string msg = testing::error_of(
        ErrorKind::kInternal, [&] { MpiCommunicator c(MPI_COMM_WORLD, "bad", nullptr, bad); });
    EXPECT_NE(msg.find("max_count=" + std::to_string(bad)), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace keel
