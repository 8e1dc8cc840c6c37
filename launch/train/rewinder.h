// The spike guard's rewind (Note [spike guard], Note [durable rewind]): back to the newest
// verified checkpoint at least spike.rewind_margin steps before an anomalous streak began, with
// the streak's data skipped from there on; or, for a halt, the restore of the last good state.
// Also retention's question, which checkpoints a later rewind may still need (pinned()). The
// trainer reports what it returns and commits the rewound state.
#pragma once

#include <cstdint>
#include <string>

#include "checkpoints/resume.h"
#include "checkpoints/store.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"
#include "launch/train/spike_guard.h"
#include "launch/train/step_result.h"
#include "parallel/communicator.h"

namespace keel {

// What a rewind did, and the alert to report for it (kind empty: none).
struct RewindOutcome {
  bool restored = false;  // the state is the target's (with the guard's new record)
  std::string kind, action, checkpoint, message;
  int64_t rewound_to = -1;
};

class Rewinder {
 public:
  // `store` and `resumer`: the run's checkpoints (store null without a run directory).
  Rewinder(const config::KeelConfig& cfg, const Topology& topo, TrainState& state,
           const CheckpointStore* store, const Resumer& resumer, const SpikeGuard& guard);

  // Collective: rank 0 picks the target (every rank learns it: parallel/agree.h), every rank
  // loads it and records the rewind in the guard's state; rank 0 discards the newer checkpoints.
  // `halt`: restore only (no data skipped), `halt_reason` begins the alert. The caller commits
  // the restored state (Note [durable rewind]).
  RewindOutcome rewind(const StepResult& r, bool halt, const std::string& halt_reason);
  // Retention: the checkpoints the guard may still rewind to (Note [spike guard]).
  bool pinned(int64_t step) const;

 private:
  const config::KeelConfig& cfg_;
  const Topology& topo_;
  TrainState& state_;
  const CheckpointStore* store_;
  const Resumer& resumer_;
  const SpikeGuard& guard_;
  bool said_cannot_rewind_ = false;
};

}  // namespace keel
