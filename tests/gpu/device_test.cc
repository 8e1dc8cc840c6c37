// The CUDA backend's device layer on a GPU: the caching allocator reuses blocks (no cudaMalloc in
// steady state, also across kernels that use the context's scratch and cuBLASLt plans), copies
// round-trip, and failed calls throw keel::Error naming the call.
#include "framework/kernels/cuda/device.h"

#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;

class DeviceTest : public GpuTest {};

TEST_F(DeviceTest, DescribesTheDevice) {
  const std::string d = cuda::device_description(0);
  EXPECT_NE(d.find("sm_"), std::string::npos) << d;
  std::cout << "[          ] device 0: " << d << "\n";
}

TEST_F(DeviceTest, AllocatorReusesBlocks) {
  cuda::Allocator& a = ctx().allocator();
  const std::vector<size_t> sizes = {1, 512, 513, 4000, 1 << 20, (1 << 20) + 7, 3 << 22};
  const auto round = [&] {
    std::vector<void*> blocks;
    for (size_t s : sizes) blocks.push_back(a.allocate(s));
    for (void* p : blocks) a.deallocate(p);
  };
  round();
  const cuda::AllocatorStats first = a.stats();
  for (int i = 0; i < 10; ++i) round();
  const cuda::AllocatorStats later = a.stats();
  EXPECT_EQ(later.device_mallocs, first.device_mallocs) << "cudaMalloc in steady state";
  EXPECT_EQ(later.cache_hits - first.cache_hits, static_cast<int64_t>(10 * sizes.size()));
  EXPECT_EQ(later.bytes_in_use, first.bytes_in_use);
  // Blocks are at least as large as asked, and 256-byte aligned.
  for (size_t s : sizes) {
    void* p = a.allocate(s);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
    EXPECT_GE(cuda::Allocator::bucket_size(s), s);
    a.deallocate(p);
  }
  // release_cached returns the cache to the device.
  const int64_t cached = a.stats().bytes_cached;
  EXPECT_GT(cached, 0);
  a.release_cached();
  EXPECT_EQ(a.stats().bytes_cached, 0);
  EXPECT_GT(a.stats().device_frees, 0);
}

TEST_F(DeviceTest, TrainingLikeStepsDoNotCallCudaMallocAfterTheFirst) {
  const int64_t N = 256, C = 128, OC = 384, V = 1000;
  const auto step = [&] {
    DeviceBuffer x = ctx().alloc(N * C * sizeof(float)), w = ctx().alloc(OC * C * sizeof(float));
    DeviceBuffer y = ctx().alloc(N * OC * sizeof(float));
    DeviceBuffer tok = ctx().alloc(N * sizeof(int32_t)), table = ctx().alloc(V * C * sizeof(float));
    cuda::fill_uniform(ctx(), x.as<float>(), N * C, -1, 1, 1);
    cuda::fill_uniform(ctx(), w.as<float>(), OC * C, -1, 1, 2);
    ctx().fill_bytes(tok.data(), 0, N * sizeof(int32_t));  // token 0 everywhere: one long run
    cuda::linear_forward(ctx(), y.as<float>(), x.as<float>(), w.as<float>(), nullptr, N, C, OC);
    cuda::embedding_backward(ctx(), table.as<float>(), x.as<float>(), tok.as<int32_t>(), N, 0, V,
                             C);  // uses the context's scratch
    DeviceBuffer norm = ctx().alloc(sizeof(double));
    cuda::sum_squares(ctx(), y.as<float>(), N * OC, norm.as<double>(), false);
    ctx().synchronize();
  };
  step();
  const int64_t mallocs = ctx().allocator().stats().device_mallocs;
  for (int i = 0; i < 5; ++i) step();
  EXPECT_EQ(ctx().allocator().stats().device_mallocs, mallocs);
}

TEST_F(DeviceTest, CopiesRoundTrip) {
  const auto host = random_vec(12345, -1, 1, 60);
  DeviceBuffer a = cuda::upload(ctx(), host);
  DeviceBuffer b = poisoned<float>(host.size());
  ctx().copy_device_to_device(b.data(), a.data(), host.size() * sizeof(float));
  EXPECT_TRUE(identical(get<float>(b, host.size()), host));
}

TEST_F(DeviceTest, FailedCallsThrowNamingTheCall) {
  // An invalid device id: cudaSetDevice fails and says so.
  try {
    cuda::Context bad(cuda::device_count());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaSetDevice"), std::string::npos) << e.what();
  }
  // An impossible allocation: cudaMalloc fails, the message names the request.
  try {
    ctx().allocator().allocate(size_t{1} << 50);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMalloc"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1125899906842624 bytes"), std::string::npos) << e.what();
  }
  // The context still works afterwards.
  DeviceBuffer ok = cuda::upload(ctx(), std::vector<float>{1.5f, -2.5f});
  EXPECT_EQ(get<float>(ok, 2)[1], -2.5f);
}

}  // namespace
}  // namespace keel::gpu_test
