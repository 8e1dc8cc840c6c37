// CUDA backend entry points built so far: device discovery and the element-wise GELU pair,
// which share their per-element math (framework/kernels/elementwise.h) with the CPU backend.
// The rest of the backend (cuBLASLt GEMMs, cuDNN attention, NCCL) lands with the CUDA issue.
#include <cuda_runtime.h>

#include <cstdint>

#include "framework/kernels/cuda/device.h"
#include "framework/kernels/elementwise.h"

namespace keel::kernels::cuda {

namespace {
__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = gelu_scalar<float>(inp[i]);
}
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dinp[i] = dout[i] * gelu_grad_scalar<float>(inp[i]);
}
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

const char* last_error() { return cudaGetErrorString(cudaGetLastError()); }

bool gelu_roundtrip(const float* host_in, const float* host_dout, float* host_out, float* host_dinp,
                    int64_t n) {
  float *in = nullptr, *dout = nullptr, *out = nullptr, *dinp = nullptr;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  bool ok = cudaMalloc(&in, bytes) == cudaSuccess && cudaMalloc(&dout, bytes) == cudaSuccess &&
            cudaMalloc(&out, bytes) == cudaSuccess && cudaMalloc(&dinp, bytes) == cudaSuccess;
  if (ok) {
    ok = cudaMemcpy(in, host_in, bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(dout, host_dout, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  if (ok) {
    const int threads = 256;
    const int blocks = static_cast<int>((n + threads - 1) / threads);
    gelu_forward_kernel<<<blocks, threads>>>(out, in, n);
    gelu_backward_kernel<<<blocks, threads>>>(dinp, in, dout, n);
    ok = cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpy(host_out, out, bytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
         cudaMemcpy(host_dinp, dinp, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  cudaFree(in);
  cudaFree(dout);
  cudaFree(out);
  cudaFree(dinp);
  return ok;
}

}  // namespace keel::kernels::cuda
