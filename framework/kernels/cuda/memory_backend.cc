// The CUDA Context as keel's Device::kCuda memory backend (framework/device_backend.h): Tensor
// memory from the Context's caching allocator, zero fill and copies on its stream. Registered by
// the Context's constructor (register_memory_backend), unregistered by its destructor.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <utility>

#include "framework/device_backend.h"
#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/device.h"

namespace keel::kernels::cuda {

class MemoryBackend final : public DeviceBackend {
 public:
  explicit MemoryBackend(Context& ctx) : ctx_(&ctx) {}

  // nullptr once the Context is gone.
  Context* context() const { return ctx_.load(); }
  void detach() { ctx_.store(nullptr); }

  void* allocate(size_t bytes) override {
    void* p = ctx("allocate").allocator().allocate(bytes);
    KEEL_ASSERT(p != nullptr);  // the allocator returns nullptr only for 0 bytes
    return p;
  }
  void deallocate(void* ptr) noexcept override {
    // After detach the allocator has freed every block (Allocator::~Allocator): nothing to do.
    Context* c = ctx_.load();
    if (c == nullptr || ptr == nullptr) return;
    try {
      c->allocator().deallocate(ptr);
    } catch (const std::exception& e) {
      // Called from Tensor destructors: a throw here would be std::terminate without a word.
      std::fprintf(stderr, "keel: CUDA memory backend: deallocate: %s\n", e.what());
    }
  }
  void zero(void* ptr, size_t bytes) override { ctx("zero").fill_bytes(ptr, 0, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    ctx("copy_to_host").copy_to_host(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    ctx("copy_from_host").copy_to_device(dst, src, bytes);
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    ctx("copy_on_device").copy_device_to_device(dst, src, bytes);
  }
  void synchronize() override { ctx("synchronize").synchronize(); }
  // Page-locked, so checkpoint copies run at the link's speed (no pageable staging).
  void* allocate_host(size_t bytes) override {
    void* p = nullptr;
    KEEL_CUDA_CHECK(cudaMallocHost(&p, bytes), "cudaMallocHost of ", bytes,
                    " bytes (pinned host memory for device copies)");
    return p;
  }
  void free_host(void* ptr) noexcept override {
    if (ptr != nullptr) cudaFreeHost(ptr);
  }

 private:
  Context& ctx(const char* what) const {
    Context* c = ctx_.load();
    KEEL_CHECK(c != nullptr, kInternal, "CUDA memory backend ", what,
               ": CUDA backend not initialised (its kernels::cuda::Context was destroyed)");
    return *c;
  }

  std::atomic<Context*> ctx_;
};

void register_memory_backend(Context& ctx) {
  if (ctx.memory_backend_ == nullptr) ctx.memory_backend_ = std::make_shared<MemoryBackend>(ctx);
  std::shared_ptr<DeviceBackend> previous = set_device_backend(Device::kCuda, ctx.memory_backend_);
  if (previous != ctx.memory_backend_) ctx.replaced_memory_backend_ = std::move(previous);
}

void Context::unregister_memory_backend() noexcept {
  if (memory_backend_ == nullptr) return;
  memory_backend_->detach();
  std::shared_ptr<DeviceBackend> restore = std::move(replaced_memory_backend_);
  // A replaced Context that has gone since is not restored.
  if (const auto* m = dynamic_cast<const MemoryBackend*>(restore.get());
      m != nullptr && m->context() == nullptr) {
    restore = nullptr;
  }
  try {
    replace_device_backend_if(Device::kCuda, memory_backend_.get(), std::move(restore));
  } catch (...) {
    // Only a failed mutex lock can throw here; a destructor must not.
  }
}

}  // namespace keel::kernels::cuda
