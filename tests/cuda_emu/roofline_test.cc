// The emulator's roofline measurement (roofline.h) on known kernels, and the estimate's scaling and
// last line (estimate.h): a bf16 GEMM of known m, n, k does exactly 2 m n k flops and moves its
// operands' bytes to within a page each; an element-wise add over N floats reads 8 N bytes and
// writes 4 N, page-rounded; the benchmark's last line has the issue's exact format. The estimate
// itself is a benchmark (keel-gpu-train-bench-emu --estimate), not a test.
#include "tests/cuda_emu/roofline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/ops.h"
#include "tests/cuda_emu/estimate.h"

namespace keel {
namespace {

namespace cuda = kernels::cuda;
namespace roofline = keel_emu::roofline;
namespace estimate = keel_emu::estimate;

constexpr uint64_t kPage = 4096;

// Runs f with the measurement on and returns the records of what it submitted.
template <typename F>
std::vector<roofline::Record> measured(cuda::Context& ctx, F f) {
  ctx.synchronize();
  roofline::take();
  roofline::set_enabled(true);
  f();
  ctx.synchronize();
  roofline::set_enabled(false);
  return roofline::take();
}

const roofline::Record& only(const std::vector<roofline::Record>& records,
                             const std::string& name) {
  const roofline::Record* found = nullptr;
  for (const auto& r : records) {
    if (r.name != name) continue;
    EXPECT_EQ(found, nullptr) << "two records named " << name;
    found = &r;
  }
  if (found == nullptr) throw std::runtime_error("no record named " + name);
  return *found;
}

TEST(RooflineEstimate, GemmHasExactFlopsAndItsOperandsBytes) {
  cuda::Context ctx(0);
  const int64_t M = 256, N = 512, K = 1024;  // C[M, N] = A[M, K] B[N, K]^T
  cuda::DeviceBuffer A = ctx.alloc(M * K * 2), B = ctx.alloc(N * K * 2), C = ctx.alloc(M * N * 4);
  cuda::fill_uniform(ctx, A.as<Bf16>(), M * K, -1.0f, 1.0f, 1);
  cuda::fill_uniform(ctx, B.as<Bf16>(), N * K, -1.0f, 1.0f, 2);
  const auto records = measured(ctx, [&] {
    cuda::gemm(ctx, false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N,
               cuda::DType::kBF16, cuda::DType::kF32);
  });
  const roofline::Record& r = only(records, "cublasLtMatmul bf16");
  EXPECT_EQ(r.launches, 1u);
  EXPECT_EQ(r.flops, 2.0 * M * N * K);
  EXPECT_EQ(r.peak, roofline::Peak::kTensorBf16);
  // Each operand is read (written) whole, page-rounded: at most one partial page at each end.
  const uint64_t read = (M * K + N * K) * 2, written = M * N * 4;
  EXPECT_GE(r.bytes_read, read);
  EXPECT_LE(r.bytes_read, read + 2 * 2 * kPage);
  EXPECT_GE(r.bytes_written, written);
  EXPECT_LE(r.bytes_written, written + 2 * kPage);
  // Compute-bound at these shapes: 2 m n k / 989 TFLOP/s against 2.5 MB / 4.8 TB/s.
  EXPECT_DOUBLE_EQ(roofline::seconds(r),
                   std::max(2.0 * M * N * K / roofline::kBf16TensorFlops,
                            std::max(static_cast<double>(r.bytes_read + r.bytes_written) /
                                         roofline::kHbmBytesPerS,
                                     roofline::kLaunchFloorS)));
}

TEST(RooflineEstimate, ElementwiseAddReadsTwoAndWritesOneArray) {
  cuda::Context ctx(0);
  const int64_t n = int64_t{1} << 20;  // 4 MiB of floats per array
  cuda::DeviceBuffer a = ctx.alloc(n * 4), b = ctx.alloc(n * 4), out = ctx.alloc(n * 4);
  cuda::fill_uniform(ctx, a.as<float>(), n, -1.0f, 1.0f, 1);
  cuda::fill_uniform(ctx, b.as<float>(), n, -1.0f, 1.0f, 2);
  const auto records =
      measured(ctx, [&] { cuda::add(ctx, out.as<float>(), a.as<float>(), b.as<float>(), n); });
  ASSERT_EQ(records.size(), 1u) << "one kernel launch";
  const roofline::Record& r = records[0];
  EXPECT_EQ(r.launches, 1u);
  EXPECT_EQ(r.flops, 0.0) << "element-wise kernels count no flops";
  EXPECT_GE(r.bytes_read, uint64_t(8 * n));
  EXPECT_LE(r.bytes_read, uint64_t(8 * n) + 2 * 2 * kPage);
  EXPECT_GE(r.bytes_written, uint64_t(4 * n));
  EXPECT_LE(r.bytes_written, uint64_t(4 * n) + 2 * kPage);
  // Memory-bound: 12 MiB at 4.8 TB/s (2.6 us), above the launch floor.
  EXPECT_DOUBLE_EQ(roofline::seconds(r),
                   static_cast<double>(r.bytes_read + r.bytes_written) / roofline::kHbmBytesPerS);
}

TEST(RooflineEstimate, NothingIsRecordedWhenOff) {
  cuda::Context ctx(0);
  const int64_t n = 1024;
  cuda::DeviceBuffer a = ctx.alloc(n * 4), out = ctx.alloc(n * 4);
  cuda::fill_uniform(ctx, a.as<float>(), n, -1.0f, 1.0f, 1);
  ctx.synchronize();
  roofline::take();
  cuda::add(ctx, out.as<float>(), a.as<float>(), a.as<float>(), n);
  ctx.synchronize();
  EXPECT_TRUE(roofline::take().empty());
}

TEST(RooflineEstimate, LabelGroupsItsLaunchesWithItsFlops) {
  cuda::Context ctx(0);
  const int64_t n = 1024;
  cuda::DeviceBuffer a = ctx.alloc(n * 4), out = ctx.alloc(n * 4);
  cuda::fill_uniform(ctx, a.as<float>(), n, -1.0f, 1.0f, 1);
  const auto records = measured(ctx, [&] {
    const roofline::Label label("fused op", 0, 1e10, roofline::Peak::kTensorBf16);
    cuda::add(ctx, out.as<float>(), a.as<float>(), a.as<float>(), n);
    cuda::add(ctx, a.as<float>(), out.as<float>(), out.as<float>(), n);
  });
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].name, "fused op");
  EXPECT_EQ(records[0].launches, 2u);
  EXPECT_EQ(records[0].attention_flops, 1e10);
  // 10 GFLOP at 989 TFLOP/s (10 us), above two launches and the bytes.
  EXPECT_DOUBLE_EQ(roofline::seconds(records[0]), 1e10 / roofline::kBf16TensorFlops);
}

roofline::Record record(const char* name, uint64_t read, uint64_t written, double flops,
                        double attention_flops) {
  roofline::Record r;
  r.name = name;
  r.launches = 1;
  r.bytes_read = read;
  r.bytes_written = written;
  r.flops = flops;
  r.attention_flops = attention_flops;
  r.peak = roofline::Peak::kTensorBf16;
  return r;
}

TEST(RooflineEstimate, ScalesTokensLinearlyAttentionByTSquaredAndLayersLinearly) {
  // A task of 1000 + 10 N bytes read, 20 N written, 100 N flops, and attention of N T.
  const auto at = [](double n) {
    return std::vector<roofline::Record>{
        record("k", uint64_t(1000 + 10 * n), uint64_t(20 * n), 100 * n, n * n)};
  };
  const auto e = estimate::scale_tokens(at(256), at(512), 256, 512, 512, 16384, 1024);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_DOUBLE_EQ(e[0].bytes_read, 1000 + 10 * 16384.0);
  EXPECT_DOUBLE_EQ(e[0].bytes_written, 20 * 16384.0);
  EXPECT_DOUBLE_EQ(e[0].flops, 100 * 16384.0 + 16384.0 * 1024);
  EXPECT_DOUBLE_EQ(e[0].launches, 1);
  // A kernel that ran in one run only is refused.
  const std::vector<roofline::Record> other{record("j", 1000, 0, 0, 0)};
  EXPECT_THROW(estimate::scale_tokens(at(256), other, 256, 512, 512, 16384, 1024),
               std::runtime_error);
  // One launched once at 256 tokens and twice at 512 (launches that depend on the rows) is scaled
  // whole: its bytes summed per run (3560 and 7120) and extrapolated, with the larger run's
  // launches.
  std::vector<roofline::Record> twice{record("k", 1000 + 10 * 256, 0, 0, 0)};
  const std::vector<roofline::Record> more{record("k", 1000, 0, 0, 0),
                                           record("k", 1000 + 10 * 512, 0, 0, 0)};
  const auto w = estimate::scale_tokens(twice, more, 256, 512, 512, 16384, 1024);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(w[0].whole);
  EXPECT_DOUBLE_EQ(w[0].launches, 2);
  EXPECT_DOUBLE_EQ(w[0].bytes_read, 3560 + (7120 - 3560) * (16384.0 - 256) / 256);
  // Layers: one + (L - 1)(two - one).
  estimate::Entry one{"k", 10, 100, 200, 300, 1.0}, two{"k", 16, 150, 300, 500, 1.5};
  const auto l = estimate::scale_layers({one}, {two}, 12);
  ASSERT_EQ(l.size(), 1u);
  EXPECT_DOUBLE_EQ(l[0].launches, 10 + 11 * 6);
  EXPECT_DOUBLE_EQ(l[0].bytes_read, 100 + 11 * 50);
  EXPECT_DOUBLE_EQ(l[0].seconds, 1.0 + 11 * 0.5);
}

TEST(RooflineEstimate, SummaryLineHasTheIssuesFormat) {
  // 14 TFLOP in 32 ms: 14e12 / (0.032 s x 989e12 FLOP/s) = 44.2%.
  EXPECT_EQ(roofline::summary_line(32.0, 14e12),
            "estimated H200 step: 32.0 ms, MFU 44.2% of 989 TFLOP/s");
}

}  // namespace
}  // namespace keel
