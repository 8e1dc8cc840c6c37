// The spike guard's decisions (Note [spike guard] in spike_guard.cc): from a step's all-reduced
// loss and global gradient norm (identical on every rank, so every rank decides alike with no
// extra communication) and the GuardState it keeps in the run state, what to do with the step.
// The trainer carries the decision out (skip the update, rewind to a checkpoint, halt) and the
// alert sink reports it. Pure functions of (config, state, inputs): a resumed run decides as the
// uninterrupted one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"

namespace keel {

enum class Anomaly {
  kNone,
  kNonfiniteLoss,
  kNonfiniteGrad,
  kLossSpike,
  kGradSpike,
};
const char* anomaly_name(Anomaly a);  // "nonfinite_loss", "loss_spike", ...

enum class GuardAction {
  kApply,   // a healthy step
  kSkip,    // an anomalous step: its update is not applied (the data still advances)
  kRewind,  // the streak reached spike.patience: rewind to a checkpoint before it
};

struct GuardVerdict {
  Anomaly anomaly = Anomaly::kNone;
  GuardAction action = GuardAction::kApply;
  double baseline = 0.0;   // the median the spiking value was compared with (NaN: none yet)
  double threshold = 0.0;  // the value it exceeded (NaN: none)
  bool armed = false;      // detection was on for this step (past warm-up, window full)
};

// Median and robust deviation (1.4826 x the median absolute deviation) of `v`.
struct RobustStats {
  double median = 0.0;
  double deviation = 0.0;
};
RobustStats robust_stats(std::vector<double> v);

class SpikeGuard {
 public:
  explicit SpikeGuard(const config::Spike& cfg) : cfg_(cfg) {}

  // Classifies step `step` (1-based) whose first training sample is `first_sample`, and updates
  // `g`: a healthy value joins the history (the oldest leaves once it holds spike.window), an
  // anomalous step extends the streak. With the guard off every step is kApply.
  GuardVerdict observe(GuardState& g, int64_t step, uint64_t first_sample, double loss,
                       double grad_norm) const;

  // The learning-rate factor at step `step` (1 outside a cool-down): spike.lr_scale right after
  // a rewind, ramping linearly back to 1 over spike.cooldown_steps.
  double lr_factor(const GuardState& g, int64_t step) const;

  // Whether one more rewind at step `step` exceeds spike.max_rewinds within spike.rewind_window.
  bool halt_due(const GuardState& g, int64_t step) const;

  bool enabled() const { return cfg_.enabled(); }
  const config::Spike& config() const { return cfg_; }

 private:
  config::Spike cfg_;
};

}  // namespace keel
