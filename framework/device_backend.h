// The one dispatch point for tensor memory: a small per-device interface (allocate, free, zero,
// copies between host and device and within a device, synchronise) and a registry keyed by
// Device. Tensor reaches device memory only through it, so layers, checkpoints and tests never
// ask which device memory is on (ggml's backend buffer interface is the model).
//
// The CPU backend is built in and cannot be replaced. Other devices have no backend until one is
// registered explicitly: the CUDA backend (keel_cuda) registers itself when a
// kernels::cuda::Context is constructed and unregisters when it is destroyed. There is no static
// initializer, which a static library's linker may drop, and no CUDA header here, so CPU-only
// binaries link no CUDA.
//
// Note [device-memory-order]: a backend may run its device-side operations (zero, device-to-device
// copy) asynchronously, in call order on one queue (the CUDA stream of its Context). Host copies
// (copy_to_host, copy_from_host) return only when complete: the host buffer may be reused or read
// at once. Freed memory may be handed to the next allocation at once, because its earlier users
// were enqueued before any new user can be (Note [cuda-stream-order]). Work enqueued by kernels on
// another queue must be synchronised by its caller before the memory is freed.
#pragma once

#include <cstddef>
#include <memory>

namespace keel {

enum class Device { kCpu, kCuda };

// "CPU", "CUDA": for messages.
const char* device_name(Device device);

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // At least `bytes` bytes, 64-byte aligned at least; not zero-filled. Never nullptr: failure
  // throws keel::Error naming the request. `bytes` > 0.
  virtual void* allocate(size_t bytes) = 0;
  // Returns memory from allocate(); nullptr is a no-op. Must not throw (called from destructors).
  virtual void deallocate(void* ptr) noexcept = 0;
  // Sets `bytes` bytes at `ptr` to zero (may be asynchronous: Note [device-memory-order]).
  virtual void zero(void* ptr, size_t bytes) = 0;
  // Device memory `src` -> host memory `dst`; returns once `dst` holds the data.
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Host memory `src` -> device memory `dst`; returns once `src` may be reused.
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  // Within this device (may be asynchronous: Note [device-memory-order]). The ranges must not
  // overlap.
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  // Waits for every asynchronous operation enqueued so far.
  virtual void synchronize() = 0;
  // Host memory for this device's copies to land in and leave from, 64-byte aligned: page-locked
  // where the device has it (CUDA: cudaMallocHost), so copies run at the link's full speed
  // instead of through the runtime's pageable staging. The CPU's is ordinary memory. Never
  // nullptr (failure throws keel::Error naming the request); `bytes` > 0. Release with
  // free_host, which must not throw.
  virtual void* allocate_host(size_t bytes);
  virtual void free_host(void* ptr) noexcept;
};

// A growable host buffer of floats from `device`'s allocate_host (pinned for CUDA), reused
// between uses: where checkpoints copy device state to and from.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(Device device);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  // At least n floats (contents not kept when it grows); n = 0 gives what is there.
  float* reserve(size_t n);
  float* data() const { return data_; }

 private:
  std::shared_ptr<DeviceBackend> backend_;
  float* data_ = nullptr;
  size_t capacity_ = 0;
};

// The backend of `device`, shared so memory it allocated can outlive a re-registration. Throws
// keel::Error (kInternal) naming the device and `what` (the operation asking) when none is
// registered. Thread-safe.
std::shared_ptr<DeviceBackend> device_backend(Device device, const char* what);
bool has_device_backend(Device device);

// Makes `backend` the backend of `device` (nullptr unregisters) and returns the one it replaces
// (or nullptr), so a test's fake or a second CUDA Context can restore it afterwards. Memory
// already allocated keeps going back to the backend that allocated it. The CPU backend is built
// in: registering for Device::kCpu is an error. Thread-safe.
std::shared_ptr<DeviceBackend> set_device_backend(Device device,
                                                  std::shared_ptr<DeviceBackend> backend);
// set_device_backend only when `expected` is the current backend of `device` (so a backend that
// leaves restores its predecessor without undoing a later registration); true if it did.
bool replace_device_backend_if(Device device, const DeviceBackend* expected,
                               std::shared_ptr<DeviceBackend> backend);

}  // namespace keel
