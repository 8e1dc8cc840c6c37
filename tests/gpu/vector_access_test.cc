// The element-wise kernels' 16-byte vector path and its fallbacks (Note [vector-access] in
// framework/kernels/cuda/internal.h): lengths that leave a tail (n = 4k + 3, 8k + 5, rows of
// 8k + 5 columns) and operands one element off 16-byte alignment (the W = 1 kernel), each against
// the host's arithmetic or the other path, bit for bit: the two paths do the same arithmetic per
// element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/cuda/sdpa_cudnn.h"
#include "framework/kernels/elementwise.h"
#include "framework/kernels/glu.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
using kernels::GluAct;

std::vector<float> as_floats(const std::vector<float>& v) { return v; }
std::vector<float> as_floats(const std::vector<Bf16>& v) { return from_bf16(v); }

// Offsets (output, inputs) in elements: all aligned (the vector path), all one off, and only the
// output or only one input one off (the fallback: every operand must be aligned).
const std::vector<std::vector<int64_t>> kOffsets = {{0, 0, 0}, {1, 1, 1}, {1, 0, 0}, {0, 0, 1}};

class VectorAccessTest : public GpuTest {
 protected:
  // v uploaded `off` elements into a buffer (NaN before them): the kernel gets data<T>(b) + off.
  template <typename T>
  DeviceBuffer up_at(const std::vector<T>& v, int64_t off) {
    std::vector<T> padded(v.size() + off);
    if (off > 0) std::memset(static_cast<void*>(padded.data()), 0xFF, off * sizeof(T));
    std::copy(v.begin(), v.end(), padded.begin() + off);
    return cuda::upload(ctx(), padded);
  }
  template <typename T>
  std::vector<T> get_at(const DeviceBuffer& b, int64_t off, int64_t n) {
    std::vector<T> all = get<T>(b, off + n);
    return std::vector<T>(all.begin() + off, all.end());
  }

  // GELU forward and backward: the aligned (vector) run's bits are the reference for the others,
  // and it matches the CPU within the fp32 bound (nvcc's FMA contraction, as ops_test.cc).
  template <typename TO, typename TI>
  void check_gelu(int64_t n, uint32_t seed, const char* what) {
    SCOPED_TRACE(std::string(what) + " n=" + std::to_string(n));
    auto x = random_vec(n, -6, 6, seed), dy = random_vec(n, -1, 1, seed + 1);
    if constexpr (std::is_same_v<TI, Bf16>) {
      x = bf16_rounded(x);
      dy = bf16_rounded(dy);
    }
    std::vector<float> y_cpu(n), dx_cpu(n);
    kernels::gelu_forward<float>(y_cpu.data(), x.data(), n);
    kernels::gelu_backward<float>(dx_cpu.data(), x.data(), dy.data(), n);
    const auto in = [&](const std::vector<float>& v) {
      if constexpr (std::is_same_v<TI, Bf16>) {
        return to_bf16(v);
      } else {
        return v;
      }
    };
    const double rtol = std::is_same_v<TO, Bf16> ? kBf16Rtol : f32_rtol(1);
    std::vector<float> y_ref, dx_ref;
    for (const auto& off : kOffsets) {
      SCOPED_TRACE("offsets " + std::to_string(off[0]) + "," + std::to_string(off[1]) + "," +
                   std::to_string(off[2]));
      DeviceBuffer y = up_at(std::vector<TO>(n), off[0]), dx = up_at(std::vector<TO>(n), off[0]);
      DeviceBuffer d_x = up_at(in(x), off[1]), d_dy = up_at(in(dy), off[2]);
      const TI* xp = d_x.as<TI>() + off[1];
      cuda::gelu_forward(ctx(), y.as<TO>() + off[0], xp, n);
      const auto y_got = as_floats(get_at<TO>(y, off[0], n));
      if constexpr (std::is_same_v<TO, TI>) {  // the backward has no mixed-type form
        cuda::gelu_backward(ctx(), dx.as<TO>() + off[0], xp, d_dy.as<TI>() + off[2], n);
      }
      const auto dx_got = as_floats(get_at<TO>(dx, off[0], n));
      if (y_ref.empty()) {
        y_ref = y_got;
        dx_ref = dx_got;
        EXPECT_TRUE(matches(y_got, y_cpu, rtol)) << "forward against the CPU";
        if constexpr (std::is_same_v<TO, TI>) {
          EXPECT_TRUE(matches(dx_got, dx_cpu, rtol)) << "backward against the CPU";
        }
      } else {
        EXPECT_TRUE(identical(y_got, y_ref)) << "forward against the aligned run";
        if constexpr (std::is_same_v<TO, TI>) {
          EXPECT_TRUE(identical(dx_got, dx_ref)) << "backward against the aligned run";
        }
      }
    }
  }

  // GLU forward and backward at the given offsets: {out, dgate, dup} as floats.
  template <typename TO, typename TI>
  std::vector<std::vector<float>> glu_run(GluAct act, const std::vector<TI>& gate,
                                          const std::vector<TI>& up, const std::vector<TI>& dout,
                                          int64_t out_off, int64_t in_off) {
    const int64_t n = static_cast<int64_t>(gate.size());
    DeviceBuffer g = up_at(gate, in_off), u = up_at(up, in_off), d = up_at(dout, in_off);
    DeviceBuffer y = up_at(std::vector<TO>(n), out_off), dg = up_at(std::vector<TO>(n), out_off);
    DeviceBuffer du = up_at(std::vector<TO>(n), out_off);
    cuda::glu_forward(ctx(), act, y.as<TO>() + out_off, g.as<TI>() + in_off, u.as<TI>() + in_off,
                      n);
    if constexpr (std::is_same_v<TO, TI>) {  // the backward has no mixed-type form
      cuda::glu_backward(ctx(), act, dg.as<TO>() + out_off, du.as<TO>() + out_off,
                         d.as<TI>() + in_off, g.as<TI>() + in_off, u.as<TI>() + in_off, n);
    }
    return {as_floats(get_at<TO>(y, out_off, n)), as_floats(get_at<TO>(dg, out_off, n)),
            as_floats(get_at<TO>(du, out_off, n))};
  }
};

// add: out = a + b for fp32, bf16 and fp32 + bf16, against the host's rounding of the same fp32
// sum: exact.
TEST_F(VectorAccessTest, AddTailsAndMisalignedOperandsMatchHostExactly) {
  uint32_t seed = 500;
  for (const int64_t n : {int64_t{4 * 1000 + 3}, int64_t{8 * 1000 + 5}, int64_t{7}, int64_t{16}}) {
    const auto a = random_vec(n, -4, 4, seed++), b = random_vec(n, -4, 4, seed++);
    const auto ab = bf16_rounded(a), bb = bf16_rounded(b);
    std::vector<float> f32(n), b16(n), mixed(n);
    for (int64_t i = 0; i < n; ++i) {
      f32[i] = a[i] + b[i];
      b16[i] = round_bf16(ab[i] + bb[i]);
      mixed[i] = a[i] + bb[i];
    }
    for (const auto& off : kOffsets) {
      SCOPED_TRACE("n=" + std::to_string(n) + " offsets " + std::to_string(off[0]) + "," +
                   std::to_string(off[1]) + "," + std::to_string(off[2]));
      {
        DeviceBuffer o = up_at(std::vector<float>(n, 0.0f), off[0]);
        DeviceBuffer x = up_at(a, off[1]), y = up_at(b, off[2]);
        cuda::add(ctx(), o.as<float>() + off[0], x.as<float>() + off[1], y.as<float>() + off[2], n);
        EXPECT_TRUE(identical(get_at<float>(o, off[0], n), f32)) << "fp32";
      }
      {
        DeviceBuffer o = up_at(std::vector<Bf16>(n), off[0]);
        DeviceBuffer x = up_at(to_bf16(ab), off[1]), y = up_at(to_bf16(bb), off[2]);
        cuda::add(ctx(), o.as<Bf16>() + off[0], x.as<Bf16>() + off[1], y.as<Bf16>() + off[2], n);
        EXPECT_TRUE(identical(from_bf16(get_at<Bf16>(o, off[0], n)), b16)) << "bf16";
      }
      {
        DeviceBuffer o = up_at(std::vector<float>(n, 0.0f), off[0]);
        DeviceBuffer x = up_at(a, off[1]), y = up_at(to_bf16(bb), off[2]);
        cuda::add(ctx(), o.as<float>() + off[0], x.as<float>() + off[1], y.as<Bf16>() + off[2], n);
        EXPECT_TRUE(identical(get_at<float>(o, off[0], n), mixed)) << "fp32 + bf16";
      }
    }
  }
}

TEST_F(VectorAccessTest, GeluTailsAndMisalignedOperandsGiveTheAlignedBits) {
  uint32_t seed = 520;
  for (const int64_t n : {int64_t{4 * 1000 + 3}, int64_t{8 * 1000 + 5}, int64_t{5}}) {
    check_gelu<float, float>(n, seed += 2, "fp32");
    check_gelu<Bf16, Bf16>(n, seed += 2, "bf16");
    check_gelu<Bf16, float>(n, seed += 2, "fp32 in, bf16 out");
  }
}

// GELU backward with the fused bias gradient: C % 4 == 0 and aligned takes 4 columns a thread;
// one element off, or C % 4 != 0, takes one. dinp and dbias are the same bits either way.
TEST_F(VectorAccessTest, GeluBackwardBiasVectorAndScalarColumnsGiveTheSameBits) {
  uint32_t seed = 540;
  for (const auto& [N, C] : {std::pair<int64_t, int64_t>{300, 96}, {300, 1028}, {50, 100}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const auto x = random_vec(N * C, -6, 6, seed++), dy = random_vec(N * C, -1, 1, seed++);
    const auto db0 = random_vec(C, -2, 2, seed++);
    std::vector<float> dx_ref, db_ref;
    for (const int64_t off : {0, 1}) {
      SCOPED_TRACE("offset " + std::to_string(off));
      DeviceBuffer d_x = up_at(x, off), d_dy = up_at(dy, off);
      DeviceBuffer d_dx = up_at(std::vector<float>(N * C), off), d_db = cuda::upload(ctx(), db0);
      cuda::gelu_backward(ctx(), d_dx.as<float>() + off, d_db.as<float>(), d_x.as<float>() + off,
                          d_dy.as<float>() + off, N, C);
      const auto dx = get_at<float>(d_dx, off, N * C), db = get<float>(d_db, C);
      if (off == 0) {
        dx_ref = dx;
        db_ref = db;
        std::vector<float> dx_cpu(N * C), db_cpu = db0;
        kernels::gelu_backward<float>(dx_cpu.data(), x.data(), dy.data(), N * C);
        for (int64_t r = 0; r < N; ++r) {
          for (int64_t c = 0; c < C; ++c) db_cpu[c] += dx_cpu[r * C + c];
        }
        EXPECT_TRUE(matches(dx, dx_cpu, f32_rtol(1)));
        EXPECT_TRUE(matches(db, db_cpu, f32_rtol(N)));
      } else {
        EXPECT_TRUE(identical(dx, dx_ref)) << "dinp";
        EXPECT_TRUE(identical(db, db_ref)) << "dbias";
      }
    }
  }
}

// GLU forward and backward (SwiGLU and GEGLU): the aligned run's bits are the reference for the
// misaligned ones (every operand one element off, or only the output), at lengths with a tail.
TEST_F(VectorAccessTest, GluTailsAndMisalignedOperandsGiveTheAlignedBits) {
  uint32_t seed = 600;
  for (const GluAct act : {GluAct::kSilu, GluAct::kGelu}) {
    for (const int64_t n : {int64_t{4 * 500 + 3}, int64_t{8 * 500 + 5}}) {
      SCOPED_TRACE(std::string(act == GluAct::kSilu ? "silu" : "gelu") + " n=" + std::to_string(n));
      const auto g = bf16_rounded(random_vec(n, -4, 4, seed++));
      const auto u = bf16_rounded(random_vec(n, -2, 2, seed++));
      const auto d = bf16_rounded(random_vec(n, -1, 1, seed++));
      for (const auto& [out_off, in_off] : {std::pair<int64_t, int64_t>{1, 1}, {1, 0}, {0, 1}}) {
        SCOPED_TRACE("offsets out " + std::to_string(out_off) + " in " + std::to_string(in_off));
        EXPECT_EQ(glu_run<float>(act, g, u, d, out_off, in_off), glu_run<float>(act, g, u, d, 0, 0))
            << "fp32";
        EXPECT_EQ(glu_run<Bf16>(act, to_bf16(g), to_bf16(u), to_bf16(d), out_off, in_off),
                  glu_run<Bf16>(act, to_bf16(g), to_bf16(u), to_bf16(d), 0, 0))
            << "bf16";
        EXPECT_EQ(glu_run<Bf16>(act, g, u, d, out_off, in_off), glu_run<Bf16>(act, g, u, d, 0, 0))
            << "fp32 in, bf16 out";
      }
      // Against the CPU once (fp32), so the reference run is itself right.
      std::vector<float> y(n), dg(n), du(n);
      kernels::glu_forward<float>(act, y.data(), g.data(), u.data(), n);
      kernels::glu_backward<float>(act, dg.data(), du.data(), d.data(), g.data(), u.data(), n);
      const auto got = glu_run<float>(act, g, u, d, 0, 0);
      EXPECT_TRUE(matches(got[0], y, f32_rtol(1)));
      EXPECT_TRUE(matches(got[1], dg, f32_rtol(1)));
      EXPECT_TRUE(matches(got[2], du, f32_rtol(1)));
    }
  }
}

// GLU backward with the fused bias gradients: 4 columns a thread (C % 4 == 0, aligned) and 1
// (one element off) give the same bits.
TEST_F(VectorAccessTest, GluBackwardBiasVectorAndScalarColumnsGiveTheSameBits) {
  const int64_t N = 200, C = 132;
  const auto g = random_vec(N * C, -4, 4, 620), u = random_vec(N * C, -2, 2, 621);
  const auto d = random_vec(N * C, -1, 1, 622), b0 = random_vec(C, -1, 1, 623);
  std::vector<std::vector<float>> ref;
  for (const int64_t off : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(off));
    DeviceBuffer d_g = up_at(g, off), d_u = up_at(u, off), d_d = up_at(d, off);
    DeviceBuffer d_dg = up_at(std::vector<float>(N * C), off);
    DeviceBuffer d_du = up_at(std::vector<float>(N * C), off);
    DeviceBuffer d_bg = cuda::upload(ctx(), b0), d_bu = cuda::upload(ctx(), b0);
    cuda::glu_backward(ctx(), GluAct::kSilu, d_dg.as<float>() + off, d_du.as<float>() + off,
                       d_bg.as<float>(), d_bu.as<float>(), d_d.as<float>() + off,
                       d_g.as<float>() + off, d_u.as<float>() + off, N, C);
    std::vector<std::vector<float>> got = {get_at<float>(d_dg, off, N * C),
                                           get_at<float>(d_du, off, N * C), get<float>(d_bg, C),
                                           get<float>(d_bu, C)};
    if (off == 0) {
      ref = got;
      std::vector<float> dg(N * C), du(N * C), bg = b0, bu = b0;
      kernels::glu_backward<float>(GluAct::kSilu, dg.data(), du.data(), d.data(), g.data(),
                                   u.data(), N * C);
      for (int64_t r = 0; r < N; ++r) {
        for (int64_t c = 0; c < C; ++c) {
          bg[c] += dg[r * C + c];
          bu[c] += du[r * C + c];
        }
      }
      EXPECT_TRUE(matches(got[2], bg, f32_rtol(N)));
      EXPECT_TRUE(matches(got[3], bu, f32_rtol(N)));
    } else {
      for (size_t k = 0; k < got.size(); ++k) EXPECT_TRUE(identical(got[k], ref[k])) << k;
    }
  }
}

// Casts of row blocks: leading dimensions that are multiples of 8 (the vector path, each row's
// cols % 8 tail one at a time) and that are not, pointers one element off, and the flat casts
// with a tail; against the host's round-to-nearest-even, exactly.
TEST_F(VectorAccessTest, CastRowTailsAndMisalignedRowsMatchHostExactly) {
  struct Case {
    int64_t rows, cols, ld_in, ld_out, off;
  };
  const Case cases[] = {
      {5, 8 * 30 + 5, 8 * 31, 8 * 32, 0},      // vector packs, a 5-column tail per row
      {5, 8 * 30, 8 * 30, 8 * 30, 0},          // packs only
      {5, 8 * 30 + 5, 8 * 30 + 5, 8 * 31, 0},  // ld_in not a multiple of 8
      {5, 8 * 30, 8 * 31, 8 * 32, 1},          // both one element off
      {1, 3, 3, 3, 0},                         // a tail only
  };
  uint32_t seed = 560;
  for (const Case& k : cases) {
    SCOPED_TRACE("rows=" + std::to_string(k.rows) + " cols=" + std::to_string(k.cols) +
                 " ld_in=" + std::to_string(k.ld_in) + " ld_out=" + std::to_string(k.ld_out) +
                 " off=" + std::to_string(k.off));
    const auto in = random_vec(k.rows * k.ld_in, -3, 3, seed++);
    // to_bf16_rows: untouched columns past cols keep their poison.
    std::vector<Bf16> out0(k.rows * k.ld_out);
    for (auto& v : out0) v = keel::to_bf16(-7.0f);
    std::vector<float> want(out0.size());
    for (size_t i = 0; i < out0.size(); ++i) want[i] = -7.0f;
    for (int64_t r = 0; r < k.rows; ++r) {
      for (int64_t c = 0; c < k.cols; ++c) want[r * k.ld_out + c] = round_bf16(in[r * k.ld_in + c]);
    }
    DeviceBuffer d_in = up_at(in, k.off), d_out = up_at(out0, k.off);
    cuda::to_bf16_rows(ctx(), d_out.as<Bf16>() + k.off, k.ld_out, d_in.as<float>() + k.off, k.ld_in,
                       k.rows, k.cols);
    EXPECT_TRUE(identical(from_bf16(get_at<Bf16>(d_out, k.off, out0.size())), want))
        << "to_bf16_rows";

    // from_bf16_rows, overwriting and accumulating, from bf16 rows of stride ld_in.
    const auto src = to_bf16(random_vec(k.rows * k.ld_in, -3, 3, seed++));
    const auto acc0 = random_vec(k.rows * k.ld_out, -1, 1, seed++);
    for (const bool accumulate : {false, true}) {
      std::vector<float> expect = acc0;
      for (int64_t r = 0; r < k.rows; ++r) {
        for (int64_t c = 0; c < k.cols; ++c) {
          const float v = keel::from_bf16(src[r * k.ld_in + c]);
          float& e = expect[r * k.ld_out + c];
          e = accumulate ? e + v : v;
        }
      }
      DeviceBuffer d_src = up_at(src, k.off), d_dst = up_at(acc0, k.off);
      cuda::from_bf16_rows(ctx(), d_dst.as<float>() + k.off, k.ld_out, d_src.as<Bf16>() + k.off,
                           k.ld_in, k.rows, k.cols, accumulate);
      EXPECT_TRUE(identical(get_at<float>(d_dst, k.off, acc0.size()), expect))
          << "from_bf16_rows accumulate=" << accumulate;
    }
  }
  // Flat casts: 8192-column rows and a ragged last row (20000 = 2 x 8192 + 3616), and 8k + 3.
  for (const int64_t n : {int64_t{20000}, int64_t{8 * 100 + 3}}) {
    for (const int64_t off : {0, 1}) {
      SCOPED_TRACE("flat n=" + std::to_string(n) + " off=" + std::to_string(off));
      const auto x = random_vec(n, -3, 3, seed++);
      DeviceBuffer d_x = up_at(x, off), d_b = up_at(std::vector<Bf16>(n), off);
      DeviceBuffer d_back = up_at(std::vector<float>(n), off);
      cuda::to_bf16(ctx(), d_b.as<Bf16>() + off, d_x.as<float>() + off, n);
      cuda::from_bf16(ctx(), d_back.as<float>() + off, d_b.as<Bf16>() + off, n);
      EXPECT_TRUE(identical(get_at<float>(d_back, off, n), bf16_rounded(x)));
    }
  }
}

// The per-head scale fold for cuDNN: rows of stride ldq a multiple of 8 (the vector path) or not,
// and q one element off; qs = bf16(scale[h] q) exactly as the host rounds it.
TEST_F(VectorAccessTest, HeadScaleFoldVectorAndScalarMatchHostExactly) {
  const int64_t B = 2, T = 9, H = 3, D = 64, HD = H * D, N = B * T;
  const std::vector<float> scale = {0.125f, 0.3f, 1.7f};
  DeviceBuffer d_scale = cuda::upload(ctx(), scale);
  uint32_t seed = 580;
  for (const auto& [ld, off] : {std::pair<int64_t, int64_t>{3 * HD + 8, 0}, {HD + 3, 0}, {HD, 1}}) {
    SCOPED_TRACE("ldq=" + std::to_string(ld) + " off=" + std::to_string(off));
    const kernels::AttentionShape s{B, T, H, D, ld, ld, ld, HD, 1};
    const auto q = to_bf16(random_vec(N * ld, -2, 2, seed++));
    std::vector<float> want(N * HD);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < HD; ++j) {
        want[n * HD + j] = round_bf16(scale[j / D] * keel::from_bf16(q[n * ld + j]));
      }
    }
    DeviceBuffer d_q = up_at(q, off), d_qs = up_at(std::vector<Bf16>(N * HD), off);
    cuda::cudnn::fold_head_scale(ctx(), s, d_qs.as<Bf16>() + off, d_q.as<Bf16>() + off,
                                 d_scale.as<float>());
    EXPECT_TRUE(identical(from_bf16(get_at<Bf16>(d_qs, off, N * HD)), want));
  }
}

}  // namespace
}  // namespace keel::gpu_test
