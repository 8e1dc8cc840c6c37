// cuBLASLt GEMMs and linear layers (framework/kernels/cuda/gemm.h) against the CPU backend
// (framework/kernels/gemm.h) on random inputs; bounds in gpu_test_util.h.
#include "framework/kernels/cuda/gemm.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
using cuda::DType;

class GemmTest : public GpuTest {};

// Shapes with odd sizes, so no dimension is a multiple of a tile.
constexpr int64_t kN = 257, kIC = 192, kOC = 320;

TEST_F(GemmTest, GemmAllTransposesWithPaddedLeadingDimensionsMatchCpu) {
  const int64_t M = 67, N = 45, K = 131;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Row-major storage: A is [M, K] or [K, M]; B is [K, N] or [N, K]; rows padded by 3.
      const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
      const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
      const int64_t lda = a_cols + 3, ldb = b_cols + 3, ldc = N + 3;
      const auto A = random_vec(a_rows * lda, -1, 1, 1);
      const auto B = random_vec(b_rows * ldb, -1, 1, 2);
      auto C = random_vec(M * ldc, -1, 1, 3);
      DeviceBuffer dA = cuda::upload(ctx(), A), dB = cuda::upload(ctx(), B);
      DeviceBuffer dC = cuda::upload(ctx(), C);
      cuda::gemm(ctx(), ta, tb, M, N, K, 0.75f, dA.data(), lda, dB.data(), ldb, 0.5f, dC.data(),
                 ldc, DType::kF32, DType::kF32);
      kernels::gemm<float>(ta, tb, M, N, K, 0.75f, A.data(), lda, B.data(), ldb, 0.5f, C.data(),
                           ldc);
      // The padding columns of C must be untouched: compare the whole buffer.
      EXPECT_TRUE(matches(get<float>(dC, C.size()), C, f32_rtol(K))) << "ta=" << ta << " tb=" << tb;
    }
  }
}

TEST_F(GemmTest, LinearForwardF32MatchesCpu) {
  const auto inp = random_vec(kN * kIC, -1, 1, 10);
  const auto w = random_vec(kOC * kIC, -0.5f, 0.5f, 11);
  // The bias at the start of its buffer (256-byte aligned: the fused cuBLASLt epilogue), four
  // elements in (16-byte aligned: still fused, by an algorithm the heuristic chose for that
  // alignment) and one element in (4-byte aligned: the separate bias pass); all must match the CPU.
  const auto bias_buf = random_vec(kOC + 4, -1, 1, 12);
  DeviceBuffer d_inp = cuda::upload(ctx(), inp), d_w = cuda::upload(ctx(), w);
  DeviceBuffer d_bias = cuda::upload(ctx(), bias_buf);
  for (int bias_offset : {0, 4, 1, -1}) {  // -1: no bias
    DeviceBuffer out = poisoned<float>(kN * kOC);
    const float* b = bias_offset >= 0 ? d_bias.as<float>() + bias_offset : nullptr;
    cuda::linear_forward(ctx(), out.as<float>(), d_inp.as<float>(), d_w.as<float>(), b, kN, kIC,
                         kOC);
    std::vector<float> ref(kN * kOC);
    kernels::linear_forward<float>(ref.data(), inp.data(), w.data(),
                                   bias_offset >= 0 ? bias_buf.data() + bias_offset : nullptr, kN,
                                   kIC, kOC);
    EXPECT_TRUE(matches(get<float>(out, ref.size()), ref, f32_rtol(kIC)))
        << "bias offset " << bias_offset;
  }
}

TEST_F(GemmTest, LinearForwardTf32IsCloseToCpu) {
  // TF32 keeps 10 mantissa bits of each input (2^-10 relative when truncated): a looser bound,
  // 5e-3 (a wrong result is off by O(1)).
  const auto inp = random_vec(kN * kIC, -1, 1, 20);
  const auto w = random_vec(kOC * kIC, -0.5f, 0.5f, 21);
  const auto bias = random_vec(kOC, -1, 1, 22);
  DeviceBuffer d_inp = cuda::upload(ctx(), inp), d_w = cuda::upload(ctx(), w);
  DeviceBuffer d_bias = cuda::upload(ctx(), bias);
  DeviceBuffer out = poisoned<float>(kN * kOC);
  ctx().set_fp32_matmul(cuda::Fp32Matmul::kTf32);
  cuda::linear_forward(ctx(), out.as<float>(), d_inp.as<float>(), d_w.as<float>(),
                       d_bias.as<float>(), kN, kIC, kOC);
  ctx().set_fp32_matmul(cuda::Fp32Matmul::kExact);
  std::vector<float> ref(kN * kOC);
  kernels::linear_forward<float>(ref.data(), inp.data(), w.data(), bias.data(), kN, kIC, kOC);
  EXPECT_TRUE(matches(get<float>(out, ref.size()), ref, 5e-3));
}

TEST_F(GemmTest, LinearBackwardF32MatchesCpu) {
  const auto inp = random_vec(kN * kIC, -1, 1, 30);
  const auto w = random_vec(kOC * kIC, -0.5f, 0.5f, 31);
  const auto dout = random_vec(kN * kOC, -1, 1, 32);
  const auto dinp0 = random_vec(kN * kIC, -1, 1, 33);
  const auto dw0 = random_vec(kOC * kIC, -1, 1, 34);  // += targets start non-zero
  const auto db0 = random_vec(kOC, -1, 1, 35);
  DeviceBuffer d_inp = cuda::upload(ctx(), inp), d_w = cuda::upload(ctx(), w);
  DeviceBuffer d_dout = cuda::upload(ctx(), dout);
  for (bool accumulate : {false, true}) {
    DeviceBuffer d_dinp = accumulate ? cuda::upload(ctx(), dinp0) : poisoned<float>(kN * kIC);
    DeviceBuffer d_dw = cuda::upload(ctx(), dw0), d_db = cuda::upload(ctx(), db0);
    cuda::linear_backward(ctx(), d_dinp.as<float>(), accumulate, d_dw.as<float>(), d_db.as<float>(),
                          d_dout.as<float>(), d_inp.as<float>(), d_w.as<float>(), kN, kIC, kOC);
    std::vector<float> dinp = dinp0, dw = dw0, db = db0;
    kernels::linear_backward<float>(dinp.data(), accumulate, dw.data(), db.data(), dout.data(),
                                    inp.data(), w.data(), kN, kIC, kOC);
    EXPECT_TRUE(matches(get<float>(d_dinp, dinp.size()), dinp, f32_rtol(kOC))) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_dw, dw.size()), dw, f32_rtol(kN))) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_db, db.size()), db, f32_rtol(kN))) << accumulate;
  }
}

TEST_F(GemmTest, LinearForwardBf16MatchesCpuOnRoundedInputs) {
  const auto inp = bf16_rounded(random_vec(kN * kIC, -1, 1, 40));
  const auto w = bf16_rounded(random_vec(kOC * kIC, -0.5f, 0.5f, 41));
  const auto bias = bf16_rounded(random_vec(kOC, -1, 1, 42));
  std::vector<float> ref(kN * kOC);
  kernels::linear_forward<float>(ref.data(), inp.data(), w.data(), bias.data(), kN, kIC, kOC);
  DeviceBuffer d_inp = cuda::upload(ctx(), to_bf16(inp)), d_w = cuda::upload(ctx(), to_bf16(w));
  {  // bf16 out, bf16 bias: one bf16 rounding of the fp32 result
    DeviceBuffer d_bias = cuda::upload(ctx(), to_bf16(bias));
    DeviceBuffer out = poisoned<Bf16>(kN * kOC);
    cuda::linear_forward(ctx(), out.as<Bf16>(), d_inp.as<Bf16>(), d_w.as<Bf16>(), d_bias.as<Bf16>(),
                         kN, kIC, kOC);
    EXPECT_TRUE(matches(from_bf16(get<Bf16>(out, ref.size())), ref, kBf16Rtol));
  }
  {  // fp32 out, fp32 bias: products of bf16 values are exact in fp32
    DeviceBuffer d_bias = cuda::upload(ctx(), bias);
    DeviceBuffer out = poisoned<float>(kN * kOC);
    cuda::linear_forward(ctx(), out.as<float>(), d_inp.as<Bf16>(), d_w.as<Bf16>(),
                         d_bias.as<float>(), kN, kIC, kOC);
    EXPECT_TRUE(matches(get<float>(out, ref.size()), ref, bf16_in_f32_out_rtol(kIC)));
  }
}

// Where cuBLASLt has no algorithm with the bias epilogue for a shape, gemm() adds the bias in a
// second pass. On the emulator KEEL_CUDA_EMU_CUBLASLT_NO_BIAS=1 makes every shape such a shape; on
// a GPU the variable does nothing and this checks the fused path again. Shapes of their own, so no
// plan cached by another test is reused.
TEST_F(GemmTest, LinearForwardWithoutABiasEpilogueAlgorithmMatchesCpu) {
  constexpr int64_t N = 33, IC = 64, OC = 48;
  const auto inp = bf16_rounded(random_vec(N * IC, -1, 1, 60));
  const auto w = bf16_rounded(random_vec(OC * IC, -0.5f, 0.5f, 61));
  const auto bias = bf16_rounded(random_vec(OC, -1, 1, 62));
  std::vector<float> ref(N * OC);
  kernels::linear_forward<float>(ref.data(), inp.data(), w.data(), bias.data(), N, IC, OC);
  DeviceBuffer d_inp = cuda::upload(ctx(), to_bf16(inp)), d_w = cuda::upload(ctx(), to_bf16(w));
  DeviceBuffer d_bias32 = cuda::upload(ctx(), bias), d_bias16 = cuda::upload(ctx(), to_bf16(bias));
  setenv("KEEL_CUDA_EMU_CUBLASLT_NO_BIAS", "1", 1);
  DeviceBuffer out32 = poisoned<float>(N * OC), out16 = poisoned<Bf16>(N * OC);
  cuda::linear_forward(ctx(), out32.as<float>(), d_inp.as<Bf16>(), d_w.as<Bf16>(),
                       d_bias32.as<float>(), N, IC, OC);
  // bf16 out: the separate pass adds the bias to the bf16-rounded product and rounds again, so
  // two bf16 roundings, within the same bound.
  cuda::linear_forward(ctx(), out16.as<Bf16>(), d_inp.as<Bf16>(), d_w.as<Bf16>(),
                       d_bias16.as<Bf16>(), N, IC, OC);
  unsetenv("KEEL_CUDA_EMU_CUBLASLT_NO_BIAS");
  EXPECT_TRUE(matches(get<float>(out32, ref.size()), ref, bf16_in_f32_out_rtol(IC)));
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(out16, ref.size())), ref, kBf16Rtol));
}

TEST_F(GemmTest, LinearBackwardBf16KeepsFp32ParameterGradients) {
  const auto inp = bf16_rounded(random_vec(kN * kIC, -1, 1, 50));
  const auto w = bf16_rounded(random_vec(kOC * kIC, -0.5f, 0.5f, 51));
  const auto dout = bf16_rounded(random_vec(kN * kOC, -1, 1, 52));
  const auto dinp0 = bf16_rounded(random_vec(kN * kIC, -1, 1, 53));
  const auto dw0 = random_vec(kOC * kIC, -1, 1, 54);
  const auto db0 = random_vec(kOC, -1, 1, 55);
  DeviceBuffer d_inp = cuda::upload(ctx(), to_bf16(inp)), d_w = cuda::upload(ctx(), to_bf16(w));
  DeviceBuffer d_dout = cuda::upload(ctx(), to_bf16(dout));
  for (bool accumulate : {false, true}) {
    DeviceBuffer d_dinp =
        accumulate ? cuda::upload(ctx(), to_bf16(dinp0)) : poisoned<Bf16>(kN * kIC);
    DeviceBuffer d_dw = cuda::upload(ctx(), dw0), d_db = cuda::upload(ctx(), db0);
    cuda::linear_backward(ctx(), d_dinp.as<Bf16>(), accumulate, d_dw.as<float>(), d_db.as<float>(),
                          d_dout.as<Bf16>(), d_inp.as<Bf16>(), d_w.as<Bf16>(), kN, kIC, kOC);
    std::vector<float> dinp = dinp0, dw = dw0, db = db0;
    kernels::linear_backward<float>(dinp.data(), accumulate, dw.data(), db.data(), dout.data(),
                                    inp.data(), w.data(), kN, kIC, kOC);
    EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dinp, dinp.size())), dinp, kBf16Rtol)) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_dw, dw.size()), dw, bf16_in_f32_out_rtol(kN))) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_db, db.size()), db, f32_rtol(kN))) << accumulate;
  }
}

TEST_F(GemmTest, BadShapesThrowNamingTheShape) {
  DeviceBuffer a = ctx().alloc(64 * sizeof(float));
  try {
    // lda 4 < K 8: the row does not fit
    cuda::gemm(ctx(), false, false, 4, 4, 8, 1.0f, a.data(), 4, a.data(), 4, 0.0f, a.data(), 4,
               DType::kF32, DType::kF32);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("M=4 N=4 K=8 lda=4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace keel::gpu_test
