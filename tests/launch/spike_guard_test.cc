// The spike guard's decisions (launch/train/spike_guard.h, Note [spike guard]): robust statistics,
// no detection before warm-up or a full window, non-finite values at once, spikes against the
// median and the robust deviation with the relative floor, anomalous values kept out of the
// baseline, patience before a rewind, the learning-rate cool-down ramp and the halt policy.
#include "launch/train/spike_guard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace keel {
namespace {

config::Spike spike_config() {
  config::Spike c;
  c.set_enabled(true);
  c.set_window(10);
  c.set_warmup_steps(5);
  c.set_sigma(6);
  c.set_min_ratio(0.25);
  c.set_grad_sigma(6);
  c.set_grad_min_ratio(2);
  c.set_patience(2);
  c.set_rewind_margin(10);
  c.set_skip_batches(20);
  c.set_lr_scale(0.25);
  c.set_cooldown_steps(4);
  c.set_max_rewinds(2);
  c.set_rewind_window(100);
  return c;
}

TEST(SpikeGuard, RobustStats) {
  const RobustStats s = robust_stats({1, 2, 3, 4, 100});
  EXPECT_DOUBLE_EQ(s.median, 3.0);
  EXPECT_DOUBLE_EQ(s.deviation, 1.4826 * 1.0);  // |x - 3| = 2 1 0 1 97: median 1
  const RobustStats e = robust_stats({4, 1, 3, 2});
  EXPECT_DOUBLE_EQ(e.median, 2.5);
  EXPECT_DOUBLE_EQ(e.deviation, 1.4826 * 1.0);  // 1.5 0.5 0.5 1.5
}

// Fills the window with healthy steps 1..n (loss 3 +- 0.01, grad norm 1 +- 0.01).
GuardState healthy(const SpikeGuard& guard, int n) {
  GuardState g;
  for (int s = 1; s <= n; ++s) {
    const double wiggle = (s % 2 ? 0.01 : -0.01);
    const GuardVerdict v = guard.observe(g, s, 4 * (s - 1), 3.0 + wiggle, 1.0 + wiggle);
    EXPECT_EQ(v.anomaly, Anomaly::kNone) << s;
  }
  return g;
}

TEST(SpikeGuard, NothingBeforeWarmupOrAFullWindow) {
  const SpikeGuard guard(spike_config());
  GuardState g;
  // Steps 1-5 are warm-up; steps 6-9 have a window of fewer than 10 values: a 10x loss passes.
  for (int s = 1; s <= 9; ++s) {
    const GuardVerdict v = guard.observe(g, s, 0, s == 7 ? 30.0 : 3.0, 1.0);
    EXPECT_EQ(v.anomaly, Anomaly::kNone) << s;
    EXPECT_FALSE(v.armed) << s;
  }
  EXPECT_EQ(g.loss_history.size(), 9u);
}

TEST(SpikeGuard, NonFiniteValuesActAtOnceEvenInWarmup) {
  const SpikeGuard guard(spike_config());
  GuardState g;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  GuardVerdict v = guard.observe(g, 1, 0, nan, 1.0);
  EXPECT_EQ(v.anomaly, Anomaly::kNonfiniteLoss);
  EXPECT_EQ(v.action, GuardAction::kSkip);
  v = guard.observe(g, 2, 4, 3.0, std::numeric_limits<double>::infinity());
  EXPECT_EQ(v.anomaly, Anomaly::kNonfiniteGrad);
  EXPECT_EQ(v.action, GuardAction::kRewind);  // the second anomalous step in a row
  EXPECT_EQ(g.streak, 2);
  EXPECT_EQ(g.streak_first, 1);
  EXPECT_EQ(g.streak_first_sample, 0u);
  EXPECT_TRUE(g.loss_history.empty());  // anomalous steps never enter the baseline
}

TEST(SpikeGuard, LossSpikeNeedsBothTheDeviationAndTheRatio) {
  const SpikeGuard guard(spike_config());
  GuardState g = healthy(guard, 12);
  // median 3 (2.99 / 3.01 alternate), deviation 1.4826 * 0.01: sigma alone would flag 3.1, but
  // the 25% floor puts the threshold at 3.75.
  GuardState a = g;
  GuardVerdict v = guard.observe(a, 13, 48, 3.7, 1.0);
  EXPECT_EQ(v.anomaly, Anomaly::kNone);
  EXPECT_TRUE(v.armed);
  v = guard.observe(g, 13, 48, 3.8, 1.0);
  EXPECT_EQ(v.anomaly, Anomaly::kLossSpike);
  EXPECT_EQ(v.action, GuardAction::kSkip);
  EXPECT_DOUBLE_EQ(v.baseline, 3.0);
  EXPECT_DOUBLE_EQ(v.threshold, 3.75);
  EXPECT_EQ(g.streak_first_sample, 48u);
  // A healthy step ends the streak; the spike never entered the history.
  v = guard.observe(g, 14, 52, 3.0, 1.0);
  EXPECT_EQ(v.anomaly, Anomaly::kNone);
  EXPECT_EQ(g.streak, 0);
  for (double x : g.loss_history) EXPECT_LT(x, 3.1);
  EXPECT_EQ(g.loss_history.size(), 10u);  // the window's length
}

TEST(SpikeGuard, GradSpikeAndPatience) {
  const SpikeGuard guard(spike_config());
  GuardState g = healthy(guard, 12);
  GuardVerdict v = guard.observe(g, 13, 48, 3.0, 2.9);  // threshold 1 + 2 x 1 = 3
  EXPECT_EQ(v.anomaly, Anomaly::kNone);
  v = guard.observe(g, 14, 52, 3.0, 3.1);
  EXPECT_EQ(v.anomaly, Anomaly::kGradSpike);
  EXPECT_EQ(v.action, GuardAction::kSkip);
  v = guard.observe(g, 15, 56, 5.0, 1.0);  // a loss spike continues the streak
  EXPECT_EQ(v.anomaly, Anomaly::kLossSpike);
  EXPECT_EQ(v.action, GuardAction::kRewind);
  EXPECT_EQ(g.streak_first, 14);
  EXPECT_EQ(g.streak_first_sample, 52u);
}

TEST(SpikeGuard, OffMeansEveryStepApplies) {
  config::Spike c = spike_config();
  c.set_enabled(false);
  const SpikeGuard guard(c);
  GuardState g;
  EXPECT_EQ(guard.observe(g, 1, 0, std::nan(""), 1.0).action, GuardAction::kApply);
  EXPECT_EQ(guard.lr_factor(g, 1), 1.0);
}

TEST(SpikeGuard, CooldownRampsBackToOne) {
  const SpikeGuard guard(spike_config());
  GuardState g;
  g.cooldown_from = 100;  // restored to step 100: steps 101.. ramp 0.25 -> 1 over 4 steps
  EXPECT_EQ(guard.lr_factor(g, 100), 1.0);
  EXPECT_DOUBLE_EQ(guard.lr_factor(g, 101), 0.25);
  EXPECT_DOUBLE_EQ(guard.lr_factor(g, 102), 0.4375);
  EXPECT_DOUBLE_EQ(guard.lr_factor(g, 104), 0.8125);
  EXPECT_EQ(guard.lr_factor(g, 105), 1.0);
  g.cooldown_from = -1;
  EXPECT_EQ(guard.lr_factor(g, 101), 1.0);
}

TEST(SpikeGuard, HaltAfterMaxRewindsWithinTheWindow) {
  const SpikeGuard guard(spike_config());  // max 2 within 100 steps
  GuardState g;
  EXPECT_FALSE(guard.halt_due(g, 50));
  g.rewinds = {50};
  EXPECT_FALSE(guard.halt_due(g, 120));
  g.rewinds = {50, 120};
  EXPECT_TRUE(guard.halt_due(g, 140));   // both within 100 steps: a third exceeds 2
  EXPECT_FALSE(guard.halt_due(g, 151));  // step 50 has left the window
}

}  // namespace
}  // namespace keel
