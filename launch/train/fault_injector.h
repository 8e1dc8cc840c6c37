// Fault injection for tests (debug.* in the config), in one place called at named points of the
// step instead of inside its arithmetic (STYLE.md: fault injection lives in config). Today:
// debug.kill_rank / kill_at_step / fault / fault_point (a rank that dies, hangs or throws at the
// start of a step, for the watchdog tests, or in the middle of a checkpoint save, for the crash
// tests).
// And the spike guard's debug.inject_spike_at_step / inject_nan_at_step: a step whose learning
// rate is scaled by debug.inject_factor, or whose gradients all become NaN; and
// debug.inject_bitflip_at_step, a flipped bit in one rank's gradients (Note [replay]).
#pragma once

#include <cstdint>
#include <vector>

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

  // What debug.inject_* does to step `step` (1-based). Each injection fires once per step
  // number: a step replayed after a rewind is not hit again (a real bad batch would have been
  // skipped), also in a process resumed after the rewind (`rewinds`, the steps the guard rewound
  // at, are part of the run state).
  struct Injection {
    bool spike = false;  // scale the step's learning rate by debug.inject_factor
    bool nan = false;    // every gradient of the step becomes NaN (the loss stays finite)
    // debug.inject_bitflip_at_step, on debug.inject_bitflip_rank only: one bit of one of this
    // rank's gradients flips, on the step's first computation only (Note [replay]).
    bool bitflip = false;
    // debug.inject_param_bitflip_at_step, on debug.inject_bitflip_rank only: one bit of one of
    // this rank's parameters flips after the step's update (a DP replica diverges).
    bool param_bitflip = false;
  };
  Injection inject(int64_t step, const std::vector<int64_t>& rewinds);
  double spike_factor() const { return cfg_.inject_factor(); }

 private:
  config::Debug cfg_;
  int world_rank_;
  // the last steps each injection fired at
  int64_t spike_fired_ = 0, nan_fired_ = 0, bitflip_fired_ = 0, param_bitflip_fired_ = 0;
};

}  // namespace keel
