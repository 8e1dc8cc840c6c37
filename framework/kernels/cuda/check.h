// The checked-call layer of the CUDA backend (internal: includes the CUDA headers). Every CUDA
// runtime and cuBLASLt call and every kernel launch goes through one of these macros; a failure
// throws keel::Error (kInternal) whose one-line message names the call, the status and the
// shapes it was given:
//   KEEL_CUDA_CHECK(cudaMemcpyAsync(...), "copy_to_host bytes=", n);
//   KEEL_CUBLAS_CHECK(cublasLtMatmul(...), "gemm M=", M, " N=", N, " K=", K);
//   kernel<<<grid, block, 0, stream>>>(...); KEEL_CUDA_LAUNCH_CHECK("norm_forward", "rows=", r);
// Launch errors are caught at the launch; faults inside a kernel surface at the next synchronising
// call. Setting KEEL_CUDA_SYNC_CHECK=1 in the environment synchronises after every launch so a
// fault is reported by the kernel that caused it (slow; for debugging). The "where" arguments are
// required (nvcc compiles C++17, which has no __VA_OPT__).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "framework/error.h"
#include "framework/kernels/cuda/device.h"

namespace keel::kernels::cuda::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const std::string& where,
                                   const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call,
                                     const std::string& where, const char* file, int line);
// cudaGetLastError after a launch (and a device synchronise under KEEL_CUDA_SYNC_CHECK=1).
void check_launch(const char* kernel, const std::string& where, const char* file, int line);

}  // namespace keel::kernels::cuda::detail

#define KEEL_CUDA_CHECK(call, ...)                                                            \
  do {                                                                                        \
    const cudaError_t keel_cuda_status_ = (call);                                             \
    if (keel_cuda_status_ != cudaSuccess) {                                                   \
      ::keel::kernels::cuda::detail::throw_cuda_error(                                        \
          keel_cuda_status_, #call, ::keel::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                         \
  } while (0)

#define KEEL_CUBLAS_CHECK(call, ...)                                                            \
  do {                                                                                          \
    const cublasStatus_t keel_cublas_status_ = (call);                                          \
    if (keel_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                         \
      ::keel::kernels::cuda::detail::throw_cublas_error(                                        \
          keel_cublas_status_, #call, ::keel::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)

#define KEEL_CUDA_LAUNCH_CHECK(kernel, ...)                                                \
  ::keel::kernels::cuda::detail::check_launch(kernel, ::keel::detail::concat(__VA_ARGS__), \
                                              __FILE__, __LINE__)
