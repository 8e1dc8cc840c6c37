// CUDA element-wise, norm, loss, embedding, optimizer and RoPE kernels
// (framework/kernels/cuda/ops.h) against the CPU backend on random inputs, outputs poisoned with
// NaN before each run; bounds in gpu_test_util.h.
#include "framework/kernels/cuda/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/adamw.h"
#include "framework/kernels/cross_entropy.h"
#include "framework/kernels/elementwise.h"
#include "framework/kernels/embedding.h"
#include "framework/kernels/gemm.h"
#include "framework/kernels/norm.h"
#include "framework/kernels/rope.h"
#include "framework/optim/optimizer.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;

class OpsTest : public GpuTest {};

// ---- element-wise ----

TEST_F(OpsTest, GeluForwardBackwardMatchCpu) {
  const int64_t n = 100003;
  const auto x = random_vec(n, -6, 6, 1);
  const auto dy = random_vec(n, -1, 1, 2);
  std::vector<float> y(n), dx(n);
  kernels::gelu_forward<float>(y.data(), x.data(), n);
  kernels::gelu_backward<float>(dx.data(), x.data(), dy.data(), n);
  DeviceBuffer d_x = cuda::upload(ctx(), x), d_dy = cuda::upload(ctx(), dy);
  DeviceBuffer d_y = poisoned<float>(n), d_dx = poisoned<float>(n);
  cuda::gelu_forward(ctx(), d_y.as<float>(), d_x.as<float>(), n);
  cuda::gelu_backward(ctx(), d_dx.as<float>(), d_x.as<float>(), d_dy.as<float>(), n);
  // The same __host__ __device__ formula; only nvcc's FMA contraction differs (a few ulp of tanh,
  // amplified in the derivative's 1 - tanh^2 for |x| ~ 4): the fp32 bound.
  EXPECT_TRUE(matches(get<float>(d_y, n), y, f32_rtol(1)));
  EXPECT_TRUE(matches(get<float>(d_dx, n), dx, f32_rtol(1)));
}

TEST_F(OpsTest, GeluBf16MatchesCpuOnRoundedInputs) {
  const int64_t n = 50001;
  const auto x = bf16_rounded(random_vec(n, -6, 6, 3));
  const auto dy = bf16_rounded(random_vec(n, -1, 1, 4));
  std::vector<float> y(n), dx(n);
  kernels::gelu_forward<float>(y.data(), x.data(), n);
  kernels::gelu_backward<float>(dx.data(), x.data(), dy.data(), n);
  DeviceBuffer d_x = cuda::upload(ctx(), to_bf16(x)), d_dy = cuda::upload(ctx(), to_bf16(dy));
  DeviceBuffer d_y = poisoned<Bf16>(n), d_dx = poisoned<Bf16>(n);
  cuda::gelu_forward(ctx(), d_y.as<Bf16>(), d_x.as<Bf16>(), n);
  cuda::gelu_backward(ctx(), d_dx.as<Bf16>(), d_x.as<Bf16>(), d_dy.as<Bf16>(), n);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_y, n)), y, kBf16Rtol));
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dx, n)), dx, kBf16Rtol));
}

// GELU's backward with its fused bias gradient (Note [fused-bias-grad]) against the CPU's
// gelu_backward and column sums: one row chunk (100 rows) and many with a ragged last one (3000
// rows: 188 chunks of 16 at C = 96, 43 of 70 at C = 770), dbias += into random values. The bf16
// dinp form sums the same fp32 values before rounding them, so its dbias equals the fp32 form's
// bit for bit.
TEST_F(OpsTest, GeluBackwardBiasOverRowChunksMatchesCpu) {
  uint32_t seed = 10;
  for (const auto& [N, C] : {std::pair<int64_t, int64_t>{3000, 96}, {3000, 770}, {100, 96}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const auto x = random_vec(N * C, -6, 6, seed++);
    const auto dy = random_vec(N * C, -1, 1, seed++);
    const auto db0 = random_vec(C, -2, 2, seed++);
    std::vector<float> dx(N * C), db = db0;
    kernels::gelu_backward<float>(dx.data(), x.data(), dy.data(), N * C);
    kernels::column_sum_add<float>(db.data(), dx.data(), N, C, C);
    DeviceBuffer d_x = cuda::upload(ctx(), x), d_dy = cuda::upload(ctx(), dy);
    DeviceBuffer d_dx = poisoned<float>(N * C), d_dxb = poisoned<Bf16>(N * C);
    DeviceBuffer d_db = cuda::upload(ctx(), db0), d_dbb = cuda::upload(ctx(), db0);
    cuda::gelu_backward(ctx(), d_dx.as<float>(), d_db.as<float>(), d_x.as<float>(),
                        d_dy.as<float>(), N, C);
    cuda::gelu_backward(ctx(), d_dxb.as<Bf16>(), d_dbb.as<float>(), d_x.as<float>(),
                        d_dy.as<float>(), N, C);
    EXPECT_TRUE(matches(get<float>(d_dx, N * C), dx, f32_rtol(1)));  // as GeluForwardBackward
    EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_dxb, N * C)), dx, kBf16Rtol));
    const auto gdb = get<float>(d_db, C);
    EXPECT_TRUE(matches(gdb, db, f32_rtol(N)));
    EXPECT_TRUE(identical(get<float>(d_dbb, C), gdb));
  }
}

TEST_F(OpsTest, ResidualAddMatchesCpu) {
  const int64_t n = 70001;
  const auto a = random_vec(n, -2, 2, 5), b = random_vec(n, -2, 2, 6);
  std::vector<float> out(n), acc = a;
  kernels::add<float>(out.data(), a.data(), b.data(), n);
  kernels::add_inplace<float>(acc.data(), b.data(), n);
  DeviceBuffer d_a = cuda::upload(ctx(), a), d_b = cuda::upload(ctx(), b);
  DeviceBuffer d_out = poisoned<float>(n);
  cuda::add(ctx(), d_out.as<float>(), d_a.as<float>(), d_b.as<float>(), n);
  cuda::add_inplace(ctx(), d_a.as<float>(), d_b.as<float>(), n);
  EXPECT_TRUE(identical(get<float>(d_out, n), out));  // one IEEE addition each
  EXPECT_TRUE(identical(get<float>(d_a, n), acc));
  // bf16: the fp32 sum of the rounded inputs, rounded once.
  const auto ar = bf16_rounded(a), br = bf16_rounded(b);
  std::vector<float> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = ar[i] + br[i];
  DeviceBuffer h_a = cuda::upload(ctx(), to_bf16(ar)), h_b = cuda::upload(ctx(), to_bf16(br));
  DeviceBuffer h_out = poisoned<Bf16>(n);
  cuda::add(ctx(), h_out.as<Bf16>(), h_a.as<Bf16>(), h_b.as<Bf16>(), n);
  cuda::add_inplace(ctx(), h_a.as<Bf16>(), h_b.as<Bf16>(), n);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(h_out, n)), ref, kBf16Rtol));
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(h_a, n)), ref, kBf16Rtol));
}

// ---- gradient norm, clipping, AdamW ----

TEST_F(OpsTest, SumSquaresMatchesCpuAndIsReproducible) {
  const int64_t n1 = 1000003, n2 = 4097;
  const auto x1 = random_vec(n1, -1, 1, 7), x2 = random_vec(n2, -3, 3, 8);
  const double ref =
      kernels::sum_squares<float>(x1.data(), n1) + kernels::sum_squares<float>(x2.data(), n2);
  DeviceBuffer d1 = cuda::upload(ctx(), x1), d2 = cuda::upload(ctx(), x2);
  DeviceBuffer out = poisoned<double>(1);
  std::vector<double> runs;
  for (int rep = 0; rep < 2; ++rep) {
    cuda::sum_squares(ctx(), d1.as<float>(), n1, out.as<double>(), /*accumulate=*/false);
    cuda::sum_squares(ctx(), d2.as<float>(), n2, out.as<double>(), /*accumulate=*/true);
    runs.push_back(get<double>(out, 1)[0]);
  }
  // Double accumulation of fp32 squares: only the summation order differs (~1e-16 relative).
  EXPECT_NEAR(runs[0], ref, 1e-12 * ref);
  EXPECT_EQ(std::memcmp(&runs[0], &runs[1], sizeof(double)), 0) << "not bitwise reproducible";
}

// The exact sum of squares of x over the segments, to far below a double's rounding: squares
// of floats are exact in double, summed pairwise in long double (64-bit mantissa).
long double exact_sum_squares(const std::vector<float>& x,
                              const std::vector<kernels::NormSegment>& segs) {
  std::vector<long double> sq;
  for (const kernels::NormSegment& s : segs) {
    for (int64_t i = s.offset; i < s.offset + s.n; ++i) {
      sq.push_back(static_cast<long double>(static_cast<double>(x[i]) * x[i]));
    }
  }
  while (sq.size() > 1) {
    std::vector<long double> half((sq.size() + 1) / 2, 0.0L);
    for (size_t i = 0; i < sq.size(); ++i) half[i / 2] += sq[i];
    sq.swap(half);
  }
  return sq.empty() ? 0.0L : sq[0];
}

// The multi-tensor norm (Note [multi-tensor norm], elementwise.cu) against sum_squares per
// segment accumulated in segment order (the trainer's sum before it) and an exact reference, over
// 300 segments (two table launches of 240 and 60) of 0 to 3000 elements (every 29th empty, every
// 50th over 20000: three chunks of 8192 and a ragged tail), with gaps between some, filled with
// 1e6 so that a gap summed shows. The two device orders differ, so the bound is each one's
// addition tree's depth times 2^-53 relative to the exact sum (squares are exact in double, all
// terms are positive): the multi-tensor tree is 32 (a thread's chunk elements) + 8 (block_sum of
// 256) + 1 (a final thread's partials: about 300 chunks here, one each) + 10 (block_sum of 1024)
// deep; the per-segment one 1 + 8 + 1 + 10 per segment and then 300 accumulations. Also: bitwise
// reproducible, a segment cut at a multiple of 8192 into two table entries gives the same bits (the
// chunks depend on the segments' lengths alone), and no segment, or only empty ones, write 0.
TEST_F(OpsTest, SumSquaresSegmentsMatchesPerTensorSumWithinItsOrderBound) {
  std::mt19937 gen(31);
  std::vector<kernels::NormSegment> segs;
  int64_t total = 0;
  std::vector<int64_t> gaps;
  for (int k = 0; k < 300; ++k) {
    int64_t n = static_cast<int64_t>(gen() % 3001);
    if (k % 29 == 3) n = 0;
    if (k % 50 == 7) n = 20000 + static_cast<int64_t>(gen() % 5000);
    segs.push_back({total, n});
    total += n;
    if (k % 7 == 2) {
      for (int i = 0; i < 5; ++i) gaps.push_back(total + i);
      total += 5;
    }
  }
  auto x = random_vec(total, -2, 2, 32);
  for (int64_t g : gaps) x[g] = 1e6f;
  const long double exact = exact_sum_squares(x, segs);
  DeviceBuffer d_x = cuda::upload(ctx(), x);
  DeviceBuffer out = poisoned<double>(1);
  const auto segmented = [&](const std::vector<kernels::NormSegment>& table) {
    ctx().copy_to_device(out.data(), std::vector<double>{std::nan("")}.data(), sizeof(double));
    cuda::sum_squares_segments(ctx(), d_x.as<float>(), table.data(),
                               static_cast<int64_t>(table.size()), out.as<double>());
    return get<double>(out, 1)[0];
  };
  const double multi = segmented(segs);
  bool any = false;
  for (const kernels::NormSegment& s : segs) {
    if (s.n == 0) continue;
    cuda::sum_squares(ctx(), d_x.as<float>() + s.offset, s.n, out.as<double>(), any);
    any = true;
  }
  const double per_tensor = get<double>(out, 1)[0];
  const double u = std::ldexp(1.0, -53);
  const double multi_bound = (32 + 8 + 1 + 10) * u, per_tensor_bound = (20 + 300) * u;
  const double rel_multi = std::abs(static_cast<double>((multi - exact) / exact));
  const double rel_per = std::abs(static_cast<double>((per_tensor - exact) / exact));
  std::printf("sum of squares %.17g: multi-tensor %.3g, per-tensor %.3g relative to exact\n",
              static_cast<double>(exact), rel_multi, rel_per);
  EXPECT_LE(rel_multi, multi_bound);
  EXPECT_LE(rel_per, per_tensor_bound);
  EXPECT_LE(std::abs(multi - per_tensor), (multi_bound + per_tensor_bound) * per_tensor);
  EXPECT_LT(multi, 1e12) << "a gap between segments was summed";

  const double again = segmented(segs);
  EXPECT_EQ(std::memcmp(&multi, &again, sizeof(double)), 0) << "not bitwise reproducible";
  // The long segment 7 cut after two chunks: the same chunks in the same order.
  std::vector<kernels::NormSegment> cut = segs;
  ASSERT_GT(cut[7].n, 2 * 8192);
  cut.insert(cut.begin() + 8, {cut[7].offset + 2 * 8192, cut[7].n - 2 * 8192});
  cut[7].n = 2 * 8192;
  const double cut_sum = segmented(cut);
  EXPECT_EQ(std::memcmp(&multi, &cut_sum, sizeof(double)), 0)
      << "cutting a segment at a chunk boundary changed the sum";

  EXPECT_EQ(segmented({}), 0.0) << "no segment";
  EXPECT_EQ(segmented({{0, 0}, {5, 0}}), 0.0) << "only empty segments";
}

TEST_F(OpsTest, ClipScaleMatchesCpuFormula) {
  DeviceBuffer sum_sq = ctx().alloc(sizeof(double));
  DeviceBuffer scale = poisoned<float>(1);
  for (double norm : {0.25, 0.999, 1.0, 1.5, 37.0}) {
    for (double max_norm : {1.0, 0.0}) {
      const double sq = norm * norm;
      ctx().copy_to_device(sum_sq.data(), &sq, sizeof(sq));
      cuda::clip_scale_from_sum_squares(ctx(), sum_sq.as<double>(), max_norm, scale.as<float>());
      EXPECT_EQ(get<float>(scale, 1)[0], clip_scale(std::sqrt(sq), max_norm))
          << "norm " << norm << " max_norm " << max_norm;
    }
  }
}

TEST_F(OpsTest, AdamWMatchesCpuWithHostAndDeviceGradScale) {
  const int64_t n = 100003;
  const auto p0 = random_vec(n, -1, 1, 9), g = random_vec(n, -2, 2, 10);
  const auto m0 = random_vec(n, -0.1f, 0.1f, 11), v0 = random_vec(n, 1e-4f, 1e-2f, 12);
  const kernels::AdamWStep step{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 3};
  std::vector<float> p = p0, m = m0, v = v0;
  kernels::adamw_update(p.data(), g.data(), m.data(), v.data(), n, step);
  for (bool device_scale : {false, true}) {
    DeviceBuffer d_p = cuda::upload(ctx(), p0), d_g = cuda::upload(ctx(), g);
    DeviceBuffer d_m = cuda::upload(ctx(), m0), d_v = cuda::upload(ctx(), v0);
    kernels::AdamWStep s = step;
    DeviceBuffer d_scale = ctx().alloc(sizeof(float));
    if (device_scale) {  // the clipping factor from the device; the host factor is then 1
      ctx().copy_to_device(d_scale.data(), &step.grad_scale, sizeof(float));
      s.grad_scale = 1.0f;
    }
    cuda::adamw_update(ctx(), d_p.as<float>(), d_g.as<float>(), d_m.as<float>(), d_v.as<float>(), n,
                       s, device_scale ? d_scale.as<float>() : nullptr);
    // Element-wise, the CPU's expression order; FMA contraction and sqrt/div rounding only.
    EXPECT_TRUE(matches(get<float>(d_p, n), p, 1e-6)) << device_scale;
    EXPECT_TRUE(matches(get<float>(d_m, n), m, 1e-6)) << device_scale;
    EXPECT_TRUE(matches(get<float>(d_v, n), v, 1e-6)) << device_scale;
  }
}

// The segmented AdamW (one launch per 128 segments) against adamw_update per segment: bitwise
// equal (both run one device function per element). 150 segments (two launches) of 1 to 5000
// elements (up to three 2048-element blocks each), empty ones, gaps between some that neither
// writes, decay on every other one; with the host and with the device grad scale.
TEST_F(OpsTest, AdamWSegmentsMatchPerTensorUpdateBitwise) {
  std::vector<kernels::AdamWSegment> segs;
  std::mt19937 gen(77);
  int64_t total = 0;
  for (int k = 0; k < 150; ++k) {
    const int64_t n = k % 37 == 5 ? 0 : 1 + static_cast<int64_t>(gen() % (k % 3 == 0 ? 5000 : 300));
    segs.push_back({total, n, k % 2 == 0});
    total += n + (k % 4 == 1 ? 3 : 0);
  }
  const auto p0 = random_vec(total, -1, 1, 20), g = random_vec(total, -2, 2, 21);
  const auto m0 = random_vec(total, -0.1f, 0.1f, 22), v0 = random_vec(total, 1e-4f, 1e-2f, 23);
  const kernels::AdamWStep step{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 3};
  for (bool device_scale : {false, true}) {
    SCOPED_TRACE(device_scale ? "device grad scale" : "host grad scale");
    kernels::AdamWStep s = step;
    DeviceBuffer d_scale = ctx().alloc(sizeof(float));
    if (device_scale) {
      ctx().copy_to_device(d_scale.data(), &step.grad_scale, sizeof(float));
      s.grad_scale = 1.0f;
    }
    const float* scale = device_scale ? d_scale.as<float>() : nullptr;
    std::vector<float> want[3], got[3];
    for (const bool segmented : {false, true}) {
      DeviceBuffer d_p = cuda::upload(ctx(), p0), d_g = cuda::upload(ctx(), g);
      DeviceBuffer d_m = cuda::upload(ctx(), m0), d_v = cuda::upload(ctx(), v0);
      if (segmented) {
        cuda::adamw_update_segments(ctx(), d_p.as<float>(), d_g.as<float>(), d_m.as<float>(),
                                    d_v.as<float>(), segs.data(), static_cast<int64_t>(segs.size()),
                                    s, scale);
      } else {
        for (const kernels::AdamWSegment& seg : segs) {
          kernels::AdamWStep one = s;
          one.weight_decay = seg.decay ? s.weight_decay : 0.0f;
          cuda::adamw_update(ctx(), d_p.as<float>() + seg.offset, d_g.as<float>() + seg.offset,
                             d_m.as<float>() + seg.offset, d_v.as<float>() + seg.offset, seg.n, one,
                             scale);
        }
      }
      std::vector<float>* out = segmented ? got : want;
      out[0] = get<float>(d_p, total);
      out[1] = get<float>(d_m, total);
      out[2] = get<float>(d_v, total);
    }
    EXPECT_NE(want[0], p0) << "the reference changed nothing";
    EXPECT_TRUE(identical(got[0], want[0])) << "param";
    EXPECT_TRUE(identical(got[1], want[1])) << "m";
    EXPECT_TRUE(identical(got[2], want[2])) << "v";
  }
}

// ---- norms ----

struct NormCase {
  kernels::NormOp op;
  kernels::NormShape s;
  bool weight, bias;
  const char* name;
};

// Compares only the elements a norm writes (groups inside each strided row) and checks that the
// gaps between rows kept their poison: the kernel wrote nothing outside its rows.
::testing::AssertionResult rows_match(const std::vector<float>& gpu, const std::vector<float>& cpu,
                                      const kernels::NormShape& s, int64_t ld, double rtol) {
  std::vector<float> g, c;
  for (int64_t n = 0; n < s.N; ++n) {
    for (int64_t j = 0; j < ld; ++j) {
      const size_t i = static_cast<size_t>(n * ld + j);
      if (j < s.G * s.Cg) {
        g.push_back(gpu[i]);
        c.push_back(cpu[i]);
      } else if (!std::isnan(gpu[i])) {
        return ::testing::AssertionFailure() << "wrote outside the rows at " << i;
      }
    }
  }
  return matches(g, c, rtol);
}

TEST_F(OpsTest, NormsForwardBackwardMatchCpu) {
  using kernels::NormOp;
  const std::vector<NormCase> cases = {
      {NormOp::kLayer, {64, 1, 768, 768, 768, 0}, true, true, "block LayerNorm"},
      {NormOp::kRms, {64, 1, 768, 768, 768, 0}, true, false, "block RMSNorm"},
      // QK-norm inside a packed qkv row (stride 3 * 12 * 64), per-head gains
      {NormOp::kRms, {48, 12, 64, 2304, 2304, 64}, true, false, "per-head RMS, HEAD"},
      {NormOp::kLayer, {48, 12, 64, 2304, 1000, 0}, true, true, "per-head LN, HEAD_SHARED"},
      {NormOp::kL2, {48, 12, 64, 2304, 800, 0}, false, false, "per-head L2"},
      {NormOp::kLayer, {33, 1, 100, 130, 110, 0}, true, true, "odd sizes"},
      // Gain gradients over many row chunks with a ragged last one (Note [fused-bias-grad]): 3000
      // rows make 188 chunks of 16 at width 96, 43 of 70 at width 770 (a ragged column strip);
      // 3000 items (n, g) of a gain shared by 3 groups (fewer than a chunk step's 8 items) and by
      // 12 (more), and 3000 rows of a per-group gain.
      {NormOp::kLayer, {3000, 1, 96, 96, 96, 0}, true, true, "3000 rows, LN 96"},
      {NormOp::kLayer, {3000, 1, 770, 800, 790, 0}, true, true, "3000 rows, LN 770"},
      {NormOp::kRms, {1000, 3, 32, 100, 96, 0}, true, false, "3000 items, RMS shared by 3"},
      {NormOp::kLayer, {250, 12, 64, 2304, 1000, 0}, true, true, "3000 items, LN shared by 12"},
      {NormOp::kRms, {3000, 2, 48, 100, 96, 48}, true, false, "3000 rows, per-group RMS"},
  };
  const float eps = 1e-5f;
  uint32_t seed = 100;
  for (const NormCase& k : cases) {
    SCOPED_TRACE(k.name);
    const kernels::NormShape& s = k.s;
    const int64_t rows = s.N * s.G;
    const int64_t wsize = s.w_group_stride == 0 ? s.Cg : s.G * s.Cg;
    const auto x = random_vec(s.N * s.ld_in, -2, 3, seed++);  // a non-zero mean
    const auto dy = random_vec(s.N * s.ld_out, -1, 1, seed++);
    const auto w = random_vec(wsize, 0.5f, 1.5f, seed++);
    const auto b = random_vec(wsize, -0.5f, 0.5f, seed++);
    const auto dx0 = random_vec(s.N * s.ld_in, -1, 1, seed++);
    const auto dw0 = random_vec(wsize, -1, 1, seed++), db0 = random_vec(wsize, -1, 1, seed++);
    const float* wp = k.weight ? w.data() : nullptr;
    const float* bp = k.bias ? b.data() : nullptr;
    // CPU reference; outputs start as NaN like the GPU's, so the gaps compare as untouched.
    std::vector<float> y(s.N * s.ld_out, NAN), mean(rows), rstd(rows);
    kernels::norm_forward<float>(k.op, s, y.data(), x.data(), wp, bp, mean.data(), rstd.data(),
                                 eps);
    DeviceBuffer d_x = cuda::upload(ctx(), x), d_dy = cuda::upload(ctx(), dy);
    DeviceBuffer d_w = cuda::upload(ctx(), w), d_b = cuda::upload(ctx(), b);
    DeviceBuffer d_y = poisoned<float>(y.size()), d_mean = poisoned<float>(rows);
    DeviceBuffer d_rstd = poisoned<float>(rows);
    cuda::norm_forward(ctx(), k.op, s, d_y.as<float>(), d_x.as<float>(),
                       k.weight ? d_w.as<float>() : nullptr, k.bias ? d_b.as<float>() : nullptr,
                       d_mean.as<float>(), d_rstd.as<float>(), eps);
    EXPECT_TRUE(rows_match(get<float>(d_y, y.size()), y, s, s.ld_out, f32_rtol(s.Cg)));
    EXPECT_TRUE(matches(get<float>(d_rstd, rows), rstd, f32_rtol(s.Cg)));
    if (k.op == NormOp::kLayer) {
      EXPECT_TRUE(matches(get<float>(d_mean, rows), mean, f32_rtol(s.Cg)));
    }

    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      std::vector<float> dx = dx0, dw = dw0, db = db0;
      if (!accumulate) {  // "=": the gaps are not written; NaN there on both sides
        for (int64_t n = 0; n < s.N; ++n) {
          for (int64_t j = 0; j < s.ld_in; ++j) dx[n * s.ld_in + j] = NAN;
        }
      }
      kernels::norm_backward<float>(k.op, s, dx.data(), accumulate, k.weight ? dw.data() : nullptr,
                                    k.bias ? db.data() : nullptr, dy.data(), x.data(), wp,
                                    mean.data(), rstd.data());
      // The GPU backward uses the GPU forward's statistics (as training would).
      DeviceBuffer d_dx = accumulate ? cuda::upload(ctx(), dx0) : poisoned<float>(dx0.size());
      DeviceBuffer d_dw = cuda::upload(ctx(), dw0), d_db = cuda::upload(ctx(), db0);
      cuda::norm_backward(
          ctx(), k.op, s, d_dx.as<float>(), accumulate, k.weight ? d_dw.as<float>() : nullptr,
          k.bias ? d_db.as<float>() : nullptr, d_dy.as<float>(), d_x.as<float>(),
          k.weight ? d_w.as<float>() : nullptr, d_mean.as<float>(), d_rstd.as<float>());
      auto gdx = get<float>(d_dx, dx.size());
      if (accumulate) {
        EXPECT_TRUE(matches(gdx, dx, f32_rtol(s.Cg)));
      } else {
        EXPECT_TRUE(rows_match(gdx, dx, s, s.ld_in, f32_rtol(s.Cg)));
      }
      const int64_t reduce = s.w_group_stride == 0 ? s.N * s.G : s.N;
      if (k.weight) {
        EXPECT_TRUE(matches(get<float>(d_dw, wsize), dw, f32_rtol(reduce)));
      }
      if (k.bias) {
        EXPECT_TRUE(matches(get<float>(d_db, wsize), db, f32_rtol(reduce)));
      }
    }
  }
}

// ---- cross-entropy ----

TEST_F(OpsTest, CrossEntropyPhasesMatchCpu) {
  // A vocab shard: rows [v_begin, v_begin + V_local), the last columns padding; some targets
  // fall in other shards.
  const int64_t N = 96, V_local = 1037, v_valid = 1000, v_begin = 2000;
  const float grad_scale = 1.0f / N, z_coef = 1e-4f;
  auto logits = random_vec(N * V_local, -4, 4, 20);
  for (int64_t n = 0; n < N; n += 7) logits[n * V_local + n] += 12.0f;  // some peaked rows
  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) {
    targets[n] = static_cast<int32_t>(n % 5 == 0 ? n * 31 : v_begin + (n * 37) % v_valid);
  }
  std::vector<float> mx(N), se(N), tl(N);
  kernels::xent_row_max(logits.data(), N, V_local, v_valid, mx.data());
  kernels::xent_row_sumexp(logits.data(), mx.data(), N, V_local, v_valid, se.data());
  kernels::xent_target_logit(logits.data(), targets.data(), N, V_local, v_begin, tl.data());
  // The finish as layers/gpt.cc calls it: the CPU kernel, lse over sum-exp in place.
  std::vector<float> lse = se;
  double cpu_sums[3];
  kernels::xent_finish(mx.data(), lse.data(), tl.data(), N, lse.data(), cpu_sums);
  std::vector<float> dlogits(N * V_local);
  kernels::xent_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V_local,
                         v_valid, v_begin, grad_scale, z_coef);

  DeviceBuffer d_logits = cuda::upload(ctx(), logits), d_targets = cuda::upload(ctx(), targets);
  DeviceBuffer d_mx = poisoned<float>(N), d_se = poisoned<float>(N), d_tl = poisoned<float>(N);
  DeviceBuffer d_sums = poisoned<double>(3);
  cuda::xent_row_max(ctx(), d_logits.as<float>(), N, V_local, v_valid, d_mx.as<float>());
  cuda::xent_row_sumexp(ctx(), d_logits.as<float>(), d_mx.as<float>(), N, V_local, v_valid,
                        d_se.as<float>());
  cuda::xent_target_logit(ctx(), d_logits.as<float>(), d_targets.as<int32_t>(), N, V_local, v_begin,
                          d_tl.as<float>());
  EXPECT_TRUE(identical(get<float>(d_mx, N), mx));
  EXPECT_TRUE(matches(get<float>(d_se, N), se, f32_rtol(v_valid)));
  EXPECT_TRUE(identical(get<float>(d_tl, N), tl));
  // lse written over sum-exp in place, as the CPU path does.
  cuda::xent_finish(ctx(), d_mx.as<float>(), d_se.as<float>(), d_tl.as<float>(), N,
                    d_se.as<float>(), d_sums.as<double>());
  EXPECT_TRUE(matches(get<float>(d_se, N), lse, f32_rtol(v_valid)));
  // Each sum's terms agree to the sum-exp's fp32 bound (the lse rows above); the sums add N
  // double terms in another order, a negligible further difference. lse ~ log(V) + a few, so
  // sum l (the logged log Z) has no cancellation; sum (l - t) has little (t << l on average).
  const auto sums = get<double>(d_sums, 3);
  ASSERT_EQ(sums.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(sums[i], cpu_sums[i], f32_rtol(v_valid) * std::abs(cpu_sums[i])) << "sum " << i;
  }
  // From the CPU's own statistics (out of place), only double rounding separates the two: the
  // per-row formula is the same and the sums differ in order alone. Twice, to the same bits: the
  // order is fixed run to run.
  DeviceBuffer d_se2 = cuda::upload(ctx(), se), d_lse2 = poisoned<float>(N);
  DeviceBuffer d_sums_a = poisoned<double>(3), d_sums_b = poisoned<double>(3);
  cuda::xent_finish(ctx(), d_mx.as<float>(), d_se2.as<float>(), d_tl.as<float>(), N,
                    d_lse2.as<float>(), d_sums_a.as<double>());
  cuda::xent_finish(ctx(), d_mx.as<float>(), d_se2.as<float>(), d_tl.as<float>(), N,
                    d_lse2.as<float>(), d_sums_b.as<double>());
  EXPECT_TRUE(matches(get<float>(d_lse2, N), lse, f32_rtol(1)));
  const auto sums_a = get<double>(d_sums_a, 3), sums_b = get<double>(d_sums_b, 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(sums_a[i], cpu_sums[i], 1e-12 * std::abs(cpu_sums[i])) << "sum " << i;
    EXPECT_EQ(sums_a[i], sums_b[i]) << "sum " << i;
  }
  // Backward, out of place and in place (dlogits over logits, as layers/gpt.cc calls it).
  DeviceBuffer d_dlogits = poisoned<float>(N * V_local);
  cuda::xent_backward(ctx(), d_dlogits.as<float>(), d_logits.as<float>(), d_se.as<float>(),
                      d_targets.as<int32_t>(), N, V_local, v_valid, v_begin, grad_scale, z_coef);
  EXPECT_TRUE(matches(get<float>(d_dlogits, dlogits.size()), dlogits, f32_rtol(v_valid)));
  cuda::xent_backward(ctx(), d_logits.as<float>(), d_logits.as<float>(), d_se.as<float>(),
                      d_targets.as<int32_t>(), N, V_local, v_valid, v_begin, grad_scale, z_coef);
  EXPECT_TRUE(matches(get<float>(d_logits, dlogits.size()), dlogits, f32_rtol(v_valid)));
}

// ---- embeddings ----

std::vector<int32_t> make_tokens(int64_t N, int64_t vocab, uint32_t seed) {
  // Frequent repeats (a small range for most tokens), so the backward's runs are long.
  std::mt19937 gen(seed);
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) {
    t[n] = static_cast<int32_t>(n % 3 == 0 ? gen() % vocab : gen() % 16);
  }
  return t;
}

TEST_F(OpsTest, EmbeddingsMatchCpu) {
  // A vocab shard [v_begin, v_begin + V_local) of a 500-token vocabulary: tokens outside it give
  // zero rows forward and nothing backward.
  const int64_t B = 4, T = 33, N = B * T, C = 200, v_begin = 8, V_local = 300, vocab = 500;
  const auto tokens = make_tokens(N, vocab, 30);
  const auto wte = random_vec(V_local * C, -1, 1, 31), wpe = random_vec(T * C, -1, 1, 32);
  const auto dout = random_vec(N * C, -1, 1, 33);
  const auto dwte0 = random_vec(V_local * C, -1, 1, 34), dwpe0 = random_vec(T * C, -1, 1, 35);
  std::vector<float> out(N * C), dwte = dwte0, dwpe = dwpe0;
  kernels::embedding_forward<float>(out.data(), tokens.data(), N, wte.data(), v_begin, V_local, C);
  kernels::position_forward<float>(out.data(), wpe.data(), B, T, C);
  kernels::embedding_backward<float>(dwte.data(), dout.data(), tokens.data(), N, v_begin, V_local,
                                     C);
  kernels::position_backward<float>(dwpe.data(), dout.data(), B, T, C);

  DeviceBuffer d_tok = cuda::upload(ctx(), tokens), d_wte = cuda::upload(ctx(), wte);
  DeviceBuffer d_wpe = cuda::upload(ctx(), wpe), d_dout = cuda::upload(ctx(), dout);
  DeviceBuffer d_out = poisoned<float>(N * C);
  cuda::embedding_forward(ctx(), d_out.as<float>(), d_tok.as<int32_t>(), N, d_wte.as<float>(),
                          v_begin, V_local, C);
  cuda::position_forward(ctx(), d_out.as<float>(), d_wpe.as<float>(), B, T, C);
  EXPECT_TRUE(identical(get<float>(d_out, out.size()), out));
  // The token backward sums a run of up to 8 rows in the CPU's order and longer ones in segments
  // (Note [embedding-backward-segments]): within the fp32 bound, and the same bits twice, so the
  // result does not depend on the run. The position backward adds in the CPU's order:
  // bit-identical.
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    DeviceBuffer d_dwte = cuda::upload(ctx(), dwte0), d_dwpe = cuda::upload(ctx(), dwpe0);
    cuda::embedding_backward(ctx(), d_dwte.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(), N,
                             v_begin, V_local, C);
    cuda::position_backward(ctx(), d_dwpe.as<float>(), d_dout.as<float>(), B, T, C);
    const auto got = get<float>(d_dwte, dwte.size());
    EXPECT_TRUE(matches(got, dwte, f32_rtol(N))) << "rep " << rep;
    if (rep == 0) first = got;
    EXPECT_TRUE(identical(got, first)) << "rep " << rep;
    EXPECT_TRUE(identical(get<float>(d_dwpe, dwpe.size()), dwpe)) << "rep " << rep;
  }
}

TEST_F(OpsTest, EmbeddingsBf16MatchCpuOnRoundedValues) {
  const int64_t B = 2, T = 64, N = B * T, C = 96, V_local = 1000;
  const auto tokens = make_tokens(N, V_local, 40);
  const auto wte = bf16_rounded(random_vec(V_local * C, -1, 1, 41));
  const auto wpe = bf16_rounded(random_vec(T * C, -1, 1, 42));
  const auto dout = bf16_rounded(random_vec(N * C, -1, 1, 43));
  const auto dwte0 = random_vec(V_local * C, -1, 1, 44), dwpe0 = random_vec(T * C, -1, 1, 45);
  std::vector<float> out(N * C), dwte = dwte0, dwpe = dwpe0;
  kernels::embedding_forward<float>(out.data(), tokens.data(), N, wte.data(), 0, V_local, C);
  kernels::position_forward<float>(out.data(), wpe.data(), B, T, C);
  kernels::embedding_backward<float>(dwte.data(), dout.data(), tokens.data(), N, 0, V_local, C);
  kernels::position_backward<float>(dwpe.data(), dout.data(), B, T, C);

  DeviceBuffer d_tok = cuda::upload(ctx(), tokens), d_wte = cuda::upload(ctx(), to_bf16(wte));
  DeviceBuffer d_wpe = cuda::upload(ctx(), to_bf16(wpe));
  DeviceBuffer d_dout = cuda::upload(ctx(), to_bf16(dout));
  DeviceBuffer d_out = poisoned<Bf16>(N * C);
  cuda::embedding_forward(ctx(), d_out.as<Bf16>(), d_tok.as<int32_t>(), N, d_wte.as<Bf16>(), 0,
                          V_local, C);
  cuda::position_forward(ctx(), d_out.as<Bf16>(), d_wpe.as<Bf16>(), B, T, C);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_out, out.size())), out, kBf16Rtol));
  // fp32 gradients from bf16 dout: the CPU's fp32 additions on the rounded values for a run of up
  // to 8 rows, segments for longer ones (Note [embedding-backward-segments]): the fp32 bound.
  DeviceBuffer d_dwte = cuda::upload(ctx(), dwte0), d_dwpe = cuda::upload(ctx(), dwpe0);
  cuda::embedding_backward(ctx(), d_dwte.as<float>(), d_dout.as<Bf16>(), d_tok.as<int32_t>(), N, 0,
                           V_local, C);
  cuda::position_backward(ctx(), d_dwpe.as<float>(), d_dout.as<Bf16>(), B, T, C);
  EXPECT_TRUE(matches(get<float>(d_dwte, dwte.size()), dwte, f32_rtol(N)));
  EXPECT_TRUE(identical(get<float>(d_dwpe, dwpe.size()), dwpe));
}

// ---- RoPE ----

TEST_F(OpsTest, RopeMatchesCpuInStridedRowsAndInPlace) {
  // q inside a packed qkv row (stride 3 * H * D), positions offset into the table.
  const int64_t B = 2, T = 40, H = 6, D = 32, stride = 3 * H * D, offset = 7;
  const kernels::RopeTable table = kernels::make_rope_table(64, D, 10000.0);
  const cuda::DeviceRopeTable d_table(ctx(), table);
  const auto x = random_vec(B * T * stride, -2, 2, 50);
  std::vector<float> y = x, dx = x;  // outside q, y keeps x's values (rope leaves them alone)
  kernels::rope_forward<float>(table, y.data(), x.data(), B, T, H, D, stride, offset);
  kernels::rope_backward<float>(table, dx.data(), x.data(), B, T, H, D, stride, offset);
  DeviceBuffer d_x = cuda::upload(ctx(), x), d_y = cuda::upload(ctx(), x);
  cuda::rope_forward(ctx(), d_table, d_y.as<float>(), d_x.as<float>(), B, T, H, D, stride, offset);
  EXPECT_TRUE(matches(get<float>(d_y, y.size()), y, 1e-6));
  cuda::rope_backward(ctx(), d_table, d_x.as<float>(), d_x.as<float>(), B, T, H, D, stride,
                      offset);  // in place
  EXPECT_TRUE(matches(get<float>(d_x, dx.size()), dx, 1e-6));
  // bf16 in place: the fp32 rotation of the rounded values, rounded once.
  const auto xr = bf16_rounded(x);
  std::vector<float> yr = xr;
  kernels::rope_forward<float>(table, yr.data(), xr.data(), B, T, H, D, stride, offset);
  DeviceBuffer d_h = cuda::upload(ctx(), to_bf16(xr));
  cuda::rope_forward(ctx(), d_table, d_h.as<Bf16>(), d_h.as<Bf16>(), B, T, H, D, stride, offset);
  EXPECT_TRUE(matches(from_bf16(get<Bf16>(d_h, yr.size())), yr, kBf16Rtol));
  // The CPU kernel's argument checks hold here too.
  EXPECT_THROW(cuda::rope_forward(ctx(), d_table, d_y.as<float>(), d_x.as<float>(), B, 60, H, D,
                                  stride, offset),
               Error);
}

}  // namespace
}  // namespace keel::gpu_test
