// Per-op wall-clock accounting for `keel-bench --profile`. Disabled, a scope costs one branch.
// On a device the host only enqueues kernels, so a profiler given a sync (the execution context's
// synchronize) waits for the device at each scope's start and end: a scope then times the device
// work it enqueued (with its launch overhead), and host and device run in lockstep, so a profiled
// step is slower than an unprofiled one and only the breakdown is meaningful.
#pragma once

#include <omp.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace keel {

class Profiler {
 public:
  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  // Called at each enabled scope's start and end; empty: none (the CPU's host work is the work).
  void set_sync(std::function<void()> sync) { sync_ = std::move(sync); }
  void sync() const {
    if (sync_) sync_();
  }
  void add(const char* name, double seconds) {
    for (auto& e : entries_) {
      if (e.first == name) {
        e.second += seconds;
        return;
      }
    }
    entries_.emplace_back(name, seconds);
  }
  void reset() { entries_.clear(); }
  const std::vector<std::pair<std::string, double>>& entries() const { return entries_; }

 private:
  bool enabled_ = false;
  std::function<void()> sync_;
  std::vector<std::pair<std::string, double>> entries_;
};

class ProfileScope {
 public:
  ProfileScope(Profiler* p, const char* name) : p_(p && p->enabled() ? p : nullptr), name_(name) {
    if (p_) {
      p_->sync();
      t0_ = omp_get_wtime();
    }
  }
  ~ProfileScope() {
    if (p_) {
      try {
        p_->sync();
      } catch (...) {  // a device error: the next checked call reports it (CUDA errors stick)
      }
      p_->add(name_, omp_get_wtime() - t0_);
    }
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* p_;
  const char* name_;
  double t0_ = 0.0;
};

}  // namespace keel
