// Collective watchdog: a thread that ends the process when one collective has been in flight
// longer than parallel.timeout_s (a peer rank died or hangs), so a job never hangs silently.
// Communicators mark each blocking call with begin()/end(); the trainer sets the current step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace keel {

class Watchdog {
 public:
  // timeout_s <= 0 disables the watchdog (no thread is started).
  Watchdog(double timeout_s, int world_rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void begin(const char* op, const char* group);
  void end();
  void set_step(long long step) { step_.store(step); }

 private:
  void loop();
  double timeout_s_;
  int rank_;
  std::atomic<double> started_{0.0};  // wall time the current collective began; 0: none
  std::atomic<const char*> op_{""};
  std::atomic<const char*> group_{""};
  std::atomic<long long> step_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace keel
