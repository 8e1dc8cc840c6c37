// The device memory dispatch point (framework/device_backend.h): the built-in CPU backend, a fake
// Device::kCuda backend (host memory, counting calls) proving that Tensor's allocation, zero fill,
// copies, slices and to() go through the registered backend, and the error for a device with no
// backend. No GPU needed; the real CUDA backend is tested in tests/gpu/tensor_test.cc.
#include "framework/device_backend.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "framework/error.h"
#include "framework/tensor.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using keel::testing::error_of;

// Host memory posing as a device: allocations are filled with 0xAB (so a missing zero fill
// shows), every call is counted and the last call's arguments kept.
class FakeDeviceBackend final : public DeviceBackend {
 public:
  struct Calls {
    int allocate = 0, deallocate = 0, zero = 0, to_host = 0, from_host = 0, on_device = 0,
        synchronize = 0;
  };
  Calls calls;
  const void* last_ptr = nullptr;  // the device-side pointer of the last zero or copy
  size_t last_bytes = 0;
  std::map<void*, size_t> live;  // block -> bytes

  ~FakeDeviceBackend() override {
    for (auto& [p, bytes] : live) std::free(p);
  }
  void* allocate(size_t bytes) override {
    ++calls.allocate;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    std::memset(p, 0xAB, bytes);
    live.emplace(p, bytes);
    last_bytes = bytes;
    return p;
  }
  void deallocate(void* ptr) noexcept override {
    ++calls.deallocate;
    if (live.erase(ptr) == 1) std::free(ptr);
  }
  void zero(void* ptr, size_t bytes) override {
    ++calls.zero;
    record(ptr, bytes);
    std::memset(ptr, 0, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    ++calls.to_host;
    record(src, bytes);
    std::memcpy(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    ++calls.from_host;
    record(dst, bytes);
    std::memcpy(dst, src, bytes);
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    ++calls.on_device;
    record(dst, bytes);
    std::memcpy(dst, src, bytes);
  }
  void synchronize() override { ++calls.synchronize; }
  void* allocate_host(size_t bytes) override {
    ++host_allocations;
    host_bytes = bytes;
    return DeviceBackend::allocate_host(bytes);
  }
  void free_host(void* ptr) noexcept override {
    ++host_frees;
    DeviceBackend::free_host(ptr);
  }
  int host_allocations = 0, host_frees = 0;
  size_t host_bytes = 0;

  // Whether `p` lies inside a block this backend handed out and has not taken back.
  bool owns(const void* p) const {
    for (const auto& [b, bytes] : live) {
      if (p >= b && p < static_cast<const char*>(b) + bytes) return true;
    }
    return false;
  }

 private:
  void record(const void* ptr, size_t bytes) {
    last_ptr = ptr;
    last_bytes = bytes;
  }
};

// Registers a fresh fake for Device::kCuda and restores whatever was there before, so no other
// test sees it.
class FakeDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_ = std::make_shared<FakeDeviceBackend>();
    previous_ = set_device_backend(Device::kCuda, fake_);
  }
  void TearDown() override {
    std::shared_ptr<DeviceBackend> mine = set_device_backend(Device::kCuda, previous_);
    EXPECT_EQ(mine, fake_) << "the registry changed under the test";
  }
  FakeDeviceBackend& fake() { return *fake_; }

 private:
  std::shared_ptr<FakeDeviceBackend> fake_;
  std::shared_ptr<DeviceBackend> previous_;
};

std::vector<float> iota_floats(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

TEST(CpuBackend, IsBuiltInAndCannotBeReplaced) {
  EXPECT_TRUE(has_device_backend(Device::kCpu));
  const std::string msg = error_of(ErrorKind::kInternal, [] {
    set_device_backend(Device::kCpu, std::make_shared<FakeDeviceBackend>());
  });
  EXPECT_NE(msg.find("CPU backend is built in"), std::string::npos) << msg;
  EXPECT_STREQ(device_name(Device::kCpu), "CPU");
  EXPECT_STREQ(device_name(Device::kCuda), "CUDA");
}

TEST(CpuBackend, TensorsAreAlignedZeroFilledAndCopyThroughTheHost) {
  // 13 floats = 52 bytes: the allocation is one 64-byte line, padding zeroed too.
  Tensor t = Tensor::zeros({13});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  const auto* bytes = static_cast<const unsigned char*>(t.raw());
  for (int i = 0; i < 64; ++i) ASSERT_EQ(bytes[i], 0) << "byte " << i;

  const std::vector<float> src = iota_floats(13, 1.5f);
  t.copy_from_host(0, 13, src.data());
  std::vector<float> back(5, -1.0f);
  t.copy_to_host(4, 5, back.data());
  EXPECT_EQ(back, std::vector<float>(src.begin() + 4, src.begin() + 9));

  // A slice shares the memory; zero_ on it clears only its elements.
  Tensor s = t.slice(3, {4});
  EXPECT_EQ(s.f32(), t.f32() + 3);
  s.zero_();
  for (int i = 0; i < 13; ++i) EXPECT_EQ(t.f32()[i], (i >= 3 && i < 7) ? 0.0f : src[i]) << i;

  // to(kCpu) is an owning copy.
  Tensor c = t.to(Device::kCpu);
  EXPECT_TRUE(c.owning());
  EXPECT_NE(c.raw(), t.raw());
  EXPECT_EQ(std::memcmp(c.raw(), t.raw(), t.nbytes()), 0);
  c.f32()[0] = 99.0f;
  EXPECT_EQ(t.f32()[0], src[0]);
}

TEST(DeviceRegistry, UnregisteredDeviceIsAOneLineErrorNamingIt) {
  std::shared_ptr<DeviceBackend> previous = set_device_backend(Device::kCuda, nullptr);
  EXPECT_FALSE(has_device_backend(Device::kCuda));
  std::string msg =
      error_of(ErrorKind::kInternal, [] { Tensor::zeros({4}, DType::kF32, Device::kCuda); });
  EXPECT_NE(msg.find("Tensor::zeros"), std::string::npos) << msg;
  EXPECT_NE(msg.find("device CUDA"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no CUDA backend in this binary"), std::string::npos) << msg;
  // A view of (pretend) device memory has no backend to copy through either.
  float dummy[4] = {};
  Tensor v = Tensor::view_of(dummy, {4}, DType::kF32, Device::kCuda);
  msg = error_of(ErrorKind::kInternal, [&] {
    float out[4];
    v.copy_to_host(0, 4, out);
  });
  EXPECT_NE(msg.find("Tensor::copy_to_host"), std::string::npos) << msg;
  msg = error_of(ErrorKind::kInternal, [&] { v.zero_(); });
  EXPECT_NE(msg.find("Tensor::zero_"), std::string::npos) << msg;
  set_device_backend(Device::kCuda, previous);
}

TEST_F(FakeDeviceTest, ZerosAllocatesAndZeroFillsThroughTheBackend) {
  {
    Tensor t = Tensor::zeros({3, 5}, DType::kF32, Device::kCuda);  // 60 bytes -> one 64-byte line
    EXPECT_EQ(t.device(), Device::kCuda);
    EXPECT_TRUE(t.owning());
    EXPECT_EQ(fake().calls.allocate, 1);
    EXPECT_TRUE(fake().owns(t.raw()));
    EXPECT_EQ(fake().calls.zero, 1);
    EXPECT_EQ(fake().last_ptr, t.raw());
    EXPECT_EQ(fake().last_bytes, 64u);
    std::vector<float> host(15, -1.0f);
    t.copy_to_host(0, 15, host.data());
    EXPECT_EQ(host, std::vector<float>(15, 0.0f));  // 0xAB garbage unless zero() ran
    EXPECT_EQ(fake().calls.to_host, 1);
    EXPECT_EQ(fake().calls.deallocate, 0);
  }
  EXPECT_EQ(fake().calls.deallocate, 1);
  EXPECT_TRUE(fake().live.empty());
}

TEST_F(FakeDeviceTest, StorageGoesBackWhenTheLastOwnerGoes) {
  Tensor s;
  {
    Tensor t = Tensor::zeros({100}, DType::kI32, Device::kCuda);
    s = t.slice(10, {20});
  }
  EXPECT_EQ(fake().calls.deallocate, 0) << "freed while a slice still uses it";
  EXPECT_TRUE(fake().owns(s.raw()));
  s = Tensor();
  EXPECT_EQ(fake().calls.deallocate, 1);
  EXPECT_TRUE(fake().live.empty());
}

TEST_F(FakeDeviceTest, CopiesZeroAndSlicesUseTheBackendAtTheRightOffsets) {
  Tensor t = Tensor::zeros({4, 8}, DType::kF32, Device::kCuda);
  const std::vector<float> src = iota_floats(32, 1.0f);
  t.copy_from_host(0, 32, src.data());
  EXPECT_EQ(fake().calls.from_host, 1);
  EXPECT_EQ(fake().last_ptr, t.raw());
  EXPECT_EQ(fake().last_bytes, 32 * sizeof(float));

  // Row 2 as a slice: copies land 16 elements in.
  Tensor row = t.slice(16, {8});
  EXPECT_EQ(row.device(), Device::kCuda);
  std::vector<float> got(3);
  row.copy_to_host(2, 3, got.data());
  EXPECT_EQ(fake().last_ptr, t.f32() + 18);
  EXPECT_EQ(fake().last_bytes, 3 * sizeof(float));
  EXPECT_EQ(got, (std::vector<float>{19.0f, 20.0f, 21.0f}));

  const std::vector<float> two = {-7.0f, -8.0f};
  row.copy_from_host(6, 2, two.data());
  EXPECT_EQ(fake().last_ptr, t.f32() + 22);

  row.zero_();
  EXPECT_EQ(fake().calls.zero, 2);  // zeros() and this one
  EXPECT_EQ(fake().last_ptr, row.raw());
  EXPECT_EQ(fake().last_bytes, 8 * sizeof(float));

  std::vector<float> all(32);
  t.copy_to_host(0, 32, all.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(all[i], (i >= 16 && i < 24) ? 0.0f : src[i]) << i;

  // Empty copies do not reach the backend.
  const int before = fake().calls.to_host;
  t.copy_to_host(5, 0, all.data());
  EXPECT_EQ(fake().calls.to_host, before);
}

TEST_F(FakeDeviceTest, ToCopiesBetweenHostAndDeviceThroughTheBackend) {
  Tensor host = Tensor::zeros({2, 3}, DType::kF64);
  for (int i = 0; i < 6; ++i) host.f64()[i] = 0.25 * (i + 1);

  Tensor dev = host.to(Device::kCuda);
  EXPECT_EQ(dev.device(), Device::kCuda);
  EXPECT_EQ(dev.shape(), host.shape());
  EXPECT_EQ(dev.dtype(), DType::kF64);
  EXPECT_EQ(fake().calls.allocate, 1);
  EXPECT_EQ(fake().calls.from_host, 1);
  EXPECT_EQ(fake().last_ptr, dev.raw());
  EXPECT_EQ(fake().last_bytes, 6 * sizeof(double));

  Tensor dev2 = dev.to(Device::kCuda);  // device to device
  EXPECT_EQ(fake().calls.allocate, 2);
  EXPECT_EQ(fake().calls.on_device, 1);
  EXPECT_EQ(fake().last_ptr, dev2.raw());
  EXPECT_NE(dev2.raw(), dev.raw());

  Tensor back = dev2.to(Device::kCpu);
  EXPECT_EQ(back.device(), Device::kCpu);
  EXPECT_EQ(fake().calls.to_host, 1);
  EXPECT_EQ(fake().calls.allocate, 2);  // the host copy is CPU memory
  EXPECT_FALSE(fake().owns(back.raw()));
  EXPECT_EQ(std::memcmp(back.raw(), host.raw(), host.nbytes()), 0);
}

TEST_F(FakeDeviceTest, MemoryGoesBackToTheBackendThatAllocatedIt) {
  Tensor t = Tensor::zeros({8}, DType::kF32, Device::kCuda);
  // Another backend takes over; t's memory must still go back to the first one.
  auto other = std::make_shared<FakeDeviceBackend>();
  std::shared_ptr<DeviceBackend> mine = set_device_backend(Device::kCuda, other);
  EXPECT_EQ(mine.get(), &fake());
  EXPECT_FALSE(replace_device_backend_if(Device::kCuda, &fake(), nullptr)) << "not current";
  t = Tensor();
  EXPECT_EQ(fake().calls.deallocate, 1);
  EXPECT_EQ(other->calls.deallocate, 0);
  EXPECT_TRUE(replace_device_backend_if(Device::kCuda, other.get(), mine));
  EXPECT_EQ(device_backend(Device::kCuda, "test").get(), &fake());
}

// Checkpoints copy device state into HostBuffers: the device's allocate_host (pinned memory on
// CUDA), grown only when a larger request comes, released once when the buffer goes.
TEST_F(FakeDeviceTest, HostBufferComesFromTheDevicesHostAllocatorAndGrowsOnlyWhenNeeded) {
  {
    HostBuffer buf(Device::kCuda);
    float* a = buf.reserve(100);
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
    EXPECT_EQ(fake().host_allocations, 1);
    EXPECT_EQ(fake().host_bytes, 100 * sizeof(float));
    for (int i = 0; i < 100; ++i) a[i] = static_cast<float>(i);  // host memory: writable
    EXPECT_EQ(buf.reserve(60), a);                               // smaller: the same block
    EXPECT_EQ(fake().host_allocations, 1);
    buf.reserve(1000);  // larger: a new block, the old one freed
    EXPECT_EQ(fake().host_allocations, 2);
    EXPECT_EQ(fake().host_frees, 1);
  }
  EXPECT_EQ(fake().host_frees, 2);
  EXPECT_EQ(fake().calls.allocate, 0) << "a host buffer took device memory";
}

}  // namespace
}  // namespace keel
