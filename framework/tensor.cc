// Tensor storage and views; memory comes from, and goes back to, the device's backend
// (framework/device_backend.h).
#include "framework/tensor.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "framework/error.h"

namespace keel {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF64:
      return 8;
    case DType::kI32:
      return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF64:
      return "f64";
    case DType::kI32:
      return "i32";
  }
  return "?";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  for (int64_t d : shape) KEEL_CHECK(d >= 0, kInternal, "negative dimension in ", shape_str(shape));
  std::shared_ptr<DeviceBackend> backend = device_backend(device, "Tensor::zeros");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  // Whole 64-byte lines, padding zeroed too, so kernels that read a full last vector see zeros.
  const size_t bytes = (std::max<size_t>(t.nbytes(), 1) + 63) / 64 * 64;
  void* p = backend->allocate(bytes);
  // The deleter holds the backend: the block goes back to the allocator that made it even if the
  // registry has changed since.
  t.storage_ = std::shared_ptr<void>(p, [backend](void* q) { backend->deallocate(q); });
  t.backend_ = backend;
  t.data_ = p;
  backend->zero(p, bytes);
  return t;
}

Tensor Tensor::view_of(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

float* Tensor::f32() const {
  KEEL_ASSERT(dtype_ == DType::kF32);
  return static_cast<float*>(data_);
}
int32_t* Tensor::i32() const {
  KEEL_ASSERT(dtype_ == DType::kI32);
  return static_cast<int32_t*>(data_);
}
double* Tensor::f64() const {
  KEEL_ASSERT(dtype_ == DType::kF64);
  return static_cast<double*>(data_);
}

std::shared_ptr<DeviceBackend> Tensor::backend(const char* what) const {
  return backend_ ? backend_ : device_backend(device_, what);
}

Tensor Tensor::slice(int64_t offset, Shape shape) const {
  KEEL_ASSERT(offset >= 0 && offset + shape_numel(shape) <= numel());
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + offset * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::copy_to_host(int64_t offset, int64_t n, void* dst) const {
  KEEL_ASSERT(offset >= 0 && n >= 0 && offset + n <= numel());
  if (n == 0) return;
  const size_t es = dtype_size(dtype_);
  backend("Tensor::copy_to_host")
      ->copy_to_host(dst, static_cast<const char*>(data_) + offset * es, n * es);
}

void Tensor::copy_from_host(int64_t offset, int64_t n, const void* src) const {
  KEEL_ASSERT(offset >= 0 && n >= 0 && offset + n <= numel());
  if (n == 0) return;
  const size_t es = dtype_size(dtype_);
  backend("Tensor::copy_from_host")
      ->copy_from_host(static_cast<char*>(data_) + offset * es, src, n * es);
}

void Tensor::zero_() {
  if (data_ && numel() > 0) backend("Tensor::zero_")->zero(data_, nbytes());
}

Tensor Tensor::to(Device device) const {
  KEEL_ASSERT(defined() || numel() == 0);
  Tensor out = zeros(shape_, dtype_, device);
  if (numel() == 0) return out;
  if (device_ == Device::kCpu) {
    out.copy_from_host(0, numel(), data_);
  } else if (device == Device::kCpu) {
    copy_to_host(0, numel(), out.data_);
  } else {
    // Device::kCuda on both sides: one device per process (one Context), so a device-side copy.
    KEEL_ASSERT(device == device_);
    backend("Tensor::to")->copy_on_device(out.data_, data_, nbytes());
  }
  return out;
}

}  // namespace keel
