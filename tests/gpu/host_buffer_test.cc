// HostBuffer on CUDA (framework/device_backend.h): checkpoints copy device state into page-locked
// host memory (cudaMallocHost), which the runtime reports as host memory it registered, and a
// device-to-host copy into it round-trips bit for bit. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "framework/device_backend.h"
#include "framework/tensor.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

TEST(HostBufferCuda, IsPinnedAndTakesDeviceCopies) {
  if (cuda::device_count() == 0) {
    GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
  }
  cuda::Context ctx(0);  // registers the CUDA memory backend
  HostBuffer buf(Device::kCuda);
  float* h = buf.reserve(4096);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, h), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "not page-locked host memory";
  const std::vector<float> v = random_vec(4096, -1.0f, 1.0f, 3);
  Tensor t = Tensor::zeros({4096}, DType::kF32, Device::kCuda);
  t.copy_from_host(0, 4096, v.data());
  t.copy_to_host(0, 4096, h);
  EXPECT_TRUE(identical(std::vector<float>(h, h + 4096), v));
}

}  // namespace
}  // namespace keel::gpu_test
