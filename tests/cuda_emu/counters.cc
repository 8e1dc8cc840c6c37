// The emulator's counts (counters.h): one snapshot's worth of state behind a mutex.
#include "tests/cuda_emu/counters.h"

#include <mutex>

namespace keel_emu::counters {

namespace {

constexpr size_t kMaxListed = size_t{1} << 20;

std::mutex g_counters_mu;
Snapshot& state() {
  static Snapshot s;
  return s;
}

}  // namespace

void reset() {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  state() = Snapshot{};
}

Snapshot snapshot() {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  return state();
}

void record_launch(const char* kernel, uint64_t blocks, uint64_t threads, int64_t elements) {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  Snapshot& s = state();
  ++s.launches_by_kernel[kernel];
  ++s.launches;
  // Bounded, so a long run that never resets (the whole test binary) does not grow without end.
  if (s.launch_list.size() < kMaxListed)
    s.launch_list.push_back({kernel, blocks, threads, elements});
}

void record_sync(const char* call) {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  Snapshot& s = state();
  ++s.syncs_by_call[call];
  ++s.syncs;
}

void record_allocation(uint64_t bytes, bool pinned) {
  std::lock_guard<std::mutex> lock(g_counters_mu);
  Snapshot& s = state();
  if (pinned) {
    ++s.pinned_allocations;
  } else {
    ++s.device_allocations;
    s.device_bytes += bytes;
  }
}

}  // namespace keel_emu::counters
