// Tests of the rotary position embedding kernels (framework/kernels/rope.h): the float kernel
// against a direct double-precision evaluation of Note [rope-convention], the rotation's
// invariants (pair norms, identity at position 0, dot products depending only on p1 - p2),
// a finite-difference check of rope_backward in double, in-place round trips, and strided
// (packed qkv) layouts leaving the other columns untouched.
#include "framework/kernels/rope.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "framework/error.h"

namespace keel::kernels {
namespace {

// FD step and tolerance as in kernels_grad_test.cc. L = sum(w * rope(x)) is linear in x, so the
// central difference has no truncation error; its rounding error ~ eps * sum|w * y| / h ~
// 1e-16 * O(100) / 1e-6 ~ 1e-8 against gradients of O(1), while a wrong sign or index in
// rope_backward is an O(1) relative error.
constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-6;
constexpr double kTheta = 10000.0;

template <typename Real>
std::vector<Real> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<Real> v(n);
  for (Real& x : v) x = static_cast<Real>(dist(rng));
  return v;
}

// Direct evaluation of Note [rope-convention] in double, from theta (not from the table), for
// one head vector x[D] at position p.
std::vector<double> rope_reference(const float* x, int64_t D, int64_t p, double theta) {
  const int64_t half = D / 2;
  std::vector<double> y(D);
  for (int64_t i = 0; i < half; ++i) {
    const double angle =
        static_cast<double>(p) * std::pow(theta, -2.0 * i / static_cast<double>(D));
    const double x1 = x[i], x2 = x[i + half];
    y[i] = x1 * std::cos(angle) - x2 * std::sin(angle);
    y[i + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
  }
  return y;
}

TEST(Rope, MatchesDoubleReferenceFormula) {
  for (const double theta : {kTheta, 500000.0}) {
    const int64_t B = 2, T = 7, H = 3, D = 16, pos_offset = 5;
    const RopeTable table = make_rope_table(64, D, theta);
    const std::vector<float> x = randn<float>(B * T * H * D, 1);
    std::vector<float> y(x.size());
    rope_forward(table, y.data(), x.data(), B, T, H, D, H * D, pos_offset);
    double worst = 0.0, scale = 0.0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t off = ((b * T + t) * H + h) * D;
          const std::vector<double> ref = rope_reference(x.data() + off, D, t + pos_offset, theta);
          for (int64_t d = 0; d < D; ++d) {
            worst = std::max(worst, std::abs(y[off + d] - ref[d]));
            scale = std::max(scale, std::abs(ref[d]));
          }
        }
      }
    }
    std::printf("[rope] theta %.0f: max |float - double ref| / max |ref| = %.2e\n", theta,
                worst / scale);
    EXPECT_LT(worst / scale, 1e-6) << "theta " << theta;
  }
}

TEST(Rope, PreservesPairNormsAndIsIdentityAtPositionZero) {
  const int64_t T = 40, H = 2, D = 32, half = D / 2;
  const RopeTable table = make_rope_table(T, D, kTheta);
  const std::vector<float> x = randn<float>(T * H * D, 2);
  std::vector<float> y(x.size());
  rope_forward(table, y.data(), x.data(), 1, T, H, D, H * D);
  double worst = 0.0;
  for (int64_t r = 0; r < T * H; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double a = x[r * D + i], b = x[r * D + i + half];
      const double c = y[r * D + i], d = y[r * D + i + half];
      const double n_in = a * a + b * b, n_out = c * c + d * d;
      worst = std::max(worst, std::abs(n_out - n_in) / std::max(n_in, 1e-12));
    }
  }
  EXPECT_LT(worst, 1e-6);
  // Row 0 is position 0: cos = 1, sin = 0 exactly.
  for (int64_t k = 0; k < H * D; ++k) EXPECT_EQ(y[k], x[k]) << k;
  // Later positions do rotate (the test above would pass for an identity kernel).
  double moved = 0.0;
  for (size_t k = H * D; k < x.size(); ++k) moved = std::max(moved, double(std::abs(y[k] - x[k])));
  EXPECT_GT(moved, 0.1);
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  const int64_t P = 256, D = 64;
  const RopeTable table = make_rope_table(P, D, kTheta);
  const std::vector<float> q = randn<float>(D, 3), k = randn<float>(D, 4);
  // Every row holds the same vector, so row p of the output is rope(v, p).
  std::vector<float> rq(P * D), rk(P * D);
  for (int64_t p = 0; p < P; ++p) {
    std::copy(q.begin(), q.end(), rq.begin() + p * D);
    std::copy(k.begin(), k.end(), rk.begin() + p * D);
  }
  rope_forward(table, rq.data(), rq.data(), 1, P, 1, D, D);
  rope_forward(table, rk.data(), rk.data(), 1, P, 1, D, D);
  auto dot = [&](int64_t p1, int64_t p2) {
    double s = 0.0;
    for (int64_t d = 0; d < D; ++d) s += double(rq[p1 * D + d]) * rk[p2 * D + d];
    return s;
  };
  double qk = 0.0, norm_q = 0.0, norm_k = 0.0;
  for (int64_t d = 0; d < D; ++d) {
    qk += double(q[d]) * k[d];
    norm_q += double(q[d]) * q[d];
    norm_k += double(k[d]) * k[d];
  }
  const double scale = std::sqrt(norm_q * norm_k);
  double worst = 0.0, spread = 0.0;
  for (const auto& [p1, p2] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 0}, {3, 0}, {0, 3}, {10, 7}, {17, 100}, {100, 17}}) {
    const double base = dot(p1, p2);
    spread = std::max(spread, std::abs(base - qk));
    for (const int64_t shift : {1, 13, 120}) {
      worst = std::max(worst, std::abs(dot(p1 + shift, p2 + shift) - base) / scale);
    }
  }
  std::printf("[rope] relative-position property: worst |dot shift| / (|q||k|) = %.2e\n", worst);
  EXPECT_LT(worst, 1e-5);
  // At p1 == p2 the dot is that of the unrotated vectors; at p1 != p2 it is not.
  EXPECT_LT(std::abs(dot(9, 9) - qk) / scale, 1e-5);
  EXPECT_GT(spread / scale, 1e-2);
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  // Strided rows (row_stride > H * D) and a position offset, in double.
  const int64_t B = 2, T = 5, H = 3, D = 8, ld = H * D + 5, pos_offset = 3;
  const RopeTable table = make_rope_table(T + pos_offset, D, kTheta);
  const size_t n = static_cast<size_t>(B * T * ld);
  std::vector<double> x = randn<double>(n, 5), w = randn<double>(n, 6);
  std::vector<double> y(n), dx(n, 0.0);
  auto loss = [&]() {
    rope_forward(table, y.data(), x.data(), B, T, H, D, ld, pos_offset);
    long double s = 0.0L;
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t c = 0; c < H * D; ++c)
        s += static_cast<long double>(w[r * ld + c]) * y[r * ld + c];
    }
    return s;
  };
  rope_backward(table, dx.data(), w.data(), B, T, H, D, ld, pos_offset);
  double worst = 0.0, scale = 0.0;
  int reported = 0;
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t c = 0; c < H * D; ++c) scale = std::max(scale, std::abs(dx[r * ld + c]));
  }
  ASSERT_GT(scale, 0.0);
  // The hundreds of tiny forwards run on one thread (OpenMP fork/join would dominate).
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t c = 0; c < H * D; ++c) {
      const size_t i = static_cast<size_t>(r * ld + c);
      const double x0 = x[i];
      x[i] = x0 + kFdStep;
      const long double lp = loss();
      x[i] = x0 - kFdStep;
      const long double lm = loss();
      x[i] = x0;
      const double fd = static_cast<double>((lp - lm) / (2.0L * kFdStep));
      const double rel =
          std::abs(dx[i] - fd) / std::max({std::abs(dx[i]), std::abs(fd), 1e-2 * scale});
      worst = std::max(worst, rel);
      if (rel > kFdTol && reported++ < 5) {
        ADD_FAILURE() << "dx[" << i << "]: analytic " << dx[i] << " vs fd " << fd;
      }
    }
  }
  omp_set_num_threads(saved_threads);
  std::printf("[fd] rope dx worst rel err %.2e over %lld elements\n", worst,
              static_cast<long long>(B * T * H * D));
}

TEST(Rope, InPlaceForwardThenBackwardReturnsInput) {
  const int64_t B = 3, T = 33, H = 4, D = 64;
  const RopeTable table = make_rope_table(T, D, kTheta);
  const std::vector<float> x = randn<float>(B * T * H * D, 7);
  std::vector<float> buf = x;
  rope_forward(table, buf.data(), buf.data(), B, T, H, D, H * D);
  // In place equals out of place.
  std::vector<float> y(x.size());
  rope_forward(table, y.data(), x.data(), B, T, H, D, H * D);
  EXPECT_EQ(buf, y);
  rope_backward(table, buf.data(), buf.data(), B, T, H, D, H * D);
  double worst = 0.0, scale = 0.0;
  for (size_t k = 0; k < x.size(); ++k) {
    worst = std::max(worst, double(std::abs(buf[k] - x[k])));
    scale = std::max(scale, double(std::abs(x[k])));
  }
  std::printf("[rope] forward+backward round trip: max err / max |x| = %.2e\n", worst / scale);
  EXPECT_LT(worst / scale, 1e-6);
}

TEST(Rope, StridedLayoutLeavesOtherColumnsUntouched) {
  // A packed qkv row [q | k | v] of 3 * H * D floats; q and k are rotated in place, v is not.
  const int64_t B = 2, T = 6, H = 2, D = 8, C = H * D, ld = 3 * C;
  const RopeTable table = make_rope_table(T, D, kTheta);
  const std::vector<float> qkv = randn<float>(B * T * ld, 8);
  std::vector<float> buf = qkv;
  rope_forward(table, buf.data(), buf.data(), B, T, H, D, ld);
  rope_forward(table, buf.data() + C, buf.data() + C, B, T, H, D, ld);
  // Contiguous reference for q and k.
  for (const int64_t part : {0, 1}) {
    std::vector<float> in(B * T * C), out(B * T * C);
    for (int64_t r = 0; r < B * T; ++r) {
      std::copy_n(qkv.begin() + r * ld + part * C, C, in.begin() + r * C);
    }
    rope_forward(table, out.data(), in.data(), B, T, H, D, C);
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(buf[r * ld + part * C + c], out[r * C + c]);
    }
  }
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t c = 2 * C; c < ld; ++c)
      ASSERT_EQ(buf[r * ld + c], qkv[r * ld + c]) << r << "," << c;
  }
  // Out of place into a strided output: the padding of y keeps its sentinel, both directions.
  const float kSentinel = -12345.0f;
  std::vector<float> y(qkv.size(), kSentinel), dx(qkv.size(), kSentinel);
  rope_forward(table, y.data(), qkv.data(), B, T, H, D, ld);
  rope_backward(table, dx.data(), qkv.data(), B, T, H, D, ld);
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t c = 0; c < ld; ++c) {
      if (c < C) {
        ASSERT_EQ(y[r * ld + c], buf[r * ld + c]);
        ASSERT_NE(dx[r * ld + c], kSentinel);
      } else {
        ASSERT_EQ(y[r * ld + c], kSentinel);
        ASSERT_EQ(dx[r * ld + c], kSentinel);
      }
    }
  }
}

TEST(Rope, RejectsBadShapes) {
  EXPECT_THROW(make_rope_table(16, 7, kTheta), Error);
  const RopeTable table = make_rope_table(16, 8, kTheta);
  std::vector<float> x(4 * 2 * 16, 1.0f);
  EXPECT_THROW(rope_forward(table, x.data(), x.data(), 1, 4, 2, 6, 16), Error);      // D mismatch
  EXPECT_THROW(rope_forward(table, x.data(), x.data(), 1, 4, 2, 8, 15), Error);      // stride < H*D
  EXPECT_THROW(rope_forward(table, x.data(), x.data(), 1, 4, 2, 8, 16, 13), Error);  // 13+4 > 16
  EXPECT_NO_THROW(rope_forward(table, x.data(), x.data(), 1, 4, 2, 8, 16, 12));
}

}  // namespace
}  // namespace keel::kernels
