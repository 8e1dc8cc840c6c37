// Tensors in CUDA memory (framework/device_backend.h through kernels::cuda::Context): zeros are
// zero even in a reused, poisoned block; host round trips, slices, device-to-device copies and
// to(); the caching allocator serves repeated allocations of one size without cudaMalloc; memory
// returns to the allocator when the last owner goes; a second Context takes over and hands back.
#include "framework/tensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "framework/device_backend.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

class TensorTest : public GpuTest {
 protected:
  std::vector<float> host_f32(const Tensor& t) {
    std::vector<float> v(t.numel());
    t.copy_to_host(0, t.numel(), v.data());
    return v;
  }
};

TEST_F(TensorTest, ZerosAreZeroEvenInAReusedPoisonedBlock) {
  const int64_t n = 1000;  // 4000 bytes: the same allocator bucket as the 64-byte-rounded tensor
  void* block = ctx().allocator().allocate(n * sizeof(float));
  ctx().fill_bytes(block, 0xFF, n * sizeof(float));
  ctx().allocator().deallocate(block);
  const int64_t hits = ctx().allocator().stats().cache_hits;

  Tensor t = Tensor::zeros({10, 100}, DType::kF32, Device::kCuda);
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_EQ(t.raw(), block) << "expected the cached block back";
  EXPECT_EQ(ctx().allocator().stats().cache_hits, hits + 1);
  EXPECT_TRUE(identical(host_f32(t), std::vector<float>(n, 0.0f)));
}

TEST_F(TensorTest, HostRoundTripSlicesAndZero) {
  const int64_t rows = 37, cols = 129;  // odd sizes: nothing lines up with a bucket
  const std::vector<float> src = random_vec(rows * cols, -2, 2, 11);
  Tensor t = Tensor::zeros({rows, cols}, DType::kF32, Device::kCuda);
  t.copy_from_host(0, t.numel(), src.data());
  EXPECT_TRUE(identical(host_f32(t), src));

  // Row 5 as a slice: reads and writes land at its offset.
  Tensor row = t.slice(5 * cols, {cols});
  EXPECT_EQ(row.f32(), t.f32() + 5 * cols);
  EXPECT_TRUE(
      identical(host_f32(row), std::vector<float>(src.begin() + 5 * cols, src.begin() + 6 * cols)));
  const std::vector<float> patch = random_vec(7, 3, 4, 12);
  row.copy_from_host(100, 7, patch.data());
  std::vector<float> expect = src;
  std::copy(patch.begin(), patch.end(), expect.begin() + 5 * cols + 100);
  EXPECT_TRUE(identical(host_f32(t), expect));

  t.slice(20 * cols, {2 * cols}).zero_();
  std::fill(expect.begin() + 20 * cols, expect.begin() + 22 * cols, 0.0f);
  EXPECT_TRUE(identical(host_f32(t), expect));
}

TEST_F(TensorTest, KernelsWriteThroughTheRawPointer) {
  Tensor t = Tensor::zeros({4096}, DType::kF32, Device::kCuda);
  cuda::fill_uniform(ctx(), t.f32(), t.numel(), 1.0f, 2.0f, 7);
  const std::vector<float> v = host_f32(t);
  for (float x : v) ASSERT_TRUE(x >= 1.0f && x < 2.0f) << x;
}

TEST_F(TensorTest, ToCopiesBetweenHostAndDeviceBitForBit) {
  // bf16 with an odd count (14 bytes) and i32, besides f32.
  Tensor h16 = Tensor::zeros({7}, DType::kBF16);
  const std::vector<Bf16> b = to_bf16(random_vec(7, -1, 1, 13));
  std::memcpy(h16.raw(), b.data(), h16.nbytes());
  Tensor hi = Tensor::zeros({3, 11}, DType::kI32);
  for (int i = 0; i < 33; ++i) hi.i32()[i] = i * 7919 - 100000;
  Tensor hf = Tensor::zeros({1000}, DType::kF32);
  const std::vector<float> f = random_vec(1000, -1, 1, 14);
  std::memcpy(hf.raw(), f.data(), hf.nbytes());

  for (const Tensor* h : {&h16, &hi, &hf}) {
    Tensor d = h->to(Device::kCuda);
    EXPECT_EQ(d.device(), Device::kCuda);
    EXPECT_EQ(d.shape(), h->shape());
    EXPECT_EQ(d.dtype(), h->dtype());
    Tensor d2 = d.to(Device::kCuda);  // device to device, on the stream
    EXPECT_NE(d2.raw(), d.raw());
    d.zero_();  // stream-ordered after the copy: d2 keeps the data
    Tensor back = d2.to(Device::kCpu);
    EXPECT_EQ(back.device(), Device::kCpu);
    EXPECT_EQ(std::memcmp(back.raw(), h->raw(), h->nbytes()), 0) << dtype_name(h->dtype());
    std::vector<unsigned char> zeroed(h->nbytes(), 1);
    d.copy_to_host(0, d.numel(), zeroed.data());
    EXPECT_EQ(zeroed, std::vector<unsigned char>(h->nbytes(), 0));
  }
}

TEST_F(TensorTest, RepeatedAllocationsOfOneSizeDoNotCallCudaMalloc) {
  const Shape shape = {256, 384};
  { Tensor warm = Tensor::zeros(shape, DType::kF32, Device::kCuda); }
  const cuda::AllocatorStats before = ctx().allocator().stats();
  const Tensor host = Tensor::zeros(shape, DType::kF32);
  for (int i = 0; i < 50; ++i) {
    Tensor t = Tensor::zeros(shape, DType::kF32, Device::kCuda);
    Tensor u = t.slice(384, {384});  // a slice shares the block: no allocation
    EXPECT_EQ(u.f32(), t.f32() + 384);
    if (i % 10 == 0) {
      // to() allocates a second block of the same size while t lives.
      Tensor c = host.to(Device::kCuda);
      EXPECT_EQ(c.device(), Device::kCuda);
    }
  }
  const cuda::AllocatorStats after = ctx().allocator().stats();
  // One more block for the loop's second live tensor at most, in its first iteration.
  EXPECT_LE(after.device_mallocs - before.device_mallocs, 1);
  EXPECT_GE(after.cache_hits - before.cache_hits, 50 + 5 - 1);
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
}

TEST_F(TensorTest, MemoryReturnsWhenTheLastOwnerGoes) {
  const int64_t base = ctx().allocator().stats().bytes_in_use;
  Tensor s;
  {
    Tensor t = Tensor::zeros({1 << 16}, DType::kF32, Device::kCuda);
    EXPECT_GE(ctx().allocator().stats().bytes_in_use - base, int64_t{4} << 16);
    s = t.slice(100, {10});
  }
  EXPECT_GT(ctx().allocator().stats().bytes_in_use, base) << "freed while a slice uses it";
  s = Tensor();
  EXPECT_EQ(ctx().allocator().stats().bytes_in_use, base);
}

TEST_F(TensorTest, ASecondContextTakesOverAndHandsBack) {
  const cuda::AllocatorStats mine = ctx().allocator().stats();
  Tensor orphan;
  {
    cuda::Context other(0);
    const int64_t other_base = other.allocator().stats().bytes_in_use;
    orphan = Tensor::zeros({5000}, DType::kF32, Device::kCuda);
    EXPECT_GT(other.allocator().stats().bytes_in_use, other_base);
    EXPECT_EQ(ctx().allocator().stats().bytes_in_use, mine.bytes_in_use);
    // Explicit registration makes the older Context current again, and back.
    cuda::register_memory_backend(ctx());
    Tensor t = Tensor::zeros({10}, DType::kF32, Device::kCuda);
    EXPECT_GT(ctx().allocator().stats().bytes_in_use, mine.bytes_in_use);
    t = Tensor();
    cuda::register_memory_backend(other);
  }
  // `other` is gone: its allocator freed every block, so releasing `orphan` is a no-op, and the
  // fixture's Context is current again.
  orphan = Tensor();
  Tensor t = Tensor::zeros({10}, DType::kF32, Device::kCuda);
  EXPECT_GT(ctx().allocator().stats().bytes_in_use, mine.bytes_in_use);
  EXPECT_TRUE(identical(host_f32(t), std::vector<float>(10, 0.0f)));
}

}  // namespace
}  // namespace keel::gpu_test
