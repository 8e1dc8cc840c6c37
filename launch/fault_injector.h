// Fault injection for tests (debug.* in the config), in one place called at named points of the
// step instead of inside its arithmetic (STYLE.md: fault injection lives in config). Today:
// debug.kill_rank / kill_at_step / fault / fault_point (a rank that dies, hangs or throws at the
// start of a step, for the watchdog tests, or in the middle of a checkpoint save, for the crash
// tests).
// The spike guard's debug.inject_* faults join here when the guard is built.
#pragma once

#include <cstdint>

#include "framework/config/keel.pb.h"

namespace keel {

enum class FaultPoint {
  kStepBegin,           // before step `step` (1-based) computes anything
  kSaveMidShard,        // the save of step `step`: this rank's shard half written
  kSaveBeforeManifest,  // ... every shard written, before the manifest (rank 0)
  kSaveBeforeLatest,    // ... renamed into place, before LATEST (rank 0)
  kAfterRewind,         // a rewind at step `step`, its rewound state committed
};

class FaultInjector {
 public:
  FaultInjector(const config::Debug& cfg, int world_rank) : cfg_(cfg), world_rank_(world_rank) {}
  // Fires whatever fault the config places at (point, step) on this rank; usually nothing. THROW
  // throws keel::Error (kInternal) naming the rank and the step.
  void at(FaultPoint point, int64_t step) const;

 private:
  config::Debug cfg_;
  int world_rank_;
};

}  // namespace keel
