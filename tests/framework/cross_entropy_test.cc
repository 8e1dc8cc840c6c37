// Tests for the cross-entropy + z-loss kernel phases (framework/kernels/cross_entropy.h) against
// the closed form computed by hand in long double, against finite differences, with padding
// columns and with a two-way vocab shard; and for the optimizer pieces of
// framework/optim/optimizer.h: the warmup + cosine schedule, clip_scale and AdamW against a
// hand-written scalar AdamW.
#include "framework/kernels/cross_entropy.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "framework/optim/optimizer.h"

namespace keel {
namespace {

using namespace keel::kernels;  // NOLINT: the kernels under test

using Vec = std::vector<double>;

// A batch of N rows of logits [N, V_local]; columns >= v_valid are padding and get a huge value
// so that including them in the max or the sum-exp would change the loss visibly.
struct XentCase {
  int64_t N, V_local, v_valid;
  double coef;
  Vec logits;
  std::vector<int32_t> targets;

  XentCase(int64_t N_, int64_t V_local_, int64_t v_valid_, double coef_, uint32_t seed)
      : N(N_), V_local(V_local_), v_valid(v_valid_), coef(coef_) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> dist(0.5, 2.0);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(v_valid - 1));
    logits.resize(N * V_local);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t v = 0; v < V_local; ++v) {
        logits[n * V_local + v] = v < v_valid ? dist(rng) : 100.0 + v;
      }
      targets.push_back(tok(rng));
    }
  }

  // Closed form in long double: lse_n, ce = mean(lse - logit[target]), z = coef * mean(lse^2).
  struct Ref {
    std::vector<long double> lse;
    long double ce = 0.0L, z = 0.0L, log_z = 0.0L;
  };
  Ref reference() const {
    Ref r;
    for (int64_t n = 0; n < N; ++n) {
      long double s = 0.0L;
      for (int64_t v = 0; v < v_valid; ++v)
        s += std::exp(static_cast<long double>(logits[n * V_local + v]));
      const long double lse = std::log(s);
      r.lse.push_back(lse);
      r.ce += lse - logits[n * V_local + targets[n]];
      r.z += lse * lse;
      r.log_z += lse;
    }
    r.log_z /= N;
    r.ce /= N;
    r.z = coef * r.z / N;
    return r;
  }

  // The kernel phases, as the model runs them (single shard: v_begin = 0).
  struct Phases {
    Vec row_max, sumexp, lse, target;
    double ce = 0.0, z = 0.0, log_z = 0.0;
  };
  Phases phases() const {
    Phases p;
    p.row_max.resize(N);
    p.sumexp.resize(N);
    p.lse.resize(N);
    p.target.resize(N);
    xent_row_max<double>(logits.data(), N, V_local, v_valid, p.row_max.data());
    xent_row_sumexp<double>(logits.data(), p.row_max.data(), N, V_local, v_valid, p.sumexp.data());
    xent_target_logit<double>(logits.data(), targets.data(), N, V_local, 0, p.target.data());
    double sums[3];
    xent_finish<double>(p.row_max.data(), p.sumexp.data(), p.target.data(), N, p.lse.data(), sums);
    p.ce = sums[0] / static_cast<double>(N);
    p.z = coef * sums[1] / static_cast<double>(N);
    p.log_z = sums[2] / static_cast<double>(N);
    return p;
  }
  double total() const {
    const Phases p = phases();
    return p.ce + p.z;
  }
  // d(ce + z) / d logits from the kernel (grad_scale = 1 / N for the means).
  Vec grad() const {
    const Phases p = phases();
    Vec d(N * V_local, 12345.0);
    xent_backward<double>(d.data(), logits.data(), p.lse.data(), targets.data(), N, V_local,
                          v_valid, 0, 1.0 / static_cast<double>(N), coef);
    return d;
  }
};

TEST(CrossEntropy, PhasesMatchClosedFormLossAndZLoss) {
  XentCase c(7, 13, 11, 0.05, 1);
  const auto ref = c.reference();
  const auto p = c.phases();
  for (int64_t n = 0; n < c.N; ++n) {
    EXPECT_NEAR(p.lse[n], static_cast<double>(ref.lse[n]), 1e-13);
    // Padding (huge logits) is excluded from the max.
    EXPECT_LT(p.row_max[n], 50.0);
    EXPECT_EQ(p.target[n], c.logits[n * c.V_local + c.targets[n]]);
  }
  EXPECT_NEAR(p.ce, static_cast<double>(ref.ce), 1e-13);
  EXPECT_NEAR(p.z, static_cast<double>(ref.z), 1e-13);
  EXPECT_NEAR(p.log_z, static_cast<double>(ref.log_z), 1e-13);
  EXPECT_GT(p.z, 1e-3);  // the z term is large enough for the comparisons to mean something
}

// xent_finish in float, as GPT::forward calls it (lse written over sum-exp in place), against the
// loop GPT::forward ran before the finish became a kernel: the loss must stay bitwise the same,
// so every sum is compared with ==, not a tolerance.
TEST(CrossEntropy, FinishInPlaceIsBitwiseTheSerialDoubleLoop) {
  const int64_t N = 257;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mxd(-3.0f, 9.0f), sed(1.0f, 3000.0f), tld(-8.0f, 8.0f);
  std::vector<float> mx(N), se(N), tl(N);
  for (int64_t n = 0; n < N; ++n) {
    mx[n] = mxd(rng);
    se[n] = sed(rng);
    tl[n] = tld(rng);
  }
  std::vector<float> lse_ref(N);
  double ce = 0.0, z = 0.0, lz = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    const double l = static_cast<double>(mx[n]) + std::log(static_cast<double>(se[n]));
    lse_ref[n] = static_cast<float>(l);
    ce += l - tl[n];
    z += l * l;
    lz += l;
  }
  std::vector<float> lse = se;  // aliased: lse == sumexp
  double sums[3] = {-1.0, -1.0, -1.0};
  xent_finish<float>(mx.data(), lse.data(), tl.data(), N, lse.data(), sums);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(lse[n], lse_ref[n]) << "row " << n;
  EXPECT_EQ(sums[0], ce);
  EXPECT_EQ(sums[1], z);
  EXPECT_EQ(sums[2], lz);
  // Out of place leaves sum-exp alone and gives the same results; N = 0 writes zero sums.
  std::vector<float> lse2(N, -1.0f);
  double sums2[3];
  xent_finish<float>(mx.data(), se.data(), tl.data(), N, lse2.data(), sums2);
  EXPECT_EQ(lse2, lse_ref);
  EXPECT_EQ(sums2[0], ce);
  EXPECT_EQ(sums2[2], lz);
  xent_finish<float>(nullptr, nullptr, nullptr, 0, nullptr, sums2);
  EXPECT_EQ(sums2[0], 0.0);
  EXPECT_EQ(sums2[1], 0.0);
  EXPECT_EQ(sums2[2], 0.0);
}

TEST(CrossEntropy, BackwardMatchesClosedFormAndZeroesPadding) {
  XentCase c(7, 13, 11, 0.05, 2);
  const auto ref = c.reference();
  const Vec d = c.grad();
  const long double gs = 1.0L / c.N;
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t v = 0; v < c.V_local; ++v) {
      const double got = d[n * c.V_local + v];
      if (v >= c.v_valid) {
        EXPECT_EQ(got, 0.0) << "padding column " << v << " got a gradient";
        continue;
      }
      const long double lse = ref.lse[n];
      const long double p = std::exp(static_cast<long double>(c.logits[n * c.V_local + v]) - lse);
      const long double expect =
          gs * (p * (1.0L + 2.0L * c.coef * lse) - (v == c.targets[n] ? 1.0L : 0.0L));
      EXPECT_NEAR(got, static_cast<double>(expect), 1e-14) << "n=" << n << " v=" << v;
    }
  }
}

// Central differences of the total (ce + z) computed through the phases, in double. The rounding
// noise of one evaluation is ~eps * |lse| ~ 7e-16 (the other rows' terms are bit-identical between
// the two evaluations), so h = 1e-5 gives FD noise ~7e-11 and truncation ~h^2 |f'''| / 6 ~ 2e-11;
// the gradients are O(1e-3 .. 1e-1), so 1e-6 relative to max(|a|, |b|, 1e-3) keeps a 10x margin
// (h = 1e-6 measured up to 4e-7, too close). A wrong term (e.g. the factor 2 of the z-loss
// gradient) is an O(1e-2) relative error.
void check_fd(XentCase& c) {
  const Vec d = c.grad();
  // The ~100 tiny loss evaluations run on one thread (OpenMP fork/join would dominate them).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  double worst = 0.0;
  for (int64_t i = 0; i < c.N * c.V_local; ++i) {
    const double x0 = c.logits[i];
    const double h = 1e-5;
    c.logits[i] = x0 + h;
    const double lp = c.total();
    c.logits[i] = x0 - h;
    const double lm = c.total();
    c.logits[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    const double rel = std::abs(fd - d[i]) / std::max({std::abs(fd), std::abs(d[i]), 1e-3});
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-6) << "logit " << i << ": analytic " << d[i] << " fd " << fd;
  }
  omp_set_num_threads(threads);
  std::printf("[fd] xent coef=%g worst rel err %.2e\n", c.coef, worst);
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferencesWithZLoss) {
  XentCase c(5, 9, 7, 0.05, 3);
  check_fd(c);
}

TEST(CrossEntropy, ZeroCoefficientIsPureCrossEntropy) {
  XentCase c(5, 9, 7, 0.0, 4);
  const auto p = c.phases();
  EXPECT_EQ(p.z, 0.0);
  EXPECT_NEAR(p.ce, static_cast<double>(c.reference().ce), 1e-13);
  const Vec d = c.grad();
  for (int64_t n = 0; n < c.N; ++n) {
    double row_sum = 0.0;
    for (int64_t v = 0; v < c.v_valid; ++v) {
      const double sm = std::exp(c.logits[n * c.V_local + v] - p.lse[n]);
      const double expect = (sm - (v == c.targets[n] ? 1.0 : 0.0)) / c.N;
      EXPECT_NEAR(d[n * c.V_local + v], expect, 1e-15);
      row_sum += d[n * c.V_local + v];
    }
    EXPECT_NEAR(row_sum, 0.0, 1e-15);  // softmax - onehot sums to zero
  }
  check_fd(c);
}

TEST(CrossEntropy, BackwardMayAliasLogits) {
  XentCase c(4, 9, 7, 0.05, 5);
  const Vec d = c.grad();
  const auto p = c.phases();
  Vec inplace = c.logits;
  xent_backward<double>(inplace.data(), inplace.data(), p.lse.data(), c.targets.data(), c.N,
                        c.V_local, c.v_valid, 0, 1.0 / c.N, c.coef);
  EXPECT_EQ(inplace, d);
}

// Vocab-parallel: two shards of the vocabulary run the phases on their own columns, combining
// max by max, sum-exp (taken against the global max) by sum and the target logit by sum.
void run_sharded(int64_t V, int64_t V_pad) {
  const int64_t N = 6, Vs = V_pad / 2;
  XentCase full(N, V_pad, V, 0.05, 6);
  const auto p = full.phases();
  const Vec d = full.grad();

  std::vector<Vec> shard(2, Vec(N * Vs));
  for (int s = 0; s < 2; ++s)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < Vs; ++v) shard[s][n * Vs + v] = full.logits[n * V_pad + s * Vs + v];
  auto valid = [&](int s) { return std::clamp<int64_t>(V - s * Vs, 0, Vs); };

  Vec gmax(N, -INFINITY), gsum(N, 0.0), gtarget(N, 0.0), tmp(N);
  for (int s = 0; s < 2; ++s) {
    xent_row_max<double>(shard[s].data(), N, Vs, valid(s), tmp.data());
    for (int64_t n = 0; n < N; ++n) gmax[n] = std::max(gmax[n], tmp[n]);  // all-reduce max
  }
  for (int s = 0; s < 2; ++s) {
    xent_row_sumexp<double>(shard[s].data(), gmax.data(), N, Vs, valid(s), tmp.data());
    for (int64_t n = 0; n < N; ++n) gsum[n] += tmp[n];  // all-reduce sum
    xent_target_logit<double>(shard[s].data(), full.targets.data(), N, Vs, s * Vs, tmp.data());
    for (int64_t n = 0; n < N; ++n) gtarget[n] += tmp[n];  // all-reduce sum
  }
  Vec lse(N);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(gmax[n], p.row_max[n]);
    EXPECT_NEAR(gsum[n], p.sumexp[n], 1e-14 * p.sumexp[n]);
    EXPECT_EQ(gtarget[n], p.target[n]);
    lse[n] = gmax[n] + std::log(gsum[n]);
    EXPECT_NEAR(lse[n], p.lse[n], 1e-14);
  }
  for (int s = 0; s < 2; ++s) {
    Vec ds(N * Vs, 777.0);
    xent_backward<double>(ds.data(), shard[s].data(), lse.data(), full.targets.data(), N, Vs,
                          valid(s), s * Vs, 1.0 / N, 0.05);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < Vs; ++v)
        EXPECT_NEAR(ds[n * Vs + v], d[n * V_pad + s * Vs + v], 1e-15)
            << "shard " << s << " n=" << n << " v=" << v;
  }
}

TEST(CrossEntropy, TwoVocabShardsEqualUnsharded) { run_sharded(12, 12); }
// Megatron-style vocab padding: 11 real tokens padded to 12, the pad lives in the last shard.
TEST(CrossEntropy, TwoVocabShardsWithPaddingEqualUnsharded) { run_sharded(11, 12); }

TEST(CrossEntropy, FloatMatchesDouble) {
  XentCase c(5, 9, 7, 0.05, 7);
  const auto p = c.phases();
  const Vec d = c.grad();
  std::vector<float> fl(c.logits.begin(), c.logits.end()), mx(c.N), se(c.N), tl(c.N), lse(c.N),
      fd(fl.size());
  xent_row_max<float>(fl.data(), c.N, c.V_local, c.v_valid, mx.data());
  xent_row_sumexp<float>(fl.data(), mx.data(), c.N, c.V_local, c.v_valid, se.data());
  xent_target_logit<float>(fl.data(), c.targets.data(), c.N, c.V_local, 0, tl.data());
  for (int64_t n = 0; n < c.N; ++n) {
    lse[n] = mx[n] + std::log(se[n]);
    EXPECT_NEAR(lse[n], p.lse[n], 1e-5 * std::abs(p.lse[n]));
  }
  xent_backward<float>(fd.data(), fl.data(), lse.data(), c.targets.data(), c.N, c.V_local,
                       c.v_valid, 0, 1.0f / c.N, 0.05f);
  for (size_t i = 0; i < d.size(); ++i) EXPECT_NEAR(fd[i], d[i], 1e-5 * 0.2);
}

// ---- schedule and clipping ---------------------------------------------------------------------

config::Optim optim_cfg() {
  config::Optim o;
  o.set_lr(1e-3f);
  o.set_min_lr_ratio(0.1f);
  o.set_warmup_steps(10);
  o.set_weight_decay(0.1f);
  o.set_beta1(0.9f);
  o.set_beta2(0.95f);
  o.set_eps(1e-8f);
  return o;
}

TEST(Schedule, LinearWarmupThenCosineToMinLr) {
  const config::Optim o = optim_cfg();
  const double peak = o.lr(), min_lr = o.lr() * o.min_lr_ratio();
  const int64_t total = 110;
  // Warmup: linear, (step + 1) / warmup of the peak, reaching the peak on its last step.
  for (int64_t s = 0; s < 10; ++s) {
    EXPECT_NEAR(learning_rate(o, s, total), peak * (s + 1) / 10.0, 1e-9) << s;
  }
  EXPECT_NEAR(learning_rate(o, 9, total), peak, 1e-9);
  EXPECT_NEAR(learning_rate(o, 10, total), peak, 1e-9);
  // Cosine: halfway down at the middle of the decay, min_lr at the end and after it.
  EXPECT_NEAR(learning_rate(o, 60, total), min_lr + 0.5 * (peak - min_lr), 1e-9);
  EXPECT_NEAR(learning_rate(o, 35, total),
              min_lr + 0.5 * (peak - min_lr) * (1 + std::cos(M_PI * 0.25)), 1e-9);
  EXPECT_NEAR(learning_rate(o, 110, total), min_lr, 1e-9);
  EXPECT_NEAR(learning_rate(o, 500, total), min_lr, 1e-9);
  // Monotone: up during warmup, never up afterwards; never above the peak.
  float prev = 0.0f;
  for (int64_t s = 0; s < 120; ++s) {
    const float lr = learning_rate(o, s, total);
    if (s < 10) {
      EXPECT_GT(lr, prev);
    } else {
      EXPECT_LE(lr, prev);
    }
    EXPECT_LE(lr, peak * (1 + 1e-6));
    EXPECT_GE(lr, min_lr * (1 - 1e-6));
    prev = lr;
  }
  // No warmup: the peak from step 0.
  config::Optim o0 = o;
  o0.set_warmup_steps(0);
  EXPECT_NEAR(learning_rate(o0, 0, total), peak, 1e-9);
}

// optim.schedule: every schedule warms up alike; LINEAR falls straight to the floor at total
// steps; WSD and WSD_SQRT hold the peak until the last decay_steps (0: total / 5), then fall
// linearly or as 1 - sqrt; CONSTANT holds the peak. Each is monotone after the warmup and stays
// within [floor, peak].
TEST(Schedule, LinearWsdAndConstant) {
  config::Optim o = optim_cfg();
  const double peak = o.lr(), floor = o.lr() * o.min_lr_ratio();
  const int64_t total = 110;
  for (config::LrSchedule sched :
       {config::COSINE, config::LINEAR, config::WSD, config::WSD_SQRT, config::CONSTANT}) {
    o.set_schedule(sched);
    SCOPED_TRACE(config::LrSchedule_Name(sched));
    for (int64_t s = 0; s < 10; ++s) {
      EXPECT_NEAR(learning_rate(o, s, total), peak * (s + 1) / 10.0, 1e-9) << s;
    }
    EXPECT_NEAR(learning_rate(o, 10, total), peak, 1e-9);
    float prev = learning_rate(o, 10, total);
    for (int64_t s = 11; s < 130; ++s) {
      const float lr = learning_rate(o, s, total);
      EXPECT_LE(lr, prev) << s;
      EXPECT_LE(lr, peak * (1 + 1e-6)) << s;
      EXPECT_GE(lr, floor * (1 - 1e-6)) << s;
      prev = lr;
    }
  }
  o.set_schedule(config::LINEAR);
  EXPECT_NEAR(learning_rate(o, 60, total), floor + 0.5 * (peak - floor), 1e-9);
  EXPECT_NEAR(learning_rate(o, 35, total), floor + 0.75 * (peak - floor), 1e-9);
  EXPECT_NEAR(learning_rate(o, 110, total), floor, 1e-9);
  // WSD with 40 decay steps: the peak through step 69, then linear over [70, 110).
  o.set_schedule(config::WSD);
  o.set_decay_steps(40);
  EXPECT_NEAR(learning_rate(o, 69, total), peak, 1e-9);
  EXPECT_NEAR(learning_rate(o, 70, total), peak, 1e-9);
  EXPECT_NEAR(learning_rate(o, 80, total), floor + 0.75 * (peak - floor), 1e-9);
  EXPECT_NEAR(learning_rate(o, 90, total), floor + 0.5 * (peak - floor), 1e-9);
  EXPECT_NEAR(learning_rate(o, 110, total), floor, 1e-9);
  // The stable phase does not depend on the run's length: extending a run moves only the decay.
  for (int64_t s = 10; s < 70; ++s) {
    EXPECT_EQ(learning_rate(o, s, total), learning_rate(o, s, 1000)) << s;
  }
  // WSD_SQRT: 1 - sqrt(p), so a quarter of the way through the decay half of it is done.
  o.set_schedule(config::WSD_SQRT);
  EXPECT_NEAR(learning_rate(o, 69, total), peak, 1e-9);
  EXPECT_NEAR(learning_rate(o, 80, total), floor + 0.5 * (peak - floor), 1e-9);
  EXPECT_NEAR(learning_rate(o, 100, total), floor + (1 - std::sqrt(0.75)) * (peak - floor), 1e-9);
  // decay_steps 0: a fifth of the run; longer than the run after warmup: from the warmup's end.
  o.set_schedule(config::WSD);
  o.set_decay_steps(0);
  EXPECT_NEAR(learning_rate(o, 87, total), peak, 1e-9);
  EXPECT_NEAR(learning_rate(o, 99, total), floor + 0.5 * (peak - floor), 1e-9);
  o.set_decay_steps(500);
  EXPECT_NEAR(learning_rate(o, 60, total), floor + 0.5 * (peak - floor), 1e-9);
  o.set_schedule(config::CONSTANT);
  EXPECT_NEAR(learning_rate(o, 500, total), peak, 1e-9);
}

TEST(Schedule, ClipScale) {
  EXPECT_EQ(clip_scale(0.5, 1.0), 1.0f);  // within the bound
  EXPECT_EQ(clip_scale(1.0, 1.0), 1.0f);  // at the bound
  EXPECT_EQ(clip_scale(5.0, 0.0), 1.0f);  // max_norm <= 0 disables
  EXPECT_EQ(clip_scale(5.0, -1.0), 1.0f);
  EXPECT_NEAR(clip_scale(4.0, 1.0), 0.25f, 1e-6);
  for (double norm : {3.0, 10.0, 1e6}) {
    const float s = clip_scale(norm, 2.0);
    EXPECT_LE(s * norm, 2.0 * (1 + 1e-6)) << norm;
    EXPECT_GE(s * norm, 2.0 * (1 - 1e-5)) << norm;
  }
}

// ---- AdamW -------------------------------------------------------------------------------------

TEST(AdamW, MatchesScalarReferenceForThreeSteps) {
  const config::Optim o = optim_cfg();
  // Two segments of the arena: [0, 6) decays, [8, 12) does not; [6, 8) is alignment padding
  // that belongs to no segment and must not move.
  const int64_t total = 12;
  const std::vector<ParamSegment> segs = {{0, 6, true}, {8, 4, false}};
  AdamW opt(o, total, segs);
  std::mt19937 rng(3);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<float> p(total);
  for (float& x : p) x = static_cast<float>(dist(rng));
  const std::vector<float> p0 = p;
  std::vector<double> rp(p.begin(), p.end()), rm(total, 0.0), rv(total, 0.0);
  std::vector<std::vector<float>> grads;
  const std::vector<float> lrs = {1e-2f, 5e-3f, 2e-2f}, scales = {1.0f, 0.5f, 1.0f};
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g(total);
    for (float& x : g) x = static_cast<float>(dist(rng));
    grads.push_back(g);
    const double lr = lrs[step - 1], gs = scales[step - 1];
    opt.step(p.data(), g.data(), lrs[step - 1], scales[step - 1]);
    EXPECT_EQ(opt.t(), step);
    for (const ParamSegment& seg : segs) {
      const double wd = seg.decay ? o.weight_decay() : 0.0;
      for (int64_t i = seg.offset; i < seg.offset + seg.n; ++i) {
        const double gi = static_cast<double>(g[i]) * gs;
        rm[i] = o.beta1() * rm[i] + (1 - o.beta1()) * gi;
        rv[i] = o.beta2() * rv[i] + (1 - o.beta2()) * gi * gi;
        const double mhat = rm[i] / (1 - std::pow(static_cast<double>(o.beta1()), step));
        const double vhat = rv[i] / (1 - std::pow(static_cast<double>(o.beta2()), step));
        rp[i] -= lr * (mhat / (std::sqrt(vhat) + o.eps()) + wd * rp[i]);
      }
    }
    for (int64_t i = 0; i < total; ++i) {
      EXPECT_NEAR(p[i], rp[i], 2e-6 * (1 + std::abs(rp[i]))) << "step " << step << " i " << i;
      EXPECT_NEAR(opt.m().f32()[i], rm[i], 1e-6 * (1 + std::abs(rm[i]))) << i;
      EXPECT_NEAR(opt.v().f32()[i], rv[i], 1e-6 * (1 + std::abs(rv[i]))) << i;
    }
  }
  for (int64_t i = 6; i < 8; ++i) EXPECT_EQ(p[i], p0[i]) << "padding between segments moved";
  // Decay applies on the first segment only: the same run with decay off everywhere matches the
  // second segment bit for bit and differs on the first.
  AdamW plain(o, total, {{0, 6, false}, {8, 4, false}});
  std::vector<float> q = p0;
  for (int step = 0; step < 3; ++step)
    plain.step(q.data(), grads[step].data(), lrs[step], scales[step]);
  for (int64_t i = 0; i < 6; ++i) EXPECT_GT(std::abs(q[i] - p[i]), 1e-5) << i;
  for (int64_t i = 8; i < 12; ++i) EXPECT_EQ(q[i], p[i]) << i;
}

}  // namespace
}  // namespace keel
