// Per-op wall-clock accounting for `keel-bench --profile`. Disabled, a scope costs one branch.
#pragma once

#include <omp.h>

#include <string>
#include <utility>
#include <vector>

namespace keel {

class Profiler {
 public:
  void set_enabled(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
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
  std::vector<std::pair<std::string, double>> entries_;
};

class ProfileScope {
 public:
  ProfileScope(Profiler* p, const char* name) : p_(p && p->enabled() ? p : nullptr), name_(name) {
    if (p_) t0_ = omp_get_wtime();
  }
  ~ProfileScope() {
    if (p_) p_->add(name_, omp_get_wtime() - t0_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* p_;
  const char* name_;
  double t0_ = 0.0;
};

}  // namespace keel
