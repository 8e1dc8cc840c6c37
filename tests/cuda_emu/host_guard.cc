// The emulator's host guard (host_guard.h): the guarded allocations, the device scopes that open
// them, and the SIGSEGV handler that tells device work from a host dereference. The handler is
// roofline.cc's (a fault on a protected device page, thread-safe under a spinlock, chaining to
// the previous handler for any other address), deciding by the faulting thread instead of counting.
#include "tests/cuda_emu/host_guard.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tests/cuda_emu/signal_chain.h"

namespace keel_emu::host_guard {

namespace {

constexpr int kFrames = 5;  // of the call stack that made an allocation, kept for the message

struct Region {
  uintptr_t begin, end;  // the pages protected: [begin, end)
  const void* user;      // what cudaMalloc returned
  size_t bytes;
  uint64_t serial;  // the process's how-manieth cudaMalloc
  void* frames[kFrames];
  int n_frames;
  bool open;  // a device scope opened it; closed when the last scope ends
};

std::atomic<bool> g_enabled{[] {
  const char* v = std::getenv("KEEL_CUDA_EMU_HOST_GUARD");
  return v != nullptr && std::strcmp(v, "1") == 0;
}()};
std::atomic<uint64_t> g_serial{0};

// Under g_spin (a spinlock, since the handler takes it): the regions, the open ones and the count
// of open device scopes. Nothing under it touches guarded memory, and the handler allocates nothing
// (g_open's capacity is kept at the number of regions).
std::atomic_flag g_spin = ATOMIC_FLAG_INIT;
std::map<uintptr_t, Region> g_regions;
std::vector<Region*> g_open;
int64_t g_scopes = 0;
thread_local int t_depth = 0;  // this thread's open device scopes

class SpinLock {
 public:
  SpinLock() {
    while (g_spin.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~SpinLock() { g_spin.clear(std::memory_order_release); }
  SpinLock(const SpinLock&) = delete;
  SpinLock& operator=(const SpinLock&) = delete;
};

struct sigaction g_previous {};
std::once_flag g_install_once;

void chain(int sig, siginfo_t* info, void* uc) { chain_signal(g_previous, sig, info, uc); }

// The region holding addr, or null (under g_spin).
Region* find(uintptr_t addr) {
  auto it = g_regions.upper_bound(addr);
  if (it == g_regions.begin()) return nullptr;
  --it;
  return addr < it->second.end ? &it->second : nullptr;
}

// "symbol+0xoff" of a return address (the module and offset when the symbol is not exported).
std::string describe_frame(void* pc) {
  Dl_info info{};
  char buf[64];
  if (dladdr(pc, &info) == 0) {
    std::snprintf(buf, sizeof(buf), "%p", pc);
    return buf;
  }
  std::string name;
  uintptr_t base = reinterpret_cast<uintptr_t>(info.dli_fbase);
  if (info.dli_sname != nullptr) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    name = status == 0 && demangled != nullptr ? demangled : info.dli_sname;
    std::free(demangled);
    if (name.size() > 100) name = name.substr(0, 97) + "...";
    base = reinterpret_cast<uintptr_t>(info.dli_saddr);
  } else {
    const char* file = info.dli_fname != nullptr ? info.dli_fname : "?";
    const char* slash = std::strrchr(file, '/');
    name = slash != nullptr ? slash + 1 : file;
  }
  std::snprintf(buf, sizeof(buf), "+0x%lx",
                static_cast<unsigned long>(reinterpret_cast<uintptr_t>(pc) - base));
  return name + buf;
}

// The host dereference: one line, then the process ends (it is already dying of a fault).
[[noreturn]] void report(const Region& r, uintptr_t addr, bool is_write, void* pc) {
  std::string from;
  for (int i = 0; i < r.n_frames; ++i) {
    if (!from.empty()) from += " <- ";
    from += describe_frame(r.frames[i]);
  }
  char head[256];
  const auto user = reinterpret_cast<uintptr_t>(r.user);
  const std::string by = pc != nullptr ? " by " + describe_frame(pc) : "";
  std::snprintf(head, sizeof(head),
                "keel cuda emulator: host %s of device memory at 0x%lx%s (offset %ld in cudaMalloc "
                "#%llu of %zu bytes at 0x%lx, allocated from ",
                is_write ? "write" : "read", static_cast<unsigned long>(addr), by.c_str(),
                static_cast<long>(addr) - static_cast<long>(user),
                static_cast<unsigned long long>(r.serial), r.bytes,
                static_cast<unsigned long>(user));
  const std::string line = head + from +
                           "): only device work may touch it (KEEL_CUDA_EMU_HOST_GUARD, "
                           "tests/cuda_emu/host_guard.h)\n";
  const ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  _exit(kExitCode);
}

void on_fault(int sig, siginfo_t* info, void* uc) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  while (g_spin.test_and_set(std::memory_order_acquire)) {
  }
  Region* r = find(addr);
  if (r == nullptr) {
    g_spin.clear(std::memory_order_release);
    return chain(sig, info, uc);
  }
  if (r->open) {
    // Opened by a device scope since this thread faulted: the access goes through when it runs
    // again (a host access then is what the guard cannot see, host_guard.h).
    g_spin.clear(std::memory_order_release);
    return;
  }
  if (t_depth > 0) {
    if (mprotect(reinterpret_cast<void*>(r->begin), r->end - r->begin, PROT_READ | PROT_WRITE) !=
        0) {
      static const char kFailed[] = "keel cuda emulator: host guard: mprotect failed\n";
      const ssize_t ignored = write(STDERR_FILENO, kFailed, sizeof(kFailed) - 1);
      (void)ignored;
      _exit(kExitCode);
    }
    r->open = true;
    g_open.push_back(r);
    g_spin.clear(std::memory_order_release);
    return;
  }
#if defined(__x86_64__)
  // The page-fault error code's bit 1: the access was a write; the instruction that made it.
  const auto& regs = static_cast<ucontext_t*>(uc)->uc_mcontext.gregs;
  const bool is_write = (regs[REG_ERR] & 2) != 0;
  void* const pc = reinterpret_cast<void*>(regs[REG_RIP]);
#else
  const bool is_write = false;
  void* const pc = nullptr;
  (void)uc;
#endif
  report(*r, addr, is_write, pc);  // under the lock: the process ends here
}

void install_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
}

// Makes every open region PROT_NONE again (under g_spin).
void close_open() {
  for (Region* r : g_open) {
    mprotect(reinterpret_cast<void*>(r->begin), r->end - r->begin, PROT_NONE);
    r->open = false;
  }
  g_open.clear();
}

}  // namespace

void set_enabled(bool on) {
  if (on) {
    g_enabled = true;
    return;
  }
  g_enabled = false;
  SpinLock lock;
  for (auto& [begin, r] : g_regions) {
    mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_READ | PROT_WRITE);
  }
  g_regions.clear();
  g_open.clear();
}

bool enabled() { return g_enabled.load(); }

void add(void* begin, size_t bytes) {
  if (!enabled() || bytes == 0) return;
  std::call_once(g_install_once, install_handler);
  Region r{};
  void* frames[kFrames + 2];
  const int n = backtrace(frames, kFrames + 2);
  // frames[0] is here, frames[1] cudaMalloc: the stack from its caller on.
  r.n_frames = std::max(0, n - 2);
  std::copy(frames + 2, frames + 2 + r.n_frames, r.frames);
  const size_t page = static_cast<size_t>(getpagesize());
  const auto user = reinterpret_cast<uintptr_t>(begin);
  r.begin = user / page * page;
  r.end = (user + bytes + page - 1) / page * page;
  r.user = begin;
  r.bytes = bytes;
  r.serial = ++g_serial;
  SpinLock lock;
  if (mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_NONE) != 0) return;
  g_regions[r.begin] = r;
  g_open.reserve(g_regions.size());
  if (g_scopes > 0) {
    // Made inside device work (none today): open until that work ends, like the rest.
    mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_READ | PROT_WRITE);
    Region& stored = g_regions[r.begin];
    stored.open = true;
    g_open.push_back(&stored);
  }
}

void remove(void* begin) {
  const size_t page = static_cast<size_t>(getpagesize());
  SpinLock lock;
  const auto it = g_regions.find(reinterpret_cast<uintptr_t>(begin) / page * page);
  if (it == g_regions.end()) return;
  g_open.erase(std::remove(g_open.begin(), g_open.end(), &it->second), g_open.end());
  g_regions.erase(it);
}

size_t guarded() {
  SpinLock lock;
  return g_regions.size();
}

DeviceScope::DeviceScope() : counted_(enabled()) {
  if (!counted_) return;
  ++t_depth;
  SpinLock lock;
  ++g_scopes;
}

DeviceScope::~DeviceScope() {
  if (!counted_) return;
  --t_depth;
  SpinLock lock;
  if (--g_scopes == 0) close_open();
}

}  // namespace keel_emu::host_guard
