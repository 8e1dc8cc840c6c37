// The bf16 forms of the CUDA norms (framework/kernels/cuda/ops.h: bf16 activations, fp32 gains,
// statistics and gradients of the gains) against the fp32 CPU kernels run on the same
// bf16-rounded inputs, for every NormOp and the grouped, strided shapes of the block norms and of
// QK-norm in each scope. Outputs are poisoned with NaN before each run. Bounds (gpu_test_util.h):
//   y, dinp (bf16):                kBf16Rtol (one bf16 rounding of an fp32 result)
//   mean, rstd (fp32, Cg terms):   f32_rtol(Cg)
//   dweight, dbias (fp32, R terms): f32_rtol(R), R = N * G rows for a gain shared by the groups,
//                                  N for a gain per group: the inputs the CPU sees are exactly the
//                                  bf16 values the GPU reads, so only the fp32 summation order
//                                  (and the statistics' last bits) differ.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/norm.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
using kernels::NormOp;
using kernels::NormShape;

class NormBf16Test : public GpuTest {};

struct Bf16NormCase {
  NormOp op;
  NormShape s;
  bool weight, bias;
  const char* name;
};

// Compares the elements inside each strided row's N x (G * Cg) view, and requires every element
// between the views to hold its value before the call (`before`: NaN poison must stay NaN, any
// other value must keep its bits): the kernel wrote nothing outside its rows.
::testing::AssertionResult view_matches(const std::vector<float>& gpu,
                                        const std::vector<float>& cpu,
                                        const std::vector<float>& before, const NormShape& s,
                                        int64_t ld, double rtol) {
  std::vector<float> g, c;
  for (int64_t n = 0; n < s.N; ++n) {
    for (int64_t j = 0; j < ld; ++j) {
      const size_t i = static_cast<size_t>(n * ld + j);
      if (j < s.G * s.Cg) {
        g.push_back(gpu[i]);
        c.push_back(cpu[i]);
      } else if (std::isnan(before[i]) ? !std::isnan(gpu[i])
                                       : std::memcmp(&gpu[i], &before[i], sizeof(float)) != 0) {
        return ::testing::AssertionFailure()
               << "wrote outside the rows at " << i << ": " << gpu[i] << " was " << before[i];
      }
    }
  }
  return matches(g, c, rtol);
}

// The shapes the model uses, with ld_in = 3 HD (q, k or v inside the packed qkv row) and
// ld_out = 2 HD (the normalised q, k buffer) for QK-norm, HD = 12 heads x 64.
const std::vector<Bf16NormCase>& cases() {
  static const std::vector<Bf16NormCase> all = {
      {NormOp::kLayer, {64, 1, 768, 768, 768, 0}, true, true, "block LayerNorm"},
      {NormOp::kRms, {64, 1, 768, 768, 768, 0}, true, false, "block RMSNorm"},
      {NormOp::kRms, {48, 12, 64, 2304, 1536, 0}, true, false, "QK RMS, HEAD_SHARED"},
      {NormOp::kLayer, {48, 12, 64, 2304, 1536, 0}, true, true, "QK LN, HEAD_SHARED"},
      {NormOp::kL2, {48, 12, 64, 2304, 1536, 0}, false, false, "QK L2, HEAD_SHARED"},
      {NormOp::kRms, {48, 12, 64, 2304, 1536, 64}, true, false, "QK RMS, HEAD"},
      {NormOp::kLayer, {48, 12, 64, 2304, 1536, 64}, true, true, "QK LN, HEAD"},
      {NormOp::kRms, {48, 1, 768, 2304, 1536, 0}, true, false, "QK RMS, PROJECTION"},
      {NormOp::kLayer, {48, 1, 768, 2304, 1536, 0}, true, true, "QK LN, PROJECTION"},
      {NormOp::kL2, {48, 1, 768, 2304, 1536, 0}, false, false, "QK L2, PROJECTION"},
      // Rows and groups that fill neither a warp's lanes nor a block's warps.
      {NormOp::kLayer, {33, 1, 100, 130, 110, 0}, true, true, "odd LN"},
      {NormOp::kRms, {37, 3, 40, 130, 125, 40}, true, false, "odd per-group RMS"},
      // Gain gradients over many row chunks with a ragged last one (Note [fused-bias-grad] in
      // framework/kernels/cuda/internal.h: 43 chunks of 70 rows, the last of 60, and a ragged
      // column strip; 3000 items (n, g) of a gain shared by 3 groups).
      {NormOp::kLayer, {3000, 1, 770, 800, 790, 0}, true, true, "3000 rows, LN 770"},
      {NormOp::kLayer, {1000, 3, 32, 100, 96, 0}, true, true, "3000 items, LN shared by 3"},
  };
  return all;
}

TEST_F(NormBf16Test, ForwardBackwardMatchCpuOnRoundedInputs) {
  const float eps = 1e-5f;
  uint32_t seed = 700;
  for (const Bf16NormCase& k : cases()) {
    SCOPED_TRACE(k.name);
    const NormShape& s = k.s;
    const int64_t rows = s.N * s.G;
    const int64_t wsize = s.w_group_stride == 0 ? s.Cg : s.G * s.Cg;
    // Activations are bf16 on the GPU, so the CPU sees them rounded; gains stay fp32.
    const auto x = bf16_rounded(random_vec(s.N * s.ld_in, -2, 3, seed++));  // a non-zero mean
    const auto dy = bf16_rounded(random_vec(s.N * s.ld_out, -1, 1, seed++));
    const auto dx0 = bf16_rounded(random_vec(s.N * s.ld_in, -1, 1, seed++));
    const auto w = random_vec(wsize, 0.5f, 1.5f, seed++);
    const auto b = random_vec(wsize, -0.5f, 0.5f, seed++);
    const auto dw0 = random_vec(wsize, -1, 1, seed++), db0 = random_vec(wsize, -1, 1, seed++);
    const float* wp = k.weight ? w.data() : nullptr;
    const float* bp = k.bias ? b.data() : nullptr;

    std::vector<float> y(s.N * s.ld_out, NAN), mean(rows), rstd(rows);
    kernels::norm_forward<float>(k.op, s, y.data(), x.data(), wp, bp, mean.data(), rstd.data(),
                                 eps);
    DeviceBuffer d_x = cuda::upload(ctx(), to_bf16(x)), d_dy = cuda::upload(ctx(), to_bf16(dy));
    DeviceBuffer d_w = cuda::upload(ctx(), w), d_b = cuda::upload(ctx(), b);
    DeviceBuffer d_y = poisoned<Bf16>(y.size()), d_mean = poisoned<float>(rows);
    DeviceBuffer d_rstd = poisoned<float>(rows);
    cuda::norm_forward(ctx(), k.op, s, d_y.as<Bf16>(), d_x.as<const Bf16>(),
                       k.weight ? d_w.as<const float>() : nullptr,
                       k.bias ? d_b.as<const float>() : nullptr, d_mean.as<float>(),
                       d_rstd.as<float>(), eps);
    const std::vector<float> all_nan(y.size(), NAN);
    EXPECT_TRUE(
        view_matches(from_bf16(get<Bf16>(d_y, y.size())), y, all_nan, s, s.ld_out, kBf16Rtol));
    EXPECT_TRUE(matches(get<float>(d_rstd, rows), rstd, f32_rtol(s.Cg)));
    if (k.op == NormOp::kLayer) {
      EXPECT_TRUE(matches(get<float>(d_mean, rows), mean, f32_rtol(s.Cg)));
    }

    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      // "=" leaves the gaps alone: NaN on both sides; "+=" must keep dx0 there bit for bit.
      std::vector<float> dx = accumulate ? dx0 : std::vector<float>(dx0.size(), NAN);
      const std::vector<float> dx_before = dx;
      std::vector<float> dw = dw0, db = db0;
      kernels::norm_backward<float>(k.op, s, dx.data(), accumulate, k.weight ? dw.data() : nullptr,
                                    k.bias ? db.data() : nullptr, dy.data(), x.data(), wp,
                                    mean.data(), rstd.data());
      // The GPU backward uses the GPU forward's statistics (as training would).
      DeviceBuffer d_dx =
          accumulate ? cuda::upload(ctx(), to_bf16(dx0)) : poisoned<Bf16>(dx0.size());
      DeviceBuffer d_dw = cuda::upload(ctx(), dw0), d_db = cuda::upload(ctx(), db0);
      cuda::norm_backward(ctx(), k.op, s, d_dx.as<Bf16>(), accumulate,
                          k.weight ? d_dw.as<float>() : nullptr,
                          k.bias ? d_db.as<float>() : nullptr, d_dy.as<const Bf16>(),
                          d_x.as<const Bf16>(), k.weight ? d_w.as<const float>() : nullptr,
                          d_mean.as<const float>(), d_rstd.as<const float>());
      EXPECT_TRUE(view_matches(from_bf16(get<Bf16>(d_dx, dx.size())), dx, dx_before, s, s.ld_in,
                               kBf16Rtol));
      const int64_t reduce = s.w_group_stride == 0 ? s.N * s.G : s.N;
      if (k.weight) {
        EXPECT_TRUE(matches(get<float>(d_dw, wsize), dw, f32_rtol(reduce)));
      } else {  // L2 has no gain: nothing may be written to dweight's buffer
        EXPECT_TRUE(identical(get<float>(d_dw, wsize), dw0));
      }
      if (k.bias) {
        EXPECT_TRUE(matches(get<float>(d_db, wsize), db, f32_rtol(reduce)));
      } else {
        EXPECT_TRUE(identical(get<float>(d_db, wsize), db0));
      }
    }
  }
}

// The gain gradients alone (dinp null, as for a frozen input), and dinp alone (dweight and dbias
// null): each part of the backward runs without the other.
TEST_F(NormBf16Test, BackwardPartsRunAlone) {
  const NormShape s{48, 12, 64, 2304, 1536, 64};  // QK LayerNorm, HEAD
  const int64_t rows = s.N * s.G, wsize = s.G * s.Cg;
  const float eps = 1e-5f;
  const auto x = bf16_rounded(random_vec(s.N * s.ld_in, -2, 3, 900));
  const auto dy = bf16_rounded(random_vec(s.N * s.ld_out, -1, 1, 901));
  const auto w = random_vec(wsize, 0.5f, 1.5f, 902), b = random_vec(wsize, -0.5f, 0.5f, 903);
  std::vector<float> y(s.N * s.ld_out, NAN), mean(rows), rstd(rows);
  kernels::norm_forward<float>(NormOp::kLayer, s, y.data(), x.data(), w.data(), b.data(),
                               mean.data(), rstd.data(), eps);
  std::vector<float> dx(x.size(), NAN), dw(wsize, 0.0f), db(wsize, 0.0f);
  kernels::norm_backward<float>(NormOp::kLayer, s, dx.data(), false, dw.data(), db.data(),
                                dy.data(), x.data(), w.data(), mean.data(), rstd.data());

  DeviceBuffer d_x = cuda::upload(ctx(), to_bf16(x)), d_dy = cuda::upload(ctx(), to_bf16(dy));
  DeviceBuffer d_w = cuda::upload(ctx(), w), d_b = cuda::upload(ctx(), b);
  DeviceBuffer d_y = poisoned<Bf16>(y.size());
  // The CPU's statistics, so each part is compared on identical inputs.
  DeviceBuffer d_mean = cuda::upload(ctx(), mean), d_rstd = cuda::upload(ctx(), rstd);

  DeviceBuffer d_dw = cuda::upload(ctx(), std::vector<float>(wsize, 0.0f));
  DeviceBuffer d_db = cuda::upload(ctx(), std::vector<float>(wsize, 0.0f));
  cuda::norm_backward(ctx(), NormOp::kLayer, s, static_cast<Bf16*>(nullptr), false,
                      d_dw.as<float>(), d_db.as<float>(), d_dy.as<const Bf16>(),
                      d_x.as<const Bf16>(), d_w.as<const float>(), d_mean.as<const float>(),
                      d_rstd.as<const float>());
  EXPECT_TRUE(matches(get<float>(d_dw, wsize), dw, f32_rtol(s.N)));
  EXPECT_TRUE(matches(get<float>(d_db, wsize), db, f32_rtol(s.N)));

  DeviceBuffer d_dx = poisoned<Bf16>(dx.size());
  cuda::norm_backward(ctx(), NormOp::kLayer, s, d_dx.as<Bf16>(), false, nullptr, nullptr,
                      d_dy.as<const Bf16>(), d_x.as<const Bf16>(), d_w.as<const float>(),
                      d_mean.as<const float>(), d_rstd.as<const float>());
  const std::vector<float> all_nan(dx.size(), NAN);
  EXPECT_TRUE(
      view_matches(from_bf16(get<Bf16>(d_dx, dx.size())), dx, all_nan, s, s.ld_in, kBf16Rtol));
}

}  // namespace
}  // namespace keel::gpu_test
