// Preemption: SIGTERM and SIGUSR1 (what Slurm sends before a time limit, what mpirun forwards)
// ask keel-train to finish the current step, save a checkpoint and exit 0. See Note [preemption]
// in stop_signals.cc.
#pragma once

namespace keel {

class StopSignals {
 public:
  // Installs the handlers for SIGTERM and SIGUSR1 (at most one StopSignals at a time).
  explicit StopSignals(int world_rank);
  ~StopSignals();  // restores what was there before
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // 0, or the number of the first stop signal this process received.
  static int received();

 private:
  static void on_signal(int sig);
};

}  // namespace keel
