// CUDA forms of the small kernels that replaced host loops in the layers (issue 10, device-neutral
// layers): attention_scales, scale_grad_accumulate and load_tokens (framework/kernels/cuda/ops.h)
// against the CPU kernels on random inputs, outputs poisoned with NaN before each run. All three
// are exact (copies and the same sequence of float additions), so results must be bitwise equal.
// And the linear layers' bias gradients (column_sum_add, framework/kernels/cuda/gemm.h), summed
// over row chunks in another order than the CPU's: within the fp32 bound, and bitwise run to run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/gemm.h"
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

// Row counts for one pass (at most 128 rows) and for many row chunks with a ragged last one
// (Note [fused-bias-grad]: 3000 rows make 188 chunks of 16 at C = 96, the last of 8, and 43 of 70
// at C = 770, the last of 60), a ragged 32-column strip, strided rows; fp32 and bf16 inputs (the
// same values: x is rounded to bf16 for both). The gradient starts random (+=); a guard element
// past its end stays NaN.
TEST_F(LayerKernelsTest, ColumnSumAddOverRowChunksMatchesCpu) {
  struct Shape {
    int64_t N, C, ld;
  };
  uint32_t seed = 50;
  for (const Shape& sh :
       {Shape{3000, 96, 96}, Shape{3000, 770, 777}, Shape{100, 96, 100}, Shape{129, 33, 40}}) {
    SCOPED_TRACE("N=" + std::to_string(sh.N) + " C=" + std::to_string(sh.C));
    const auto x = bf16_rounded(random_vec(sh.N * sh.ld, -1.0f, 1.0f, seed++));
    const auto grad0 = random_vec(sh.C, -2.0f, 2.0f, seed++);
    std::vector<float> cpu = grad0;
    kernels::column_sum_add<float>(cpu.data(), x.data(), sh.N, sh.C, sh.ld);
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(bf16 ? "bf16" : "fp32");
      DeviceBuffer d_x = bf16 ? cuda::upload(ctx(), to_bf16(x)) : cuda::upload(ctx(), x);
      std::vector<float> runs[2];
      for (std::vector<float>& run : runs) {
        DeviceBuffer d_grad = poisoned<float>(sh.C + 1);
        ctx().copy_to_device(d_grad.data(), grad0.data(), sh.C * sizeof(float));
        if (bf16) {
          cuda::column_sum_add(ctx(), d_grad.as<float>(), d_x.as<const Bf16>(), sh.N, sh.C, sh.ld);
        } else {
          cuda::column_sum_add(ctx(), d_grad.as<float>(), d_x.as<const float>(), sh.N, sh.C, sh.ld);
        }
        const auto got = get<float>(d_grad, sh.C + 1);
        EXPECT_TRUE(std::isnan(got[sh.C])) << "wrote past the gradient";
        run.assign(got.begin(), got.begin() + sh.C);
      }
      EXPECT_TRUE(matches(runs[0], cpu, f32_rtol(sh.N)));
      EXPECT_TRUE(identical(runs[1], runs[0])) << "not reproducible run to run";
    }
  }
}

}  // namespace
}  // namespace keel::gpu_test
