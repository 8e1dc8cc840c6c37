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
// - Abort hooks (add_abort_hook) run after the timeout line and before the process ends: MPI's
//   shared-memory collectives need nothing, but NCCL's do (Note [abort hooks] in watchdog.cc).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

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

  // Abort hooks: when a collective outlives timeout_s, the watchdog thread prints its line, then
  // runs every registered hook once, in registration order, then ends the process as before.
  // The intended hook is NcclCommunicator::abort(): ncclCommAbort makes the NCCL call blocked in
  // the training thread return, so NCCL's kernels and proxy threads stop before the process goes
  // (Note [abort hooks]). Each hook runs on its own thread started by the watchdog thread and is
  // abandoned (one line says so; the next hook runs) when it has not returned within
  // abort_hook_grace_s(timeout_s), so a hook that hangs too cannot keep the job alive. Hooks run
  // concurrently with the stuck thread (and an abandoned hook with later ones): they must be
  // thread-safe, and must not throw (an exception is reported and ignored). A disabled watchdog
  // (timeout_s <= 0) never runs them. Both calls are thread-safe; add returns the id to remove.
  int add_abort_hook(std::function<void()> hook);
  // Removes the hook `id` (an id not registered, or already removed, is ignored). Once the
  // watchdog has begun running its hooks the process is ending (it _Exits right after them): a
  // removal then never returns, so the object a running hook uses (an NCCL communicator being
  // destroyed on another thread) outlives the hook.
  void remove_abort_hook(int id);
  // How long each hook may run: min(2 s, timeout_s / 4).
  static double abort_hook_grace_s(double timeout_s);

 private:
  void run_abort_hooks();
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
  std::mutex hooks_mu_;                                       // guards hooks_ and next_hook_id_
  std::vector<std::pair<int, std::function<void()>>> hooks_;  // in registration order
  int next_hook_id_ = 1;
  std::atomic<bool> ending_{false};  // run_abort_hooks has begun: _Exit follows
  std::thread thread_;
};

// Marks one blocking call as a collective in flight for `w` (null: no watchdog) for its lifetime:
// begin() on construction, end() on destruction. `op` must outlive it; `group` too (a
// communicator's name).
class WatchdogScope {
 public:
  WatchdogScope(Watchdog* w, const char* op, const std::string& group) : w_(w) {
    if (w_) w_->begin(op, group.c_str());
  }
  ~WatchdogScope() {
    if (w_) w_->end();
  }
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  Watchdog* w_;
};

}  // namespace keel
