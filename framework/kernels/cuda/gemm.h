// cuBLASLt matrix products of the CUDA backend, with the CPU backend's semantics
// (framework/kernels/gemm.h): row-major throughout, weights stored [out, in]. Device pointers;
// the work runs on ctx's stream. Plain C++ header (no CUDA headers).
//
// Precision: fp32 GEMMs follow ctx.fp32_matmul() (exact fp32 by default, or TF32). bf16 GEMMs take
// bf16 A and B, accumulate in fp32 and write bf16 or fp32 C; bias has C's type.
#pragma once

#include <cstdint>

#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"

namespace keel::kernels::cuda {

enum class DType { kF32, kBF16 };
const char* dtype_name(DType t);

// C[M, N] = alpha * op(A) @ op(B) + beta * C (+ bias[N] added to every row when bias is not
// null, fused into the GEMM as a cuBLASLt epilogue), row-major; op(X) = X or X^T. A and B have
// type ab, C and bias type c. Throws keel::Error naming the shapes when cuBLASLt refuses.
void gemm(Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc,
          DType ab, DType c, const void* bias = nullptr);

// forward: out[N, OC] = inp[N, IC] @ weight[OC, IC]^T + bias[OC]   (=; bias may be null)
void linear_forward(Context& ctx, float* out, const float* inp, const float* weight,
                    const float* bias, int64_t N, int64_t IC, int64_t OC);
void linear_forward(Context& ctx, Bf16* out, const Bf16* inp, const Bf16* weight, const Bf16* bias,
                    int64_t N, int64_t IC, int64_t OC);
void linear_forward(Context& ctx, float* out, const Bf16* inp, const Bf16* weight,
                    const float* bias, int64_t N, int64_t IC, int64_t OC);

// backward: dinp[N, IC] (= or += per accumulate_dinp; skipped when null) = dout @ weight
//           dweight[OC, IC] += dout^T @ inp;  dbias[OC] += column sums of dout (skipped if null)
// The bf16 form keeps fp32 parameter gradients (master weights): dweight and dbias are fp32.
void linear_backward(Context& ctx, float* dinp, bool accumulate_dinp, float* dweight, float* dbias,
                     const float* dout, const float* inp, const float* weight, int64_t N,
                     int64_t IC, int64_t OC);
void linear_backward(Context& ctx, Bf16* dinp, bool accumulate_dinp, float* dweight, float* dbias,
                     const Bf16* dout, const Bf16* inp, const Bf16* weight, int64_t N, int64_t IC,
                     int64_t OC);

// out[c] += sum_n x[n * ld + c] for c < C, in a fixed order (deterministic), fp32 accumulation.
void column_sum_add(Context& ctx, float* out, const float* x, int64_t N, int64_t C, int64_t ld);
void column_sum_add(Context& ctx, float* out, const Bf16* x, int64_t N, int64_t C, int64_t ld);

}  // namespace keel::kernels::cuda
