// CUDA backend host side: device discovery, the checked-call layer's error messages, the caching
// allocator and the execution context (see device.h, check.h).
#include "framework/kernels/cuda/device.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/gemm_plan.h"

namespace keel::kernels::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the runtime's record of the failed query
    return 0;
  }
  return n;
}

std::string device_description(int device) {
  cudaDeviceProp prop{};
  KEEL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "device ", device);
  return keel::detail::concat(prop.name, " (sm_", prop.major, prop.minor, ", ",
                              static_cast<double>(prop.totalGlobalMem) / (1ull << 30), " GiB, ",
                              prop.multiProcessorCount, " SMs)");
}

std::string library_versions() {
  int runtime = 0, driver = 0;
  KEEL_CUDA_CHECK(cudaRuntimeGetVersion(&runtime), "library_versions");
  KEEL_CUDA_CHECK(cudaDriverGetVersion(&driver), "library_versions");
  return keel::detail::concat("CUDA runtime ", runtime / 1000, ".", runtime % 1000 / 10,
                              ", driver ", driver / 1000, ".", driver % 1000 / 10, ", cuBLASLt ",
                              cublasLtGetVersion());
}

std::string cuda_error_message(int status, const char* call, const std::string& where) {
  const auto e = static_cast<cudaError_t>(status);
  return keel::detail::concat(call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                              ")", where.empty() ? "" : " [", where, where.empty() ? "" : "]");
}

std::string cublas_error_message(int status, const char* call, const std::string& where) {
  const auto s = static_cast<cublasStatus_t>(status);
  return keel::detail::concat(call, " failed: ", cublasLtGetStatusName(s), " (",
                              cublasLtGetStatusString(s), ")", where.empty() ? "" : " [", where,
                              where.empty() ? "" : "]");
}

namespace detail {

void throw_cuda_error(cudaError_t status, const char* call, const std::string& where,
                      const char* file, int line) {
  // The runtime also records the error for cudaGetLastError; clear it, or the next launch check
  // would report this failure again as its own.
  cudaGetLastError();
  throw Error(ErrorKind::kInternal, cuda_error_message(status, call, where), file, line);
}

void throw_cublas_error(cublasStatus_t status, const char* call, const std::string& where,
                        const char* file, int line) {
  throw Error(ErrorKind::kInternal, cublas_error_message(status, call, where), file, line);
}

namespace {
bool sync_after_launch() {
  static const bool on = [] {
    const char* v = std::getenv("KEEL_CUDA_SYNC_CHECK");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }();
  return on;
}
}  // namespace

void check_launch(const char* kernel, const std::string& where, const char* file, int line) {
  const cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess) {
    throw_cuda_error(launch, keel::detail::concat("launch of ", kernel).c_str(), where, file, line);
  }
  if (sync_after_launch()) {
    const cudaError_t run = cudaDeviceSynchronize();
    if (run != cudaSuccess) {
      throw_cuda_error(run, keel::detail::concat("kernel ", kernel).c_str(), where, file, line);
    }
  }
}

}  // namespace detail

// ---- Allocator ------------------------------------------------------------------------------

#if KEEL_CUDA_EMULATOR
// tests/cuda_emu (the CUDA emulator, which compiles this file unchanged otherwise): fills a block
// the cache hands out again with NaN, stream-ordered on `stream`, so a kernel reading what its new
// owner never wrote shows.
extern "C" void keel_cuda_emu_block_reused(void* block, size_t bytes, cudaStream_t stream);
#endif

size_t Allocator::bucket_size(size_t bytes) {
  constexpr size_t kMin = 512;
  if (bytes <= kMin) return kMin;
  // Four classes per power of two: the top three bits of the size (after rounding up) survive.
  size_t top = size_t{1} << (63 - __builtin_clzll(bytes));  // largest power of two <= bytes
  const size_t step = top / 4;
  return (bytes + step - 1) / step * step;
}

Allocator::Allocator(int device, CUstream_st* stream) : device_(device), stream_(stream) {}

Allocator::~Allocator() {
  // Destructors must not throw: errors here (a device already torn down at exit) are ignored.
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) cudaFree(p);
  }
  for (auto& [p, size] : live_) cudaFree(p);
}

void* Allocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t size = bucket_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= static_cast<int64_t>(size);
    ++stats_.cache_hits;
#if KEEL_CUDA_EMULATOR
    keel_cuda_emu_block_reused(p, size, stream_);
#endif
  } else {
    cudaError_t st = cudaMalloc(&p, size);
    if (st == cudaErrorMemoryAllocation && stats_.bytes_cached > 0) {
      cudaGetLastError();
      release_cached_locked();
      st = cudaMalloc(&p, size);
    }
    if (st != cudaSuccess) {
      detail::throw_cuda_error(
          st, "cudaMalloc",
          keel::detail::concat("device ", device_, ": ", bytes, " bytes requested (bucket ", size,
                               "); allocator holds ", stats_.bytes_in_use, " bytes in use, ",
                               stats_.bytes_cached, " cached"),
          __FILE__, __LINE__);
    }
    ++stats_.device_mallocs;
  }
  live_.emplace(p, size);
  stats_.bytes_in_use += static_cast<int64_t>(size);
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  return p;
}

void Allocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  KEEL_CHECK(it != live_.end(), kInternal, "cuda allocator: free of a pointer it did not allocate");
  const size_t size = it->second;
  live_.erase(it);
  free_[size].push_back(ptr);
  stats_.bytes_in_use -= static_cast<int64_t>(size);
  stats_.bytes_cached += static_cast<int64_t>(size);
}

void Allocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void Allocator::release_cached_locked() {
  // Cached blocks may still be read by enqueued kernels (Note [cuda-stream-order]).
  KEEL_CUDA_CHECK(cudaDeviceSynchronize(), "release_cached device ", device_);
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) {
      KEEL_CUDA_CHECK(cudaFree(p), "release_cached bytes=", size);
      ++stats_.device_frees;
      stats_.bytes_cached -= static_cast<int64_t>(size);
    }
    blocks.clear();
  }
}

AllocatorStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

DeviceBuffer::DeviceBuffer(Allocator& allocator, size_t bytes)
    : allocator_(&allocator), ptr_(allocator.allocate(bytes)), bytes_(bytes) {}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (allocator_ != nullptr && ptr_ != nullptr) allocator_->deallocate(ptr_);
  allocator_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

// ---- Context --------------------------------------------------------------------------------

Context::Context(int device) : device_(device) {
  KEEL_CUDA_CHECK(cudaSetDevice(device), "device ", device, " of ", device_count());
  KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "device ", device);
  KEEL_CUBLAS_CHECK(cublasLtCreate(&cublaslt_), "device ", device);
  allocator_ = std::make_unique<Allocator>(device, stream_);
  workspace_ = alloc(kCublasWorkspaceBytes);
  register_memory_backend(*this);
}

Context::~Context() {
  // Release in reverse order; errors are ignored (destructors do not throw). Tensors must stop
  // returning blocks to the allocator before it goes.
  unregister_memory_backend();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (UploadSlot& slot : uploads_) {
    if (slot.copied != nullptr) cudaEventDestroy(slot.copied);
    if (slot.host != nullptr) cudaFreeHost(slot.host);
  }
  if (readback_ != nullptr) cudaFreeHost(readback_);
  plans_.clear();
  scratch_.reset();
  workspace_.reset();
  allocator_.reset();
  if (cublaslt_ != nullptr) cublasLtDestroy(cublaslt_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void* Context::scratch(size_t bytes) {
  if (bytes > scratch_.bytes()) {
    scratch_.reset();  // stream-ordered reuse: safe to hand back while kernels still use it
    scratch_ = alloc(Allocator::bucket_size(bytes));
  }
  return scratch_.data();
}

void Context::copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_),
                  "copy_to_device bytes=", bytes);
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_), "copy_to_device bytes=", bytes);
}

void Context::upload_async(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  UploadSlot& slot = uploads_[next_upload_];
  next_upload_ = (next_upload_ + 1) % kUploadSlots;
  if (slot.pending) {
    // Note [pinned uploads]: the slot's previous copy must have read it before it is rewritten.
    const cudaError_t q = cudaEventQuery(slot.copied);
    if (q == cudaErrorNotReady) {
      KEEL_CUDA_CHECK(cudaEventSynchronize(slot.copied), "upload_async bytes=", bytes);
    } else {
      KEEL_CUDA_CHECK(q, "upload_async bytes=", bytes);
    }
    slot.pending = false;
  }
  if (slot.copied == nullptr) {
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming), "upload_async");
  }
  if (bytes > slot.bytes) {
    if (slot.host != nullptr) KEEL_CUDA_CHECK(cudaFreeHost(slot.host), "upload_async");
    slot.host = nullptr;
    slot.bytes = 0;
    KEEL_CUDA_CHECK(cudaMallocHost(&slot.host, bytes), "upload_async pinned bytes=", bytes);
    slot.bytes = bytes;
  }
  std::memcpy(slot.host, src, bytes);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, stream_),
                  "upload_async bytes=", bytes);
  KEEL_CUDA_CHECK(cudaEventRecord(slot.copied, stream_), "upload_async bytes=", bytes);
  slot.pending = true;
}

void Context::copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (bytes <= kPinnedReadbackBytes) {
    if (readback_ == nullptr) {
      KEEL_CUDA_CHECK(cudaMallocHost(&readback_, kPinnedReadbackBytes), "copy_to_host");
    }
    KEEL_CUDA_CHECK(cudaMemcpyAsync(readback_, src, bytes, cudaMemcpyDeviceToHost, stream_),
                    "copy_to_host bytes=", bytes);
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_), "copy_to_host bytes=", bytes);
    std::memcpy(dst, readback_, bytes);
    return;
  }
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                  "copy_to_host bytes=", bytes);
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_), "copy_to_host bytes=", bytes);
}

void Context::copy_device_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                  "copy_device_to_device bytes=", bytes);
}

void Context::fill_bytes(void* dst, uint8_t value, size_t bytes) {
  if (bytes == 0) return;
  KEEL_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_), "fill_bytes bytes=", bytes);
}

void Context::synchronize() { KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_), "device ", device_); }

float Context::time_ms(const std::function<void()>& fn) {
  cudaEvent_t start = nullptr, stop = nullptr;
  KEEL_CUDA_CHECK(cudaEventCreate(&start), "time_ms");
  KEEL_CUDA_CHECK(cudaEventCreate(&stop), "time_ms");
  float ms = 0.0f;
  try {
    KEEL_CUDA_CHECK(cudaEventRecord(start, stream_), "time_ms");
    fn();
    KEEL_CUDA_CHECK(cudaEventRecord(stop, stream_), "time_ms");
    KEEL_CUDA_CHECK(cudaEventSynchronize(stop), "time_ms");
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop), "time_ms");
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

GemmPlan& Context::gemm_plan(const std::string& key,
                             const std::function<std::unique_ptr<GemmPlan>()>& make) {
  auto it = plans_.find(key);
  if (it == plans_.end()) it = plans_.emplace(key, make()).first;
  return *it->second;
}

}  // namespace keel::kernels::cuda
