// The CUDA emulator's scheduler and host API (see README.md here): runs the CUDA backend's kernels
// on the CPU, one fiber per CUDA thread, and stands in for the parts of the CUDA runtime and
// cuBLASLt the backend calls, so its code runs unchanged on a machine without a GPU.
//
// What it checks that a GPU would only show as a wrong number, a hang or a crash:
//  - launch configurations (block and grid limits, dynamic shared memory above 48 KiB without the
//    opt-in attribute, above the 227 KiB Hopper maximum, a stream that does not exist);
//  - threads waiting at different __syncthreads, and barriers and warp exchanges waiting for each
//    other (both hang a GPU): a fault naming the kernel, the block and where each thread waits;
//  - reads of memory nobody wrote: new device allocations and every block's shared memory, static
//    and dynamic, start as NaN (0xFF bytes); thread order alternates between blocks and launches
//    (Note [cuda-emu-order]) so a missing barrier shows whichever thread writes;
//  - accesses past the end of a device allocation or after its cudaFree: the allocation ends at a
//    protected page and cudaFree unmaps it, so the access faults.
//  - under the host guard (host_guard.h, opt-in), host code dereferencing device memory: a
//    stream's tasks and the pool's blocks run in device scopes, anything else faults.
// Kernels, copies and fills are tasks queued on their stream, run at their call or, deferred, when
// something waits for them (Note [cuda-emu-deferred] in emu.h). A launch's blocks run on the
// thread that runs it and a pool of host threads (Note [cuda-emu-blocks]); the threads of a block
// run cooperatively on one host thread, switching only at barriers and warp exchanges.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dirent.h>
#include <omp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cuda_emu/counters.h"
#include "tests/cuda_emu/emu.h"
#include "tests/cuda_emu/host_guard.h"
#include "tests/cuda_emu/roofline.h"

namespace keel_emu {

namespace {

constexpr size_t kStackBytes = size_t{256} << 10;
constexpr size_t kDefaultSharedBytes = 48 << 10;  // without the opt-in attribute
constexpr size_t kMaxSharedBytes = 232448;        // sm_90's opt-in maximum (227 KiB)

// ---- errors: the last error (cudaGetLastError) and the message that explains it ----

std::mutex g_mu;  // API state below; kernels run under g_launch_mu
std::mutex g_launch_mu;
thread_local cudaError_t g_last_error = cudaSuccess;  // per host thread, as CUDA's

cudaError_t fail(cudaError_t code, const std::string& message) {
  std::fprintf(stderr, "keel cuda emulator: %s\n", message.c_str());
  g_last_error = code;
  return code;
}

// ---- fibers: a context switch ----
//
// On x86-64, a switch saves the callee-saved registers and the SSE/x87 control words on the
// fiber's stack and swaps stack pointers (no system call; ucontext's swapcontext saves the signal
// mask with one, which made it most of the emulator's time). Elsewhere, ucontext.

#if defined(__x86_64__)
extern "C" void keel_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .globl keel_emu_switch
  .type keel_emu_switch,@function
keel_emu_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size keel_emu_switch, .-keel_emu_switch
  .popsection
)");

struct Context {
  void* sp = nullptr;
};
// Makes `c` start entry() on the stack [stack, stack + bytes) at its first switch_to.
void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;                                  // entry's return address: it never returns
  *--slot = reinterpret_cast<uint64_t>(entry);  // keel_emu_switch's ret lands here
  for (int r = 0; r < 6; ++r) *--slot = 0;      // rbp rbx r12 r13 r14 r15
  uint32_t ctl[2] = {0, 0};
  asm volatile("stmxcsr %0" : "=m"(ctl[0]));
  asm volatile("fnstcw %0" : "=m"(ctl[1]));
  --slot;
  std::memcpy(slot, ctl, sizeof(uint64_t));
  c.sp = slot;
}
inline void switch_context(Context& from, Context& to) { keel_emu_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ---- the scheduler ----

struct Fiber {
  Context ctx;
  ThreadIds ids;
  int lane = 0, warp = 0;
  enum State { kReady, kAtBarrier, kAtWarp, kDone } state = kReady;
  uint32_t wait_mask = 0;  // kAtWarp: the exchange's mask
  int src = 0;             // kAtWarp: the lane whose value it reads
  const char* what = "";   // kAtWarp: the intrinsic
  const char* file = "";   // kAtBarrier: where
  int line = 0;
  uint64_t result = 0;  // kAtWarp: the value read, set when the exchange completes
};

struct Warp {
  uint32_t exists = 0;   // lanes that are threads of the block
  uint32_t waiting = 0;  // lanes at an exchange
  uint32_t exited = 0;   // lanes whose thread has returned
  uint64_t values[32] = {};
};

// Host memory whose end touches a protected page, so an access past it faults (the dynamic shared
// memory of a launch: 16-byte aligned, as CUDA's is at least).
class GuardedBytes {
 public:
  explicit GuardedBytes(size_t bytes) : size_(bytes) {
    const size_t page = static_cast<size_t>(getpagesize());
    const size_t body = (bytes + 15) / 16 * 16;
    length_ = (body + page - 1) / page * page + page;
    void* p = mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "keel cuda emulator: out of memory for shared memory\n");
      std::abort();
    }
    base_ = static_cast<char*>(p);
    mprotect(base_ + length_ - page, page, PROT_NONE);
    data_ = base_ + length_ - page - body;
  }
  ~GuardedBytes() { munmap(base_, length_); }
  GuardedBytes(const GuardedBytes&) = delete;
  GuardedBytes& operator=(const GuardedBytes&) = delete;
  unsigned char* data() const { return reinterpret_cast<unsigned char*>(data_); }
  size_t size() const { return size_; }
  void poison() const { std::memset(data_, 0xFF, size_); }

 private:
  char* base_ = nullptr;
  char* data_ = nullptr;
  size_t size_ = 0, length_ = 0;
};

struct Block {
  const LaunchConfig* cfg = nullptr;
  void (*body)(const void*) = nullptr;
  const void* arg = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, at_barrier = 0;
  Context sched;
  std::unique_ptr<GuardedBytes> shared;  // dynamic shared memory
  // Static shared memory (Note [cuda-emu-shared] in emu.h): a fixed area, so addresses stay put;
  // each tag's offset is kept for the whole launch, the bytes re-poisoned for every block.
  std::unique_ptr<GuardedBytes> statics;  // 1 KiB-aligned: kMaxSharedBytes is 227 x 1024
  std::map<const void*, size_t> static_offsets;
  size_t statics_used = 0;
  size_t shared_limit = 0;  // static + dynamic bytes a block may use
  uint64_t launch = 0;      // the launch's number (Note [cuda-emu-order])
  std::string fault;
};

thread_local Block* t_block = nullptr;
thread_local Fiber* t_fiber = nullptr;
// The ids every thread of the running block shares (set before its fibers are made).
thread_local ThreadIds t_fiber_ids_template;
std::atomic<uint64_t> g_launches{0};  // kernels launched so far (Note [cuda-emu-order])

struct Stacks {
  std::vector<char*> stacks;
  ~Stacks() {
    for (char* s : stacks) munmap(s, kStackBytes);
  }
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p =
          mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::fprintf(stderr, "keel cuda emulator: out of memory for fiber stacks\n");
        std::abort();
      }
      mprotect(p, static_cast<size_t>(getpagesize()), PROT_NONE);  // overflow faults
      stacks.push_back(static_cast<char*>(p));
    }
    return stacks[i];
  }
};
thread_local Stacks t_stacks;

void yield() { switch_context(t_fiber->ctx, t_block->sched); }

// Releases the threads at __syncthreads, all of which must wait at the same one.
void release_barrier(Block& b) {
  const Fiber* first = nullptr;
  for (Fiber& f : b.fibers) {
    if (f.state != Fiber::kAtBarrier) continue;
    if (first == nullptr) {
      first = &f;
    } else if ((f.line != first->line || std::strcmp(f.file, first->file) != 0) &&
               b.fault.empty()) {
      std::ostringstream os;
      os << "divergent __syncthreads: thread " << first->ids.thread_idx.x << " waits at "
         << first->file << ":" << first->line << ", thread " << f.ids.thread_idx.x << " at "
         << f.file << ":" << f.line;
      b.fault = os.str();
    }
    f.state = Fiber::kReady;
  }
  b.at_barrier = 0;
}

// Completes the exchange of the lanes in `mask` once every lane of it that has not exited waits
// at it with that mask (CUDA: the non-exited threads named in the mask must take part). Reading
// an exited lane is undefined in CUDA: a fault.
void try_release_warp(Block& b, int warp, uint32_t mask) {
  Warp& w = b.warps[static_cast<size_t>(warp)];
  if (((w.waiting | w.exited) & mask) != mask || (w.waiting & mask) == 0) return;
  Fiber* lanes = &b.fibers[static_cast<size_t>(warp) * 32];
  for (int l = 0; l < 32; ++l) {
    if ((w.waiting & mask) >> l & 1u && lanes[l].wait_mask != mask) return;
  }
  for (int l = 0; l < 32; ++l) {
    if (!((w.waiting & mask) >> l & 1u)) continue;
    if ((w.exited >> lanes[l].src & 1u) && b.fault.empty()) {
      std::ostringstream os;
      os << lanes[l].what << " in thread " << lanes[l].ids.thread_idx.x << " reads lane "
         << lanes[l].src << ", which has exited";
      b.fault = os.str();
    }
    lanes[l].result = w.values[lanes[l].src];
    lanes[l].state = Fiber::kReady;
  }
  w.waiting &= ~mask;
}

void fiber_entry() {
  Block& b = *t_block;
  try {
    b.body(b.arg);
  } catch (const std::exception& e) {
    if (b.fault.empty()) b.fault = std::string("exception in device code: ") + e.what();
  } catch (...) {
    if (b.fault.empty()) b.fault = "exception in device code";
  }
  Fiber& f = *t_fiber;
  f.state = Fiber::kDone;
  --b.live;
  if (b.live > 0 && b.at_barrier == b.live) release_barrier(b);
  // Exchanges that waited only for this lane can complete now.
  Warp& w = b.warps[static_cast<size_t>(f.warp)];
  w.exited |= 1u << f.lane;
  for (int l = 0; l < 32 && w.waiting != 0; ++l) {
    if (w.waiting >> l & 1u) try_release_warp(b, f.warp, b.fibers[f.warp * 32 + l].wait_mask);
  }
  switch_context(f.ctx, b.sched);  // for good: a finished fiber is never resumed
  std::abort();
}

std::string describe_wait(const Block& b) {
  std::ostringstream os;
  int barrier = 0, done = 0;
  for (const Fiber& f : b.fibers) {
    barrier += f.state == Fiber::kAtBarrier;
    done += f.state == Fiber::kDone;
  }
  os << barrier << " thread(s) at __syncthreads, " << done << " exited";
  int shown = 0;
  for (const Fiber& f : b.fibers) {
    if (f.state != Fiber::kAtWarp || shown >= 4) continue;
    const uint32_t missing = f.wait_mask & ~b.warps[static_cast<size_t>(f.warp)].waiting;
    os << "; thread " << f.ids.thread_idx.x << "," << f.ids.thread_idx.y << ","
       << f.ids.thread_idx.z << " at " << f.what << " mask 0x" << std::hex << f.wait_mask
       << " waits for lanes 0x" << missing << std::dec;
    ++shown;
  }
  return os.str();
}

// Runs one block to completion; false (with b.fault) on a deadlock or an exception.
bool run_block(Block& b) {
  const dim3& bd = b.cfg->block;
  const int n = static_cast<int>(bd.x * bd.y * bd.z);
  b.fibers.assign(static_cast<size_t>(n), Fiber{});
  b.warps.assign(static_cast<size_t>((n + 31) / 32), Warp{});
  b.live = n;
  b.at_barrier = 0;
  b.shared->poison();
  std::memset(b.statics->data(), 0xFF, b.statics_used);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[static_cast<size_t>(i)];
    f.ids = t_fiber_ids_template;
    f.ids.thread_idx =
        uint3{static_cast<unsigned>(i) % bd.x, static_cast<unsigned>(i) / bd.x % bd.y,
              static_cast<unsigned>(i) / (bd.x * bd.y)};
    f.lane = i % 32;
    f.warp = i / 32;
    b.warps[static_cast<size_t>(f.warp)].exists |= 1u << f.lane;
    make_context(f.ctx, t_stacks.get(static_cast<size_t>(i)), kStackBytes, fiber_entry);
  }
  // Note [cuda-emu-order]: blocks alternate between running their threads in ascending and in
  // descending order between barriers (by block index, and by launch, so a one-block grid gets
  // both over its launches): a thread that reads what another writes without a barrier between
  // them reads the value from before the write (NaN in fresh shared memory) in one of the two,
  // whichever thread writes.
  const uint3 bi = t_fiber_ids_template.block_idx;
  const dim3 gd = t_fiber_ids_template.grid_dim;
  const bool descending = (bi.x + gd.x * (bi.y + gd.y * bi.z) + b.launch) % 2 == 1;
  while (b.live > 0) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      Fiber& f = b.fibers[static_cast<size_t>(descending ? n - 1 - k : k)];
      if (f.state != Fiber::kReady) continue;
      t_fiber = &f;
      switch_context(b.sched, f.ctx);
      t_fiber = nullptr;
      ran = true;
    }
    if (!b.fault.empty()) return false;
    if (!ran) {
      b.fault = "deadlock: " + describe_wait(b);
      return false;
    }
  }
  return b.fault.empty();
}

}  // namespace

const ThreadIds& ids() { return t_fiber->ids; }
int lane_id() { return t_fiber->lane; }
void* dynamic_shared() { return t_block->shared->data(); }

void wmma_fault(const char* what) {
  Block& b = *t_block;
  if (b.fault.empty()) {
    b.fault = std::string(what) + " (thread " + std::to_string(t_fiber->ids.thread_idx.x) + ")";
  }
  yield();  // the scheduler stops the block
}

void* block_static_shared(const void* tag, size_t bytes, size_t align) {
  Block& b = *t_block;
  auto it = b.static_offsets.find(tag);
  if (it == b.static_offsets.end()) {
    align = std::max<size_t>(align, 16);
    const size_t offset = (b.statics_used + align - 1) / align * align;
    if (offset + bytes + b.shared->size() > b.shared_limit || offset + bytes > b.statics->size()) {
      if (b.fault.empty()) {
        b.fault = "static shared memory (" + std::to_string(offset + bytes) + " bytes) plus " +
                  std::to_string(b.shared->size()) + " dynamic exceeds the block's " +
                  std::to_string(b.shared_limit);
      }
      yield();  // the scheduler stops the block
    }
    std::memset(b.statics->data() + b.statics_used, 0xFF, offset + bytes - b.statics_used);
    b.statics_used = offset + bytes;
    it = b.static_offsets.emplace(tag, offset).first;
  }
  return b.statics->data() + it->second;
}

void syncthreads(const char* file, int line) {
  Block& b = *t_block;
  Fiber& f = *t_fiber;
  f.state = Fiber::kAtBarrier;
  f.file = file;
  f.line = line;
  if (++b.at_barrier == b.live) release_barrier(b);
  if (f.state != Fiber::kReady) yield();
}

uint64_t warp_exchange(uint32_t mask, uint64_t bits, int src, const char* what) {
  Block& b = *t_block;
  Fiber& f = *t_fiber;
  Warp& w = b.warps[static_cast<size_t>(f.warp)];
  if (!(mask >> f.lane & 1u) || (mask & ~w.exists) || !(mask >> src & 1u)) {
    if (b.fault.empty()) {
      std::ostringstream os;
      os << what << " in thread " << f.ids.thread_idx.x << " (lane " << f.lane << ") with mask 0x"
         << std::hex << mask << " reads lane " << std::dec << src
         << ": the mask must name this lane, the lane read, and only lanes of the block (0x"
         << std::hex << w.exists << ")";
      b.fault = os.str();
    }
    yield();  // the scheduler stops the block
  }
  w.values[f.lane] = bits;
  w.waiting |= 1u << f.lane;
  f.wait_mask = mask;
  f.src = src;
  f.what = what;
  f.state = Fiber::kAtWarp;
  try_release_warp(b, f.warp, mask);
  if (f.state != Fiber::kReady) yield();
  return f.result;
}

// ---- launches ----

std::map<const void*, int>& max_shared_attr() {
  static std::map<const void*, int> m;
  return m;
}

// ---- ptxas's resources per kernel (Note [cuda-emu-resources] in emu.h) ----

namespace {

#ifndef KEEL_EMU_RESOURCES_DIR
#define KEEL_EMU_RESOURCES_DIR ""
#endif

struct KernelResources {
  int registers = 0;    // the most over the kernel's instances
  int max_threads = 0;  // the smallest __launch_bounds__ over them (0: none)
};
struct ResourceTables {
  bool loaded = false;
  int files = 0;
  std::map<std::string, KernelResources> kernels;  // "stem/name"
};

std::string source_stem(const char* path) {
  std::string s = path == nullptr ? "" : path;
  const size_t slash = s.find_last_of('/');
  if (slash != std::string::npos) s = s.substr(slash + 1);
  const size_t dot = s.find('.');
  return dot == std::string::npos ? s : s.substr(0, dot);
}

void add_resources(ResourceTables& t, const std::string& key, int registers, int max_threads) {
  KernelResources& k = t.kernels[key];
  k.registers = std::max(k.registers, registers);
  if (max_threads > 0) {
    k.max_threads = k.max_threads == 0 ? max_threads : std::min(k.max_threads, max_threads);
  }
}

// The tables cmake/nvcc_resources.py writes: kernel, source, arch, registers, stack, spill stores,
// spill loads, static shared bytes, max threads, mangled name; tab-separated. Under g_mu.
ResourceTables& resource_tables() {
  static ResourceTables t;
  if (t.loaded) return t;
  t.loaded = true;
  const std::string dir = KEEL_EMU_RESOURCES_DIR;
  DIR* d = dir.empty() ? nullptr : opendir(dir.c_str());
  if (d == nullptr) return t;
  while (const dirent* e = readdir(d)) {
    const std::string f = e->d_name;
    if (f.size() < 5 || f.compare(f.size() - 4, 4, ".tsv") != 0) continue;
    FILE* fp = std::fopen((dir + "/" + f).c_str(), "r");
    if (fp == nullptr) continue;
    ++t.files;
    char line[4096];
    while (std::fgets(line, sizeof(line), fp) != nullptr) {
      std::vector<std::string> cols;
      std::istringstream is(line);
      std::string c;
      while (std::getline(is, c, '\t')) cols.push_back(c);
      if (cols.size() < 9) continue;
      add_resources(t, cols[1] + "/" + cols[0], std::atoi(cols[3].c_str()),
                    std::atoi(cols[8].c_str()));
    }
    std::fclose(fp);
  }
  closedir(d);
  return t;
}

// Why the GPU would refuse cfg for lack of registers or over the kernel's launch bounds; empty if
// it would not. Under g_mu.
std::string resource_refusal(const LaunchConfig& cfg, uint64_t threads) {
  constexpr uint64_t kRegistersPerSm = 65536, kAllocationUnit = 256;  // sm_90, per warp
  ResourceTables& t = resource_tables();
  std::string name = cfg.name;
  if (name.rfind("::") != std::string::npos) name = name.substr(name.rfind("::") + 2);
  const auto it = t.kernels.find(source_stem(cfg.source) + "/" + name);
  std::ostringstream why;
  if (it == t.kernels.end()) {
    const bool ours = cfg.source != nullptr && std::strstr(cfg.source, "framework/kernels/cuda/");
    if (!ours) return "";  // the emulator's own test kernels have no ptxas build
    why << "no ptxas resources for " << name << " of " << source_stem(cfg.source) << ".cu in "
        << (t.files == 0 ? "" : "the ") << t.files << " table(s) of '" << KEEL_EMU_RESOURCES_DIR
        << "' (built with keel_cuda through cmake/nvcc_resources.py: rebuild keel_cuda)";
    return why.str();
  }
  const KernelResources& k = it->second;
  const uint64_t warps = (threads + 31) / 32;
  const uint64_t per_warp =
      (uint64_t(k.registers) * 32 + kAllocationUnit - 1) / kAllocationUnit * kAllocationUnit;
  if (k.max_threads > 0 && threads > uint64_t(k.max_threads)) {
    why << threads << " threads per block, above the kernel's __launch_bounds__ of "
        << k.max_threads;
  } else if (warps * per_warp > kRegistersPerSm) {
    why << threads << " threads per block at " << k.registers << " registers each (ptxas, sm_90) "
        << "need " << warps * per_warp << " registers, above the " << kRegistersPerSm
        << " of an SM";
  }
  return why.str();
}

}  // namespace

void set_kernel_resources(const char* source, const char* name, int registers, int max_threads) {
  std::lock_guard<std::mutex> lock(g_mu);
  add_resources(resource_tables(), std::string(source) + "/" + name, registers, max_threads);
}

// ---- streams: queues of tasks, pending collectives, waits and event markers ----
//
// Note [cuda-emu-deferred] (emu.h) has the model. A stream is a queue of operations in stream
// order; an operation completes only after every operation before it on its stream. complete()
// runs a stream's queue up to an operation on the calling thread: it runs tasks, polls pending
// collectives, and completes the operations a wait names on other streams first (an event names
// the point of its record, so waits form no cycles). Several host threads may drive queues at
// once: a task runs on one of them (`running`), the others wait for it.

namespace {

struct Stream;
struct Op {
  enum class Kind { kTask, kPending, kWait, kMarker };
  Kind kind = Kind::kTask;
  Stream* stream = nullptr;
  std::function<void()> task;                // kTask
  std::shared_ptr<Pending> pending;          // kPending
  std::vector<std::shared_ptr<Op>> after;    // kWait: operations of other streams
  std::chrono::steady_clock::time_point at;  // kMarker: when it completed (event timing)
  bool done = false;                         // under g_mu
  bool running = false;                      // under g_mu: a thread runs its task
};
struct Stream {
  bool blocking = true;  // false: cudaStreamNonBlocking, which the legacy default stream skips
  std::deque<std::shared_ptr<Op>> ops;  // not yet completed (done ones are dropped lazily)
};
struct Event {
  std::shared_ptr<Op> marker;  // the record's point in its stream; null: never recorded
};
Stream g_default_stream;  // the null stream
std::set<cudaStream_t>& live_streams() {
  static std::set<cudaStream_t> s;
  return s;
}
Stream& stream_of(cudaStream_t s) {
  return s == nullptr ? g_default_stream : *reinterpret_cast<Stream*>(s);
}

std::atomic<bool> g_deferred{[] {
  const char* v = std::getenv("KEEL_CUDA_EMU_DEFERRED");
  return v != nullptr && std::strcmp(v, "1") == 0;
}()};

// A fault of a task that ran outside its own call (deferred, or behind a pending collective): the
// next synchronising call reports it, as a GPU reports a kernel's fault.
std::atomic<cudaError_t> g_async_error{cudaSuccess};
thread_local const Op* t_submitting = nullptr;  // the task whose own call runs it (eager mode)

// The last not-completed operation of `s`, or null (under g_mu).
std::shared_ptr<Op> tail(Stream& s) {
  while (!s.ops.empty() && s.ops.back()->done) s.ops.pop_back();
  return s.ops.empty() ? nullptr : s.ops.back();
}

// Queues `op` on stream `sid` (under g_mu), after the implicit waits of the legacy default stream:
// work on it waits for every blocking stream, and work on a blocking stream waits for it.
void push(cudaStream_t sid, std::shared_ptr<Op> op) {
  Stream& s = stream_of(sid);
  std::vector<std::shared_ptr<Op>> implicit;
  if (sid == nullptr) {
    for (cudaStream_t o : live_streams()) {
      if (!stream_of(o).blocking) continue;
      if (auto t = tail(stream_of(o))) implicit.push_back(std::move(t));
    }
  } else if (s.blocking) {
    if (auto t = tail(g_default_stream)) implicit.push_back(std::move(t));
  }
  if (!implicit.empty()) {
    auto w = std::make_shared<Op>();
    w->kind = Op::Kind::kWait;
    w->stream = &s;
    w->after = std::move(implicit);
    s.ops.push_back(std::move(w));
  }
  op->stream = &s;
  s.ops.push_back(std::move(op));
}

// Runs `op`'s stream up to and including `op`; block=false returns false where it would wait.
bool complete(const std::shared_ptr<Op>& op, bool block) {
  if (op == nullptr) return true;
  for (;;) {
    std::shared_ptr<Op> front;
    {
      std::unique_lock<std::mutex> lock(g_mu);
      if (op->done) return true;
      Stream& s = *op->stream;
      while (!s.ops.empty() && s.ops.front()->done) s.ops.pop_front();
      front = s.ops.front();  // op is queued and not done, so the queue is not empty
      if (front->running) {
        if (!block) return false;
        lock.unlock();
        std::this_thread::yield();
        continue;
      }
      if (front->kind == Op::Kind::kMarker) {
        front->at = std::chrono::steady_clock::now();
        front->done = true;
        continue;
      }
      if (front->kind == Op::Kind::kTask) front->running = true;
    }
    switch (front->kind) {
      case Op::Kind::kTask: {
        const cudaError_t before = g_last_error;
        g_last_error = cudaSuccess;
        {
          // Device work: under the host guard it may touch device memory (host_guard.h).
          const host_guard::DeviceScope device;
          front->task();
        }
        const cudaError_t e = g_last_error;
        if (e == cudaSuccess) g_last_error = before;
        if (e != cudaSuccess && front.get() != t_submitting) {
          cudaError_t none = cudaSuccess;
          g_async_error.compare_exchange_strong(none, e);
        }
        std::lock_guard<std::mutex> lock(g_mu);
        front->task = nullptr;  // its arguments go now
        front->running = false;
        front->done = true;
        break;
      }
      case Op::Kind::kPending:
        if (front->pending->test()) {
          std::lock_guard<std::mutex> lock(g_mu);
          front->done = true;
        } else if (!block) {
          return false;
        } else {
          std::this_thread::yield();
        }
        break;
      case Op::Kind::kWait: {
        for (const auto& dep : front->after) {
          if (!complete(dep, block)) return false;
        }
        std::lock_guard<std::mutex> lock(g_mu);
        front->done = true;
        break;
      }
      case Op::Kind::kMarker:
        break;
    }
  }
}

// Completes what `sid` holds now; with legacy semantics for the null stream (which also waits for
// the blocking streams).
bool complete_stream(cudaStream_t sid, bool block) {
  std::vector<std::shared_ptr<Op>> targets;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (sid == nullptr) {
      for (cudaStream_t o : live_streams()) {
        if (!stream_of(o).blocking) continue;
        if (auto t = tail(stream_of(o))) targets.push_back(std::move(t));
      }
    }
    if (auto t = tail(stream_of(sid))) targets.push_back(std::move(t));
  }
  for (const auto& t : targets) {
    if (!complete(t, block)) return false;
  }
  return true;
}

// The fault of a deferred task, reported once by a synchronising call.
cudaError_t take_async_error() { return g_async_error.exchange(cudaSuccess); }

}  // namespace

bool deferred() { return g_deferred.load(); }
bool set_deferred(bool on) { return g_deferred.exchange(on); }

void submit(cudaStream_t stream, std::function<void()> task) {
  auto op = std::make_shared<Op>();
  op->task = std::move(task);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    push(stream, op);
  }
  if (deferred()) return;
  const Op* const outer = t_submitting;
  t_submitting = op.get();
  complete(op, /*block=*/true);  // eager: at its call, after the stream's earlier work
  t_submitting = outer;
}

void enqueue_pending(cudaStream_t stream, std::shared_ptr<Pending> work) {
  auto op = std::make_shared<Op>();
  op->kind = Op::Kind::kPending;
  op->pending = std::move(work);
  std::lock_guard<std::mutex> lock(g_mu);
  push(stream, std::move(op));
}

void wait_stream(cudaStream_t stream) { complete_stream(stream, /*block=*/true); }

void wait_stream_touching(cudaStream_t stream, const void* p, size_t n) {
  for (;;) {
    std::vector<std::shared_ptr<Op>> touching;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      for (const auto& op : stream_of(stream).ops) {
        if (!op->done && op->kind == Op::Kind::kPending && op->pending->touches(p, n)) {
          touching.push_back(op);
        }
      }
    }
    if (touching.empty()) return;
    bool all = true;
    for (const auto& op : touching) {
      if (op->pending->test()) {
        std::lock_guard<std::mutex> lock(g_mu);
        op->done = true;
      } else {
        all = false;
      }
    }
    if (all) return;
    std::this_thread::yield();
  }
}

void prepare_collective(cudaStream_t stream) {
  std::vector<std::shared_ptr<Op>> ops;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ops.assign(stream_of(stream).ops.begin(), stream_of(stream).ops.end());
  }
  for (const auto& op : ops) {
    if (op->kind == Op::Kind::kTask) {
      complete(op, /*block=*/true);
    } else if (op->kind == Op::Kind::kWait) {
      // A wait only orders other streams' work first: completing it ahead of the collectives
      // pending before it on this stream is a schedule a GPU could run too.
      for (const auto& dep : op->after) complete(dep, /*block=*/true);
      std::lock_guard<std::mutex> lock(g_mu);
      op->done = true;
    }
  }
}

namespace {
void wait_all_streams() {
  std::vector<cudaStream_t> all;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    all.assign(live_streams().begin(), live_streams().end());
  }
  wait_stream(nullptr);
  for (cudaStream_t s : all) wait_stream(s);
}
}  // namespace

int device_count() {
  static const int n = [] {
    const char* env = std::getenv("KEEL_CUDA_EMU_DEVICES");
    const int v = env != nullptr ? std::atoi(env) : 1;
    return v >= 1 && v <= 64 ? v : 1;
  }();
  return n;
}

namespace {
thread_local int t_device = 0;
}  // namespace

// Note [cuda-emu-blocks]: a launch's blocks run on the launching thread and on up to
// OMP_NUM_THREADS - 1 pool threads at once (each with its own stacks, its own shared memory and
// the scheduler of its block), so blocks that race with each other without atomics can show it,
// and the emulator uses the cores the tests are given.
class WorkerPool {
 public:
  WorkerPool() {
    const int n = std::max(1, omp_get_max_threads()) - 1;
    for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(i + 1); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  size_t size() const { return threads_.size(); }

  // Runs job(0) here and job(1) .. job(workers - 1) on pool threads; returns when all are done.
  void run(int workers, const std::function<void(int)>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      workers_ = workers;
      pending_ = workers - 1;
      ++generation_;
    }
    cv_.notify_all();
    job(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
        if (id >= workers_) continue;
        job = job_;
      }
      {
        const host_guard::DeviceScope device;  // a block's work is device work (host_guard.h)
        (*job)(id);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        --pending_;
      }
      done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  int workers_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool quit_ = false;
};
WorkerPool g_pool;

// Runs a launch's grid (checked by run_grid) on this thread and the pool; a fault goes to this
// thread's cudaGetLastError.
void execute_grid(const LaunchConfig& cfg, size_t allowed, void (*body)(const void*),
                  const void* arg) {
  const dim3 &g = cfg.grid, &bd = cfg.block;
  std::lock_guard<std::mutex> launch_lock(g_launch_mu);
  const uint64_t launch = g_launches++;
  const uint64_t blocks = uint64_t{g.x} * g.y * g.z;
  const int workers = static_cast<int>(std::min<uint64_t>(blocks, g_pool.size() + 1));
  std::vector<std::string> faults(static_cast<size_t>(workers));
  std::atomic<bool> stop{false};
  // Worker w runs blocks w, w + workers, ... on its host thread, in its own Block (Note
  // [cuda-emu-blocks]).
  const auto work = [&](int w) {
    Block b;
    b.cfg = &cfg;
    b.body = body;
    b.arg = arg;
    b.shared = std::make_unique<GuardedBytes>(cfg.shared_bytes);
    b.statics = std::make_unique<GuardedBytes>(kMaxSharedBytes);
    // Static plus dynamic: 48 KiB, or with the opt-in the device's maximum (the attribute bounds
    // the dynamic part alone, checked above).
    b.shared_limit = allowed > kDefaultSharedBytes ? kMaxSharedBytes : kDefaultSharedBytes;
    b.launch = launch;
    Block* const outer_block = t_block;
    t_block = &b;
    t_fiber_ids_template.block_dim = bd;
    t_fiber_ids_template.grid_dim = g;
    for (uint64_t i = static_cast<uint64_t>(w); i < blocks && !stop.load(); i += workers) {
      const auto x = static_cast<unsigned>(i % g.x), y = static_cast<unsigned>(i / g.x % g.y),
                 z = static_cast<unsigned>(i / (uint64_t{g.x} * g.y));
      t_fiber_ids_template.block_idx = uint3{x, y, z};
      if (!run_block(b)) {
        std::ostringstream os;
        os << "kernel " << cfg.name << " block (" << x << "," << y << "," << z << ") of grid ("
           << g.x << "," << g.y << "," << g.z << "), block (" << bd.x << "," << bd.y << "," << bd.z
           << "): " << b.fault;
        faults[static_cast<size_t>(w)] = os.str();
        stop = true;
      }
    }
    t_block = outer_block;
  };
  g_pool.run(workers, work);
  for (const std::string& f : faults) {
    if (f.empty()) continue;
    std::lock_guard<std::mutex> lock(g_mu);
    fail(cudaErrorLaunchFailure, f);  // on the thread that ran it (Note [cuda-emu-deferred])
    break;
  }
}

void run_grid(const LaunchConfig& cfg, void (*body)(const void*), std::shared_ptr<const void> arg) {
  std::ostringstream why;
  const dim3 &g = cfg.grid, &bd = cfg.block;
  const uint64_t threads = uint64_t{bd.x} * bd.y * bd.z;
  counters::record_launch(cfg.name, uint64_t{g.x} * g.y * g.z, threads, -1);
  size_t allowed = kDefaultSharedBytes;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto attr = max_shared_attr().find(cfg.kernel);
    if (attr != max_shared_attr().end()) {
      allowed = std::max(allowed, static_cast<size_t>(attr->second));
    }
    if (threads == 0 || threads > 1024 || bd.x > 1024 || bd.y > 1024 || bd.z > 64) {
      why << "block (" << bd.x << "," << bd.y << "," << bd.z << ") is not 1 to 1024 threads";
    } else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 ||
               g.z > 65535) {
      why << "grid (" << g.x << "," << g.y << "," << g.z << ") is outside the limits";
    } else if (cfg.kernel == nullptr && cfg.shared_bytes > kDefaultSharedBytes) {
      why << cfg.shared_bytes << " bytes of dynamic shared memory for a kernel launched without "
          << "its template arguments (the emulator cannot check its opt-in: name them)";
    } else if (cfg.shared_bytes > allowed) {
      why << cfg.shared_bytes << " bytes of dynamic shared memory, above the " << allowed
          << " allowed (cudaFuncAttributeMaxDynamicSharedMemorySize)";
    } else if (cfg.stream != nullptr && !live_streams().count(cfg.stream)) {
      why << "stream " << static_cast<const void*>(cfg.stream) << " does not exist";
    }
    if (!why.str().empty()) {
      fail(cudaErrorInvalidConfiguration, std::string("launch of ") + cfg.name + ": " + why.str());
      return;
    }
    const std::string refused = resource_refusal(cfg, threads);
    if (!refused.empty()) {
      fail(cudaErrorLaunchOutOfResources, std::string("launch of ") + cfg.name + ": " + refused);
      return;
    }
  }
  // The grid runs as a task of its stream (Note [cuda-emu-deferred]), with copies of what it needs;
  // in the roofline's estimate mode (roofline.h) with the bytes it touches counted.
  submit(cfg.stream, [cfg, allowed, body, arg = std::move(arg), rec = roofline::start(cfg.name)] {
    roofline::run_measured(rec.get(), [&] { execute_grid(cfg, allowed, body, arg.get()); });
  });
}

// ---- memory ----

namespace {

struct Mapping {
  char* base;
  size_t length;
};
std::map<void*, Mapping>& device_allocations() {
  static std::map<void*, Mapping> m;
  return m;
}
std::map<void*, size_t>& host_allocations() {  // cudaMallocHost: page-locked on a GPU
  static std::map<void*, size_t> m;
  return m;
}

// The allocation in `m` that holds p, or m.end().
template <typename Map, typename Size>
typename Map::iterator containing(Map& m, const void* p, Size size_of) {
  auto it = m.upper_bound(const_cast<void*>(p));
  if (it == m.begin()) return m.end();
  --it;
  const char* start = static_cast<const char*>(it->first);
  return static_cast<const char*>(p) < start + size_of(it->second) ? it : m.end();
}

// Whether p is host memory a GPU could not copy to or from directly: neither a device allocation
// nor cudaMallocHost's page-locked memory (counters.h: a pageable copy waits for the device).
bool is_pageable(const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  return containing(device_allocations(), p, [](const Mapping& m) { return m.length; }) ==
             device_allocations().end() &&
         containing(host_allocations(), p, [](size_t n) { return n; }) == host_allocations().end();
}

}  // namespace

cudaError_t sort_pairs_i32(void* temp, size_t& temp_bytes, const int32_t* keys_in,
                           int32_t* keys_out, const int32_t* values_in, int32_t* values_out, int n,
                           int begin_bit, int end_bit, cudaStream_t stream) {
  constexpr size_t kTempBytes = 256;  // the emulator needs none; a size keeps callers honest
  if (temp == nullptr) {
    temp_bytes = kTempBytes;
    return cudaSuccess;
  }
  if (temp_bytes < kTempBytes || n < 0 || begin_bit < 0 || end_bit > 32 || begin_bit >= end_bit) {
    std::lock_guard<std::mutex> lock(g_mu);
    return fail(cudaErrorInvalidValue, "cub::DeviceRadixSort::SortPairs: bad arguments");
  }
  counters::record_launch("cub::DeviceRadixSort::SortPairs", 0, 0, n);
  const uint32_t keymask =
      (end_bit == 32 ? 0xffffffffu : ((1u << end_bit) - 1u)) & ~((1u << begin_bit) - 1u);
  submit(stream, [=, rec = roofline::start("cub::DeviceRadixSort::SortPairs")] {
    roofline::run_measured(rec.get(), [&] {
      std::vector<int> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return (static_cast<uint32_t>(keys_in[a]) & keymask) <
               (static_cast<uint32_t>(keys_in[b]) & keymask);
      });
      std::vector<int32_t> k(static_cast<size_t>(n)), v(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        k[static_cast<size_t>(i)] = keys_in[order[static_cast<size_t>(i)]];
        v[static_cast<size_t>(i)] = values_in[order[static_cast<size_t>(i)]];
      }
      std::copy(k.begin(), k.end(), keys_out);
      std::copy(v.begin(), v.end(), values_out);
    });
  });
  return cudaSuccess;
}

}  // namespace keel_emu

using keel_emu::fail;
using keel_emu::g_mu;

// ---- the CUDA runtime API the backend uses ----

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = keel_emu::device_count();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (device < 0 || device >= keel_emu::device_count()) {
    return fail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) +
                                            "): " + std::to_string(keel_emu::device_count()) +
                                            " emulated device(s) (KEEL_CUDA_EMU_DEVICES)");
  }
  keel_emu::t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = keel_emu::t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= keel_emu::device_count()) {
    std::lock_guard<std::mutex> lock(g_mu);
    return fail(cudaErrorInvalidDevice,
                "cudaGetDeviceProperties(" + std::to_string(device) + "): no such emulated device");
  }
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "keel CUDA emulator (host CPU)");
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = size_t{80} << 30;
  prop->multiProcessorCount = 132;
  prop->sharedMemPerBlock = keel_emu::kDefaultSharedBytes;
  prop->sharedMemPerBlockOptin = keel_emu::kMaxSharedBytes;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorLaunchOutOfResources:
      return "cudaErrorLaunchOutOfResources";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    default:
      return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "emulated CUDA error (see the emulator's message above)";
}

cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> lock(g_mu);
  cudaError_t e = keel_emu::g_last_error;
  if (e == cudaSuccess) e = keel_emu::take_async_error();  // a deferred task's fault
  keel_emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  std::lock_guard<std::mutex> lock(g_mu);
  return keel_emu::g_last_error != cudaSuccess ? keel_emu::g_last_error
                                               : keel_emu::g_async_error.load();
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  keel_emu::counters::record_allocation(bytes, /*pinned=*/false);
  const size_t page = static_cast<size_t>(getpagesize());
  const size_t body = (bytes + 255) / 256 * 256;  // the start stays 256-byte aligned
  const size_t length = (body + page - 1) / page * page + page;
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  std::lock_guard<std::mutex> lock(g_mu);
  if (p == MAP_FAILED) return fail(cudaErrorMemoryAllocation, "cudaMalloc: out of host memory");
  char* base = static_cast<char*>(p);
  char* guard = base + length - page;
  mprotect(guard, page, PROT_NONE);  // one byte past the (256-rounded) end faults
  char* user = guard - body;
  std::memset(user, 0xFF, body);  // NaN in fp32 and bf16: unwritten memory shows
  keel_emu::device_allocations()[user] = {base, length};
  keel_emu::roofline::add_region(user, body);
  keel_emu::host_guard::add(user, bytes);  // PROT_NONE to host code under the guard
  *ptr = user;
  return cudaSuccess;
}

// device.cc's allocator calls this when its cache hands a block out again (KEEL_CUDA_EMULATOR):
// the block reads as NaN to its new owner, like a fresh cudaMalloc. The allocator's blocks are
// ordered on `stream` (Note [cuda-stream-order]): deferred, the fill is queued there, so work of
// another stream that still uses the block without a synchronisation reads NaN; at once otherwise,
// after the collectives still pending on the block.
void keel_cuda_emu_block_reused(void* block, size_t bytes, cudaStream_t stream) {
  if (keel_emu::deferred()) {
    keel_emu::submit(stream, [block, bytes] { std::memset(block, 0xFF, bytes); });
    return;
  }
  std::vector<cudaStream_t> all;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    all.assign(keel_emu::live_streams().begin(), keel_emu::live_streams().end());
  }
  keel_emu::wait_stream_touching(nullptr, block, bytes);
  for (cudaStream_t s : all) keel_emu::wait_stream_touching(s, block, bytes);
  keel_emu::submit(stream, [block, bytes] { std::memset(block, 0xFF, bytes); });
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  keel_emu::counters::record_sync("cudaFree");
  keel_emu::wait_all_streams();  // cudaFree synchronises the device
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = keel_emu::device_allocations().find(ptr);
  if (it == keel_emu::device_allocations().end()) {
    return fail(cudaErrorInvalidValue, "cudaFree of a pointer cudaMalloc did not return");
  }
  keel_emu::roofline::remove_region(ptr);
  keel_emu::host_guard::remove(ptr);
  munmap(it->second.base, it->second.length);  // later use faults
  keel_emu::device_allocations().erase(it);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  keel_emu::counters::record_allocation(bytes, /*pinned=*/true);
  const size_t rounded = (bytes + 255) / 256 * 256;
  *ptr = bytes == 0 ? nullptr : std::aligned_alloc(256, rounded);
  std::lock_guard<std::mutex> lock(g_mu);
  if (bytes != 0 && *ptr == nullptr) {
    return fail(cudaErrorMemoryAllocation, "cudaMallocHost: out of host memory");
  }
  if (*ptr != nullptr) keel_emu::host_allocations()[*ptr] = rounded;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_mu);
  if (!keel_emu::host_allocations().erase(ptr)) {
    return fail(cudaErrorInvalidValue, "cudaFreeHost of a pointer cudaMallocHost did not return");
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  *attr = cudaPointerAttributes{};
  attr->type = cudaMemoryTypeUnregistered;
  auto& dev = keel_emu::device_allocations();
  auto& host = keel_emu::host_allocations();
  if (keel_emu::containing(dev, ptr, [](const keel_emu::Mapping& m) { return m.length; }) !=
      dev.end()) {
    attr->type = cudaMemoryTypeDevice;
    attr->devicePointer = const_cast<void*>(ptr);
  } else if (keel_emu::containing(host, ptr, [](size_t n) { return n; }) != host.end()) {
    attr->type = cudaMemoryTypeHost;
    attr->hostPointer = const_cast<void*>(ptr);
    attr->devicePointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

// Async copies and fills are tasks of their stream (Note [cuda-emu-deferred]), which read their
// source when they run: CUDA lets a copy between device and pageable memory run asynchronously
// too ("might be synchronous"), so keel must not rely on either.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/,
                            cudaStream_t stream) {
  if (bytes > 0 && (keel_emu::is_pageable(dst) || keel_emu::is_pageable(src))) {
    keel_emu::counters::record_sync("pageable cudaMemcpyAsync");
  }
  if (bytes > 0) {
    keel_emu::submit(stream, [=, rec = keel_emu::roofline::start("cudaMemcpyAsync")] {
      keel_emu::roofline::run_measured(rec.get(), [=] { std::memmove(dst, src, bytes); });
    });
  }
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/) {
  keel_emu::counters::record_sync("cudaMemcpy");
  keel_emu::wait_stream(nullptr);  // the legacy default stream
  if (bytes > 0) {
    const keel_emu::host_guard::DeviceScope device;  // the copy engine's work (host_guard.h)
    std::memmove(dst, src, bytes);
  }
  return keel_emu::take_async_error();
}
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) {
    keel_emu::submit(stream, [=, rec = keel_emu::roofline::start("cudaMemsetAsync")] {
      keel_emu::roofline::run_measured(rec.get(), [=] { std::memset(dst, value, bytes); });
    });
  }
  return cudaSuccess;
}
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {  // asynchronous to the host
  return cudaMemsetAsync(dst, value, bytes, nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* s = new keel_emu::Stream;
  s->blocking = (flags & cudaStreamNonBlocking) == 0;
  *stream = reinterpret_cast<cudaStream_t>(s);
  keel_emu::live_streams().insert(*stream);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!keel_emu::live_streams().count(stream)) {
      return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of an unknown stream");
    }
  }
  keel_emu::wait_stream(stream);  // its work completes first, as on a GPU
  std::lock_guard<std::mutex> lock(g_mu);
  keel_emu::live_streams().erase(stream);
  delete reinterpret_cast<keel_emu::Stream*>(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  keel_emu::counters::record_sync("cudaStreamSynchronize");
  keel_emu::wait_stream(stream);
  return keel_emu::take_async_error();
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (!keel_emu::complete_stream(stream, /*block=*/false)) return cudaErrorNotReady;
  return keel_emu::take_async_error();
}
cudaError_t cudaDeviceSynchronize() {
  keel_emu::counters::record_sync("cudaDeviceSynchronize");
  keel_emu::wait_all_streams();
  return keel_emu::take_async_error();
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new keel_emu::Event);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned /*flags*/) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<keel_emu::Event*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto& e = *reinterpret_cast<keel_emu::Event*>(event);
  auto marker = std::make_shared<keel_emu::Op>();
  marker->kind = keel_emu::Op::Kind::kMarker;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    keel_emu::push(stream, marker);
    e.marker = marker;
  }
  // Eager, the marker completes now unless collectives are still pending before it.
  if (!keel_emu::deferred()) keel_emu::complete(marker, /*block=*/false);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  keel_emu::counters::record_sync("cudaEventSynchronize");
  std::shared_ptr<keel_emu::Op> marker;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    marker = reinterpret_cast<keel_emu::Event*>(event)->marker;
  }
  keel_emu::complete(marker, /*block=*/true);
  return keel_emu::take_async_error();
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::shared_ptr<keel_emu::Op> marker;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    marker = reinterpret_cast<keel_emu::Event*>(event)->marker;
  }
  if (!keel_emu::complete(marker, /*block=*/false)) return cudaErrorNotReady;
  return keel_emu::take_async_error();
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned /*flags*/) {
  auto& e = *reinterpret_cast<keel_emu::Event*>(event);
  std::lock_guard<std::mutex> lock(g_mu);
  if (e.marker == nullptr || e.marker->done) return cudaSuccess;
  auto wait = std::make_shared<keel_emu::Op>();
  wait->kind = keel_emu::Op::Kind::kWait;
  wait->after.push_back(e.marker);
  keel_emu::push(stream, std::move(wait));
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto& a = reinterpret_cast<keel_emu::Event*>(start)->marker;
  const auto& b = reinterpret_cast<keel_emu::Event*>(end)->marker;
  if (a == nullptr || b == nullptr) {
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime of an unrecorded event");
  }
  if (!a->done || !b->done) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || static_cast<size_t>(value) > keel_emu::kMaxSharedBytes) {
    return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                           " bytes of dynamic shared memory, above the " +
                                           std::to_string(keel_emu::kMaxSharedBytes) +
                                           " an sm_90 block can have");
  }
  keel_emu::max_shared_attr()[func] = value;
  return cudaSuccess;
}

}  // extern "C"
