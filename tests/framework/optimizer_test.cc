// The optimizer's one call a step (framework/optim/optimizer.cc) and the segment-table methods it
// and the trainer's gradient norm reach the kernels through (ExecContext::adamw_update_segments,
// sum_squares_segments, kernels/exec_context.h) on the CPU, where they must give exactly what the
// per-tensor calls they replace gave: the CPU's results are compared bit for bit across layouts.
#include "framework/optim/optimizer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "framework/kernels/adamw.h"
#include "framework/kernels/elementwise.h"
#include "framework/kernels/exec_context.h"

namespace keel {
namespace {

std::vector<float> random_floats(int64_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// 200 segments of 0 to 40000 elements (every 13th empty, a ragged last chunk of the CPU's 2^14
// element partition in most), gaps between some: the table's sum is the per-tensor sums
// accumulated in segment order, bit for bit, and a gap is never summed.
TEST(SumSquaresSegments, CpuEqualsPerTensorSumsBitwise) {
  std::mt19937 gen(5);
  std::vector<kernels::NormSegment> segs;
  int64_t total = 0;
  for (int k = 0; k < 200; ++k) {
    const int64_t n = k % 13 == 4 ? 0 : static_cast<int64_t>(gen() % 40001);
    segs.push_back({total, n});
    total += n + (k % 3 == 0 ? 7 : 0);
  }
  std::vector<float> x = random_floats(total, 1.0f, 6);
  std::vector<bool> in_segment(static_cast<size_t>(total), false);
  for (const auto& s : segs) std::fill_n(in_segment.begin() + s.offset, s.n, true);
  for (int64_t i = 0; i < total; ++i) {
    if (!in_segment[static_cast<size_t>(i)]) x[static_cast<size_t>(i)] = 1e10f;
  }
  double want = 0.0;
  for (const auto& s : segs) {
    if (s.n > 0) want += kernels::sum_squares(x.data() + s.offset, s.n);
  }
  double got = -1.0;
  kernels::cpu_exec().sum_squares_segments(x.data(), segs.data(), static_cast<int64_t>(segs.size()),
                                           &got);
  EXPECT_EQ(std::memcmp(&got, &want, sizeof(double)), 0) << got << " vs " << want;
  EXPECT_LT(got, 1e12) << "a gap between segments was summed";
  EXPECT_GT(got, 0.5 * static_cast<double>(total)) << "too little summed";

  got = -1.0;
  kernels::cpu_exec().sum_squares_segments(x.data(), nullptr, 0, &got);
  EXPECT_EQ(got, 0.0) << "no segment";
  const std::vector<kernels::NormSegment> empty = {{0, 0}, {9, 0}};
  got = -1.0;
  kernels::cpu_exec().sum_squares_segments(x.data(), empty.data(), 2, &got);
  EXPECT_EQ(got, 0.0) << "only empty segments";
}

// AdamW::step's one adamw_update_segments call against adamw_update per segment with its decay
// (what the step did before), over three steps with clipping scales: bitwise equal; elements in
// no segment never move.
TEST(AdamWSegments, StepEqualsPerSegmentUpdatesBitwise) {
  config::Optim o;
  o.set_lr(1e-3f);
  o.set_weight_decay(0.1f);
  o.set_beta1(0.9f);
  o.set_beta2(0.95f);
  o.set_eps(1e-8f);
  std::vector<ParamSegment> segs;
  int64_t total = 0;
  for (int k = 0; k < 40; ++k) {
    const int64_t n = k % 11 == 6 ? 0 : 1 + (k * 7919) % 5000;
    segs.push_back({total, n, k % 3 != 1});
    total += n + (k % 4 == 0 ? 3 : 0);
  }
  const std::vector<float> p0 = random_floats(total, 1.0f, 7);
  AdamW opt(o, total, segs);
  std::vector<float> p = p0, rp = p0, rm(static_cast<size_t>(total), 0.0f), rv = rm;
  const float lrs[3] = {1e-2f, 5e-3f, 2e-2f}, scales[3] = {1.0f, 0.5f, 0.8f};
  for (int step = 1; step <= 3; ++step) {
    const std::vector<float> g = random_floats(total, 1.0f, 100 + step);
    opt.step(p.data(), g.data(), lrs[step - 1], scales[step - 1]);
    for (const ParamSegment& seg : segs) {
      const kernels::AdamWStep s{
          lrs[step - 1],    o.beta1(), o.beta2(), o.eps(), seg.decay ? o.weight_decay() : 0.0f,
          scales[step - 1], step};
      kernels::adamw_update(rp.data() + seg.offset, g.data() + seg.offset, rm.data() + seg.offset,
                            rv.data() + seg.offset, seg.n, s);
    }
    const std::vector<float> m(opt.m().f32(), opt.m().f32() + total);
    const std::vector<float> v(opt.v().f32(), opt.v().f32() + total);
    EXPECT_TRUE(same_bits(p, rp)) << "param, step " << step;
    EXPECT_TRUE(same_bits(m, rm)) << "m, step " << step;
    EXPECT_TRUE(same_bits(v, rv)) << "v, step " << step;
  }
  EXPECT_FALSE(same_bits(p, p0)) << "nothing moved";
  int64_t end = 0;
  for (const ParamSegment& seg : segs) {
    for (int64_t i = end; i < seg.offset; ++i) EXPECT_EQ(p[i], p0[i]) << "gap element " << i;
    end = seg.offset + seg.n;
  }
}

}  // namespace
}  // namespace keel
