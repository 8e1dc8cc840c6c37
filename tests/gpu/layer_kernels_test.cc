// CUDA forms of the small kernels that replaced host loops in the layers (issue 10, device-neutral
// layers): attention_scales, scale_grad_accumulate and load_tokens (framework/kernels/cuda/ops.h)
// against the CPU kernels on random inputs, outputs poisoned with NaN before each run. All three
// are exact (copies and the same sequence of float additions), so results must be bitwise equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;

class LayerKernelsTest : public GpuTest {};

TEST_F(LayerKernelsTest, AttentionScalesMatchCpu) {
  // H past one block of threads, so every block's elements are checked.
  const int64_t H = 300;
  const float def = 1.0f / std::sqrt(96.0f);
  const auto gain = random_vec(H, 0.5f, 20.0f, 41);
  DeviceBuffer d_gain = cuda::upload(ctx(), gain);
  for (int mode = 0; mode < 3; ++mode) {
    // 0: no gain (1/sqrt(D)); 1: per-head gain; 2: one shared gain.
    const bool shared = mode == 2;
    const float* g = mode == 0 ? nullptr : gain.data();
    std::vector<float> cpu(H);
    kernels::attention_scales<float>(cpu.data(), g, H, shared, def);
    DeviceBuffer d_out = poisoned<float>(H);
    cuda::attention_scales(ctx(), d_out.as<float>(), mode == 0 ? nullptr : d_gain.as<float>(), H,
                           shared, def);
    EXPECT_TRUE(identical(get<float>(d_out, H), cpu)) << "mode " << mode;
  }
}

TEST_F(LayerKernelsTest, ScaleGradAccumulateMatchesCpuBitwise) {
  const int64_t H = 300;
  // Magnitudes spread over decades, so a different order of the shared gain's additions would
  // round differently.
  auto dscale = random_vec(H, -1.0f, 1.0f, 42);
  for (int64_t h = 0; h < H; h += 3) dscale[h] *= 1e4f;
  const auto grad0 = random_vec(H, -2.0f, 2.0f, 43);
  DeviceBuffer d_dscale = cuda::upload(ctx(), dscale);
  for (const bool shared : {false, true}) {
    const int64_t G = shared ? 1 : H;  // elements of the gain's gradient
    std::vector<float> cpu(grad0.begin(), grad0.begin() + G);
    kernels::scale_grad_accumulate<float>(cpu.data(), dscale.data(), H, shared);
    // Accumulation (+=) reads the gradient, so it starts from random values, not poison; one
    // guard element past the end stays poisoned and must not be written.
    std::vector<float> start(grad0.begin(), grad0.begin() + G);
    DeviceBuffer d_grad = poisoned<float>(G + 1);
    ctx().copy_to_device(d_grad.data(), start.data(), G * sizeof(float));
    cuda::scale_grad_accumulate(ctx(), d_grad.as<float>(), d_dscale.as<float>(), H, shared);
    const auto got = get<float>(d_grad, G + 1);
    EXPECT_TRUE(identical(std::vector<float>(got.begin(), got.begin() + G), cpu))
        << "shared " << shared;
    EXPECT_TRUE(std::isnan(got[G])) << "shared " << shared << ": wrote past the gradient";
  }
}

TEST_F(LayerKernelsTest, LoadTokensCopiesHostBatch) {
  const int64_t n = 4099;
  std::mt19937 gen(44);
  std::uniform_int_distribution<int32_t> tok(1, 50303);
  std::vector<int32_t> host(n);
  for (auto& t : host) t = tok(gen);
  std::vector<int32_t> cpu(n);
  kernels::load_tokens(cpu.data(), host.data(), n);
  DeviceBuffer d = poisoned<int32_t>(n);
  cuda::load_tokens(ctx(), d.as<int32_t>(), host.data(), n);
  // Overwriting the host batch at once must not change what was loaded (the copy is complete).
  std::vector<int32_t> expected = host;
  std::fill(host.begin(), host.end(), -5);
  EXPECT_EQ(get<int32_t>(d, n), expected);
  EXPECT_EQ(cpu, expected);
  cuda::load_tokens(ctx(), nullptr, nullptr, 0);  // nothing to copy
}

}  // namespace
}  // namespace keel::gpu_test
