// kernels::set_flush_denormals: with it on, a denormal input reads as zero (DAZ) and a product
// that would be denormal comes out zero (FTZ), on the calling thread and on every thread of the
// OpenMP pool that BLAS shares, and sgemm over denormal inputs returns zeros; off, IEEE denormals
// come back. The trainer turns it on unless train.keep_denormals is set.
#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <vector>

#include "framework/kernels/gemm.h"

namespace keel {
namespace {

// Each OpenMP thread's x * y, through volatile so the compiler cannot fold it.
std::vector<float> per_thread_product(float x, float y, int threads) {
  std::vector<float> out(threads, -1.0f);
#pragma omp parallel num_threads(threads)
  {
    volatile float a = x, b = y;
    out[omp_get_thread_num()] = a * b;
  }
  return out;
}

class DenormalsTest : public testing::Test {
 protected:
  void TearDown() override { kernels::set_flush_denormals(false); }
};

TEST_F(DenormalsTest, FlushesOnEveryPoolThreadAndRestores) {
  const float denormal = FLT_MIN / 8;  // 1.47e-39: below the smallest normal float
  ASSERT_GT(denormal, 0.0f);
  const int threads = 3;
  if (!kernels::set_flush_denormals(true)) GTEST_SKIP() << "this CPU has no FTZ/DAZ modes";
  for (float v : per_thread_product(denormal, 1.0f, threads)) EXPECT_EQ(v, 0.0f) << "DAZ";
  for (float v : per_thread_product(FLT_MIN, 0.25f, threads)) EXPECT_EQ(v, 0.0f) << "FTZ";
  // Normal numbers are untouched.
  for (float v : per_thread_product(FLT_MIN, 2.0f, threads)) EXPECT_EQ(v, 2 * FLT_MIN);

  ASSERT_TRUE(kernels::set_flush_denormals(false));
  for (float v : per_thread_product(denormal, 1.0f, threads)) EXPECT_EQ(v, denormal);
  for (float v : per_thread_product(FLT_MIN, 0.25f, threads)) EXPECT_EQ(v, FLT_MIN / 4);
}

TEST_F(DenormalsTest, BlasSeesFlushedInputs) {
  // out[1, 2] = x[1, 4] . w[2, 4]^T with denormal inputs: IEEE keeps a denormal sum; flushed, 0.
  const float d = FLT_MIN / 16;
  const std::vector<float> x = {d, d, d, d}, w = {1, 1, 1, 1, 1, 1, 1, 1};
  std::vector<float> out(2, -1.0f);
  kernels::set_num_threads(2);
  if (!kernels::set_flush_denormals(true)) GTEST_SKIP() << "this CPU has no FTZ/DAZ modes";
  kernels::linear_forward<float>(out.data(), x.data(), w.data(), nullptr, 1, 4, 2);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 0.0f);
  kernels::set_flush_denormals(false);
  kernels::linear_forward<float>(out.data(), x.data(), w.data(), nullptr, 1, 4, 2);
  EXPECT_EQ(out[0], 4 * d);
  EXPECT_EQ(out[1], 4 * d);
}

}  // namespace
}  // namespace keel
