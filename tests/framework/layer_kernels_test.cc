// The small kernels that took over host loops of the layers (issue 10, device-neutral layers):
// attention_scales and scale_grad_accumulate (framework/kernels/attention.h), load_tokens and
// num_threads (framework/kernels/gemm.h). The CUDA forms are tested against these in
// tests/gpu/layer_kernels_test.cc.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "framework/kernels/attention.h"
#include "framework/kernels/gemm.h"

namespace keel {
namespace {

TEST(AttentionScales, DefaultScaleWithoutGain) {
  const float s = 1.0f / std::sqrt(64.0f);
  std::vector<float> out(5, -7.0f);
  kernels::attention_scales<float>(out.data(), nullptr, 5, false, s);
  for (float v : out) EXPECT_EQ(v, s);
  // shared_gain does not matter without a gain.
  std::fill(out.begin(), out.end(), -7.0f);
  kernels::attention_scales<float>(out.data(), nullptr, 5, true, s);
  for (float v : out) EXPECT_EQ(v, s);
}

TEST(AttentionScales, PerHeadAndSharedGain) {
  const std::vector<float> gain = {3.5f, -1.25f, 7.0f, 0.5f};
  std::vector<float> out(4, -7.0f);
  kernels::attention_scales<float>(out.data(), gain.data(), 4, false, 0.125f);
  EXPECT_EQ(out, gain);
  // A shared gain is one value, gain[0], for every head.
  std::fill(out.begin(), out.end(), -7.0f);
  kernels::attention_scales<float>(out.data(), gain.data(), 4, true, 0.125f);
  for (float v : out) EXPECT_EQ(v, 3.5f);
  // Only H elements are written.
  std::vector<double> outd(3, -7.0);
  const double g = 2.0;
  kernels::attention_scales<double>(outd.data(), &g, 2, true, 0.125);
  EXPECT_EQ(outd, (std::vector<double>{2.0, 2.0, -7.0}));
}

TEST(ScaleGradAccumulate, PerHeadAddsEachHead) {
  std::vector<float> grad = {1.0f, 2.0f, 3.0f};
  const std::vector<float> ds = {0.5f, -4.0f, 0.25f};
  kernels::scale_grad_accumulate<float>(grad.data(), ds.data(), 3, false);
  EXPECT_EQ(grad, (std::vector<float>{1.5f, -2.0f, 3.25f}));
}

TEST(ScaleGradAccumulate, SharedSumsHeadsInIncreasingOrder) {
  // Float addition is not associative: 1 + 1e8 rounds to 1e8 (spacing 8 there), so adding the
  // heads in order 0, 1, 2 gives ((1 + 1e8) + 1) - 1e8 = 0, while the same values with the two
  // large ones adjacent give ((1 + 1e8) - 1e8) + 1 = 1. The model's loss must not change with
  // the refactor, so the order is part of the contract.
  float grad = 1.0f;
  const std::vector<float> ds = {1e8f, 1.0f, -1e8f};
  kernels::scale_grad_accumulate<float>(&grad, ds.data(), 3, true);
  EXPECT_EQ(grad, 0.0f);
  float grad2 = 1.0f;
  const std::vector<float> reordered = {1e8f, -1e8f, 1.0f};
  kernels::scale_grad_accumulate<float>(&grad2, reordered.data(), 3, true);
  EXPECT_EQ(grad2, 1.0f);
}

TEST(LoadTokens, CopiesExactlyN) {
  const std::vector<int32_t> src = {5, -1, 2147483647, 0, 42};
  std::vector<int32_t> dst(6, 9);
  kernels::load_tokens(dst.data(), src.data(), 5);
  EXPECT_EQ(dst, (std::vector<int32_t>{5, -1, 2147483647, 0, 42, 9}));
  kernels::load_tokens(nullptr, nullptr, 0);  // nothing to copy: no access
}

TEST(NumThreads, IsTheOpenMpPoolSize) {
  // The layers size attention's workspace with it; it must be what the OpenMP kernels use.
  const int saved = omp_get_max_threads();
  kernels::set_num_threads(3);
  EXPECT_EQ(kernels::num_threads(), 3);
  EXPECT_EQ(kernels::num_threads(), omp_get_max_threads());
  kernels::set_num_threads(saved);
  EXPECT_EQ(kernels::num_threads(), saved);
}

}  // namespace
}  // namespace keel
