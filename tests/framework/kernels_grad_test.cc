// Finite-difference gradient checks of the CPU forward/backward kernel pairs (gemm, norm, the
// split norm whose row statistics are summed across TP ranks, attention, elementwise,
// embedding), run in double precision, plus float-vs-double agreement
// and the thread-count independence of sum_squares.
//
// Every check uses the scalar objective L = sum(out * R) for a fixed random R, so dL/dout = R is
// what the backward kernel receives, and compares its gradients with central differences
// (L(x + h) - L(x - h)) / 2h for every input element.
//
// Tolerance (kFdTol = 1e-6, relative): with h = 1e-6 the truncation error is ~h^2 |L'''| / 6 ~
// 1e-13 and the rounding error is ~eps * sum|out * R| / h ~ 1e-16 * O(10) / 1e-6 ~ 1e-9 (L is
// summed in long double, so only the kernels' own double rounding enters). Relative to gradients
// of O(0.1 - 1) that is 1e-8 .. 1e-7, so 1e-6 leaves a margin of 10x while a wrong formula (a
// missing term, a wrong sign or stride) shows up as an O(1) relative error. The denominator is
// max(|a|, |b|, 1e-2 * max|grad of this tensor|): elements whose gradient is tiny or exactly zero
// (late keys that few queries see, masked entries) are measured against 1% of the tensor's scale
// instead of against 1e-8, where the absolute FD rounding noise (observed up to ~2e-9 for
// attention's dk, whose entries are ~1e-3) would be "relatively" large. A wrong formula still
// fails: it would have to be wrong by less than 1e-8 of the tensor's largest gradient to pass.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "framework/kernels/attention.h"
#include "framework/kernels/elementwise.h"
#include "framework/kernels/embedding.h"
#include "framework/kernels/gemm.h"
#include "framework/kernels/norm.h"

namespace keel::kernels {
namespace {

constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-6;
constexpr double kFloatTol = 1e-5;  // float kernel vs double kernel, relative to max |double|

using Vec = std::vector<double>;

Vec randn(size_t n, uint32_t seed, double mean = 0.0, double stdv = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(mean, stdv);
  Vec v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// Restores the OpenMP thread count a test changed.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(omp_get_max_threads()) {}
  explicit ThreadCountGuard(int threads) : ThreadCountGuard() { omp_set_num_threads(threads); }
  ~ThreadCountGuard() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

long double dot_ld(const Vec& a, const Vec& b) {
  long double s = 0.0L;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<long double>(a[i]) * b[i];
  return s;
}

// Compares the analytic gradient `grad` of `loss` w.r.t. the elements `idx` of `x` (all elements
// when idx is empty) with central differences. `x` is perturbed in place and restored. Returns
// the worst relative error and reports every element over the tolerance.
double check_fd(const std::string& what, Vec& x, const Vec& grad,
                const std::function<long double()>& loss, std::vector<size_t> idx = {}) {
  if (idx.empty()) {
    idx.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) idx[i] = i;
  }
  Vec fd(idx.size());
  {
    // The thousands of tiny forwards run on one thread: with two threads on a busy machine the
    // OpenMP fork/join of each call dominates. The analytic pass keeps the caller's threads.
    ThreadCountGuard one_thread(1);
    for (size_t k = 0; k < idx.size(); ++k) {
      const size_t i = idx[k];
      const double x0 = x[i];
      x[i] = x0 + kFdStep;
      const long double lp = loss();
      x[i] = x0 - kFdStep;
      const long double lm = loss();
      x[i] = x0;
      fd[k] = static_cast<double>((lp - lm) / (2.0L * kFdStep));
    }
  }
  double scale = 0.0;
  for (size_t k = 0; k < idx.size(); ++k) scale = std::max(scale, std::abs(grad[idx[k]]));
  EXPECT_GT(scale, 0.0) << what << ": an all-zero gradient checks nothing";
  double worst = 0.0;
  int reported = 0;
  for (size_t k = 0; k < idx.size(); ++k) {
    const double a = grad[idx[k]], b = fd[k];
    const double rel = std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-2 * scale, 1e-300});
    worst = std::max(worst, rel);
    if (rel > kFdTol && reported++ < 5) {
      ADD_FAILURE() << what << "[" << idx[k] << "]: analytic " << a << " vs fd " << b << " (rel "
                    << rel << ")";
    }
  }
  std::printf("[fd] %-40s worst rel err %.2e over %zu elements\n", what.c_str(), worst, idx.size());
  return worst;
}

std::vector<float> to_float(const Vec& v) { return std::vector<float>(v.begin(), v.end()); }

// max |f - d| / max |d|: float kernel against the double kernel on the same inputs.
double float_rel_err(const std::vector<float>& f, const Vec& d) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < d.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(f[i]) - d[i]));
    scale = std::max(scale, std::abs(d[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// ---- linear ------------------------------------------------------------------------------------

struct LinearCase {
  int64_t N = 5, IC = 7, OC = 6;
  Vec inp = randn(N * IC, 1), w = randn(OC * IC, 2), b = randn(OC, 3), R = randn(N * OC, 4);
  long double loss() const {
    Vec out(N * OC);
    linear_forward<double>(out.data(), inp.data(), w.data(), b.data(), N, IC, OC);
    return dot_ld(out, R);
  }
};

TEST(LinearGrad, InputWeightBiasMatchFiniteDifferences) {
  LinearCase c;
  Vec dinp(c.N * c.IC, 0.0), dw(c.OC * c.IC, 0.0), db(c.OC, 0.0);
  linear_backward<double>(dinp.data(), false, dw.data(), db.data(), c.R.data(), c.inp.data(),
                          c.w.data(), c.N, c.IC, c.OC);
  auto loss = [&] { return c.loss(); };
  check_fd("linear dinp", c.inp, dinp, loss);
  check_fd("linear dweight", c.w, dw, loss);
  check_fd("linear dbias", c.b, db, loss);
}

TEST(LinearGrad, ForwardMatchesNaiveWithAndWithoutBias) {
  LinearCase c;
  for (bool with_bias : {true, false}) {
    Vec out(c.N * c.OC, 123.0);  // forward overwrites (=)
    linear_forward<double>(out.data(), c.inp.data(), c.w.data(), with_bias ? c.b.data() : nullptr,
                           c.N, c.IC, c.OC);
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t o = 0; o < c.OC; ++o) {
        long double ref = with_bias ? c.b[o] : 0.0;
        for (int64_t i = 0; i < c.IC; ++i)
          ref += static_cast<long double>(c.inp[n * c.IC + i]) * c.w[o * c.IC + i];
        EXPECT_NEAR(out[n * c.OC + o], static_cast<double>(ref), 1e-12) << with_bias;
      }
    }
  }
}

TEST(LinearGrad, AccumulateFlagsAddToExistingContents) {
  LinearCase c;
  Vec dinp0(c.N * c.IC, 0.0), dw0(c.OC * c.IC, 0.0), db0(c.OC, 0.0);
  linear_backward<double>(dinp0.data(), false, dw0.data(), db0.data(), c.R.data(), c.inp.data(),
                          c.w.data(), c.N, c.IC, c.OC);
  const Vec pre_inp = randn(dinp0.size(), 11), pre_w = randn(dw0.size(), 12),
            pre_b = randn(db0.size(), 13);
  // accumulate_dinp = true: dinp += ; false: dinp = . dweight and dbias always +=.
  for (bool acc : {true, false}) {
    Vec dinp = pre_inp, dw = pre_w, db = pre_b;
    linear_backward<double>(dinp.data(), acc, dw.data(), db.data(), c.R.data(), c.inp.data(),
                            c.w.data(), c.N, c.IC, c.OC);
    for (size_t i = 0; i < dinp.size(); ++i)
      EXPECT_NEAR(dinp[i], (acc ? pre_inp[i] : 0.0) + dinp0[i], 1e-12) << "acc=" << acc;
    for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], pre_w[i] + dw0[i], 1e-12);
    for (size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db[i], pre_b[i] + db0[i], 1e-12);
  }
  // Null gradients are skipped without touching the others.
  Vec dw(c.OC * c.IC, 0.0);
  linear_backward<double>(nullptr, false, dw.data(), nullptr, c.R.data(), c.inp.data(), c.w.data(),
                          c.N, c.IC, c.OC);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], dw0[i], 1e-12);
}

TEST(LinearGrad, FloatMatchesDouble) {
  LinearCase c;
  Vec out(c.N * c.OC), dinp(c.N * c.IC, 0.0), dw(c.OC * c.IC, 0.0), db(c.OC, 0.0);
  linear_forward<double>(out.data(), c.inp.data(), c.w.data(), c.b.data(), c.N, c.IC, c.OC);
  linear_backward<double>(dinp.data(), false, dw.data(), db.data(), c.R.data(), c.inp.data(),
                          c.w.data(), c.N, c.IC, c.OC);
  auto fi = to_float(c.inp), fw = to_float(c.w), fb = to_float(c.b), fR = to_float(c.R);
  std::vector<float> fout(out.size()), fdinp(dinp.size(), 0.f), fdw(dw.size(), 0.f),
      fdb(db.size(), 0.f);
  linear_forward<float>(fout.data(), fi.data(), fw.data(), fb.data(), c.N, c.IC, c.OC);
  linear_backward<float>(fdinp.data(), false, fdw.data(), fdb.data(), fR.data(), fi.data(),
                         fw.data(), c.N, c.IC, c.OC);
  EXPECT_LT(float_rel_err(fout, out), kFloatTol);
  EXPECT_LT(float_rel_err(fdinp, dinp), kFloatTol);
  EXPECT_LT(float_rel_err(fdw, dw), kFloatTol);
  EXPECT_LT(float_rel_err(fdb, db), kFloatTol);
}

// ---- norm --------------------------------------------------------------------------------------

const char* op_name(NormOp op) {
  switch (op) {
    case NormOp::kLayer:
      return "layer";
    case NormOp::kRms:
      return "rms";
    default:
      return "l2";
  }
}

// One norm problem: input [N, ld_in] (only the N x G x Cg region is read), output [N, ld_out].
struct NormCase {
  NormOp op;
  NormShape s;
  std::string name;
  Vec inp, w, b, R;
  bool has_w, has_b;
  double eps = 1e-5;

  NormCase(NormOp op_, NormShape s_, std::string name_, uint32_t seed)
      : op(op_), s(s_), name(std::string(op_name(op_)) + " " + name_) {
    // A non-zero mean so LayerNorm's centring matters.
    inp = randn(s.N * s.ld_in, seed, 0.7, 1.0);
    const int64_t wn = s.w_group_stride == 0 ? s.Cg : s.G * s.Cg;
    has_w = op != NormOp::kL2;  // the L2 QK-norm has no gain (its scale lives in attention)
    has_b = op == NormOp::kLayer;
    w = randn(wn, seed + 1, 1.0, 0.5);
    b = randn(wn, seed + 2, 0.0, 0.5);
    R = randn(s.N * s.ld_out, seed + 3);
  }
  const double* wp() const { return has_w ? w.data() : nullptr; }
  const double* bp() const { return has_b ? b.data() : nullptr; }
  long double loss() const {
    Vec out(s.N * s.ld_out, 0.0), mean(s.N * s.G), rstd(s.N * s.G);
    norm_forward<double>(op, s, out.data(), inp.data(), wp(), bp(), mean.data(), rstd.data(), eps);
    return dot_ld(out, R);
  }
  // Indices of inp that the kernel reads (the grouped region of every row).
  std::vector<size_t> region() const {
    std::vector<size_t> idx;
    for (int64_t n = 0; n < s.N; ++n)
      for (int64_t c = 0; c < s.G * s.Cg; ++c) idx.push_back(n * s.ld_in + c);
    return idx;
  }
};

std::vector<NormCase> norm_cases(NormOp op) {
  std::vector<NormCase> cs;
  // plain rows (block norm): G = 1, ld = C
  cs.emplace_back(op, NormShape{4, 1, 10, 10, 10, 0}, "plain rows", 100);
  // grouped, one gain shared by the groups (HEAD_SHARED)
  cs.emplace_back(op, NormShape{3, 3, 5, 15, 15, 0}, "grouped shared gain", 200);
  // grouped, a gain per group (HEAD)
  cs.emplace_back(op, NormShape{3, 3, 5, 15, 15, 5}, "grouped per-group gain", 300);
  // QK-norm layout: q inside qkv rows (ld_in = 3 H D) into qk rows (ld_out = 2 H D), H=3, D=4
  cs.emplace_back(op, NormShape{3, 3, 4, 36, 24, 4}, "strided per-head (qk)", 400);
  cs.emplace_back(op, NormShape{3, 3, 4, 36, 24, 0}, "strided head-shared (qk)", 500);
  // PROJECTION scope: one group spanning all heads, strided.
  cs.emplace_back(op, NormShape{3, 1, 12, 36, 24, 12}, "strided projection (qk)", 600);
  return cs;
}

void run_norm_grad(NormOp op) {
  for (NormCase c : norm_cases(op)) {
    SCOPED_TRACE(c.name);
    const NormShape& s = c.s;
    // Analytic: accumulate = false into a buffer pre-filled with a sentinel, so we also see that
    // the gaps of a strided dinp (ld_in > G Cg) are left alone.
    constexpr double kSentinel = -777.0;
    Vec out(s.N * s.ld_out, 0.0), mean(s.N * s.G), rstd(s.N * s.G);
    norm_forward<double>(c.op, s, out.data(), c.inp.data(), c.wp(), c.bp(), mean.data(),
                         rstd.data(), c.eps);
    Vec dinp(s.N * s.ld_in, kSentinel), dw(c.w.size(), 0.0), db(c.b.size(), 0.0);
    norm_backward<double>(c.op, s, dinp.data(), false, c.has_w ? dw.data() : nullptr,
                          c.has_b ? db.data() : nullptr, c.R.data(), c.inp.data(), c.wp(),
                          mean.data(), rstd.data());
    const std::vector<size_t> region = c.region();
    std::vector<bool> in_region(dinp.size(), false);
    for (size_t i : region) in_region[i] = true;
    for (size_t i = 0; i < dinp.size(); ++i) {
      if (!in_region[i]) {
        EXPECT_EQ(dinp[i], kSentinel) << "dinp gap " << i << " was written";
      }
    }
    auto loss = [&] { return c.loss(); };
    check_fd("norm " + c.name + " dinp", c.inp, dinp, loss, region);
    if (c.has_w) check_fd("norm " + c.name + " dweight", c.w, dw, loss);
    if (c.has_b) check_fd("norm " + c.name + " dbias", c.b, db, loss);

    // accumulate = true adds to dinp (and dweight, dbias always add).
    const Vec pre = randn(dinp.size(), 77), pre_w = randn(dw.size(), 78),
              pre_b = randn(db.size(), 79);
    Vec dinp2 = pre, dw2 = pre_w, db2 = pre_b;
    norm_backward<double>(c.op, s, dinp2.data(), true, c.has_w ? dw2.data() : nullptr,
                          c.has_b ? db2.data() : nullptr, c.R.data(), c.inp.data(), c.wp(),
                          mean.data(), rstd.data());
    for (size_t i = 0; i < dinp2.size(); ++i) {
      const double expect = in_region[i] ? pre[i] + dinp[i] : pre[i];
      EXPECT_NEAR(dinp2[i], expect, 1e-12) << "accumulate dinp " << i;
    }
    for (size_t i = 0; i < dw2.size(); ++i)
      EXPECT_NEAR(dw2[i], pre_w[i] + (c.has_w ? dw[i] : 0.0), 1e-12);
    for (size_t i = 0; i < db2.size(); ++i)
      EXPECT_NEAR(db2[i], pre_b[i] + (c.has_b ? db[i] : 0.0), 1e-12);
  }
}

TEST(NormGrad, LayerNormMatchesFiniteDifferences) { run_norm_grad(NormOp::kLayer); }
TEST(NormGrad, RmsNormMatchesFiniteDifferences) { run_norm_grad(NormOp::kRms); }
TEST(NormGrad, L2NormMatchesFiniteDifferences) { run_norm_grad(NormOp::kL2); }

TEST(NormGrad, OutputHasTheNormalisedStatistics) {
  // Per group: LayerNorm output (before gain) has mean 0 and variance ~1, RMS has mean square ~1,
  // L2 has unit norm (up to eps).
  for (NormOp op : {NormOp::kLayer, NormOp::kRms, NormOp::kL2}) {
    const NormShape s{3, 3, 4, 36, 24, 4};
    NormCase c(op, s, "stats", 900);
    Vec ones(c.w.size(), 1.0), out(s.N * s.ld_out, 0.0), mean(s.N * s.G), rstd(s.N * s.G);
    norm_forward<double>(op, s, out.data(), c.inp.data(), op == NormOp::kL2 ? nullptr : ones.data(),
                         nullptr, mean.data(), rstd.data(), 0.0);
    for (int64_t n = 0; n < s.N; ++n) {
      for (int64_t g = 0; g < s.G; ++g) {
        double sum = 0.0, sq = 0.0;
        for (int64_t k = 0; k < s.Cg; ++k) {
          const double y = out[n * s.ld_out + g * s.Cg + k];
          sum += y;
          sq += y * y;
        }
        if (op == NormOp::kLayer) {
          EXPECT_NEAR(sum / s.Cg, 0.0, 1e-12);
        }
        if (op == NormOp::kL2) {
          EXPECT_NEAR(sq, 1.0, 1e-12) << op_name(op);
        } else {
          EXPECT_NEAR(sq / s.Cg, 1.0, 1e-12) << op_name(op);
        }
      }
    }
  }
}

TEST(NormGrad, FloatMatchesDouble) {
  for (NormOp op : {NormOp::kLayer, NormOp::kRms, NormOp::kL2}) {
    SCOPED_TRACE(op_name(op));
    NormCase c(op, NormShape{3, 3, 4, 36, 24, 4}, "float", 1000);
    const NormShape& s = c.s;
    Vec out(s.N * s.ld_out, 0.0), mean(s.N * s.G), rstd(s.N * s.G), dinp(s.N * s.ld_in, 0.0),
        dw(c.w.size(), 0.0), db(c.b.size(), 0.0);
    norm_forward<double>(op, s, out.data(), c.inp.data(), c.wp(), c.bp(), mean.data(), rstd.data(),
                         c.eps);
    norm_backward<double>(op, s, dinp.data(), false, dw.data(), db.data(), c.R.data(), c.inp.data(),
                          c.wp(), mean.data(), rstd.data());
    auto fi = to_float(c.inp), fw = to_float(c.w), fb = to_float(c.b), fR = to_float(c.R);
    std::vector<float> fout(out.size(), 0.f), fmean(mean.size()), frstd(rstd.size()),
        fdinp(dinp.size(), 0.f), fdw(dw.size(), 0.f), fdb(db.size(), 0.f);
    const float* fwp = c.has_w ? fw.data() : nullptr;
    const float* fbp = c.has_b ? fb.data() : nullptr;
    norm_forward<float>(op, s, fout.data(), fi.data(), fwp, fbp, fmean.data(), frstd.data(),
                        static_cast<float>(c.eps));
    norm_backward<float>(op, s, fdinp.data(), false, fdw.data(), fdb.data(), fR.data(), fi.data(),
                         fwp, fmean.data(), frstd.data());
    EXPECT_LT(float_rel_err(fout, out), kFloatTol);
    EXPECT_LT(float_rel_err(fdinp, dinp), kFloatTol);
    if (c.has_w) {
      EXPECT_LT(float_rel_err(fdw, dw), kFloatTol);
    }
    if (c.has_b) {
      EXPECT_LT(float_rel_err(fdb, db), kFloatTol);
    }
  }
}

// ---- split norm: a row sharded across TP ranks -------------------------------------------------
//
// PROJECTION-scope QK-norm under tensor parallelism: rank k holds channels [cuts[k], cuts[k+1])
// of every group in buffers of its own, laid out as its local q inside qkv (ld_in = 3 G ck,
// ld_out = 2 G ck for ck channels). Each rank reduces partial statistics; their sum stands in
// for the all-reduce; each rank then normalises its part. Attention uses G = 1; G = 2 with a
// per-group and with a shared gain exercises the kernels' grouping as well. The forward must
// equal the unsplit norm_forward, and the backward assembled from the per-rank partials must
// match finite differences of L = sum(out * R) taken through the whole split forward.

constexpr double kUnread = 1.0e6;      // fills what a kernel must not read (it would show)
constexpr double kUnwritten = -333.0;  // fills what a kernel must not write

struct SplitNormCase {
  NormOp op;
  int64_t N, G, Cg_total;
  bool shared_gain;
  std::vector<int64_t> cuts;  // 0 = cuts[0] < ... < cuts.back() = Cg_total
  std::string name;
  Vec inp, w, b, R;  // global, dense: inp, R [N, G, Cg_total]; w, b [G or 1, Cg_total]
  bool has_w, has_b;
  double eps = 1e-5;

  SplitNormCase(NormOp op_, int64_t N_, int64_t G_, int64_t Cg_total_, bool shared,
                std::vector<int64_t> cuts_, uint32_t seed)
      : op(op_), N(N_), G(G_), Cg_total(Cg_total_), shared_gain(shared), cuts(std::move(cuts_)) {
    name = std::string(op_name(op)) + " G=" + std::to_string(G) + (shared ? " shared" : "") +
           " ranks=" + std::to_string(ranks());
    inp = randn(N * G * Cg_total, seed, 0.7, 1.0);
    const int64_t wn = (shared ? 1 : G) * Cg_total;
    w = randn(wn, seed + 1, 1.0, 0.5);
    b = randn(wn, seed + 2, 0.0, 0.5);
    R = randn(N * G * Cg_total, seed + 3);
    has_w = op != NormOp::kL2;
    has_b = op == NormOp::kLayer;
  }
  int ranks() const { return static_cast<int>(cuts.size()) - 1; }
  int64_t ck(int k) const { return cuts[k + 1] - cuts[k]; }
  NormShape local_shape(int k) const {
    return NormShape{N, G, ck(k), 3 * G * ck(k), 2 * G * ck(k), shared_gain ? 0 : ck(k)};
  }
  NormShape whole_shape() const {
    return NormShape{N, G, Cg_total, G * Cg_total, G * Cg_total, shared_gain ? 0 : Cg_total};
  }
  // Index in the global dense [N, G, Cg_total] of rank k's local channel c of (n, g).
  size_t global_at(int k, int64_t n, int64_t g, int64_t c) const {
    return static_cast<size_t>((n * G + g) * Cg_total + cuts[k] + c);
  }
  // Index in the global gain of rank k's local gain element i (i < wn_local(k)).
  size_t global_w(int k, int64_t i) const {
    const int64_t g = i / ck(k), c = i % ck(k);
    return static_cast<size_t>(g * Cg_total + cuts[k] + c);
  }
  int64_t wn_local(int k) const { return (shared_gain ? 1 : G) * ck(k); }
};

// One rank's buffers: its slices of the inputs and what its kernels produced.
struct RankBufs {
  NormShape s;
  Vec inp, w, b, dout, out, mean, rstd;
};

// The split forward. Returns the global output [N, G, Cg_total]; fills ranks when not null.
Vec split_forward(const SplitNormCase& c, std::vector<RankBufs>* ranks_out = nullptr) {
  std::vector<RankBufs> rk(c.ranks());
  Vec stats(2 * c.N * c.G, 0.0);
  for (int k = 0; k < c.ranks(); ++k) {
    RankBufs& r = rk[k];
    r.s = c.local_shape(k);
    r.inp.assign(c.N * r.s.ld_in, kUnread);
    r.dout.assign(c.N * r.s.ld_out, kUnread);
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t g = 0; g < c.G; ++g)
        for (int64_t ch = 0; ch < c.ck(k); ++ch) {
          r.inp[n * r.s.ld_in + g * r.s.Cg + ch] = c.inp[c.global_at(k, n, g, ch)];
          r.dout[n * r.s.ld_out + g * r.s.Cg + ch] = c.R[c.global_at(k, n, g, ch)];
        }
    r.w.resize(c.wn_local(k));
    r.b.resize(c.wn_local(k));
    for (int64_t i = 0; i < c.wn_local(k); ++i) {
      r.w[i] = c.w[c.global_w(k, i)];
      r.b[i] = c.b[c.global_w(k, i)];
    }
    Vec part(2 * c.N * c.G, kUnread);  // (=): the previous contents must not leak in
    norm_partial_stats<double>(r.s, r.inp.data(), part.data());
    for (size_t i = 0; i < stats.size(); ++i) stats[i] += part[i];  // the all-reduce
  }
  Vec out(c.N * c.G * c.Cg_total, 0.0);
  for (int k = 0; k < c.ranks(); ++k) {
    RankBufs& r = rk[k];
    r.out.assign(c.N * r.s.ld_out, kUnwritten);
    r.mean.assign(c.N * c.G, kUnread);
    r.rstd.assign(c.N * c.G, kUnread);
    norm_forward_from_stats<double>(c.op, r.s, c.Cg_total, stats.data(), r.out.data(), r.inp.data(),
                                    c.has_w ? r.w.data() : nullptr, c.has_b ? r.b.data() : nullptr,
                                    r.mean.data(), r.rstd.data(), c.eps);
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t g = 0; g < c.G; ++g)
        for (int64_t ch = 0; ch < c.ck(k); ++ch)
          out[c.global_at(k, n, g, ch)] = r.out[n * r.s.ld_out + g * r.s.Cg + ch];
  }
  if (ranks_out) *ranks_out = std::move(rk);
  return out;
}

// Analytic gradients of the split backward, gathered into global dinp, dweight, dbias. For
// accumulate, each rank's dinp starts from pre_dinp's slice (and from kUnwritten otherwise);
// dweight and dbias always start from pre_dw, pre_db.
struct SplitGrads {
  Vec dinp, dw, db;
};
SplitGrads split_backward(const SplitNormCase& c, std::vector<RankBufs>& rk, bool accumulate,
                          const Vec& pre_dinp, const Vec& pre_dw, const Vec& pre_db) {
  Vec parts(2 * c.N * c.G, 0.0);
  for (int k = 0; k < c.ranks(); ++k) {
    const RankBufs& r = rk[k];
    Vec part(2 * c.N * c.G, kUnread);  // (=)
    norm_backward_partials<double>(r.s, r.dout.data(), r.inp.data(), c.has_w ? r.w.data() : nullptr,
                                   r.mean.data(), r.rstd.data(), part.data());
    for (size_t i = 0; i < parts.size(); ++i) parts[i] += part[i];  // the all-reduce
  }
  SplitGrads out{Vec(c.inp.size(), 0.0), pre_dw, pre_db};
  for (int k = 0; k < c.ranks(); ++k) {
    const RankBufs& r = rk[k];
    Vec dinp(c.N * r.s.ld_in, kUnwritten);
    if (accumulate) {
      for (int64_t n = 0; n < c.N; ++n)
        for (int64_t g = 0; g < c.G; ++g)
          for (int64_t ch = 0; ch < c.ck(k); ++ch)
            dinp[n * r.s.ld_in + g * r.s.Cg + ch] = pre_dinp[c.global_at(k, n, g, ch)];
    }
    Vec dw(c.wn_local(k)), db(c.wn_local(k));
    for (int64_t i = 0; i < c.wn_local(k); ++i) {
      dw[i] = pre_dw[c.global_w(k, i)];
      db[i] = pre_db[c.global_w(k, i)];
    }
    norm_backward_from_partials<double>(
        c.op, r.s, c.Cg_total, parts.data(), dinp.data(), accumulate, c.has_w ? dw.data() : nullptr,
        c.has_b ? db.data() : nullptr, r.dout.data(), r.inp.data(), c.has_w ? r.w.data() : nullptr,
        r.mean.data(), r.rstd.data());
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t i = 0; i < r.s.ld_in; ++i) {
        const double v = dinp[n * r.s.ld_in + i];
        if (i < c.G * r.s.Cg) {
          out.dinp[c.global_at(k, n, i / r.s.Cg, i % r.s.Cg)] = v;
        } else {
          EXPECT_EQ(v, kUnwritten) << "rank " << k << " dinp gap (" << n << ", " << i << ")";
        }
      }
    }
    // Each rank owns the gain channels of its slice (of a shared gain too): disjoint pieces.
    for (int64_t i = 0; i < c.wn_local(k); ++i) {
      out.dw[c.global_w(k, i)] = dw[i];
      out.db[c.global_w(k, i)] = db[i];
    }
  }
  return out;
}

std::vector<SplitNormCase> split_norm_cases(NormOp op) {
  std::vector<SplitNormCase> cs;
  cs.emplace_back(op, 4, 1, 12, false, std::vector<int64_t>{0, 12}, 1100);        // tp = 1
  cs.emplace_back(op, 4, 1, 12, false, std::vector<int64_t>{0, 6, 12}, 1200);     // tp = 2
  cs.emplace_back(op, 3, 1, 12, false, std::vector<int64_t>{0, 5, 9, 12}, 1300);  // uneven
  cs.emplace_back(op, 3, 2, 9, false, std::vector<int64_t>{0, 4, 9}, 1400);       // per group
  cs.emplace_back(op, 3, 2, 9, true, std::vector<int64_t>{0, 2, 5, 9}, 1500);     // shared
  return cs;
}

void run_split_norm(NormOp op) {
  for (SplitNormCase c : split_norm_cases(op)) {
    SCOPED_TRACE(c.name);
    const NormShape whole = c.whole_shape();
    const size_t rows = static_cast<size_t>(c.N * c.G);

    // (a) The split forward equals the unsplit one. kLayer's split variance is E[x^2] - mean^2,
    // not the two-pass sum, so the two agree to rounding (~1e-15 here), not bit for bit.
    std::vector<RankBufs> rk;
    const Vec out = split_forward(c, &rk);
    Vec ref(out.size(), 0.0), ref_mean(rows), ref_rstd(rows);
    norm_forward<double>(op, whole, ref.data(), c.inp.data(), c.has_w ? c.w.data() : nullptr,
                         c.has_b ? c.b.data() : nullptr, ref_mean.data(), ref_rstd.data(), c.eps);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-12) << "out " << i;
    for (int k = 0; k < c.ranks(); ++k) {
      const RankBufs& r = rk[k];
      for (size_t i = 0; i < rows; ++i) {
        // Every rank holds the same statistics, bit for bit (one all-reduced input, one formula).
        EXPECT_EQ(r.rstd[i], rk[0].rstd[i]) << "rank " << k << " row " << i;
        EXPECT_EQ(r.mean[i], rk[0].mean[i]) << "rank " << k << " row " << i;
        EXPECT_NEAR(r.rstd[i], ref_rstd[i], 1e-12 * ref_rstd[i]) << "row " << i;
        if (op == NormOp::kLayer) {
          EXPECT_NEAR(r.mean[i], ref_mean[i], 1e-12) << "row " << i;
        }
      }
      // out (=) writes only the group region of its rows, never the k half of qk.
      for (int64_t n = 0; n < c.N; ++n)
        for (int64_t i = c.G * r.s.Cg; i < r.s.ld_out; ++i)
          EXPECT_EQ(r.out[n * r.s.ld_out + i], kUnwritten) << "rank " << k << " out gap";
    }

    // (b) The assembled backward matches finite differences of the split forward.
    const Vec zero_w(c.w.size(), 0.0), zero_b(c.b.size(), 0.0);
    const SplitGrads g = split_backward(c, rk, false, Vec(), zero_w, zero_b);
    auto loss = [&] { return dot_ld(split_forward(c), c.R); };
    check_fd("split norm " + c.name + " dinp", c.inp, g.dinp, loss);
    if (c.has_w) check_fd("split norm " + c.name + " dweight", c.w, g.dw, loss);
    if (c.has_b) check_fd("split norm " + c.name + " dbias", c.b, g.db, loss);
    if (!c.has_w) {
      EXPECT_EQ(g.dw, zero_w);  // null gradients are skipped
    }
    if (!c.has_b) {
      EXPECT_EQ(g.db, zero_b);
    }
    // ... and agrees with the unsplit backward.
    Vec ref_dinp(c.inp.size(), 0.0), ref_dw(c.w.size(), 0.0), ref_db(c.b.size(), 0.0);
    norm_backward<double>(op, whole, ref_dinp.data(), false, c.has_w ? ref_dw.data() : nullptr,
                          c.has_b ? ref_db.data() : nullptr, c.R.data(), c.inp.data(),
                          c.has_w ? c.w.data() : nullptr, ref_mean.data(), ref_rstd.data());
    for (size_t i = 0; i < ref_dinp.size(); ++i) EXPECT_NEAR(g.dinp[i], ref_dinp[i], 1e-12);
    for (size_t i = 0; i < ref_dw.size(); ++i) EXPECT_NEAR(g.dw[i], ref_dw[i], 1e-12);
    for (size_t i = 0; i < ref_db.size(); ++i) EXPECT_NEAR(g.db[i], ref_db[i], 1e-12);

    // accumulate = true adds to dinp; dweight and dbias add either way.
    const Vec pre = randn(c.inp.size(), 87), pre_w = randn(c.w.size(), 88),
              pre_b = randn(c.b.size(), 89);
    for (bool acc : {true, false}) {
      SCOPED_TRACE(acc ? "accumulate" : "overwrite");
      const SplitGrads g2 = split_backward(c, rk, acc, pre, pre_w, pre_b);
      for (size_t i = 0; i < pre.size(); ++i)
        EXPECT_NEAR(g2.dinp[i], (acc ? pre[i] : 0.0) + g.dinp[i], 1e-12) << "dinp " << i;
      for (size_t i = 0; i < pre_w.size(); ++i) EXPECT_NEAR(g2.dw[i], pre_w[i] + g.dw[i], 1e-12);
      for (size_t i = 0; i < pre_b.size(); ++i) EXPECT_NEAR(g2.db[i], pre_b[i] + g.db[i], 1e-12);
    }
  }
}

TEST(SplitNormGrad, LayerNormAcrossRanksMatchesUnsplitAndFiniteDifferences) {
  run_split_norm(NormOp::kLayer);
}
TEST(SplitNormGrad, RmsNormAcrossRanksMatchesUnsplitAndFiniteDifferences) {
  run_split_norm(NormOp::kRms);
}
TEST(SplitNormGrad, L2NormAcrossRanksMatchesUnsplitAndFiniteDifferences) {
  run_split_norm(NormOp::kL2);
}

// ---- attention ---------------------------------------------------------------------------------

// q, k, v, out with four different row strides (each wider than H D) and per-head scales.
struct AttnCase {
  AttentionShape s;
  Vec q, k, v, scale, R;
  AttnCase(int64_t B, int64_t T, int64_t H, int64_t D, uint32_t seed) {
    const int64_t HD = H * D;
    s = AttentionShape{B, T, H, D, HD + 3, HD + 5, HD + 1, HD + 2};
    q = randn(B * T * s.ldq, seed);
    k = randn(B * T * s.ldk, seed + 1);
    v = randn(B * T * s.ldv, seed + 2);
    scale.resize(H);
    for (int64_t h = 0; h < H; ++h) scale[h] = 0.35 + 0.2 * h;  // distinct per head
    R = randn(B * T * s.ldo, seed + 3);
  }
  void forward(Vec& out, Vec& probs, double* max_logit) const {
    out.assign(s.B * s.T * s.ldo, 0.0);
    probs.assign(s.B * s.H * s.T * s.T, -1.0);
    attention_forward<double>(s, out.data(), probs.data(), q.data(), k.data(), v.data(),
                              scale.data(), max_logit);
  }
  long double loss() const {
    Vec out, probs;
    double ml;
    forward(out, probs, &ml);
    return dot_ld(out, R);
  }
  // Elements (b, t, h, d) of a buffer with row stride ld.
  std::vector<size_t> region(int64_t ld) const {
    std::vector<size_t> idx;
    for (int64_t bt = 0; bt < s.B * s.T; ++bt)
      for (int64_t c = 0; c < s.H * s.D; ++c) idx.push_back(bt * ld + c);
    return idx;
  }
};

void run_attention_grad(int64_t T) {
  AttnCase c(2, T, 2, 4, 50 + static_cast<uint32_t>(T));
  const AttentionShape& s = c.s;
  constexpr double kSentinel = -555.0;
  Vec out, probs;
  double max_logit = -1.0;
  c.forward(out, probs, &max_logit);

  // probs: rows sum to 1, zero above the diagonal; max |logit| equals a brute-force max.
  double brute_max = 0.0;
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const double* row = probs.data() + ((b * s.H + h) * T + t) * T;
        long double sum = 0.0L;
        for (int64_t u = 0; u < T; ++u) {
          if (u > t) {
            EXPECT_EQ(row[u], 0.0) << "probs above the diagonal at t=" << t << " u=" << u;
          } else {
            EXPECT_GE(row[u], 0.0);
            sum += row[u];
            long double qk = 0.0L;
            for (int64_t d = 0; d < s.D; ++d)
              qk += static_cast<long double>(c.q[(b * T + t) * s.ldq + h * s.D + d]) *
                    c.k[(b * T + u) * s.ldk + h * s.D + d];
            brute_max = std::max(brute_max, std::abs(static_cast<double>(c.scale[h] * qk)));
          }
        }
        EXPECT_NEAR(static_cast<double>(sum), 1.0, 1e-13) << "row t=" << t;
      }
    }
  }
  EXPECT_NEAR(max_logit, brute_max, 1e-12 * brute_max);

  // Output gaps (ldo > H D) are not written by forward.
  Vec out_sentinel(s.B * T * s.ldo, kSentinel), probs2(probs.size());
  attention_forward<double>(s, out_sentinel.data(), probs2.data(), c.q.data(), c.k.data(),
                            c.v.data(), c.scale.data(), nullptr);
  for (size_t i = 0; i < out_sentinel.size(); ++i) {
    if (static_cast<int64_t>(i % s.ldo) >= s.H * s.D) {
      EXPECT_EQ(out_sentinel[i], kSentinel);
    }
  }

  Vec ws(attention_workspace_elems(s, omp_get_max_threads()));
  Vec dq(c.q.size(), kSentinel), dk(c.k.size(), kSentinel), dv(c.v.size(), kSentinel);
  const Vec pre_dscale = {0.25, -0.5};
  Vec dscale = pre_dscale;
  attention_backward<double>(s, dq.data(), dk.data(), dv.data(), dscale.data(), c.R.data(),
                             probs.data(), c.q.data(), c.k.data(), c.v.data(), c.scale.data(),
                             ws.data());
  // Gaps of the strided gradients are left alone.
  for (auto [buf, ld] : {std::pair{&dq, s.ldq}, std::pair{&dk, s.ldk}, std::pair{&dv, s.ldv}}) {
    for (size_t i = 0; i < buf->size(); ++i) {
      if (static_cast<int64_t>(i % ld) >= s.H * s.D) {
        EXPECT_EQ((*buf)[i], kSentinel);
      }
    }
  }
  const std::string tag = "attention T=" + std::to_string(T);
  auto loss = [&] { return c.loss(); };
  check_fd(tag + " dq", c.q, dq, loss, c.region(s.ldq));
  check_fd(tag + " dk", c.k, dk, loss, c.region(s.ldk));
  check_fd(tag + " dv", c.v, dv, loss, c.region(s.ldv));
  Vec dscale_only(s.H);
  for (int64_t h = 0; h < s.H; ++h) dscale_only[h] = dscale[h] - pre_dscale[h];  // += semantics
  check_fd(tag + " dscale", c.scale, dscale_only, loss);

  // dscale = null gives the same dq, dk, dv.
  Vec dq2(dq.size(), kSentinel), dk2(dk.size(), kSentinel), dv2(dv.size(), kSentinel);
  attention_backward<double>(s, dq2.data(), dk2.data(), dv2.data(), nullptr, c.R.data(),
                             probs.data(), c.q.data(), c.k.data(), c.v.data(), c.scale.data(),
                             ws.data());
  EXPECT_EQ(dq2, dq);
  EXPECT_EQ(dk2, dk);
  EXPECT_EQ(dv2, dv);
}

// T = 70 > 64 and not a multiple of it: the causal row/column blocking crosses a block boundary.
TEST(AttentionGrad, CrossesCausalBlockBoundaryT70) { run_attention_grad(70); }
TEST(AttentionGrad, ShortSequenceT5) { run_attention_grad(5); }

TEST(AttentionGrad, FloatMatchesDouble) {
  AttnCase c(2, 70, 2, 4, 321);
  const AttentionShape& s = c.s;
  Vec out, probs;
  double ml;
  c.forward(out, probs, &ml);
  Vec ws(attention_workspace_elems(s, omp_get_max_threads()));
  Vec dq(c.q.size(), 0.0), dk(c.k.size(), 0.0), dv(c.v.size(), 0.0), dscale(s.H, 0.0);
  attention_backward<double>(s, dq.data(), dk.data(), dv.data(), dscale.data(), c.R.data(),
                             probs.data(), c.q.data(), c.k.data(), c.v.data(), c.scale.data(),
                             ws.data());
  auto fq = to_float(c.q), fk = to_float(c.k), fv = to_float(c.v), fs = to_float(c.scale),
       fR = to_float(c.R);
  std::vector<float> fout(out.size(), 0.f), fprobs(probs.size()), fdq(dq.size(), 0.f),
      fdk(dk.size(), 0.f), fdv(dv.size(), 0.f), fdscale(s.H, 0.f),
      fws(attention_workspace_elems(s, omp_get_max_threads()));
  float fml = 0.f;
  attention_forward<float>(s, fout.data(), fprobs.data(), fq.data(), fk.data(), fv.data(),
                           fs.data(), &fml);
  attention_backward<float>(s, fdq.data(), fdk.data(), fdv.data(), fdscale.data(), fR.data(),
                            fprobs.data(), fq.data(), fk.data(), fv.data(), fs.data(), fws.data());
  EXPECT_LT(float_rel_err(fout, out), kFloatTol);
  EXPECT_LT(float_rel_err(fprobs, probs), kFloatTol);
  EXPECT_LT(float_rel_err(fdq, dq), kFloatTol);
  EXPECT_LT(float_rel_err(fdk, dk), kFloatTol);
  EXPECT_LT(float_rel_err(fdv, dv), kFloatTol);
  EXPECT_LT(float_rel_err(fdscale, dscale), kFloatTol);
  EXPECT_NEAR(fml, ml, kFloatTol * ml);
}

// ---- gelu --------------------------------------------------------------------------------------

TEST(GeluGrad, MatchesFiniteDifferences) {
  const int64_t n = 60;
  Vec x(n), R = randn(n, 7);
  for (int64_t i = 0; i < n; ++i) x[i] = -5.0 + 10.0 * i / (n - 1);  // tails and the bend
  auto loss = [&] {
    Vec out(n);
    gelu_forward<double>(out.data(), x.data(), n);
    return dot_ld(out, R);
  };
  Vec dx(n, 99.0);
  gelu_backward<double>(dx.data(), x.data(), R.data(), n);
  check_fd("gelu", x, dx, loss);
  // Known values of the tanh GELU.
  Vec y(3);
  const Vec xs = {0.0, 1.0, -1.0};
  gelu_forward<double>(y.data(), xs.data(), 3);
  EXPECT_EQ(y[0], 0.0);
  EXPECT_NEAR(y[1], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[2], -0.15880800939172324, 1e-15);
}

TEST(GeluGrad, FloatMatchesDouble) {
  const int64_t n = 60;
  Vec x = randn(n, 8, 0.0, 2.0), R = randn(n, 9), out(n), dx(n);
  gelu_forward<double>(out.data(), x.data(), n);
  gelu_backward<double>(dx.data(), x.data(), R.data(), n);
  auto fx = to_float(x), fR = to_float(R);
  std::vector<float> fout(n), fdx(n);
  gelu_forward<float>(fout.data(), fx.data(), n);
  gelu_backward<float>(fdx.data(), fx.data(), fR.data(), n);
  EXPECT_LT(float_rel_err(fout, out), kFloatTol);
  EXPECT_LT(float_rel_err(fdx, dx), kFloatTol);
}

// ---- embedding ---------------------------------------------------------------------------------

void run_embedding_grad(int64_t v_begin, int64_t V_local, int64_t C, const std::string& tag) {
  // Repeated tokens (accumulation) and, for a shard, tokens on both sides of it.
  const std::vector<int32_t> tokens = {3, 0, 9, 3, 5, 4, 6, 3, 7, 1, 4};
  const int64_t N = static_cast<int64_t>(tokens.size());
  Vec wte = randn(V_local * C, 17), R = randn(N * C, 18);
  auto loss = [&] {
    Vec out(N * C, 55.0);
    embedding_forward<double>(out.data(), tokens.data(), N, wte.data(), v_begin, V_local, C);
    return dot_ld(out, R);
  };
  Vec out(N * C, 55.0);
  embedding_forward<double>(out.data(), tokens.data(), N, wte.data(), v_begin, V_local, C);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = tokens[n] - v_begin;
    const bool here = row >= 0 && row < V_local;
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(out[n * C + c], here ? wte[row * C + c] : 0.0) << tag << " n=" << n;
  }
  // One guard row past the shard: the backward must not scatter outside it.
  constexpr double kGuard = 31.0;
  Vec dwte((V_local + 1) * C, 0.0);
  std::fill(dwte.begin() + V_local * C, dwte.end(), kGuard);
  embedding_backward<double>(dwte.data(), R.data(), tokens.data(), N, v_begin, V_local, C);
  for (int64_t i = V_local * C; i < (V_local + 1) * C; ++i) EXPECT_EQ(dwte[i], kGuard) << tag;
  dwte.resize(V_local * C);
  check_fd("embedding " + tag, wte, dwte, loss);
  // Rows of tokens that do not occur have exactly zero gradient.
  for (int64_t r = 0; r < V_local; ++r) {
    const bool seen = std::count(tokens.begin(), tokens.end(), static_cast<int32_t>(r + v_begin));
    if (seen) continue;
    for (int64_t c = 0; c < C; ++c) EXPECT_EQ(dwte[r * C + c], 0.0) << tag << " row " << r;
  }
  // += semantics.
  Vec pre = randn(V_local * C, 19), acc = pre;
  embedding_backward<double>(acc.data(), R.data(), tokens.data(), N, v_begin, V_local, C);
  for (size_t i = 0; i < acc.size(); ++i) EXPECT_NEAR(acc[i], pre[i] + dwte[i], 1e-12);
}

TEST(EmbeddingGrad, FullTableMatchesFiniteDifferences) { run_embedding_grad(0, 10, 6, "full"); }
// Rows [4, 7) of the table, C = 70 crosses the backward's 64-channel blocks.
TEST(EmbeddingGrad, VocabShardMatchesFiniteDifferences) {
  run_embedding_grad(4, 3, 70, "shard [4,7)");
}

TEST(EmbeddingGrad, PositionMatchesFiniteDifferences) {
  const int64_t B = 3, T = 5, C = 6;
  Vec wpe = randn(T * C, 21), base = randn(B * T * C, 22), R = randn(B * T * C, 23);
  auto loss = [&] {
    Vec out = base;  // position_forward adds (+=)
    position_forward<double>(out.data(), wpe.data(), B, T, C);
    return dot_ld(out, R);
  };
  Vec out = base;
  position_forward<double>(out.data(), wpe.data(), B, T, C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (b * T + t) * C + c;
        EXPECT_EQ(out[i], base[i] + wpe[t * C + c]);
      }
  const Vec pre = randn(T * C, 24);
  Vec dwpe = pre;
  position_backward<double>(dwpe.data(), R.data(), B, T, C);
  for (size_t i = 0; i < dwpe.size(); ++i) dwpe[i] -= pre[i];  // += semantics
  check_fd("position", wpe, dwpe, loss);
}

TEST(EmbeddingGrad, FloatMatchesDouble) {
  const std::vector<int32_t> tokens = {3, 0, 9, 3, 5};
  const int64_t N = 5, V = 10, C = 6;
  Vec wte = randn(V * C, 25), R = randn(N * C, 26), out(N * C), dwte(V * C, 0.0);
  embedding_forward<double>(out.data(), tokens.data(), N, wte.data(), 0, V, C);
  embedding_backward<double>(dwte.data(), R.data(), tokens.data(), N, 0, V, C);
  auto fw = to_float(wte), fR = to_float(R);
  std::vector<float> fout(N * C), fdwte(V * C, 0.f);
  embedding_forward<float>(fout.data(), tokens.data(), N, fw.data(), 0, V, C);
  embedding_backward<float>(fdwte.data(), fR.data(), tokens.data(), N, 0, V, C);
  EXPECT_LT(float_rel_err(fout, out), kFloatTol);
  EXPECT_LT(float_rel_err(fdwte, dwte), kFloatTol);
}

// ---- sum_squares -------------------------------------------------------------------------------

template <typename T>
void run_sum_squares_threads() {
  ThreadCountGuard guard;
  const int64_t n = (1 << 21) + 12345;  // many chunks and a ragged last one
  std::mt19937 rng(99);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<T> x(n);
  for (T& v : x) v = static_cast<T>(dist(rng));
  omp_set_num_threads(1);
  const double one = sum_squares<T>(x.data(), n);
  omp_set_num_threads(2);
  const double two = sum_squares<T>(x.data(), n);
  omp_set_num_threads(3);  // an uneven split of the chunks
  const double three = sum_squares<T>(x.data(), n);
  EXPECT_EQ(std::memcmp(&one, &two, sizeof(double)), 0) << one << " vs " << two;
  EXPECT_EQ(std::memcmp(&one, &three, sizeof(double)), 0) << one << " vs " << three;
  long double ref = 0.0L;
  for (T v : x) ref += static_cast<long double>(v) * v;
  EXPECT_NEAR(one, static_cast<double>(ref), 1e-12 * static_cast<double>(ref));
}

TEST(SumSquares, BitIdenticalForOneAndTwoThreadsFloat) { run_sum_squares_threads<float>(); }
TEST(SumSquares, BitIdenticalForOneAndTwoThreadsDouble) { run_sum_squares_threads<double>(); }

}  // namespace
}  // namespace keel::kernels
