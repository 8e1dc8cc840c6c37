// CUDA gated linear units (framework/kernels/cuda/ops.h glu_*) against the CPU kernels of
// framework/kernels/glu.h, SwiGLU and GEGLU, fp32 and bf16, out of place and in place, outputs
// poisoned with NaN first; bounds in gpu_test_util.h.
#include "framework/kernels/glu.h"

#include <gtest/gtest.h>

#include <vector>

#include "framework/kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
using kernels::GluAct;

class GluTest : public GpuTest, public ::testing::WithParamInterface<GluAct> {};

const char* act_name(GluAct a) { return a == GluAct::kSilu ? "silu" : "gelu"; }

TEST_P(GluTest, Fp32ForwardBackwardMatchCpu) {
  const GluAct a = GetParam();
  const int64_t n = 100003;
  // Gate values reach into both tails of the activations (sigmoid(-6) = 0.0025), where GELU's
  // derivative amplifies FMA-contraction differences most (the range ops_test's GELU bound covers).
  const auto gate = random_vec(n, -6, 6, 21), up = random_vec(n, -2, 2, 22);
  const auto dout = random_vec(n, -1, 1, 23);
  std::vector<float> out(n), dgate(n), dup(n);
  kernels::glu_forward<float>(a, out.data(), gate.data(), up.data(), n);
  kernels::glu_backward<float>(a, dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n);

  DeviceBuffer d_gate = cuda::upload(ctx(), gate), d_up = cuda::upload(ctx(), up);
  DeviceBuffer d_dout = cuda::upload(ctx(), dout);
  DeviceBuffer d_out = poisoned<float>(n), d_dgate = poisoned<float>(n), d_dup = poisoned<float>(n);
  cuda::glu_forward(ctx(), a, d_out.as<float>(), d_gate.as<float>(), d_up.as<float>(), n);
  cuda::glu_backward(ctx(), a, d_dgate.as<float>(), d_dup.as<float>(), d_dout.as<float>(),
                     d_gate.as<float>(), d_up.as<float>(), n);
  // The same __host__ __device__ formulas in the same order; only FMA contraction differs.
  EXPECT_TRUE(matches(get<float>(d_out, n), out, f32_rtol(1))) << act_name(a);
  EXPECT_TRUE(matches(get<float>(d_dgate, n), dgate, f32_rtol(1))) << act_name(a);
  EXPECT_TRUE(matches(get<float>(d_dup, n), dup, f32_rtol(1))) << act_name(a);

  // In place, as glu.h allows: out over up, and dup over dout.
  cuda::glu_forward(ctx(), a, d_up.as<float>(), d_gate.as<float>(), d_up.as<float>(), n);
  EXPECT_TRUE(matches(get<float>(d_up, n), out, f32_rtol(1))) << act_name(a) << " in place";
  DeviceBuffer d_up2 = cuda::upload(ctx(), up);
  DeviceBuffer d_dgate2 = poisoned<float>(n);
  cuda::glu_backward(ctx(), a, d_dgate2.as<float>(), d_dout.as<float>(), d_dout.as<float>(),
                     d_gate.as<float>(), d_up2.as<float>(), n);
  EXPECT_TRUE(matches(get<float>(d_dgate2, n), dgate, f32_rtol(1))) << act_name(a) << " in place";
  EXPECT_TRUE(matches(get<float>(d_dout, n), dup, f32_rtol(1))) << act_name(a) << " in place";
}

TEST_P(GluTest, Bf16MatchesCpuOnRoundedInputs) {
  const GluAct a = GetParam();
  const int64_t n = 50001;
  const auto gate = bf16_rounded(random_vec(n, -6, 6, 24));
  const auto up = bf16_rounded(random_vec(n, -2, 2, 25));
  const auto dout = bf16_rounded(random_vec(n, -1, 1, 26));
  std::vector<float> out(n), dgate(n), dup(n);
  kernels::glu_forward<float>(a, out.data(), gate.data(), up.data(), n);
  kernels::glu_backward<float>(a, dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n);

  DeviceBuffer d_gate = cuda::upload(ctx(), to_bf16(gate)), d_up = cuda::upload(ctx(), to_bf16(up));
  DeviceBuffer d_dout = cuda::upload(ctx(), to_bf16(dout));
  DeviceBuffer d_out = poisoned<Bf16>(n), d_dgate = poisoned<Bf16>(n), d_dup = poisoned<Bf16>(n);
  cuda::glu_forward(ctx(), a, d_out.as<Bf16>(), d_gate.as<Bf16>(), d_up.as<Bf16>(), n);
  cuda::glu_backward(ctx(), a, d_dgate.as<Bf16>(), d_dup.as<Bf16>(), d_dout.as<Bf16>(),
                     d_gate.as<Bf16>(), d_up.as<Bf16>(), n);
  // fp32 math on the exact bf16 inputs, one bf16 rounding per output.
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_out, n)), out, kBf16Rtol)) << act_name(a);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dgate, n)), dgate, kBf16Rtol)) << act_name(a);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dup, n)), dup, kBf16Rtol)) << act_name(a);

  DeviceBuffer d_dgate2 = poisoned<Bf16>(n);
  cuda::glu_backward(ctx(), a, d_dgate2.as<Bf16>(), d_dout.as<Bf16>(), d_dout.as<Bf16>(),
                     d_gate.as<Bf16>(), d_up.as<Bf16>(), n);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dgate2, n)), dgate, kBf16Rtol)) << act_name(a);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dout, n)), dup, kBf16Rtol)) << act_name(a);
}

INSTANTIATE_TEST_SUITE_P(Acts, GluTest, ::testing::Values(GluAct::kSilu, GluAct::kGelu),
                         [](const ::testing::TestParamInfo<GluAct>& info) {
                           return std::string(act_name(info.param));
                         });

}  // namespace
}  // namespace keel::gpu_test
