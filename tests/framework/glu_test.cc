// Tests of the gated-linear-unit kernels (framework/kernels/glu.h): forward against formulas
// written out here in double (SiLU from std::exp, GELU from std::tanh), the backward against
// central finite differences in double, float against double, the in-place (dup == dout) form,
// and finite results far out in the tails.
#include "framework/kernels/glu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace keel::kernels {
namespace {

// As kernels_grad_test.cc: L = sum(R * out) with a fixed random R, so dL/dout = R. With
// h = 1e-6 the truncation error is ~h^2 |L'''| / 6 ~ 1e-13 and the rounding error ~1e-16 *
// O(10) / 1e-6 ~ 1e-9 against gradients of O(0.1 .. 1): 1e-6 relative leaves a 10x margin,
// while a wrong derivative (a dropped term, a wrong sign, the activation's gradient applied to
// the wrong operand) is an O(1) relative error.
constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-6;
// float kernel against the double kernel, relative to the largest |double| (fast_expf and
// fast_tanhf are accurate to ~2e-7).
constexpr double kFloatTol = 1e-5;

std::vector<double> randn(size_t n, uint32_t seed, double stdv = 1.5) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, stdv);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

struct Act {
  GluAct act;
  const char* name;
};

// The activations written independently of glu.h and elementwise.h.
double reference_act(GluAct act, double x) {
  if (act == GluAct::kSilu) return x / (1.0 + std::exp(-x));
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

class Glu : public ::testing::TestWithParam<Act> {};

TEST_P(Glu, ForwardMatchesTheFormula) {
  const GluAct act = GetParam().act;
  const int64_t n = 1000;
  const std::vector<double> gate = randn(n, 1, 3.0), up = randn(n, 2);
  std::vector<double> out(n);
  glu_forward<double>(act, out.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double want = reference_act(act, gate[i]) * up[i];
    EXPECT_NEAR(out[i], want, 1e-14 * (1.0 + std::abs(want))) << i;
  }
  // The activation multiplies the gate, not the up projection: swapping them changes the result.
  std::vector<double> swapped(n);
  glu_forward<double>(act, swapped.data(), up.data(), gate.data(), n);
  double diff = 0.0;
  for (int64_t i = 0; i < n; ++i) diff = std::max(diff, std::abs(swapped[i] - out[i]));
  EXPECT_GT(diff, 0.1);
}

TEST_P(Glu, BackwardMatchesFiniteDifferences) {
  const GluAct act = GetParam().act;
  const int64_t n = 257;
  std::vector<double> gate = randn(n, 3, 2.0), up = randn(n, 4);
  const std::vector<double> r = randn(n, 5, 1.0);
  std::vector<double> dgate(n), dup(n);
  glu_backward<double>(act, dgate.data(), dup.data(), r.data(), gate.data(), up.data(), n);
  std::vector<double> out(n);
  auto loss = [&] {
    glu_forward<double>(act, out.data(), gate.data(), up.data(), n);
    long double s = 0.0L;
    for (int64_t i = 0; i < n; ++i) s += static_cast<long double>(out[i]) * r[i];
    return s;
  };
  double worst = 0.0;
  for (auto [x, grad, what] : {std::tuple{&gate, &dgate, "dgate"}, std::tuple{&up, &dup, "dup"}}) {
    for (int64_t i = 0; i < n; ++i) {
      const double x0 = (*x)[i];
      (*x)[i] = x0 + kFdStep;
      const long double lp = loss();
      (*x)[i] = x0 - kFdStep;
      const long double lm = loss();
      (*x)[i] = x0;
      const double fd = static_cast<double>((lp - lm) / (2.0L * kFdStep));
      const double a = (*grad)[i];
      const double rel = std::abs(fd - a) / std::max({std::abs(fd), std::abs(a), 1e-3});
      worst = std::max(worst, rel);
      EXPECT_LE(rel, kFdTol) << what << "[" << i << "]: analytic " << a << " vs fd " << fd;
    }
  }
  std::printf("[glu] %s: worst relative FD error %.1e\n", GetParam().name, worst);
}

TEST_P(Glu, FloatMatchesDoubleAndInPlaceMatchesOutOfPlace) {
  const GluAct act = GetParam().act;
  const int64_t n = 4099;  // not a multiple of any vector width
  const std::vector<double> gate = randn(n, 6, 3.0), up = randn(n, 7), r = randn(n, 8, 1.0);
  std::vector<float> gf(gate.begin(), gate.end()), uf(up.begin(), up.end()), rf(r.begin(), r.end());
  std::vector<double> out(n), dgate(n), dup(n);
  glu_forward<double>(act, out.data(), gate.data(), up.data(), n);
  glu_backward<double>(act, dgate.data(), dup.data(), r.data(), gate.data(), up.data(), n);
  std::vector<float> outf(n), dgatef(n), dupf(n);
  glu_forward<float>(act, outf.data(), gf.data(), uf.data(), n);
  glu_backward<float>(act, dgatef.data(), dupf.data(), rf.data(), gf.data(), uf.data(), n);
  auto max_abs = [](const std::vector<double>& v) {
    double m = 0.0;
    for (double x : v) m = std::max(m, std::abs(x));
    return m;
  };
  for (auto [d, f, what] : {std::tuple{&out, &outf, "out"}, std::tuple{&dgate, &dgatef, "dgate"},
                            std::tuple{&dup, &dupf, "dup"}}) {
    // The float inputs are the double ones rounded (6e-8 relative), far below the tolerance.
    const double scale = max_abs(*d);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR((*f)[i], (*d)[i], kFloatTol * scale) << what << "[" << i << "]";
    }
  }
  // dup may be dout: the same values as out of place, bit for bit.
  std::vector<float> inplace = rf, dgate2(n);
  glu_backward<float>(act, dgate2.data(), inplace.data(), inplace.data(), gf.data(), uf.data(), n);
  EXPECT_EQ(inplace, dupf);
  EXPECT_EQ(dgate2, dgatef);
}

TEST_P(Glu, TailsStayFinite) {
  const GluAct act = GetParam().act;
  const std::vector<float> gate = {-1000.0f, -100.0f, -20.0f, 0.0f, 20.0f, 100.0f, 1000.0f};
  const int64_t n = static_cast<int64_t>(gate.size());
  const std::vector<float> up(n, 2.0f), r(n, 1.0f);
  std::vector<float> out(n), dgate(n), dup(n);
  glu_forward<float>(act, out.data(), gate.data(), up.data(), n);
  glu_backward<float>(act, dgate.data(), dup.data(), r.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(out[i]) && std::isfinite(dgate[i]) && std::isfinite(dup[i]))
        << "gate " << gate[i];
  }
  // act(x) -> 0 for x -> -inf and -> x for x -> +inf, with slopes 0 and 1.
  EXPECT_NEAR(out[0], 0.0f, 1e-6f);
  EXPECT_NEAR(out[6], 2000.0f, 1e-3f);
  EXPECT_NEAR(dgate[0], 0.0f, 1e-6f);
  EXPECT_NEAR(dgate[6], 2.0f, 1e-5f);
  EXPECT_EQ(out[3], 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Activations, Glu,
                         ::testing::Values(Act{GluAct::kSilu, "silu"}, Act{GluAct::kGelu, "gelu"}),
                         [](const ::testing::TestParamInfo<Act>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace keel::kernels
