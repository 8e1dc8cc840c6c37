// tests/gpu/kernel_table.h, the CPU half of keel-gpu-train-bench --kernel-table, on synthetic
// records: names as CUPTI reports them (nvcc's mangled names, cuBLASLt's and cuDNN's) grouped
// into the roofline estimate's rows, the per-kernel sums, the busy time of overlapping records,
// and the printed table. Needs no GPU (it runs in keel_cuda_emu_tests on every tests/run).
#include "tests/gpu/kernel_table.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace keel::kernel_table {
namespace {

using Kind = Record::Kind;

// nvcc's names for two of keel's kernels (from libkeel_cuda.a): a template in nvcc's per-file
// anonymous namespace, and a plain function.
constexpr const char* kNormForward =
    "_ZN4keel7kernels4cuda39_GLOBAL__N__bf14dd84_7_norm_cu_ddeda19519norm_forward_kernelIffEEvNS0_"
    "6NormOpENS0_9NormShapeEPT_PKT0_PKfSC_PfSD_f";
constexpr const char* kToBf16 =
    "_ZN4keel7kernels4cuda39_GLOBAL__N__f4b8ec91_7_cast_cu_80a65af714to_bf16_kernelEP13__nv_"
    "bfloat16lPKflll";

TEST(KernelTableTest, DemanglesAndKeepsPlainNames) {
  EXPECT_EQ(demangle(kToBf16),
            "keel::kernels::cuda::(anonymous namespace)::to_bf16_kernel(__nv_bfloat16*, long, "
            "float const*, long, long, long)");
  EXPECT_EQ(demangle("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"),
            "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT");
  EXPECT_EQ(demangle("_Znot a mangled name"), "_Znot a mangled name");
}

TEST(KernelTableTest, NamesWithoutReturnTypeParametersNamespacesAndTemplates) {
  EXPECT_EQ(qualified_name("void a::(anonymous namespace)::f<float, (int)3>(float*, int)"),
            "a::(anonymous namespace)::f<float, (int)3>");
  EXPECT_EQ(function_name("a::(anonymous namespace)::f<float, (int)3>"), "f");
  EXPECT_EQ(function_name("a::Outer<b::C>::inner"), "inner");
  EXPECT_EQ(function_name("plain_kernel"), "plain_kernel");
}

TEST(KernelTableTest, GroupsLikeTheEstimatesRows) {
  EXPECT_EQ(group_kernel(kNormForward), "norm_forward_kernel");
  EXPECT_EQ(group_kernel(kToBf16), "to_bf16_kernel");
  // cuBLASLt's GEMMs, whatever their generation.
  for (const char* gemm :
       {"nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
        "segment_k_off_kernel__5x_cublas",
        "_ZN8cublasLt19splitKreduce_kernelEv",
        "_ZN7cutlass7Kernel2I52cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_tnEEvNT_"
        "6ParamsE"}) {
    EXPECT_EQ(group_kernel(gemm), "cublasLtMatmul") << gemm;
  }
  // cuDNN's fused attention, by direction where the name says it.
  EXPECT_EQ(
      group_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_"
                   "4x1x1_kernel0_0"),
      "cuDNN SDPA forward");
  EXPECT_EQ(
      group_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x64_"
                   "4x1x1_cga1x1x1_kernel0_0"),
      "cuDNN SDPA backward");
  EXPECT_EQ(group_kernel("cudnn_generated_fort_native_sdpa_sm90_knob_2_kernel0_0"), "cuDNN SDPA");
  // keel's own kernels stay keel's even when their names hold a library's word.
  EXPECT_EQ(group_kernel("_ZN4keel7kernels4cuda11gemm_kernelEv"), "gemm_kernel");
  // Anything else: the demangled name without `void` and parameters.
  EXPECT_EQ(group_kernel("_ZN3foo3barIiEEvPi"), "foo::bar<int>");
  EXPECT_EQ(group({Kind::kMemcpy, "HtoD", 1, 2}), "memcpy HtoD");
  EXPECT_EQ(group({Kind::kMemset, "", 1, 2}), "memset");
}

TEST(KernelTableTest, SumsPerRowLargestFirstWithTheBusyUnion) {
  const std::vector<Record> records = {
      {Kind::kKernel, kNormForward, 1000, 4000},              // 3 us
      {Kind::kKernel, "nvjet_tst_a", 4000, 14000},            // 10 us
      {Kind::kKernel, kNormForward, 14000, 17000},            // 3 us
      {Kind::kKernel, "sm90_xmma_gemm_b", 15000, 19000},      // 4 us, overlapping 2 us
      {Kind::kMemset, "", 30000, 31000},                      // 1 us after a gap
      {Kind::kKernel, "cudnn_generated_sdpa_fprop_k", 0, 0},  // untimed
  };
  const Table t = aggregate(records);
  ASSERT_EQ(t.rows.size(), 4u);
  EXPECT_EQ(t.rows[0].name, "cublasLtMatmul");
  EXPECT_EQ(t.rows[0].launches, 2);
  EXPECT_EQ(t.rows[0].total_ns, 14000u);
  EXPECT_EQ(t.rows[1].name, "norm_forward_kernel");
  EXPECT_EQ(t.rows[1].launches, 2);
  EXPECT_EQ(t.rows[1].total_ns, 6000u);
  EXPECT_EQ(t.rows[2].name, "memset");
  EXPECT_EQ(t.rows[3].name, "cuDNN SDPA forward");
  EXPECT_EQ(t.rows[3].launches, 1);
  EXPECT_EQ(t.rows[3].total_ns, 0u);
  EXPECT_EQ(t.launches, 6);
  EXPECT_EQ(t.untimed, 1);
  EXPECT_EQ(t.total_ns, 21000u);
  EXPECT_EQ(t.busy_ns, 19000u);  // [1000, 19000) and [30000, 31000)
}

TEST(KernelTableTest, PrintsPerStepRowsAndATotal) {
  std::vector<Record> records;
  for (int step = 0; step < 2; ++step) {
    const uint64_t at = 1000000ull * step;
    records.push_back({Kind::kKernel, "nvjet_tst_a", at, at + 500000});     // 500 us
    records.push_back({Kind::kKernel, kToBf16, at + 500000, at + 600000});  // 100 us
    records.push_back({Kind::kKernel, kToBf16, at + 600000, at + 700000});
  }
  records.push_back({Kind::kKernel, std::string(80, 'x'), 5000000, 5002000});
  const std::string out = format_table(aggregate(records), 2);
  EXPECT_NE(out.find("  kernel "), std::string::npos) << out;
  // Per step: 1 GEMM of 500 us and 2 casts of 100 us; the odd kernel once in the 2 steps.
  EXPECT_NE(out.find("  cublasLtMatmul" + std::string(46, ' ') +
                     "         1      0.500     500.00   71.3%\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("  to_bf16_kernel" + std::string(46, ' ') +
                     "         2      0.200     100.00   28.5%\n"),
            std::string::npos)
      << out;
  // An odd launch count per step, and a long name cut to 60 characters.
  EXPECT_NE(out.find("  " + std::string(57, 'x') + "...       0.5      0.001       2.00    0.1%\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("  total" + std::string(55, ' ') + "       3.5      0.701\n"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace keel::kernel_table
