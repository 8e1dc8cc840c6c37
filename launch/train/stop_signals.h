// Preemption: SIGTERM and SIGUSR1 (what Slurm sends before a time limit, what mpirun forwards)
// ask keel-train to finish the current step, save a checkpoint and exit 0. See Note [preemption]
// in stop_signals.cc.
#pragma once

namespace keel {

class StopSignals {
 public:
  // The same stop signal again within this many seconds of the first is ignored (srun and
  // slurmstepd each deliver one SIGTERM); later, or a different stop signal, ends the process.
  static constexpr int kRepeatWindowSeconds = 5;

  // Installs the handlers for SIGTERM and SIGUSR1 (at most one StopSignals at a time).
  explicit StopSignals(int world_rank);
  // Restores what was there before, unless a stop signal came: then the handlers stay until the
  // process exits, so a repeat during shutdown is still ignored within the window.
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // 0, or the number of the first stop signal this process received.
  static int received();

 private:
  static void on_signal(int sig);
};

}  // namespace keel
