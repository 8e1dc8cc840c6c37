// Collective watchdog: a job never ends silently or hangs because one rank died or hangs.
// - A thread ends the process when one collective has been in flight longer than
//   parallel.timeout_s (a peer rank hangs, or died without the launcher noticing).
// - When a rank dies, the launcher ends the survivors with SIGTERM (Open MPI's mpirun ~1 s after
//   the death, then SIGKILL 1 s later; Slurm likewise), long before any timeout: the watchdog's
//   SIGTERM handler first prints what this rank was waiting in. See Note [launcher SIGTERM].
//   When SIGTERM means "save and stop" instead (keel-train), the line comes when the collective
//   stays stuck after the signal: Note [stop signal].
// Both lines name this rank, the collective, its group and the step. Communicators mark each
// blocking call with begin()/end(); the trainer sets the current step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace keel {

class Watchdog {
 public:
  // timeout_s <= 0 disables the watchdog (no thread is started, no SIGTERM handler installed).
  Watchdog(double timeout_s, int world_rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `op` and `group` must outlive the collective (string literals, a communicator's name).
  void begin(const char* op, const char* group);
  void end();
  void set_step(long long step) { step_.store(step); }
  long long step() const { return step_.load(); }  // 0 before the first step

  // Async-signal-safe: a stop signal (SIGTERM, SIGUSR1) arrived and the process carries on to
  // save. The running watchdog reports a collective that stays stuck after it (Note [stop
  // signal]); without a running watchdog, nothing happens.
  static void note_stop_signal(int sig);

 private:
  void loop();
  static void on_sigterm(int sig);   // async-signal-safe: formats with write(2) only
  void report_stuck_after_signal();  // async-signal-safe; prints once
  double timeout_s_;
  int rank_;
  std::atomic<double> started_{0.0};  // wall time the current collective began; 0: none
  std::atomic<const char*> op_{""};
  std::atomic<const char*> group_{""};
  std::atomic<long long> step_{0};
  std::atomic<double> signal_at_{0.0};  // wall time of a stop signal; 0: none
  std::atomic<int> signal_{0};
  std::atomic<bool> stuck_reported_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool handles_sigterm_ = false;
  std::thread thread_;
};

}  // namespace keel
