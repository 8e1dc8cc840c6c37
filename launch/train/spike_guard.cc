// Note [spike guard]: every step, on the all-reduced loss and global gradient norm,
//   - a non-finite loss or gradient norm is anomalous at once;
//   - a value above median + max(sigma x robust deviation, min_ratio x median) of the last
//     spike.window healthy values is a spike (the loss and the gradient norm each with their
//     thresholds), once the window is full and the step is past spike.warmup_steps.
// The median and the MAD ignore the outliers they are meant to catch, and anomalous values never
// enter the history, so a spike cannot raise its own baseline. An anomalous step's update is
// skipped (no parameter, moment or step-count change; the data advances), and spike.patience
// consecutive anomalous steps ask for a rewind: the trainer restores the newest verified
// checkpoint at least spike.rewind_margin steps before the streak's first step, skips
// spike.skip_batches batches of data from where the streak began, and optionally cools the
// learning rate down. More than spike.max_rewinds rewinds within spike.rewind_window steps halt
// the run (exit 3). A training loss that falls, or a gradient norm that drifts slowly, stays
// under a median that trails it, so a healthy run raises nothing (measured in docs/spike-guard.md,
// "False positives").
#include "launch/train/spike_guard.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace keel {

const char* anomaly_name(Anomaly a) {
  switch (a) {
    case Anomaly::kNone:
      return "none";
    case Anomaly::kNonfiniteLoss:
      return "nonfinite_loss";
    case Anomaly::kNonfiniteGrad:
      return "nonfinite_grad";
    case Anomaly::kLossSpike:
      return "loss_spike";
    case Anomaly::kGradSpike:
      return "grad_spike";
  }
  return "unknown";
}

RobustStats robust_stats(std::vector<double> v) {
  RobustStats s;
  if (v.empty()) return s;
  auto median = [](std::vector<double>& x) {
    const size_t n = x.size(), h = n / 2;
    std::nth_element(x.begin(), x.begin() + h, x.end());
    double m = x[h];
    if (n % 2 == 0) m = (m + *std::max_element(x.begin(), x.begin() + h)) / 2.0;
    return m;
  };
  s.median = median(v);
  for (double& x : v) x = std::fabs(x - s.median);
  s.deviation = 1.4826 * median(v);
  return s;
}

GuardVerdict SpikeGuard::observe(GuardState& g, int64_t step, uint64_t first_sample, double loss,
                                 double grad_norm) const {
  GuardVerdict v;
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  v.baseline = v.threshold = kNaN;
  if (!cfg_.enabled()) return v;
  const size_t window = static_cast<size_t>(cfg_.window());
  v.armed = step > cfg_.warmup_steps() && g.loss_history.size() >= window;
  struct Check {
    bool spike;
    double median, threshold;
  };
  auto check = [](double x, const std::vector<double>& history, double sigma, double ratio) {
    const RobustStats s = robust_stats(history);
    const double threshold = s.median + std::max(sigma * s.deviation, ratio * std::fabs(s.median));
    return Check{x > threshold, s.median, threshold};
  };
  if (!std::isfinite(loss)) {
    v.anomaly = Anomaly::kNonfiniteLoss;
  } else if (!std::isfinite(grad_norm)) {
    v.anomaly = Anomaly::kNonfiniteGrad;
  } else if (v.armed) {
    const Check l = check(loss, g.loss_history, cfg_.sigma(), cfg_.min_ratio());
    const Check n = check(grad_norm, g.grad_history, cfg_.grad_sigma(), cfg_.grad_min_ratio());
    if (l.spike) {
      v.anomaly = Anomaly::kLossSpike;
      v.baseline = l.median;
      v.threshold = l.threshold;
    } else if (n.spike) {
      v.anomaly = Anomaly::kGradSpike;
      v.baseline = n.median;
      v.threshold = n.threshold;
    }
  }
  if (v.anomaly == Anomaly::kNone) {
    g.streak = 0;
    g.loss_history.push_back(loss);
    g.grad_history.push_back(grad_norm);
    while (g.loss_history.size() > window) g.loss_history.erase(g.loss_history.begin());
    while (g.grad_history.size() > window) g.grad_history.erase(g.grad_history.begin());
    return v;
  }
  if (g.streak == 0) {
    g.streak_first = step;
    g.streak_first_sample = first_sample;
  }
  ++g.streak;
  v.action = g.streak >= cfg_.patience() ? GuardAction::kRewind : GuardAction::kSkip;
  return v;
}

double SpikeGuard::lr_factor(const GuardState& g, int64_t step) const {
  if (!cfg_.enabled() || g.cooldown_from < 0 || cfg_.cooldown_steps() <= 0) return 1.0;
  const double into = static_cast<double>(step - g.cooldown_from - 1);
  if (into < 0 || into >= cfg_.cooldown_steps()) return 1.0;
  const double s = cfg_.lr_scale();
  return s + (1.0 - s) * into / cfg_.cooldown_steps();
}

bool SpikeGuard::halt_due(const GuardState& g, int64_t step) const {
  int64_t recent = 0;
  for (int64_t r : g.rewinds) {
    if (step - r < cfg_.rewind_window()) ++recent;
  }
  return recent + 1 > cfg_.max_rewinds();
}

}  // namespace keel
