// Tensor storage and views (CPU memory; the CUDA backend adds device allocation).
#include "framework/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

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
  KEEL_CHECK(device == Device::kCpu, kInternal, "Tensor::zeros: only CPU memory is built yet");
  for (int64_t d : shape) KEEL_CHECK(d >= 0, kInternal, "negative dimension in ", shape_str(shape));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  const size_t bytes = (std::max<size_t>(t.nbytes(), 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  KEEL_CHECK(p != nullptr, kInternal, "out of memory allocating ", bytes, " bytes");
  std::memset(p, 0, bytes);
  t.storage_ = std::shared_ptr<void>(p, std::free);
  t.data_ = p;
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

Tensor Tensor::slice(int64_t offset, Shape shape) const {
  KEEL_ASSERT(offset >= 0 && offset + shape_numel(shape) <= numel());
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + offset * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::copy_to_host(int64_t offset, int64_t n, void* dst) const {
  KEEL_ASSERT(offset >= 0 && n >= 0 && offset + n <= numel());
  KEEL_CHECK(device_ == Device::kCpu, kInternal, "copy_to_host: only CPU memory is built yet");
  const size_t es = dtype_size(dtype_);
  if (n > 0) std::memcpy(dst, static_cast<const char*>(data_) + offset * es, n * es);
}

void Tensor::copy_from_host(int64_t offset, int64_t n, const void* src) const {
  KEEL_ASSERT(offset >= 0 && n >= 0 && offset + n <= numel());
  KEEL_CHECK(device_ == Device::kCpu, kInternal, "copy_from_host: only CPU memory is built yet");
  const size_t es = dtype_size(dtype_);
  if (n > 0) std::memcpy(static_cast<char*>(data_) + offset * es, src, n * es);
}

void Tensor::zero_() {
  if (data_) std::memset(data_, 0, nbytes());
}

}  // namespace keel
