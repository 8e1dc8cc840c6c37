// The emulator's roofline measurement (roofline.h): the records, and the page-fault byte count
// behind run_measured.
#include "tests/cuda_emu/roofline.h"

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "tests/cuda_emu/signal_chain.h"

namespace keel_emu::roofline {

namespace {

std::atomic<bool> g_enabled{false};
std::mutex g_records_mu;  // the record list and every record's counts
std::vector<std::shared_ptr<Record>> g_records;
thread_local std::shared_ptr<Record> t_label;

std::mutex g_regions_mu;
std::map<uintptr_t, uintptr_t> g_regions;  // page-aligned begin -> end, of every device mapping

// ---- the measurement in progress (one at a time, under g_measure_mu) ----
//
// The handler reads these while g_measuring is set; they change only while it is not.
struct Region {
  uintptr_t begin, end;
  size_t first_page;  // its pages' index in g_page_state
};
std::mutex g_measure_mu;
std::atomic<bool> g_measuring{false};
std::vector<Region> g_active;
std::vector<uint8_t> g_page_state;  // 0 untouched, 1 read, 2 written; under g_spin
std::atomic_flag g_spin = ATOMIC_FLAG_INIT;
std::atomic<uint64_t> g_pages_read{0}, g_pages_written{0};
std::atomic<bool> g_map_failed{false};
thread_local bool t_in_measured = false;
size_t g_page = 4096;

struct sigaction g_previous {};
std::once_flag g_install_once;

void chain(int sig, siginfo_t* info, void* uc) { chain_signal(g_previous, sig, info, uc); }

// The first touch of a protected device page: open it as far as the access needs and count it.
void on_fault(int sig, siginfo_t* info, void* uc) {
  if (!g_measuring.load(std::memory_order_acquire)) return chain(sig, info, uc);
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const auto it = std::upper_bound(g_active.begin(), g_active.end(), addr,
                                   [](uintptr_t a, const Region& r) { return a < r.begin; });
  if (it == g_active.begin() || addr >= std::prev(it)->end) return chain(sig, info, uc);
  const Region& r = *std::prev(it);
  const uintptr_t page = addr / g_page * g_page;
  const size_t index = r.first_page + (page - r.begin) / g_page;
  while (g_spin.test_and_set(std::memory_order_acquire)) {
  }
  uint8_t& state = g_page_state[index];
#if defined(__x86_64__)
  // The page-fault error code's bit 1: the access was a write. (A read fault on a page already
  // open for reading is another thread's, taken before the first one's mprotect.)
  const bool write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  // Without the error code, every first fault opens the page for reading, and a write faults
  // again on it: a second fault is taken for a write (two threads' simultaneous first reads of
  // one page then count it written too).
  const bool write = state == 1;
#endif
  if (write) {
    if (state != 2) g_pages_written.fetch_add(1);
    state = 2;
  } else if (state == 0) {
    g_pages_read.fetch_add(1);
    state = 1;
  }
  const int prot = state == 2 ? PROT_READ | PROT_WRITE : PROT_READ;
  if (mprotect(reinterpret_cast<void*>(page), g_page, prot) != 0) {
    // Out of mappings (vm.max_map_count): open the whole region rather than fault forever.
    g_map_failed = true;
    mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_READ | PROT_WRITE);
  }
  g_spin.clear(std::memory_order_release);
}

void install_handler() {
  g_page = static_cast<size_t>(getpagesize());
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous);
}

}  // namespace

double peak_flops(Peak p) {
  switch (p) {
    case Peak::kTensorBf16:
      return kBf16TensorFlops;
    case Peak::kTensorTf32:
      return kTf32TensorFlops;
    case Peak::kCudaCores:
      break;
  }
  return kFp32Flops;
}

double seconds(const Record& r) {
  const double bytes = static_cast<double>(r.bytes_read + r.bytes_written);
  return std::max({bytes / kHbmBytesPerS, (r.flops + r.attention_flops) / peak_flops(r.peak),
                   static_cast<double>(r.launches) * kLaunchFloorS});
}

void set_enabled(bool on) { g_enabled = on; }
bool enabled() { return g_enabled.load(); }

std::vector<Record> take() {
  std::lock_guard<std::mutex> lock(g_records_mu);
  std::vector<Record> out;
  out.reserve(g_records.size());
  for (const auto& r : g_records) out.push_back(*r);
  g_records.clear();
  return out;
}

Label::Label(const char* name, double flops, double attention_flops, Peak peak) {
  if (!enabled()) return;
  record_ = std::make_shared<Record>();
  record_->name = name;
  record_->flops = flops;
  record_->attention_flops = attention_flops;
  record_->peak = peak;
  {
    std::lock_guard<std::mutex> lock(g_records_mu);
    g_records.push_back(record_);
  }
  outer_ = t_label;
  t_label = record_;
}

Label::~Label() {
  if (record_ != nullptr) t_label = outer_;
}

std::shared_ptr<Record> start(const char* name, double flops, Peak peak) {
  if (!enabled()) return nullptr;
  std::lock_guard<std::mutex> lock(g_records_mu);
  if (t_label != nullptr) {
    ++t_label->launches;
    t_label->flops += flops;
    return t_label;
  }
  auto r = std::make_shared<Record>();
  r->name = name;
  r->launches = 1;
  r->flops = flops;
  r->peak = peak;
  g_records.push_back(r);
  return r;
}

void run_measured(Record* rec, const std::function<void()>& task) {
  if (rec == nullptr || t_in_measured) {
    task();
    return;
  }
  std::lock_guard<std::mutex> lock(g_measure_mu);
  std::call_once(g_install_once, install_handler);
  {
    std::lock_guard<std::mutex> regions(g_regions_mu);
    g_active.clear();
    size_t pages = 0;
    for (const auto& [begin, end] : g_regions) {
      g_active.push_back({begin, end, pages});
      pages += (end - begin) / g_page;
    }
    g_page_state.assign(pages, 0);
  }
  g_pages_read = 0;
  g_pages_written = 0;
  g_measuring.store(true, std::memory_order_release);
  for (const Region& r : g_active) {
    mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_NONE);
  }
  t_in_measured = true;
  task();
  t_in_measured = false;
  for (const Region& r : g_active) {
    mprotect(reinterpret_cast<void*>(r.begin), r.end - r.begin, PROT_READ | PROT_WRITE);
  }
  g_measuring.store(false, std::memory_order_release);
  if (g_map_failed.exchange(false)) {
    std::fprintf(stderr,
                 "keel cuda emulator: roofline: out of memory mappings while counting the pages "
                 "of %s (vm.max_map_count); its bytes are a lower bound\n",
                 rec->name.c_str());
  }
  std::lock_guard<std::mutex> records(g_records_mu);
  rec->bytes_read += g_pages_read.load() * g_page;
  rec->bytes_written += g_pages_written.load() * g_page;
}

void add_region(void* begin, size_t bytes) {
  const size_t page = static_cast<size_t>(getpagesize());
  const auto b = reinterpret_cast<uintptr_t>(begin) / page * page;
  const auto e = (reinterpret_cast<uintptr_t>(begin) + bytes + page - 1) / page * page;
  std::lock_guard<std::mutex> lock(g_regions_mu);
  g_regions[b] = e;
}

void remove_region(void* begin) {
  const size_t page = static_cast<size_t>(getpagesize());
  std::lock_guard<std::mutex> lock(g_regions_mu);
  g_regions.erase(reinterpret_cast<uintptr_t>(begin) / page * page);
}

std::string summary_line(double step_ms, double model_flops_per_step) {
  const double mfu = 100.0 * model_flops_per_step / (step_ms * 1e-3 * kBf16TensorFlops);
  char line[128];
  std::snprintf(line, sizeof(line), "estimated H200 step: %.1f ms, MFU %.1f%% of 989 TFLOP/s",
                step_ms, mfu);
  return line;
}

}  // namespace keel_emu::roofline
