// cuBLASLt GEMMs for the CUDA backend (see gemm.h). Row-major keel matrices are column-major
// matrices transposed, so C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T:
// cuBLASLt's first operand is keel's B and its second is keel's A, with M and N swapped. The bias
// epilogue then adds bias[i] to column-major row i, i.e. to keel's column i, as linear layers need.
#include "framework/kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/gemm_plan.h"
#include "framework/kernels/cuda/internal.h"

namespace keel::kernels::cuda {

const char* dtype_name(DType t) { return t == DType::kF32 ? "fp32" : "bf16"; }

namespace {

cudaDataType_t cuda_type(DType t) { return t == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

// Largest power of two (<= 256) dividing the address: cuBLASLt's heuristic must only return
// algorithms that accept pointers this aligned (its default assumes 256).
uint32_t alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

std::unique_ptr<GemmPlan> make_plan(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                    int64_t K, int64_t lda, int64_t ldb, int64_t ldc, DType ab,
                                    DType c, cublasComputeType_t compute, const void* bias,
                                    const uint32_t align[4], const std::string& shape) {
  auto plan = std::make_unique<GemmPlan>();
  KEEL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F), shape);
  // Column-major operands: first = keel's B, second = keel's A (see the file comment).
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  KEEL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &op_first, sizeof(op_first)),
                    shape);
  KEEL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &op_second, sizeof(op_second)),
                    shape);
  // Stored column-major shapes (rows, cols) of the operands before op().
  const uint64_t first_rows = trans_b ? K : N, first_cols = trans_b ? N : K;
  const uint64_t second_rows = trans_a ? M : K, second_cols = trans_a ? K : M;
  KEEL_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, cuda_type(ab), first_rows, first_cols, ldb), shape);
  KEEL_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, cuda_type(ab), second_rows, second_cols, lda), shape);
  KEEL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, cuda_type(c), N, M, ldc), shape);

  cublasLtMatmulPreference_t pref = nullptr;
  KEEL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), shape);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  // A split-K algorithm's in-place reduction would sum partial products in D's type: for a bf16 D,
  // only reductions in the compute type (fp32, in the workspace) keep "accumulate in fp32" true.
  const uint32_t reductions =
      c == DType::kBF16 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE : CUBLASLT_REDUCTION_SCHEME_MASK;
  for (int attempt = bias != nullptr ? 0 : 1; attempt < 2 && found == 0; ++attempt) {
    const bool with_bias = attempt == 0;
    const cublasLtEpilogue_t epi = with_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    const size_t ws = ctx.cublas_workspace_bytes();
    // First-operand alignment is B's, second is A's (the swap above).
    const uint32_t a_first = align[1], a_second = align[0], a_c = align[2];
    // The heuristic reads the bias pointer's alignment from the descriptor (cublasLt.h: routines
    // that do not dereference it "depend on its value to determine expected pointer alignment"):
    // the real one, or it picks an algorithm for a 256-byte-aligned bias. The plan is cached per
    // alignment (gemm's key), so later calls' biases are as aligned as this one.
    const bool ok =
        cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                       sizeof(epi)) == CUBLAS_STATUS_SUCCESS &&
        (!with_bias ||
         cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                        sizeof(bias)) == CUBLAS_STATUS_SUCCESS) &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &reductions,
                                             sizeof(reductions)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                             &a_first, sizeof(a_first)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             &a_second,
                                             sizeof(a_second)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a_c,
                                             sizeof(a_c)) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a_c,
                                             sizeof(a_c)) == CUBLAS_STATUS_SUCCESS;
    if (!ok) {
      cublasLtMatmulPreferenceDestroy(pref);
      KEEL_FAIL(kInternal, "cublasLt descriptor attributes rejected [", shape, "]");
    }
    status = cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), plan->desc, plan->a, plan->b, plan->c,
                                            plan->c, pref, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS) found = 0;
    plan->bias_epilogue = with_bias && found > 0;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) {
    detail::throw_cublas_error(
        status == CUBLAS_STATUS_SUCCESS ? CUBLAS_STATUS_NOT_SUPPORTED : status,
        "cublasLtMatmulAlgoGetHeuristic", shape + ": no algorithm", __FILE__, __LINE__);
  }
  plan->algo = result.algo;
  plan->workspace_bytes = result.workspaceSize;
  return plan;
}

}  // namespace

void gemm(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc,
          DType ab, DType c, const void* bias) {
  const cublasComputeType_t compute = ab == DType::kF32 && ctx.fp32_matmul() == Fp32Matmul::kTf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  const std::string shape = keel::detail::concat(
      "gemm ", trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', " M=", M, " N=", N, " K=", K, " lda=", lda,
      " ldb=", ldb, " ldc=", ldc, " ", dtype_name(ab), "->", dtype_name(c),
      compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? " tf32" : "", bias != nullptr ? " +bias" : "");
  KEEL_CHECK(M >= 0 && N >= 0 && K > 0, kUsage, "cuda ", shape, ": dimensions must be positive");
  KEEL_CHECK(!(ab == DType::kF32 && c == DType::kBF16), kUsage, "cuda ", shape,
             ": fp32 inputs with a bf16 output are not supported");
  KEEL_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N, kUsage, "cuda ",
             shape, ": a leading dimension is smaller than its row");
  if (M == 0 || N == 0) return;
  const uint32_t align[4] = {alignment(A), alignment(B), alignment(C), alignment(bias)};
  const std::string key = keel::detail::concat(shape, " ", compute, " al=", align[0], ",", align[1],
                                               ",", align[2], ",", align[3]);
  // The fused epilogue reads the bias with vector loads; a bias that is not 16-byte aligned (a
  // view into a larger buffer) takes the separate pass instead.
  const bool fuse_bias = bias != nullptr && align[3] >= 16;
  GemmPlan& plan = ctx.gemm_plan(key, [&] {
    return make_plan(ctx, trans_a, trans_b, M, N, K, lda, ldb, ldc, ab, c, compute,
                     fuse_bias ? bias : nullptr, align, shape);
  });
  if (plan.bias_epilogue) {
    KEEL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias, sizeof(bias)),
                      shape);
  }
  KEEL_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt(), plan.desc, &alpha, B, plan.a, A, plan.b, &beta,
                                   C, plan.c, C, plan.c, &plan.algo, ctx.cublas_workspace(),
                                   plan.workspace_bytes, ctx.stream()),
                    shape);
  // No fused-bias algorithm for this shape and alignment: add the bias in a second pass.
  if (bias != nullptr && !plan.bias_epilogue) add_bias_rows(ctx, C, bias, M, N, ldc, c);
}

void linear_forward(Context& ctx, float* out, const float* inp, const float* weight,
                    const float* bias, int64_t N, int64_t IC, int64_t OC) {
  gemm(ctx, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC, DType::kF32,
       DType::kF32, bias);
}

void linear_forward(Context& ctx, Bf16* out, const Bf16* inp, const Bf16* weight, const Bf16* bias,
                    int64_t N, int64_t IC, int64_t OC) {
  gemm(ctx, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC, DType::kBF16,
       DType::kBF16, bias);
}

void linear_forward(Context& ctx, float* out, const Bf16* inp, const Bf16* weight,
                    const float* bias, int64_t N, int64_t IC, int64_t OC) {
  gemm(ctx, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC, DType::kBF16,
       DType::kF32, bias);
}

namespace {
template <typename T>
void linear_backward_impl(Context& ctx, T* dinp, bool accumulate_dinp, float* dweight, float* dbias,
                          const T* dout, const T* inp, const T* weight, int64_t N, int64_t IC,
                          int64_t OC, DType ab) {
  if (dinp != nullptr) {
    gemm(ctx, false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, accumulate_dinp ? 1.0f : 0.0f,
         dinp, IC, ab, ab);
  }
  if (dweight != nullptr) {
    gemm(ctx, true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC, ab, DType::kF32);
  }
  if (dbias != nullptr) column_sum_add(ctx, dbias, dout, N, OC, OC);
}
}  // namespace

void linear_backward(Context& ctx, float* dinp, bool accumulate_dinp, float* dweight, float* dbias,
                     const float* dout, const float* inp, const float* weight, int64_t N,
                     int64_t IC, int64_t OC) {
  linear_backward_impl<float>(ctx, dinp, accumulate_dinp, dweight, dbias, dout, inp, weight, N, IC,
                              OC, DType::kF32);
}

void linear_backward(Context& ctx, Bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias,
                     const Bf16* dout, const Bf16* inp, const Bf16* weight, int64_t N, int64_t IC,
                     int64_t OC) {
  linear_backward_impl<Bf16>(ctx, dinp, accumulate_dinp, dweight, dbias, dout, inp, weight, N, IC,
                             OC, DType::kBF16);
}

}  // namespace keel::kernels::cuda
