// HostBuffer on CUDA (framework/device_backend.h): checkpoints copy device state into page-locked
// host memory (cudaMallocHost), which the runtime reports as host memory it registered, and a
// device-to-host copy into it round-trips bit for bit. The Context's asynchronous uploads
// through pinned staging (Note [pinned uploads] in framework/kernels/cuda/device.h) let the
// caller rewrite its source at once and never rewrite a slot before its copy ran (the emulator's
// deferred mode runs nothing until a wait, so a missing one shows). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

TEST(HostBufferCuda, AsyncUploadsTakeTheirSourceAtTheCallAndReuseSlotsSafely) {
  if (cuda::device_count() == 0) {
    GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
  }
  cuda::Context ctx(0);
  // More uploads than slots, of growing sizes (a slot grows while its old copy may be pending),
  // each from one host vector rewritten straight after the call, with nothing waiting between.
  constexpr int kUploads = 3 * static_cast<int>(cuda::Context::kUploadSlots) + 1;
  std::vector<cuda::DeviceBuffer> dst;
  std::vector<std::vector<int32_t>> want;
  std::vector<int32_t> src;
  for (int u = 0; u < kUploads; ++u) {
    const size_t n = 1000 + 257 * static_cast<size_t>(u);
    src.assign(n, 0);
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<int32_t>(u * 100000 + i);
    dst.push_back(ctx.alloc(n * sizeof(int32_t)));
    ctx.upload_async(dst.back().data(), src.data(), n * sizeof(int32_t));
    want.push_back(src);
    std::fill(src.begin(), src.end(), -1);  // the caller's buffer reused at once
  }
  for (int u = 0; u < kUploads; ++u) {
    EXPECT_EQ(cuda::download<int32_t>(ctx, dst[u].data(), want[u].size()), want[u])
        << "upload " << u;
  }
}

}  // namespace
}  // namespace keel::gpu_test
