// A fake device for tests on machines without a GPU: Device::kCuda memory that the host cannot
// touch, and an execution context that runs the CPU kernels on it. It proves on the CPU that the
// model, optimizer, trainer and checkpoints reach device memory only through the backend's copies
// (Tensor::copy_to_host and friends) or an ExecContext: any other host dereference of a device
// pointer dies with SIGSEGV, as an illegal address would on a GPU.
//
// How: all fake-device memory lives in one reserved virtual region (PROT_NONE). The region is
// "locked" (PROT_NONE) except while the backend itself (zero, copies) or a FakeDeviceExec method
// runs; then the used part is "unlocked" (read/write) by one mprotect and locked again afterwards.
// Unlocks nest (a count), so a method may call another. Every pointer an ExecContext method or a
// backend copy takes as device memory must lie in a live fake allocation (else keel::Error,
// kInternal), so a host pointer handed to a device kernel is caught too.
//
// Limits: protection is per process, so while one thread is inside an ExecContext method another
// thread's stray host access goes unnoticed (tests that run ranks as threads still never fail
// wrongly; they only prove less while kernels overlap). The kernels are the CPU's, so results are
// bitwise the CPU's; what this checks is where memory is touched, not CUDA numerics.
//
// Usage: { keel::testing::ScopedFakeDevice fake;  // registers backend + exec factory for kCuda
//          auto exec = keel::kernels::make_exec(keel::Device::kCuda);
//          Tensor t = Tensor::zeros({n}, DType::kF32, Device::kCuda); ... }
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "framework/device_backend.h"
#include "framework/error.h"
#include "framework/kernels/exec_context.h"

namespace keel::testing {

// The fake device's memory: one reserved region, a size-class allocator over it, and the lock.
// One per process (instance()), never destroyed: Tensors freed by other statics' destructors
// still return their blocks here.
class FakeDeviceMemory {
 public:
  struct Stats {
    int64_t allocations = 0;    // allocate() calls so far
    int64_t live_blocks = 0;    // allocated and not yet freed
    size_t live_bytes = 0;      // requested bytes of the live blocks
    size_t used_bytes = 0;      // the bump high-water mark (what lock/unlock cover)
    int64_t unlocks = 0;        // outermost unlocks so far (each one mprotect)
    int64_t exec_calls = 0;     // FakeDeviceExec methods run
    int64_t backend_calls = 0;  // zero / copies run through the backend
  };

  static FakeDeviceMemory& instance() {
    static FakeDeviceMemory* memory = new FakeDeviceMemory();
    return *memory;
  }

  FakeDeviceMemory(const FakeDeviceMemory&) = delete;
  FakeDeviceMemory& operator=(const FakeDeviceMemory&) = delete;

  // 64-byte aligned (page aligned from a page up), filled with 0xFF (NaN as floats) so code that
  // assumes allocate() zero-fills, which a CUDA allocator does not, sees garbage.
  void* allocate(size_t bytes) {
    KEEL_CHECK(bytes > 0, kInternal, "fake device: allocate of 0 bytes");
    const size_t cls = class_size(bytes);
    size_t offset = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<size_t>& free_list = free_[cls];
      if (!free_list.empty()) {
        offset = free_list.back();
        free_list.pop_back();
      } else {
        const size_t align = cls >= page_ ? page_ : kAlign;
        offset = (bump_ + align - 1) / align * align;
        KEEL_CHECK(offset + cls <= capacity_, kInternal, "fake device: out of memory allocating ",
                   bytes, " bytes (", bump_, " of ", capacity_, " reserved bytes used)");
        // A 64-byte gap after each block: an end pointer (allowed, for empty views) is then
        // never the start of the next block, which may be freed.
        bump_ = offset + cls + kAlign;
        grow_used_locked();
      }
      live_.emplace(offset, Block{bytes, cls});
      ++stats_.allocations;
      ++stats_.live_blocks;
      stats_.live_bytes += bytes;
    }
    void* p = base_ + offset;
    Unlocked unlocked(*this);
    std::memset(p, 0xFF, bytes);
    return p;
  }

  // Not throwing (DeviceBackend::deallocate is called from destructors): a pointer this memory
  // did not hand out is a bug in the caller, reported on stderr before aborting.
  void deallocate(void* ptr) noexcept {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = in_region(ptr) ? live_.find(offset_of(ptr)) : live_.end();
    if (it == live_.end()) {
      std::fprintf(stderr, "fake device: deallocate(%p) of memory it did not allocate\n", ptr);
      std::abort();
    }
    const Block block = it->second;
    live_.erase(it);
    --stats_.live_blocks;
    stats_.live_bytes -= block.bytes;
    // Large blocks give their pages back, so a long test's footprint is its live memory.
    if (block.cls >= kReleaseBytes) {
      madvise(static_cast<char*>(ptr), block.cls, MADV_DONTNEED);
    }
    free_[block.cls].push_back(static_cast<size_t>(static_cast<char*>(ptr) - base_));
  }

  // True when [p, p + bytes] lies within one live allocation (its end included, so an empty
  // view at the end of a block passes).
  bool is_device_range(const void* p, size_t bytes = 0) const {
    if (!in_region(p)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const size_t off = offset_of(p);
    auto it = live_.upper_bound(off);
    if (it == live_.begin()) return false;
    --it;
    return off + bytes <= it->first + it->second.bytes;
  }
  // True when p points anywhere into the reserved region (live or not).
  bool in_region(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + capacity_;
  }

  // Makes the used region readable and writable while it lives (nested: the outermost one
  // mprotects). A test may use it to read device memory directly, as a positive control.
  class Unlocked {
   public:
    explicit Unlocked(FakeDeviceMemory& memory) : memory_(memory) { memory_.unlock(); }
    ~Unlocked() { memory_.lock(); }
    Unlocked(const Unlocked&) = delete;
    Unlocked& operator=(const Unlocked&) = delete;

   private:
    FakeDeviceMemory& memory_;
  };

  bool unlocked() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unlock_depth_ > 0;
  }
  Stats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    Stats s = stats_;
    s.used_bytes = used_;
    return s;
  }
  size_t capacity() const { return capacity_; }

  void count_exec_call() {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.exec_calls;
  }
  void count_backend_call() {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.backend_calls;
  }

 private:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kReleaseBytes = size_t(1) << 20;

  struct Block {
    size_t bytes;  // requested
    size_t cls;    // size class: the bytes the block occupies
  };

  FakeDeviceMemory() {
    // 64 GiB of address space, never backed until touched (MAP_NORESERVE); smaller when the
    // process's address-space limit refuses that.
    for (size_t size = size_t(64) << 30; size >= (size_t(1) << 30); size /= 2) {
      void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base_ = static_cast<char*>(p);
        capacity_ = size;
        return;
      }
    }
    KEEL_FAIL(kInternal,
              "fake device: cannot reserve 1 GiB of address space: ", std::strerror(errno));
  }

  // Multiples of 64 up to 1 KiB, then four classes per power of two (at most 25% waste, and the
  // waste is address space only: untouched pages are never backed).
  static size_t class_size(size_t bytes) {
    const size_t r = (bytes + kAlign - 1) / kAlign * kAlign;
    if (r <= 1024) return r;
    size_t p = 1024;
    while (p * 2 <= r) p *= 2;
    const size_t step = p / 4;
    return (r + step - 1) / step * step;
  }

  size_t offset_of(const void* p) const {
    return static_cast<size_t>(static_cast<const char*>(p) - base_);
  }

  void protect(size_t begin, size_t end, int prot) {
    if (end <= begin) return;
    if (mprotect(base_ + begin, end - begin, prot) != 0) {
      std::fprintf(stderr, "fake device: mprotect failed: %s\n", std::strerror(errno));
      std::abort();
    }
  }

  // mu_ held. Extends the used prefix (whole pages) to cover the bump pointer; while unlocked,
  // the new pages are opened at once so a block allocated inside an unlocked scope is usable.
  void grow_used_locked() {
    const size_t new_used = (bump_ + page_ - 1) / page_ * page_;
    if (new_used <= used_) return;
    if (unlock_depth_ > 0) protect(used_, new_used, PROT_READ | PROT_WRITE);
    used_ = new_used;
  }

  void unlock() {
    std::lock_guard<std::mutex> lock(mu_);
    if (unlock_depth_++ == 0) {
      ++stats_.unlocks;
      protect(0, used_, PROT_READ | PROT_WRITE);
    }
  }
  void lock() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--unlock_depth_ == 0) protect(0, used_, PROT_NONE);
  }

  mutable std::mutex mu_;
  // mprotect and madvise take page-aligned addresses; blocks of a page or more start on one.
  const size_t page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t bump_ = 0;  // next free offset
  size_t used_ = 0;  // bump_ rounded up to a page: the part lock/unlock cover
  int unlock_depth_ = 0;
  std::map<size_t, Block> live_;                          // offset -> block
  std::unordered_map<size_t, std::vector<size_t>> free_;  // size class -> free offsets
  Stats stats_;
};

// The fake device's memory backend: the copies check that their device side is fake memory and
// their host side is not, and run unlocked. Synchronous, as the fake device has no queue.
class FakeDeviceBackend final : public DeviceBackend {
 public:
  void* allocate(size_t bytes) override { return memory().allocate(bytes); }
  void deallocate(void* ptr) noexcept override { memory().deallocate(ptr); }
  void zero(void* ptr, size_t bytes) override {
    check_device("zero", "ptr", ptr, bytes);
    run([&] { std::memset(ptr, 0, bytes); });
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    check_device("copy_to_host", "src", src, bytes);
    check_host("copy_to_host", "dst", dst);
    run([&] { std::memcpy(dst, src, bytes); });
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    check_device("copy_from_host", "dst", dst, bytes);
    check_host("copy_from_host", "src", src);
    run([&] { std::memcpy(dst, src, bytes); });
  }
  void copy_on_device(void* dst, const void* src, size_t bytes) override {
    check_device("copy_on_device", "dst", dst, bytes);
    check_device("copy_on_device", "src", src, bytes);
    run([&] { std::memcpy(dst, src, bytes); });
  }
  void synchronize() override {}

 private:
  static FakeDeviceMemory& memory() { return FakeDeviceMemory::instance(); }
  template <typename Fn>
  static void run(Fn&& fn) {
    memory().count_backend_call();
    FakeDeviceMemory::Unlocked unlocked(memory());
    fn();
  }
  static void check_device(const char* op, const char* arg, const void* p, size_t bytes) {
    KEEL_CHECK(memory().is_device_range(p, bytes), kInternal, "fake device backend ", op, ": ", arg,
               " [", p, ", +", bytes, ") is not inside one live fake-device allocation");
  }
  static void check_host(const char* op, const char* arg, const void* p) {
    KEEL_CHECK(!memory().in_region(p), kInternal, "fake device backend ", op, ": host buffer ", arg,
               " ", p, " is fake-device memory");
  }
};

// An ExecContext for Device::kCuda that runs kernels::cpu_exec()'s kernels on fake-device memory,
// unlocked for the call. Every device pointer argument (all but host_src and the RoPE table) must
// be null or inside a live fake allocation: a layer that hands a device kernel host memory would
// fault on a GPU, and throws here.
class FakeDeviceExec final : public kernels::ExecContext {
 public:
  explicit FakeDeviceExec(int device_index = 0) : device_index_(device_index) {}

  Device device() const override { return Device::kCuda; }
  std::string describe() const override {
    return "fake CUDA " + std::to_string(device_index_) +
           ": CPU kernels on PROT_NONE-guarded memory, " + std::to_string(threads()) + " threads";
  }
  // The CPU's: the fake's kernels do run on the host's threads, and attention's workspace
  // (sized by the caller from threads() when AttentionShape::threads is 0) must fit them.
  int threads() const override { return cpu().threads(); }
  void synchronize() override { cpu().synchronize(); }

  void linear_forward(kernels::ActOut out, kernels::ActIn inp, const float* weight,
                      const float* bias, int64_t N, int64_t IC, int64_t OC) override {
    Call c("linear_forward", {out.data, inp.data, weight, bias});
    cpu().linear_forward(out, inp, weight, bias, N, IC, OC);
  }
  void linear_backward(kernels::ActOut dinp, bool accumulate_dinp, float* dweight, float* dbias,
                       kernels::ActIn dout, kernels::ActIn inp, const float* weight, int64_t N,
                       int64_t IC, int64_t OC) override {
    Call c("linear_backward", {dinp.data, dweight, dbias, dout.data, inp.data, weight});
    cpu().linear_backward(dinp, accumulate_dinp, dweight, dbias, dout, inp, weight, N, IC, OC);
  }
  void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) override {
    Call c("load_tokens", {dst});
    KEEL_CHECK(!FakeDeviceMemory::instance().in_region(host_src), kInternal,
               "FakeDeviceExec::load_tokens: host_src is fake-device memory");
    cpu().load_tokens(dst, host_src, n);
  }

  void gelu_forward(kernels::ActOut out, kernels::ActIn inp, int64_t n) override {
    Call c("gelu_forward", {out.data, inp.data});
    cpu().gelu_forward(out, inp, n);
  }
  void gelu_backward(kernels::ActOut dinp, float* dbias, kernels::ActIn inp, kernels::ActIn dout,
                     int64_t N, int64_t C) override {
    Call c("gelu_backward", {dinp.data, dbias, inp.data, dout.data});
    cpu().gelu_backward(dinp, dbias, inp, dout, N, C);
  }
  void add(float* out, const float* a, kernels::ActIn b, int64_t n) override {
    Call c("add", {out, a, b.data});
    cpu().add(out, a, b, n);
  }
  void copy_to_f32(float* out, kernels::ActIn in, int64_t n) override {
    Call c("copy_to_f32", {out, in.data});
    cpu().copy_to_f32(out, in, n);
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    Call c("add_inplace", {y, x});
    cpu().add_inplace(y, x, n);
  }
  void glu_forward(kernels::GluAct act, kernels::ActOut out, const float* gate, const float* up,
                   int64_t n) override {
    Call c("glu_forward", {out.data, gate, up});
    cpu().glu_forward(act, out, gate, up, n);
  }
  void glu_backward(kernels::GluAct act, kernels::ActOut dgate, kernels::ActOut dup,
                    float* dgate_bias, float* dup_bias, const float* dout, const float* gate,
                    const float* up, int64_t N, int64_t C) override {
    Call c("glu_backward", {dgate.data, dup.data, dgate_bias, dup_bias, dout, gate, up});
    cpu().glu_backward(act, dgate, dup, dgate_bias, dup_bias, dout, gate, up, N, C);
  }
  void sum_squares(const float* x, int64_t n, double* out, bool accumulate) override {
    Call c("sum_squares", {x, out});
    cpu().sum_squares(x, n, out, accumulate);
  }

  void norm_forward(kernels::NormOp op, const kernels::NormShape& s, kernels::ActOut out,
                    kernels::ActIn inp, const float* weight, const float* bias, float* mean,
                    float* rstd, float eps) override {
    Call c("norm_forward", {out.data, inp.data, weight, bias, mean, rstd});
    cpu().norm_forward(op, s, out, inp, weight, bias, mean, rstd, eps);
  }
  void norm_backward(kernels::NormOp op, const kernels::NormShape& s, kernels::ActOut dinp,
                     bool accumulate, float* dweight, float* dbias, kernels::ActIn dout,
                     kernels::ActIn inp, const float* weight, const float* mean,
                     const float* rstd) override {
    Call c("norm_backward", {dinp.data, dweight, dbias, dout.data, inp.data, weight, mean, rstd});
    cpu().norm_backward(op, s, dinp, accumulate, dweight, dbias, dout, inp, weight, mean, rstd);
  }
  void norm_partial_stats(const kernels::NormShape& s, kernels::ActIn inp, float* stats) override {
    Call c("norm_partial_stats", {inp.data, stats});
    cpu().norm_partial_stats(s, inp, stats);
  }
  void norm_forward_from_stats(kernels::NormOp op, const kernels::NormShape& s, int64_t Cg_total,
                               const float* stats, kernels::ActOut out, kernels::ActIn inp,
                               const float* weight, const float* bias, float* mean, float* rstd,
                               float eps) override {
    Call c("norm_forward_from_stats", {stats, out.data, inp.data, weight, bias, mean, rstd});
    cpu().norm_forward_from_stats(op, s, Cg_total, stats, out, inp, weight, bias, mean, rstd, eps);
  }
  void norm_backward_partials(const kernels::NormShape& s, kernels::ActIn dout, kernels::ActIn inp,
                              const float* weight, const float* mean, const float* rstd,
                              float* part) override {
    Call c("norm_backward_partials", {dout.data, inp.data, weight, mean, rstd, part});
    cpu().norm_backward_partials(s, dout, inp, weight, mean, rstd, part);
  }
  void norm_backward_from_partials(kernels::NormOp op, const kernels::NormShape& s,
                                   int64_t Cg_total, const float* part, kernels::ActOut dinp,
                                   bool accumulate, float* dweight, float* dbias,
                                   kernels::ActIn dout, kernels::ActIn inp, const float* weight,
                                   const float* mean, const float* rstd) override {
    Call c("norm_backward_from_partials",
           {part, dinp.data, dweight, dbias, dout.data, inp.data, weight, mean, rstd});
    cpu().norm_backward_from_partials(op, s, Cg_total, part, dinp, accumulate, dweight, dbias, dout,
                                      inp, weight, mean, rstd);
  }

  int64_t attention_saved_elems(const kernels::AttentionShape& s) const override {
    return cpu().attention_saved_elems(s);
  }
  int64_t attention_workspace_elems(const kernels::AttentionShape& s) const override {
    return cpu().attention_workspace_elems(s);
  }
  void attention_forward(const kernels::AttentionShape& s, kernels::ActOut out, float* saved,
                         kernels::ActIn q, kernels::ActIn k, kernels::ActIn v, const float* scale,
                         float* max_abs_logit) override {
    Call c("attention_forward", {out.data, saved, q.data, k.data, v.data, scale, max_abs_logit});
    cpu().attention_forward(s, out, saved, q, k, v, scale, max_abs_logit);
  }
  void attention_backward(const kernels::AttentionShape& s, kernels::ActOut dq, kernels::ActOut dk,
                          kernels::ActOut dv, float* dscale, kernels::ActIn dout,
                          kernels::ActIn out, const float* saved, kernels::ActIn q,
                          kernels::ActIn k, kernels::ActIn v, const float* scale,
                          float* workspace) override {
    Call c("attention_backward", {dq.data, dk.data, dv.data, dscale, dout.data, out.data, saved,
                                  q.data, k.data, v.data, scale, workspace});
    cpu().attention_backward(s, dq, dk, dv, dscale, dout, out, saved, q, k, v, scale, workspace);
  }
  void attention_scales(float* out, const float* gain, int64_t H, bool shared_gain,
                        float default_scale) override {
    Call c("attention_scales", {out, gain});
    cpu().attention_scales(out, gain, H, shared_gain, default_scale);
  }
  void scale_grad_accumulate(float* grad, const float* dscale, int64_t H,
                             bool shared_gain) override {
    Call c("scale_grad_accumulate", {grad, dscale});
    cpu().scale_grad_accumulate(grad, dscale, H, shared_gain);
  }

  void rope_forward(const kernels::RopeTable& table, kernels::ActOut y, kernels::ActIn x, int64_t B,
                    int64_t T, int64_t H, int64_t D, int64_t row_stride) override {
    Call c("rope_forward", {y.data, x.data});
    cpu().rope_forward(table, y, x, B, T, H, D, row_stride);
  }
  void rope_backward(const kernels::RopeTable& table, kernels::ActOut dx, kernels::ActIn dy,
                     int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride) override {
    Call c("rope_backward", {dx.data, dy.data});
    cpu().rope_backward(table, dx, dy, B, T, H, D, row_stride);
  }

  void embedding_forward(float* out, const int32_t* tokens, int64_t N, const float* wte,
                         int64_t v_begin, int64_t V_local, int64_t C) override {
    Call c("embedding_forward", {out, tokens, wte});
    cpu().embedding_forward(out, tokens, N, wte, v_begin, V_local, C);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                          int64_t v_begin, int64_t V_local, int64_t C) override {
    Call c("embedding_backward", {dwte, dout, tokens});
    cpu().embedding_backward(dwte, dout, tokens, N, v_begin, V_local, C);
  }
  void position_forward(float* out, const float* wpe, int64_t B, int64_t T, int64_t C) override {
    Call c("position_forward", {out, wpe});
    cpu().position_forward(out, wpe, B, T, C);
  }
  void position_backward(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) override {
    Call c("position_backward", {dwpe, dout});
    cpu().position_backward(dwpe, dout, B, T, C);
  }

  void xent_row_max(kernels::ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                    float* row_max) override {
    Call c("xent_row_max", {logits.data, row_max});
    cpu().xent_row_max(logits, N, V_local, v_valid_local, row_max);
  }
  void xent_row_sumexp(kernels::ActIn logits, const float* row_max, int64_t N, int64_t V_local,
                       int64_t v_valid_local, float* sumexp) override {
    Call c("xent_row_sumexp", {logits.data, row_max, sumexp});
    cpu().xent_row_sumexp(logits, row_max, N, V_local, v_valid_local, sumexp);
  }
  void xent_row_max_sumexp(kernels::ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                           float* row_max, float* sumexp) override {
    Call c("xent_row_max_sumexp", {logits.data, row_max, sumexp});
    cpu().xent_row_max_sumexp(logits, N, V_local, v_valid_local, row_max, sumexp);
  }
  void xent_fused(kernels::ActOut dlogits, kernels::ActIn logits, const int32_t* targets, int64_t N,
                  int64_t V_local, int64_t v_valid_local, int64_t v_begin, float grad_scale,
                  float z_coef, float* row_max, float* sumexp) override {
    Call c("xent_fused", {dlogits.data, logits.data, targets, row_max, sumexp});
    cpu().xent_fused(dlogits, logits, targets, N, V_local, v_valid_local, v_begin, grad_scale,
                     z_coef, row_max, sumexp);
  }
  void xent_target_logit(kernels::ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                         int64_t v_begin, float* target_logit) override {
    Call c("xent_target_logit", {logits.data, targets, target_logit});
    cpu().xent_target_logit(logits, targets, N, V_local, v_begin, target_logit);
  }
  void xent_finish(const float* row_max, const float* sumexp, const float* target_logit, int64_t N,
                   float* lse, double* sums) override {
    Call c("xent_finish", {row_max, sumexp, target_logit, lse, sums});
    cpu().xent_finish(row_max, sumexp, target_logit, N, lse, sums);
  }
  void xent_backward(kernels::ActOut dlogits, kernels::ActIn logits, const float* lse,
                     const int32_t* targets, int64_t N, int64_t V_local, int64_t v_valid_local,
                     int64_t v_begin, float grad_scale, float z_coef) override {
    Call c("xent_backward", {dlogits.data, logits.data, lse, targets});
    cpu().xent_backward(dlogits, logits, lse, targets, N, V_local, v_valid_local, v_begin,
                        grad_scale, z_coef);
  }

  void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                    const kernels::AdamWStep& step) override {
    Call c("adamw_update", {param, grad, m, v});
    cpu().adamw_update(param, grad, m, v, n, step);
  }

 private:
  static kernels::ExecContext& cpu() { return kernels::cpu_exec(); }

  // One method call: checks the device pointers (in argument order; null allowed), then keeps
  // the memory unlocked until the method returns.
  class Call {
   public:
    Call(const char* method, std::initializer_list<const void*> device_ptrs)
        : checked_(check(method, device_ptrs)), unlocked_(FakeDeviceMemory::instance()) {
      FakeDeviceMemory::instance().count_exec_call();
    }

   private:
    static bool check(const char* method, std::initializer_list<const void*> ptrs) {
      int i = 0;
      for (const void* p : ptrs) {
        KEEL_CHECK(p == nullptr || FakeDeviceMemory::instance().is_device_range(p), kInternal,
                   "FakeDeviceExec::", method, ": device pointer argument ", i, " (", p,
                   ") is not inside a live fake-device allocation");
        ++i;
      }
      return true;
    }
    bool checked_;  // initialised first: a bad argument throws before anything is unlocked
    FakeDeviceMemory::Unlocked unlocked_;
  };

  int device_index_;
};

// Registers the fake as Device::kCuda for its lifetime: the memory backend (the previous one, if
// any, comes back afterwards) and the exec factory (unregistered afterwards), so
// make_exec(Device::kCuda) and Tensor::zeros(..., Device::kCuda) use it. Scopes may nest.
// Tensors may outlive the scope: their blocks go back to the never-destroyed FakeDeviceMemory.
class ScopedFakeDevice {
 public:
  ScopedFakeDevice() : backend_(std::make_shared<FakeDeviceBackend>()) {
    FakeDeviceMemory::instance();  // reserve the region now: a failure throws here, not later
    std::lock_guard<std::mutex> lock(state().mu);
    // A factory registered by someone else (a real CUDA one) could not be restored afterwards:
    // the registry has no getter for it.
    KEEL_CHECK(state().depth > 0 || !kernels::has_exec_factory(Device::kCuda), kInternal,
               "ScopedFakeDevice: an execution context factory for CUDA is already registered");
    previous_ = set_device_backend(Device::kCuda, backend_);
    if (state().depth++ == 0) kernels::set_exec_factory(Device::kCuda, &make_fake_exec);
  }
  ~ScopedFakeDevice() {
    std::lock_guard<std::mutex> lock(state().mu);
    replace_device_backend_if(Device::kCuda, backend_.get(), previous_);
    if (--state().depth == 0) kernels::set_exec_factory(Device::kCuda, nullptr);
  }
  ScopedFakeDevice(const ScopedFakeDevice&) = delete;
  ScopedFakeDevice& operator=(const ScopedFakeDevice&) = delete;

  FakeDeviceMemory& memory() const { return FakeDeviceMemory::instance(); }

  // The ExecFactory registered for Device::kCuda (a plain function: the fake keeps its state in
  // FakeDeviceMemory::instance()).
  static std::unique_ptr<kernels::ExecContext> make_fake_exec(int device_index) {
    return std::make_unique<FakeDeviceExec>(device_index);
  }

 private:
  struct State {
    std::mutex mu;
    int depth = 0;  // live scopes
  };
  static State& state() {
    static State* s = new State();
    return *s;
  }

  std::shared_ptr<DeviceBackend> backend_;
  std::shared_ptr<DeviceBackend> previous_;
};

}  // namespace keel::testing
