// What one training step produced (StepResult) and the decide phase's verdict on it (Verdict):
// the values the trainer's loop, its log (run_log.h) and the rewinder (rewinder.h) pass around.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launch/train/spike_guard.h"

namespace keel {

struct StepResult {
  int64_t step = 0;     // 1-based optimizer step just taken
  double loss = 0.0;    // mean cross-entropy over the global batch, nats/token
  double z_loss = 0.0;  // z-loss term (coefficient included)
  double log_z = 0.0;   // mean log-partition of the output logits (logged with or without z-loss)
  double grad_norm = 0.0;  // global gradient norm before clipping
  float lr = 0.0f;
  float max_attn_logit = 0.0f;  // largest |scaled q.k| of the step, over layers, heads and ranks
  // [n_layers]: each block's largest |scaled q.k| of the step (over heads and ranks), and the
  // first block holding the step's largest (-1 without blocks)
  std::vector<float> max_attn_logit_layers;
  int max_attn_logit_layer = -1;
  double seconds = 0.0;         // wall time of the step
  double comm_exposed_s = 0.0;  // DP gradient sync time not hidden behind backward
  double comm_window_s = 0.0;   // from the first bucket's launch to the sync's end
  double backward_s = 0.0;      // time of the last micro-batch's backward (overlap window)
  uint64_t first_sample = 0;    // the step's first training sample
  GuardVerdict guard;           // the spike guard's verdict on the step
  bool rewound = false;         // the guard rewound after this step (state_->step went back)
  // This rank's loss partials (cross-entropy, z-loss, log Z summed over its micro-batches)
  // before the all-reduce: what a replay compares besides the gradients (Note [replay]).
  double local_stats[3] = {0.0, 0.0, 0.0};
  // With activation-norm recording on (a replay): this rank's sum of squares of each block's
  // output, over its micro-batches and its rows of the stream; empty otherwise.
  std::vector<double> act_sq_layers;
  // The step was computed twice (Note [replay]): "same", or "different" with the ranks named.
  std::string replay;
};

// What the decide phase chose for the step's gradients.
enum class StepDecision {
  kApply,   // clip and update
  kSkip,    // an anomalous step: no update (Note [spike guard])
  kRewind,  // rewind to a checkpoint before the anomalies, skip their data
  kHalt,    // too many rewinds: restore the last good checkpoint and stop (exit 3)
  // a replay of the step differed (suspected hardware) and spike.on_hardware_fault=STOP: save
  // the state (no update applied) and stop (exit 4)
  kHardwareStop,
};

// The decide phase's verdict (STYLE.md, a verdict as a value): what to do with the step's
// gradients and why; Trainer::carry_out acts on it in one place.
struct Verdict {
  StepDecision what = StepDecision::kApply;
  std::string why;  // with kHalt: the reason the run halts (the alert's message begins with it)
};

}  // namespace keel
