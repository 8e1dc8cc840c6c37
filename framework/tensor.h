// Tensor: a shape, a dtype and a device over memory that is either owned (one allocation from the
// device's backend, framework/device_backend.h) or a view into someone else's (an arena slice).
// Kernels never see Tensors, only raw views (pointer + dims) taken from them; Tensors are how
// layers and arenas hand memory around. Every access to the memory itself (zero fill, host copies)
// goes through the device's backend, so the same code serves CPU and device tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/device_backend.h"

namespace keel {

enum class DType { kF32, kBF16, kF64, kI32 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  // Owning, zero-filled (including the padding up to the next 64 bytes), 64-byte aligned, from
  // `device`'s backend (on CUDA: the Context's caching allocator, zero-filled on its stream). The
  // memory goes back to that backend when the last Tensor sharing it (slices included) goes.
  // Throws kInternal when `device` has no backend (a CPU-only binary, or no CUDA Context yet).
  static Tensor zeros(Shape shape, DType dtype = DType::kF32, Device device = Device::kCpu);
  // Non-owning view over `data` (memory of `device`); the caller keeps the memory alive.
  static Tensor view_of(void* data, Shape shape, DType dtype = DType::kF32,
                        Device device = Device::kCpu);

  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool owning() const { return storage_ != nullptr; }
  bool defined() const { return data_ != nullptr; }

  // The memory itself (raw and the typed pointers): a device pointer for a device tensor, which
  // the host must not dereference (pass it to that device's kernels, or use the copies below).
  void* raw() const { return data_; }
  float* f32() const;
  int32_t* i32() const;
  double* f64() const;

  // Device-neutral host copies of elements [offset, offset + n): what checkpoints, sampling and
  // tests use instead of dereferencing a pointer that may be device memory. Both return once the
  // host buffer holds the data / may be reused (Note [device-memory-order]).
  void copy_to_host(int64_t offset, int64_t n, void* dst) const;
  void copy_from_host(int64_t offset, int64_t n, const void* src) const;

  // A view of `numel(shape)` elements starting `offset` elements in; shares ownership.
  Tensor slice(int64_t offset, Shape shape) const;
  // Zero-fills the elements (asynchronously on a device: Note [device-memory-order]).
  void zero_();
  // An owning copy on `device` (also when it is this tensor's device): same shape and dtype.
  Tensor to(Device device) const;

 private:
  // backend_, or for a view of foreign memory the device's registered backend.
  std::shared_ptr<DeviceBackend> backend(const char* what) const;

  std::shared_ptr<void> storage_;
  // The backend that allocated storage_ (null for views of foreign memory): copies and zeroing
  // use it, so a tensor keeps talking to its own Context's stream even after another Context
  // registered itself for the device.
  std::shared_ptr<DeviceBackend> backend_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
};

}  // namespace keel
