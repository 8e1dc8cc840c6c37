// The CUDA backend's host-side API: device discovery, the caching device allocator, and the
// execution context (device, stream, cuBLASLt handle and workspace) that every CUDA kernel takes
// as its first argument. Plain C++: this header does not include the CUDA headers, so layer code,
// tests and tools compile with the host compiler alone. Compiled only when KEEL_HAVE_CUDA.
//
// Note [cuda-stream-order]: every kernel, copy and fill of a Context runs on its one stream, in
// call order. The allocator hands a freed block to the next allocation at once, without an event:
// that is safe because the block's previous users were enqueued on the same stream before any new
// user can be. Memory shared with another stream (NCCL, a copy stream) must be synchronised by the
// caller before it is freed.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "framework/device_backend.h"

struct CUstream_st;      // cudaStream_t is CUstream_st*
struct CUevent_st;       // cudaEvent_t is CUevent_st*
struct cublasLtContext;  // cublasLtHandle_t is cublasLtContext*

namespace keel::kernels::cuda {

// Number of usable GPUs; 0 when the CUDA runtime reports any error (no driver: error 35; no
// device: 100), so a CUDA-enabled binary runs its CPU path on a machine without a GPU.
int device_count();
// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `device`; throws keel::Error when it cannot ask.
std::string device_description(int device);
// "CUDA runtime 13.0, driver 13.0, cuBLASLt 130100" (the libraries actually loaded).
std::string library_versions();

// One-line messages for failed calls (used by the checked-call layer; public so they are tested
// without a GPU): "<call> failed: <name> (<description>) [<where>]".
std::string cuda_error_message(int status, const char* call, const std::string& where);
std::string cublas_error_message(int status, const char* call, const std::string& where);

struct AllocatorStats {
  int64_t bytes_in_use = 0;       // handed out and not yet freed (bucket sizes)
  int64_t bytes_cached = 0;       // freed into the cache, still held from the device
  int64_t peak_bytes_in_use = 0;  // highest bytes_in_use so far
  int64_t device_mallocs = 0;     // successful cudaMalloc calls
  int64_t device_frees = 0;       // cudaFree calls (only on release_cached or after an OOM)
  int64_t cache_hits = 0;         // allocations served from the cache
};

// Caching device allocator: size-bucketed free lists, so the training loop, which allocates the
// same sizes every step, calls cudaMalloc only in its first step. Blocks go back to the device
// only on release_cached(), on destruction, or when a cudaMalloc fails (then the cache is released
// and the allocation retried once). Thread-safe; see Note [cuda-stream-order].
class Allocator {
 public:
  // `stream`: the stream its blocks are ordered on (Note [cuda-stream-order]); the CUDA emulator
  // queues its poisoning of a reused block there.
  explicit Allocator(int device, CUstream_st* stream = nullptr);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // A block of at least `bytes` bytes, 256-byte aligned; nullptr for 0 bytes.
  void* allocate(size_t bytes);
  // Returns a block from allocate() to the cache; nullptr is a no-op.
  void deallocate(void* ptr);
  // cudaFree every cached block (synchronises the device first).
  void release_cached();
  AllocatorStats stats() const;

  // The size class of a request: 512 bytes at least, then four classes per power of two (at most
  // 25% rounding waste), so nearby sizes share a free list.
  static size_t bucket_size(size_t bytes);

 private:
  void release_cached_locked();

  int device_;
  CUstream_st* stream_;
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> live_;     // block -> bucket size
  std::map<size_t, std::vector<void*>> free_;  // bucket size -> cached blocks
  AllocatorStats stats_;
};

// An owning device allocation (returned to its allocator's cache on destruction). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Allocator& allocator, size_t bytes);
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  void reset();

 private:
  Allocator* allocator_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// How fp32 GEMMs use the tensor cores: exact fp32 (the default, so CUDA results match the CPU to
// fp32 rounding) or TF32 inputs (10-bit mantissa, ~8x the throughput on Hopper).
enum class Fp32Matmul { kExact, kTf32 };

// Which algorithm cuDNN's SDPA backward takes (train.deterministic, through
// ExecContext::set_determinism): its deterministic one (bitwise repeatable; on Hopper a dP
// workspace of B * H * T^2 * 2 bytes per call) or its default (dQ accumulated with atomics, no
// such workspace, not bitwise repeatable). Part of the cuDNN plan cache's key (sdpa_cudnn.cc).
enum class SdpaBackward { kDeterministic, kFast };

struct GemmPlan;      // cached cuBLASLt descriptors and algorithm for one GEMM shape (gemm.cc)
class MemoryBackend;  // the Context as keel's Device::kCuda memory backend (memory_backend.cc)
class Context;

// Makes `ctx` the memory backend of Device::kCuda (framework/device_backend.h), so
// Tensor::zeros(..., Device::kCuda) allocates from its caching allocator and Tensor's copies and
// zero fill run on its stream. The Context's constructor calls it; call it again to make an older
// Context current after a newer one was created (a no-op when `ctx` is already current). When a
// Context is destroyed it unregisters itself, restoring the backend it replaced if that Context
// still lives; Tensors that outlive their Context keep dangling device pointers whose release is
// then a no-op (the allocator has freed every block). An explicit call, not a static initializer,
// which a static library's linker may drop.
void register_memory_backend(Context& ctx);

// The execution context of the CUDA backend: one device, one stream, a cuBLASLt handle with its
// workspace, a caching allocator and a scratch buffer for kernels that need temporary memory.
// Kernels never allocate: they use the workspace and scratch, which grow only when a larger
// request first arrives. One Context per device per process (keel runs one rank per GPU).
// Constructing one registers it as the Device::kCuda memory backend (register_memory_backend).
class Context {
 public:
  static constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // NVIDIA's advice for Hopper

  explicit Context(int device = 0);  // throws keel::Error naming the failed call
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  CUstream_st* stream() const { return stream_; }
  cublasLtContext* cublaslt() const { return cublaslt_; }
  Allocator& allocator() { return *allocator_; }
  void* cublas_workspace() const { return workspace_.data(); }
  size_t cublas_workspace_bytes() const { return workspace_.bytes(); }
  Fp32Matmul fp32_matmul() const { return fp32_matmul_; }
  void set_fp32_matmul(Fp32Matmul mode) { fp32_matmul_ = mode; }
  SdpaBackward sdpa_backward() const { return sdpa_backward_; }
  void set_sdpa_backward(SdpaBackward algo) { sdpa_backward_ = algo; }

  DeviceBuffer alloc(size_t bytes) { return DeviceBuffer(*allocator_, bytes); }
  // Temporary device memory valid until the next scratch() call; stream-ordered, so a kernel may
  // use it while later host code asks for it again (Note [cuda-stream-order]).
  void* scratch(size_t bytes);

  // Host <-> device copies on the stream. Both return once the copy is complete (the host buffer
  // may be reused or read at once), which also surfaces errors of earlier kernels.
  void copy_to_device(void* dst, const void* src, size_t bytes);
  void copy_to_host(void* dst, const void* src, size_t bytes);
  void copy_device_to_device(void* dst, const void* src, size_t bytes);  // stream-ordered
  // Note [pinned uploads]: dst (device) = src (host), enqueued on the stream without a host wait.
  // src is copied at once into one of kUploadSlots pinned staging slots (so the caller may rewrite
  // it on return), and the slot's copy runs when the stream reaches it. A slot is rewritten only
  // after the event recorded behind its previous copy has completed: a query, which by then has
  // (a slot comes round again kUploadSlots uploads later, at least a step on in the trainer's
  // two-per-micro-batch use, after the step's readbacks waited for the stream); if not, the one
  // case that waits, cudaEventSynchronize. A slot grows (waiting for its copy, then a new pinned
  // allocation) only when a larger upload first arrives, so the steady step allocates nothing.
  void upload_async(void* dst, const void* src, size_t bytes);
  static constexpr size_t kUploadSlots = 4;
  // Readbacks of at most kPinnedReadbackBytes (a step's scalars, a few layers' maxima) go through
  // a pinned buffer, so copy_to_host waits once (the stream) instead of twice (a pageable copy,
  // which a GPU runs synchronously, then the stream).
  static constexpr size_t kPinnedReadbackBytes = 4096;
  // Sets `bytes` bytes at dst to `value` (0xFF writes NaN into fp32 and bf16 buffers: the tests'
  // poison), stream-ordered.
  void fill_bytes(void* dst, uint8_t value, size_t bytes);
  void synchronize();

  // Device time of fn() (which enqueues work on this stream) in milliseconds, by CUDA events.
  float time_ms(const std::function<void()>& fn);

  // The cuBLASLt plan cache (gemm.cc): descriptors and the heuristic's algorithm per shape.
  GemmPlan& gemm_plan(const std::string& key,
                      const std::function<std::unique_ptr<GemmPlan>()>& make);

 private:
  friend void register_memory_backend(Context& ctx);
  void unregister_memory_backend() noexcept;  // memory_backend.cc; the destructor calls it

  int device_ = 0;
  CUstream_st* stream_ = nullptr;
  cublasLtContext* cublaslt_ = nullptr;
  std::unique_ptr<Allocator> allocator_;
  DeviceBuffer workspace_;
  DeviceBuffer scratch_;
  Fp32Matmul fp32_matmul_ = Fp32Matmul::kExact;
  SdpaBackward sdpa_backward_ = SdpaBackward::kDeterministic;
  std::map<std::string, std::unique_ptr<GemmPlan>> plans_;
  struct UploadSlot {
    void* host = nullptr;  // pinned (cudaMallocHost)
    size_t bytes = 0;
    CUevent_st* copied = nullptr;  // recorded behind the slot's last copy
    bool pending = false;          // copied was recorded and not yet seen complete
  };
  std::array<UploadSlot, kUploadSlots> uploads_;
  size_t next_upload_ = 0;
  void* readback_ = nullptr;  // pinned, kPinnedReadbackBytes, made on the first small readback
  std::shared_ptr<MemoryBackend> memory_backend_;                 // this Context as a backend
  std::shared_ptr<keel::DeviceBackend> replaced_memory_backend_;  // restored when it goes
};

// Typed helpers for tests and tools: a device copy of host data, and the host copy of a device
// array.
template <typename T>
DeviceBuffer upload(Context& ctx, const std::vector<T>& host) {
  DeviceBuffer buf = ctx.alloc(host.size() * sizeof(T));
  if (!host.empty()) ctx.copy_to_device(buf.data(), host.data(), host.size() * sizeof(T));
  return buf;
}
template <typename T>
std::vector<T> download(Context& ctx, const void* device_ptr, size_t count) {
  std::vector<T> host(count);
  if (count > 0) ctx.copy_to_host(host.data(), device_ptr, count * sizeof(T));
  return host;
}

}  // namespace keel::kernels::cuda
