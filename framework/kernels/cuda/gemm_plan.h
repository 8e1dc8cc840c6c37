// Internal: one cached cuBLASLt GEMM (descriptors and the heuristic's algorithm) per shape, dtype,
// epilogue and pointer alignment; owned by the Context's plan cache (device.h).
#pragma once

#include <cublasLt.h>

namespace keel::kernels::cuda {

struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool bias_epilogue = false;  // false: the heuristic found no bias-epilogue algorithm
  size_t workspace_bytes = 0;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace keel::kernels::cuda
