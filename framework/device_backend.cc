// The device memory registry and the built-in CPU backend (see device_backend.h).
#include "framework/device_backend.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "framework/error.h"

namespace keel {

const char* device_name(Device device) {
  switch (device) {
    case Device::kCpu:
      return "CPU";
    case Device::kCuda:
      return "CUDA";
  }
  return "?";
}

void* DeviceBackend::allocate_host(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  KEEL_CHECK(p != nullptr, kInternal, "out of memory allocating ", rounded,
             " bytes of host memory");
  return p;
}

void DeviceBackend::free_host(void* ptr) noexcept { std::free(ptr); }

HostBuffer::HostBuffer(Device device) : backend_(device_backend(device, "a host buffer")) {}

HostBuffer::~HostBuffer() {
  if (data_ != nullptr) backend_->free_host(data_);
}

float* HostBuffer::reserve(size_t n) {
  KEEL_ASSERT(backend_ != nullptr);
  if (n > capacity_) {
    if (data_ != nullptr) backend_->free_host(data_);
    data_ = nullptr;
    capacity_ = 0;
    data_ = static_cast<float*>(backend_->allocate_host(n * sizeof(float)));
    capacity_ = n;
  }
  return data_;
}

namespace {

// Host memory: 64-byte aligned (a cache line, and the widest SIMD load) and synchronous.
class CpuBackend final : public DeviceBackend {
 public:
  void* allocate(size_t bytes) override {
    // aligned_alloc wants a multiple of the alignment.
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    KEEL_CHECK(p != nullptr, kInternal, "out of memory allocating ", rounded, " bytes");
    return p;
  }
  void deallocate(void* ptr) noexcept override { std::free(ptr); }
  void zero(void* ptr, size_t bytes) override {
    if (bytes > 0) std::memset(ptr, 0, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void synchronize() override {}
};

// Never destroyed: Tensors in other statics may be freed after this file's statics are gone.
const std::shared_ptr<DeviceBackend>& cpu_backend() {
  static const auto* backend = new std::shared_ptr<DeviceBackend>(std::make_shared<CpuBackend>());
  return *backend;
}

struct Registry {
  std::mutex mu;
  std::shared_ptr<DeviceBackend> cuda;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed, for the same reason as cpu_backend()
  return *r;
}

}  // namespace

std::shared_ptr<DeviceBackend> device_backend(Device device, const char* what) {
  // The CPU slot never changes: no lock on the host path.
  if (device == Device::kCpu) return cpu_backend();
  Registry& r = registry();
  std::shared_ptr<DeviceBackend> backend;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    backend = r.cuda;
  }
  KEEL_CHECK(backend != nullptr, kInternal, what, ": no memory backend for device ",
             device_name(device),
             " (no CUDA backend in this binary, or CUDA backend not initialised: no "
             "kernels::cuda::Context exists)");
  return backend;
}

bool has_device_backend(Device device) {
  if (device == Device::kCpu) return true;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.cuda != nullptr;
}

std::shared_ptr<DeviceBackend> set_device_backend(Device device,
                                                  std::shared_ptr<DeviceBackend> backend) {
  KEEL_CHECK(device != Device::kCpu, kInternal,
             "set_device_backend: the CPU backend is built in and cannot be replaced");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return std::exchange(r.cuda, std::move(backend));
}

bool replace_device_backend_if(Device device, const DeviceBackend* expected,
                               std::shared_ptr<DeviceBackend> backend) {
  KEEL_CHECK(device != Device::kCpu, kInternal,
             "replace_device_backend_if: the CPU backend is built in and cannot be replaced");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.cuda.get() != expected) return false;
  r.cuda = std::move(backend);
  return true;
}

}  // namespace keel
