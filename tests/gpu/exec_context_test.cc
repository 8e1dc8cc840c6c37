// The CUDA execution context (framework/kernels/cuda/exec_context.h) against the CPU one
// (kernels::cpu_exec()), method by method through the ExecContext interface, on random inputs
// that are never zero, with every output poisoned with NaN (0xFF bytes) first so an element the
// method should write but does not fails. Strided shapes where the method takes strides: QK-norm
// inside packed qkv rows (ld_in = 3HD, ld_out = 2HD, per-head and shared gains), RoPE on q inside
// a packed row, attention on views of a fused qkv buffer; elements outside the views must stay
// poisoned. Bounds are those of gpu_test_util.h (and of the CUDA kernels' own tests, which hold
// the same kernels to the same CPU kernels): fp32 1e-5 relative, widened by sqrt(K / 1024) for
// reductions of length K. Also: the factory registration (make_exec(Device::kCuda) after
// register_cuda_exec_factory, tensors of Device::kCuda from the context's allocator). Without a
// GPU every test that needs one skips with its reason.
#include "framework/kernels/cuda/exec_context.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "framework/tensor.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
using kernels::AttentionShape;
using kernels::ExecContext;
using kernels::GluAct;
using kernels::NormOp;
using kernels::NormShape;

// The fixture's CUDA context is the CudaExec's own (not GpuTest's): uploads, poison fills and
// downloads must run on the stream the methods run on.
class ExecContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
    }
    exec_ = std::make_unique<cuda::CudaExec>(0);
  }

  ExecContext& gpu() { return *exec_; }
  ExecContext& cpu() { return kernels::cpu_exec(); }
  cuda::Context& ctx() { return exec_->context(); }

  template <typename T>
  DeviceBuffer up(const std::vector<T>& host) {
    return cuda::upload(ctx(), host);
  }
  template <typename T>
  DeviceBuffer poisoned(size_t n) {
    DeviceBuffer b = ctx().alloc(n * sizeof(T));
    ctx().fill_bytes(b.data(), 0xFF, n * sizeof(T));
    return b;
  }
  template <typename T>
  std::vector<T> get(const DeviceBuffer& b, size_t n) {
    return cuda::download<T>(ctx(), b.data(), n);
  }
  static float* f(const DeviceBuffer& b) { return b.as<float>(); }

 private:
  std::unique_ptr<cuda::CudaExec> exec_;
};

// Only the elements of rows that a strided method writes (columns [0, width) of rows of `ld`
// elements, the first at `off`), compared; every other element must still hold the poison.
::testing::AssertionResult view_matches(const std::vector<float>& gpu,
                                        const std::vector<float>& cpu, int64_t rows, int64_t width,
                                        int64_t ld, int64_t off, double rtol) {
  if (gpu.size() != cpu.size()) {
    return ::testing::AssertionFailure() << "size " << gpu.size() << " != " << cpu.size();
  }
  std::vector<char> in_view(gpu.size(), 0);
  std::vector<float> g, c;
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t j = 0; j < width; ++j) {
      const size_t i = static_cast<size_t>(off + n * ld + j);
      in_view[i] = 1;
      g.push_back(gpu[i]);
      c.push_back(cpu[i]);
    }
  }
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (!in_view[i] && !std::isnan(gpu[i])) {
      return ::testing::AssertionFailure() << "element " << i << " outside the view was written";
    }
  }
  return matches(g, c, rtol);
}

std::vector<float> nan_vec(size_t n) { return std::vector<float>(n, NAN); }

// ---- gemm.h ----

TEST_F(ExecContextTest, LinearForwardBackwardMatchCpu) {
  const int64_t N = 37, IC = 70, OC = 45;
  const auto inp = random_vec(N * IC, -1, 1, 1), w = random_vec(OC * IC, -1, 1, 2);
  const auto bias = random_vec(OC, -1, 1, 3), dout = random_vec(N * OC, -1, 1, 4);
  const auto dinp0 = random_vec(N * IC, -1, 1, 5);
  const auto dw0 = random_vec(OC * IC, -1, 1, 6), db0 = random_vec(OC, -1, 1, 7);
  DeviceBuffer d_inp = up(inp), d_w = up(w), d_bias = up(bias), d_dout = up(dout);
  for (const bool with_bias : {true, false}) {
    std::vector<float> out(N * OC);
    cpu().linear_forward(out.data(), inp.data(), w.data(), with_bias ? bias.data() : nullptr, N, IC,
                         OC);
    DeviceBuffer d_out = poisoned<float>(N * OC);
    gpu().linear_forward(f(d_out), f(d_inp), f(d_w), with_bias ? f(d_bias) : nullptr, N, IC, OC);
    EXPECT_TRUE(matches(get<float>(d_out, out.size()), out, f32_rtol(IC))) << "bias " << with_bias;
  }
  for (const bool accumulate : {false, true}) {
    std::vector<float> dinp = dinp0, dw = dw0, db = db0;
    cpu().linear_backward(dinp.data(), accumulate, dw.data(), db.data(), dout.data(), inp.data(),
                          w.data(), N, IC, OC);
    DeviceBuffer d_dinp = accumulate ? up(dinp0) : poisoned<float>(dinp0.size());
    DeviceBuffer d_dw = up(dw0), d_db = up(db0);  // parameter gradients accumulate (+=)
    gpu().linear_backward(f(d_dinp), accumulate, f(d_dw), f(d_db), f(d_dout), f(d_inp), f(d_w), N,
                          IC, OC);
    EXPECT_TRUE(matches(get<float>(d_dinp, dinp.size()), dinp, f32_rtol(OC))) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_dw, dw.size()), dw, f32_rtol(N))) << accumulate;
    EXPECT_TRUE(matches(get<float>(d_db, db.size()), db, f32_rtol(N))) << accumulate;
  }
}

TEST_F(ExecContextTest, LoadTokensCopiesTheHostBatch) {
  const int64_t n = 1029;
  std::mt19937 gen(8);
  std::uniform_int_distribution<int32_t> tok(1, 50303);
  std::vector<int32_t> host(n);
  for (auto& t : host) t = tok(gen);
  const std::vector<int32_t> expected = host;
  DeviceBuffer d = poisoned<int32_t>(n);
  gpu().load_tokens(d.as<int32_t>(), host.data(), n);
  std::fill(host.begin(), host.end(), -7);  // host_src may be reused once the call returns
  EXPECT_EQ(get<int32_t>(d, n), expected);
}

// ---- elementwise.h, glu.h ----

TEST_F(ExecContextTest, ElementwiseAndGluMatchCpu) {
  // [N, C] for the backward forms' bias sums: several row chunks (GLU's 5, GELU's 19; the last one
  // short) and a partial 32-column strip (Note [fused-bias-grad]).
  const int64_t N = 300, C = 37, n = N * C;
  const auto a = random_vec(n, -3, 3, 10), b = random_vec(n, -3, 3, 11);
  const auto dout = random_vec(n, -1, 1, 12), bias0 = random_vec(C, -1, 1, 13);
  DeviceBuffer d_a = up(a), d_b = up(b), d_dout = up(dout);

  std::vector<float> y(n), dx(n), sum(n), acc = a, dbias = bias0;
  cpu().gelu_forward(y.data(), a.data(), n);
  cpu().gelu_backward(dx.data(), dbias.data(), a.data(), dout.data(), N, C);
  cpu().add(sum.data(), a.data(), b.data(), n);
  cpu().add_inplace(acc.data(), b.data(), n);
  DeviceBuffer d_y = poisoned<float>(n), d_dx = poisoned<float>(n), d_sum = poisoned<float>(n);
  DeviceBuffer d_dx2 = poisoned<float>(n), d_acc = up(a), d_dbias = up(bias0);
  gpu().gelu_forward(f(d_y), f(d_a), n);
  gpu().gelu_backward(f(d_dx), nullptr, f(d_a), f(d_dout), N, C);
  gpu().gelu_backward(f(d_dx2), f(d_dbias), f(d_a), f(d_dout), N, C);
  gpu().add(f(d_sum), f(d_a), f(d_b), n);
  gpu().add_inplace(f(d_acc), f(d_b), n);
  EXPECT_TRUE(matches(get<float>(d_y, n), y, f32_rtol(1))) << "gelu_forward";
  EXPECT_TRUE(matches(get<float>(d_dx, n), dx, f32_rtol(1))) << "gelu_backward";
  // The fused column sums compute each element as the element-wise kernel does.
  EXPECT_TRUE(identical(get<float>(d_dx2, n), get<float>(d_dx, n))) << "gelu_backward, dbias";
  EXPECT_TRUE(matches(get<float>(d_dbias, C), dbias, f32_rtol(N))) << "gelu_backward dbias";
  EXPECT_TRUE(identical(get<float>(d_sum, n), sum)) << "add";  // one IEEE addition each
  EXPECT_TRUE(identical(get<float>(d_acc, n), acc)) << "add_inplace";
  // In place (dinp = dout), with the bias sums: the same values.
  DeviceBuffer d_inplace = up(dout), d_dbias2 = up(bias0);
  gpu().gelu_backward(f(d_inplace), f(d_dbias2), f(d_a), f(d_inplace), N, C);
  EXPECT_TRUE(identical(get<float>(d_inplace, n), get<float>(d_dx, n))) << "gelu in place";
  EXPECT_TRUE(identical(get<float>(d_dbias2, C), get<float>(d_dbias, C))) << "gelu in place";

  for (const GluAct act : {GluAct::kSilu, GluAct::kGelu}) {
    const char* name = act == GluAct::kSilu ? "silu" : "gelu";
    std::vector<float> out(n), dgate(n), dup(n), gate_bias = bias0;
    std::vector<float> up_bias = random_vec(C, -1, 1, 14);
    const std::vector<float> up_bias0 = up_bias;
    cpu().glu_forward(act, out.data(), a.data(), b.data(), n);
    cpu().glu_backward(act, dgate.data(), dup.data(), gate_bias.data(), up_bias.data(), dout.data(),
                       a.data(), b.data(), N, C);
    DeviceBuffer d_out = poisoned<float>(n), d_dgate = poisoned<float>(n);
    DeviceBuffer d_dup = poisoned<float>(n), d_dgate2 = poisoned<float>(n);
    DeviceBuffer d_dup2 = poisoned<float>(n), d_gate_bias = up(bias0), d_up_bias = up(up_bias0);
    gpu().glu_forward(act, f(d_out), f(d_a), f(d_b), n);
    gpu().glu_backward(act, f(d_dgate), f(d_dup), nullptr, nullptr, f(d_dout), f(d_a), f(d_b), N,
                       C);
    gpu().glu_backward(act, f(d_dgate2), f(d_dup2), f(d_gate_bias), f(d_up_bias), f(d_dout), f(d_a),
                       f(d_b), N, C);
    EXPECT_TRUE(matches(get<float>(d_out, n), out, f32_rtol(1))) << name;
    EXPECT_TRUE(matches(get<float>(d_dgate, n), dgate, f32_rtol(1))) << name;
    EXPECT_TRUE(matches(get<float>(d_dup, n), dup, f32_rtol(1))) << name;
    EXPECT_TRUE(identical(get<float>(d_dgate2, n), get<float>(d_dgate, n))) << name << " bias";
    EXPECT_TRUE(identical(get<float>(d_dup2, n), get<float>(d_dup, n))) << name << " bias";
    EXPECT_TRUE(matches(get<float>(d_gate_bias, C), gate_bias, f32_rtol(N))) << name;
    EXPECT_TRUE(matches(get<float>(d_up_bias, C), up_bias, f32_rtol(N))) << name;
    // One bias only: the other stays untouched.
    DeviceBuffer d_up_bias2 = up(up_bias0);
    gpu().glu_backward(act, f(d_dgate2), f(d_dup2), nullptr, f(d_up_bias2), f(d_dout), f(d_a),
                       f(d_b), N, C);
    EXPECT_TRUE(identical(get<float>(d_up_bias2, C), get<float>(d_up_bias, C))) << name;
  }
}

TEST_F(ExecContextTest, SumSquaresWritesThenAccumulatesADeviceDouble) {
  const auto x1 = random_vec(70001, -2, 2, 13), x2 = random_vec(999, -5, 5, 14);
  DeviceBuffer d_x1 = up(x1), d_x2 = up(x2), d_out = poisoned<double>(1);
  double ref = NAN;
  cpu().sum_squares(x1.data(), static_cast<int64_t>(x1.size()), &ref, /*accumulate=*/false);
  gpu().sum_squares(f(d_x1), static_cast<int64_t>(x1.size()), d_out.as<double>(), false);
  // Double sums of fp32 squares (exact in double): only the order differs (~1e-16 relative).
  const double first = get<double>(d_out, 1)[0];
  EXPECT_NEAR(first, ref, 1e-12 * ref);
  cpu().sum_squares(x2.data(), static_cast<int64_t>(x2.size()), &ref, /*accumulate=*/true);
  gpu().sum_squares(f(d_x2), static_cast<int64_t>(x2.size()), d_out.as<double>(), true);
  const double second = get<double>(d_out, 1)[0];
  EXPECT_NEAR(second, ref, 1e-12 * ref);
  EXPECT_GT(second, first);  // it added to the first sum rather than replacing it
}

// ---- norm.h ----

struct NormCase {
  NormOp op;
  NormShape s;
  bool weight, bias;
  const char* name;
};

// Block norms, QK-norm per head inside packed qkv rows (ld_in = 3HD; the normalised q/k go to
// rows of 2HD), with a gain per head (stride Cg) or one shared by the heads (stride 0, the
// HEAD_SHARED scope), and odd sizes.
std::vector<NormCase> norm_cases() {
  const int64_t H = 4, D = 24, HD = H * D;
  return {
      {NormOp::kLayer, {37, 1, 300, 300, 300, 0}, true, true, "block LayerNorm"},
      {NormOp::kRms, {37, 1, 300, 300, 300, 0}, true, false, "block RMSNorm"},
      {NormOp::kRms, {29, H, D, 3 * HD, 2 * HD, D}, true, false, "per-head RMS, HEAD"},
      {NormOp::kLayer, {29, H, D, 3 * HD, 2 * HD, 0}, true, true, "per-head LN, HEAD_SHARED"},
      {NormOp::kRms, {29, H, D, 3 * HD, 2 * HD, 0}, true, false, "per-head RMS, HEAD_SHARED"},
      {NormOp::kL2, {29, H, D, 3 * HD, 2 * HD, 0}, false, false, "per-head L2"},
      {NormOp::kLayer, {33, 1, 100, 130, 110, 0}, true, true, "odd sizes"},
  };
}

int64_t wsize_of(const NormShape& s) { return s.w_group_stride == 0 ? s.Cg : s.G * s.Cg; }
// Rows each gain element's gradient sums over.
int64_t grad_reduce_of(const NormShape& s) { return s.w_group_stride == 0 ? s.N * s.G : s.N; }

// Random inputs of one norm case, host and device.
struct NormData {
  std::vector<float> x, dy, w, b, dx0, dw0, db0;
  DeviceBuffer d_x, d_dy, d_w, d_b;
};

class ExecContextNormTest : public ExecContextTest {
 protected:
  NormData make(const NormCase& k, uint32_t seed) {
    const NormShape& s = k.s;
    const int64_t wsize = wsize_of(s);
    NormData d;
    d.x = random_vec(s.N * s.ld_in, -2, 3, seed);  // a non-zero mean
    d.dy = random_vec(s.N * s.ld_out, -1, 1, seed + 1);
    d.w = random_vec(wsize, 0.5f, 1.5f, seed + 2);
    d.b = random_vec(wsize, -0.5f, 0.5f, seed + 3);
    d.dx0 = random_vec(s.N * s.ld_in, -1, 1, seed + 4);
    d.dw0 = random_vec(wsize, -1, 1, seed + 5);
    d.db0 = random_vec(wsize, -1, 1, seed + 6);
    d.d_x = up(d.x);
    d.d_dy = up(d.dy);
    d.d_w = up(d.w);
    d.d_b = up(d.b);
    return d;
  }
  static const float* wp(const NormCase& k, const std::vector<float>& w) {
    return k.weight ? w.data() : nullptr;
  }
  static const float* bp(const NormCase& k, const std::vector<float>& b) {
    return k.bias ? b.data() : nullptr;
  }
  static float* dwp(const NormCase& k, const DeviceBuffer& w) { return k.weight ? f(w) : nullptr; }
  static float* dbp(const NormCase& k, const DeviceBuffer& b) { return k.bias ? f(b) : nullptr; }
};

TEST_F(ExecContextNormTest, ForwardBackwardMatchCpu) {
  const float eps = 1e-5f;
  uint32_t seed = 100;
  for (const NormCase& k : norm_cases()) {
    SCOPED_TRACE(k.name);
    const NormShape& s = k.s;
    const int64_t rows = s.N * s.G, wsize = wsize_of(s), width = s.G * s.Cg;
    NormData d = make(k, seed);
    seed += 10;
    std::vector<float> y = nan_vec(s.N * s.ld_out), mean(rows), rstd(rows);
    cpu().norm_forward(k.op, s, y.data(), d.x.data(), wp(k, d.w), bp(k, d.b), mean.data(),
                       rstd.data(), eps);
    DeviceBuffer d_y = poisoned<float>(y.size()), d_mean = poisoned<float>(rows);
    DeviceBuffer d_rstd = poisoned<float>(rows);
    gpu().norm_forward(k.op, s, f(d_y), f(d.d_x), dwp(k, d.d_w), dbp(k, d.d_b), f(d_mean),
                       f(d_rstd), eps);
    EXPECT_TRUE(
        view_matches(get<float>(d_y, y.size()), y, s.N, width, s.ld_out, 0, f32_rtol(s.Cg)));
    EXPECT_TRUE(matches(get<float>(d_rstd, rows), rstd, f32_rtol(s.Cg))) << "rstd";
    if (k.op == NormOp::kLayer) {
      EXPECT_TRUE(matches(get<float>(d_mean, rows), mean, f32_rtol(s.Cg))) << "mean";
    }
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      std::vector<float> dx = accumulate ? d.dx0 : nan_vec(d.dx0.size()), dw = d.dw0, db = d.db0;
      cpu().norm_backward(k.op, s, dx.data(), accumulate, k.weight ? dw.data() : nullptr,
                          k.bias ? db.data() : nullptr, d.dy.data(), d.x.data(), wp(k, d.w),
                          mean.data(), rstd.data());
      // The GPU backward uses the GPU forward's statistics, as training does.
      DeviceBuffer d_dx = accumulate ? up(d.dx0) : poisoned<float>(d.dx0.size());
      DeviceBuffer d_dw = up(d.dw0), d_db = up(d.db0);
      gpu().norm_backward(k.op, s, f(d_dx), accumulate, dwp(k, d_dw), dbp(k, d_db), f(d.d_dy),
                          f(d.d_x), dwp(k, d.d_w), f(d_mean), f(d_rstd));
      const auto gdx = get<float>(d_dx, dx.size());
      if (accumulate) {
        EXPECT_TRUE(matches(gdx, dx, f32_rtol(s.Cg))) << "dinp";
      } else {
        EXPECT_TRUE(view_matches(gdx, dx, s.N, width, s.ld_in, 0, f32_rtol(s.Cg))) << "dinp";
      }
      if (k.weight) {
        EXPECT_TRUE(matches(get<float>(d_dw, wsize), dw, f32_rtol(grad_reduce_of(s)))) << "dw";
      }
      if (k.bias) {
        EXPECT_TRUE(matches(get<float>(d_db, wsize), db, f32_rtol(grad_reduce_of(s)))) << "db";
      }
    }
  }
}

// The split forms, one phase at a time from the same inputs on both sides, then chained on one
// rank (Cg_total = Cg): partial stats -> from_stats must equal norm_forward, partials ->
// from_partials norm_backward. kLayer's split variance E[x^2] - mean^2 cancels: for these inputs
// (mean ~0.5, std ~1.4) it loses ~1.1x the relative precision of E[x^2] only, inside f32_rtol.
TEST_F(ExecContextNormTest, SplitFormsMatchCpuAndTheFusedNorm) {
  const float eps = 1e-5f;
  uint32_t seed = 200;
  for (const NormCase& k : norm_cases()) {
    SCOPED_TRACE(k.name);
    const NormShape& s = k.s;
    const int64_t rows = s.N * s.G, wsize = wsize_of(s), width = s.G * s.Cg;
    NormData d = make(k, seed);
    seed += 10;

    // Phase 1: partial statistics.
    std::vector<float> stats(2 * rows);
    cpu().norm_partial_stats(s, d.x.data(), stats.data());
    DeviceBuffer d_stats = poisoned<float>(2 * rows);
    gpu().norm_partial_stats(s, f(d.d_x), f(d_stats));
    EXPECT_TRUE(matches(get<float>(d_stats, 2 * rows), stats, f32_rtol(s.Cg))) << "stats";

    // Phase 2 from the CPU's statistics: the same double math on both sides.
    std::vector<float> y = nan_vec(s.N * s.ld_out), mean(rows), rstd(rows);
    cpu().norm_forward_from_stats(k.op, s, s.Cg, stats.data(), y.data(), d.x.data(), wp(k, d.w),
                                  bp(k, d.b), mean.data(), rstd.data(), eps);
    DeviceBuffer d_cpu_stats = up(stats), d_y = poisoned<float>(y.size());
    DeviceBuffer d_mean = poisoned<float>(rows), d_rstd = poisoned<float>(rows);
    gpu().norm_forward_from_stats(k.op, s, s.Cg, f(d_cpu_stats), f(d_y), f(d.d_x), dwp(k, d.d_w),
                                  dbp(k, d.d_b), f(d_mean), f(d_rstd), eps);
    EXPECT_TRUE(view_matches(get<float>(d_y, y.size()), y, s.N, width, s.ld_out, 0, f32_rtol(1)))
        << "from_stats out";
    EXPECT_TRUE(matches(get<float>(d_rstd, rows), rstd, f32_rtol(1))) << "from_stats rstd";
    EXPECT_TRUE(matches(get<float>(d_mean, rows), mean, f32_rtol(1))) << "from_stats mean";

    // Chained on the GPU, one rank: equal to the fused forward (CPU reference).
    std::vector<float> y_ref = nan_vec(s.N * s.ld_out), mean_ref(rows), rstd_ref(rows);
    cpu().norm_forward(k.op, s, y_ref.data(), d.x.data(), wp(k, d.w), bp(k, d.b), mean_ref.data(),
                       rstd_ref.data(), eps);
    DeviceBuffer d_y2 = poisoned<float>(y.size()), d_rstd2 = poisoned<float>(rows);
    gpu().norm_forward_from_stats(k.op, s, s.Cg, f(d_stats), f(d_y2), f(d.d_x), dwp(k, d.d_w),
                                  dbp(k, d.d_b), /*mean=*/nullptr, f(d_rstd2), eps);
    EXPECT_TRUE(
        view_matches(get<float>(d_y2, y.size()), y_ref, s.N, width, s.ld_out, 0, f32_rtol(s.Cg)))
        << "split forward vs norm_forward";
    EXPECT_TRUE(matches(get<float>(d_rstd2, rows), rstd_ref, f32_rtol(s.Cg))) << "split rstd";

    // Backward phase 1: partials, from the CPU forward's statistics on both sides. A LayerNorm
    // needs its mean; RMS and L2 take none (null: mean 0).
    const float* mean_arg = k.op == NormOp::kLayer ? mean_ref.data() : nullptr;
    std::vector<float> part(2 * rows);
    cpu().norm_backward_partials(s, d.dy.data(), d.x.data(), wp(k, d.w), mean_arg, rstd_ref.data(),
                                 part.data());
    DeviceBuffer d_mean_ref = up(mean_ref), d_rstd_ref = up(rstd_ref);
    DeviceBuffer d_part = poisoned<float>(2 * rows);
    gpu().norm_backward_partials(s, f(d.d_dy), f(d.d_x), dwp(k, d.d_w),
                                 k.op == NormOp::kLayer ? f(d_mean_ref) : nullptr, f(d_rstd_ref),
                                 f(d_part));
    // The partial sums cancel (sum dn xhat ~ 0 for a LayerNorm): the rms floor of the bound
    // carries them.
    EXPECT_TRUE(matches(get<float>(d_part, 2 * rows), part, f32_rtol(s.Cg))) << "partials";

    // Backward phase 2 from the CPU's partials, and chained (GPU partials) against the fused
    // backward.
    DeviceBuffer d_cpu_part = up(part);
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      std::vector<float> dx = accumulate ? d.dx0 : nan_vec(d.dx0.size()), dw = d.dw0, db = d.db0;
      cpu().norm_backward_from_partials(k.op, s, s.Cg, part.data(), dx.data(), accumulate,
                                        k.weight ? dw.data() : nullptr,
                                        k.bias ? db.data() : nullptr, d.dy.data(), d.x.data(),
                                        wp(k, d.w), mean_ref.data(), rstd_ref.data());
      DeviceBuffer d_dx = accumulate ? up(d.dx0) : poisoned<float>(d.dx0.size());
      DeviceBuffer d_dw = up(d.dw0), d_db = up(d.db0);
      gpu().norm_backward_from_partials(k.op, s, s.Cg, f(d_cpu_part), f(d_dx), accumulate,
                                        dwp(k, d_dw), dbp(k, d_db), f(d.d_dy), f(d.d_x),
                                        dwp(k, d.d_w), f(d_mean_ref), f(d_rstd_ref));
      const auto gdx = get<float>(d_dx, dx.size());
      if (accumulate) {
        EXPECT_TRUE(matches(gdx, dx, f32_rtol(1))) << "from_partials dinp";
      } else {
        EXPECT_TRUE(view_matches(gdx, dx, s.N, width, s.ld_in, 0, f32_rtol(1)))
            << "from_partials dinp";
      }
      if (k.weight) {
        EXPECT_TRUE(matches(get<float>(d_dw, wsize), dw, f32_rtol(grad_reduce_of(s)))) << "dw";
      }
      if (k.bias) {
        EXPECT_TRUE(matches(get<float>(d_db, wsize), db, f32_rtol(grad_reduce_of(s)))) << "db";
      }

      std::vector<float> dx_ref = accumulate ? d.dx0 : nan_vec(d.dx0.size());
      cpu().norm_backward(k.op, s, dx_ref.data(), accumulate, nullptr, nullptr, d.dy.data(),
                          d.x.data(), wp(k, d.w), mean_ref.data(), rstd_ref.data());
      DeviceBuffer d_dx2 = accumulate ? up(d.dx0) : poisoned<float>(d.dx0.size());
      gpu().norm_backward_from_partials(k.op, s, s.Cg, f(d_part), f(d_dx2), accumulate, nullptr,
                                        nullptr, f(d.d_dy), f(d.d_x), dwp(k, d.d_w), f(d_mean_ref),
                                        f(d_rstd_ref));
      const auto gdx2 = get<float>(d_dx2, dx_ref.size());
      if (accumulate) {
        EXPECT_TRUE(matches(gdx2, dx_ref, f32_rtol(s.Cg))) << "split backward vs norm_backward";
      } else {
        EXPECT_TRUE(view_matches(gdx2, dx_ref, s.N, width, s.ld_in, 0, f32_rtol(s.Cg)))
            << "split backward vs norm_backward";
      }
    }
  }
}

// A row sharded over two "ranks" (PROJECTION-scope QK-norm under TP): each reduces its half of
// the columns, the statistics are added (the all-reduce, here add() on the device), and each
// half normalises with Cg_total = the full row. Together the halves equal the fused norm of the
// whole row, forward and backward.
TEST_F(ExecContextNormTest, SplitFormsOverTwoShardsEqualTheWholeRow) {
  const float eps = 1e-5f;
  const int64_t N = 23, half = 96, full = 2 * half, ld_in = 3 * full + 4, ld_out = full + 3;
  uint32_t seed = 300;
  for (const NormOp op : {NormOp::kLayer, NormOp::kRms, NormOp::kL2}) {
    const bool weight = op != NormOp::kL2, bias = op == NormOp::kLayer;
    SCOPED_TRACE(op == NormOp::kLayer ? "kLayer" : op == NormOp::kRms ? "kRms" : "kL2");
    const NormShape whole{N, 1, full, ld_in, ld_out, 0};
    const NormShape shard{N, 1, half, ld_in, ld_out, 0};
    const auto x = random_vec(N * ld_in, -2, 3, seed), dy = random_vec(N * ld_out, -1, 1, seed + 1);
    const auto w = random_vec(full, 0.5f, 1.5f, seed + 2),
               b = random_vec(full, -0.5f, 0.5f, seed + 3);
    const auto dw0 = random_vec(full, -1, 1, seed + 4), db0 = random_vec(full, -1, 1, seed + 5);
    seed += 10;
    std::vector<float> y = nan_vec(N * ld_out), mean(N), rstd(N);
    cpu().norm_forward(op, whole, y.data(), x.data(), weight ? w.data() : nullptr,
                       bias ? b.data() : nullptr, mean.data(), rstd.data(), eps);
    std::vector<float> dx = nan_vec(N * ld_in), dw = dw0, db = db0;
    cpu().norm_backward(op, whole, dx.data(), false, weight ? dw.data() : nullptr,
                        bias ? db.data() : nullptr, dy.data(), x.data(),
                        weight ? w.data() : nullptr, mean.data(), rstd.data());

    DeviceBuffer d_x = up(x), d_dy = up(dy), d_w = up(w), d_b = up(b);
    DeviceBuffer d_dw = up(dw0), d_db = up(db0);
    DeviceBuffer d_y = poisoned<float>(y.size()), d_dx = poisoned<float>(dx.size());
    DeviceBuffer d_stats0 = poisoned<float>(2 * N), d_stats1 = poisoned<float>(2 * N);
    DeviceBuffer d_stats = poisoned<float>(2 * N), d_mean = poisoned<float>(N);
    DeviceBuffer d_rstd = poisoned<float>(N);
    DeviceBuffer d_part0 = poisoned<float>(2 * N), d_part1 = poisoned<float>(2 * N);
    DeviceBuffer d_part = poisoned<float>(2 * N);
    auto at = [](const DeviceBuffer& buf, int64_t off) { return f(buf) + off; };
    gpu().norm_partial_stats(shard, at(d_x, 0), f(d_stats0));
    gpu().norm_partial_stats(shard, at(d_x, half), f(d_stats1));
    gpu().add(f(d_stats), f(d_stats0), f(d_stats1), 2 * N);
    for (const int64_t off : {int64_t{0}, half}) {  // both shards get the same mean and rstd
      gpu().norm_forward_from_stats(op, shard, full, f(d_stats), at(d_y, off), at(d_x, off),
                                    weight ? at(d_w, off) : nullptr, bias ? at(d_b, off) : nullptr,
                                    f(d_mean), f(d_rstd), eps);
    }
    EXPECT_TRUE(view_matches(get<float>(d_y, y.size()), y, N, full, ld_out, 0, f32_rtol(full)))
        << "out";
    EXPECT_TRUE(matches(get<float>(d_rstd, N), rstd, f32_rtol(full))) << "rstd";
    if (op == NormOp::kLayer) {
      EXPECT_TRUE(matches(get<float>(d_mean, N), mean, f32_rtol(full))) << "mean";
    }
    const float* mean_arg = op == NormOp::kLayer ? f(d_mean) : nullptr;
    gpu().norm_backward_partials(shard, at(d_dy, 0), at(d_x, 0), weight ? at(d_w, 0) : nullptr,
                                 mean_arg, f(d_rstd), f(d_part0));
    gpu().norm_backward_partials(shard, at(d_dy, half), at(d_x, half),
                                 weight ? at(d_w, half) : nullptr, mean_arg, f(d_rstd), f(d_part1));
    gpu().add(f(d_part), f(d_part0), f(d_part1), 2 * N);
    for (const int64_t off : {int64_t{0}, half}) {
      gpu().norm_backward_from_partials(op, shard, full, f(d_part), at(d_dx, off), false,
                                        weight ? at(d_dw, off) : nullptr,
                                        bias ? at(d_db, off) : nullptr, at(d_dy, off), at(d_x, off),
                                        weight ? at(d_w, off) : nullptr, f(d_mean), f(d_rstd));
    }
    EXPECT_TRUE(view_matches(get<float>(d_dx, dx.size()), dx, N, full, ld_in, 0, f32_rtol(full)))
        << "dinp";
    if (weight) {
      EXPECT_TRUE(matches(get<float>(d_dw, full), dw, f32_rtol(N))) << "dw";
    }
    if (bias) {
      EXPECT_TRUE(matches(get<float>(d_db, full), db, f32_rtol(N))) << "db";
    }
  }
}

// ---- attention.h ----

// lse[(b * H + h) * T + t] = log sum_{u <= t} exp(scale[h] q_t . k_u), in double.
std::vector<float> reference_lse(const AttentionShape& s, const float* q, const float* k,
                                 const std::vector<float>& scale) {
  std::vector<float> lse(s.B * s.H * s.T);
  std::vector<double> x(s.T);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int64_t t = 0; t < s.T; ++t) {
        double mx = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (int64_t d = 0; d < s.D; ++d) {
            dot += static_cast<double>(q[(b * s.T + t) * s.ldq + h * s.D + d]) *
                   k[(b * s.T + u) * s.ldk + h * s.D + d];
          }
          x[u] = scale[h] * dot;
          mx = std::max(mx, x[u]);
        }
        double sum = 0.0;
        for (int64_t u = 0; u <= t; ++u) sum += std::exp(x[u] - mx);
        lse[(b * s.H + h) * s.T + t] = static_cast<float>(mx + std::log(sum));
      }
    }
  }
  return lse;
}

// q, k, v as views of one fused qkv buffer (rows of 3HD + 8: columns no view covers), out in rows
// of HD + 5; T = 45 is not a multiple of the fused kernel's 32-row tile; per-head scales. Bounds
// as the fused kernel's own test (attention_test.cc): out, lse and dq/dk/dv sum over up to T keys
// (f32_rtol(T)), max |logit| is a dot product of D terms, dscale sums B * T * T / 2 terms.
TEST_F(ExecContextTest, AttentionMatchesCpu) {
  for (const int64_t D : {int64_t{24}, int64_t{64}}) {
    const int64_t B = 2, T = 45, H = 3, HD = H * D, N = B * T;
    const int64_t ld = 3 * HD + 8, ldo = HD + 5;
    SCOPED_TRACE("D=" + std::to_string(D));
    const AttentionShape s{B, T, H, D, ld, ld, ld, ldo, /*threads=*/0};
    const int64_t size = N * ld, out_size = N * ldo;
    const auto qkv = random_vec(size, -1, 1, 400 + static_cast<uint32_t>(D));
    const auto dout = random_vec(out_size, -1, 1, 401);
    std::vector<float> scale = random_vec(H, 0.5f, 2.0f, 402);
    for (float& x : scale) x /= std::sqrt(static_cast<float>(D));
    const auto dscale0 = random_vec(H, -1, 1, 403);  // dscale accumulates (+=)
    const float* q = qkv.data();
    const float* k = qkv.data() + HD;
    const float* v = qkv.data() + 2 * HD;

    // The CPU reference buffers start at zero (its GEMMs may read C with beta 0); only the GPU's
    // are poisoned, and only the views are compared.
    std::vector<float> out(out_size, 0.0f), saved(cpu().attention_saved_elems(s));
    float mal = NAN;
    cpu().attention_forward(s, out.data(), saved.data(), q, k, v, scale.data(), &mal);
    std::vector<float> dqkv(size, 0.0f), dscale = dscale0;
    std::vector<float> ws(cpu().attention_workspace_elems(s));
    cpu().attention_backward(s, dqkv.data(), dqkv.data() + HD, dqkv.data() + 2 * HD, dscale.data(),
                             dout.data(), out.data(), saved.data(), q, k, v, scale.data(),
                             ws.data());

    // The CUDA context saves the log-sum-exp [B, H, T] and needs no workspace.
    ASSERT_EQ(gpu().attention_saved_elems(s), B * H * T);
    const int64_t ws_elems = gpu().attention_workspace_elems(s);
    ASSERT_GE(ws_elems, 0);
    DeviceBuffer d_qkv = up(qkv), d_dout = up(dout), d_scale = up(scale);
    DeviceBuffer d_dscale = up(dscale0);
    DeviceBuffer d_out = poisoned<float>(out_size), d_saved = poisoned<float>(B * H * T);
    DeviceBuffer d_mal = poisoned<float>(1), d_dqkv = poisoned<float>(size);
    DeviceBuffer d_ws = poisoned<float>(static_cast<size_t>(std::max<int64_t>(ws_elems, 1)));
    gpu().attention_forward(s, f(d_out), f(d_saved), f(d_qkv), f(d_qkv) + HD, f(d_qkv) + 2 * HD,
                            f(d_scale), f(d_mal));
    gpu().attention_backward(s, f(d_dqkv), f(d_dqkv) + HD, f(d_dqkv) + 2 * HD, f(d_dscale),
                             f(d_dout), f(d_out), f(d_saved), f(d_qkv), f(d_qkv) + HD,
                             f(d_qkv) + 2 * HD, f(d_scale), ws_elems > 0 ? f(d_ws) : nullptr);

    EXPECT_TRUE(view_matches(get<float>(d_out, out_size), out, N, HD, ldo, 0, f32_rtol(T)))
        << "out";
    EXPECT_TRUE(matches(get<float>(d_saved, B * H * T), reference_lse(s, q, k, scale), f32_rtol(T)))
        << "saved lse";
    EXPECT_TRUE(matches(get<float>(d_mal, 1), {mal}, f32_rtol(D))) << "max_abs_logit";
    const auto g_dqkv = get<float>(d_dqkv, size);
    // Each gradient view alone (the others' columns are also written, so compare per view and
    // check the 8 columns past 3HD separately).
    for (int i = 0; i < 3; ++i) {
      std::vector<float> g, c;
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < HD; ++j) {
          g.push_back(g_dqkv[n * ld + i * HD + j]);
          c.push_back(dqkv[n * ld + i * HD + j]);
        }
      }
      EXPECT_TRUE(matches(g, c, f32_rtol(T))) << "d"
                                              << "qkv"[i];
    }
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 3 * HD; j < ld; ++j) {
        EXPECT_TRUE(std::isnan(g_dqkv[n * ld + j])) << "wrote outside dq/dk/dv at row " << n;
      }
    }
    EXPECT_TRUE(matches(get<float>(d_dscale, H), dscale, f32_rtol(B * T * T / 2))) << "dscale";
  }
}

TEST_F(ExecContextTest, AttentionScalesAndScaleGradMatchCpuBitwise) {
  const int64_t H = 300;
  const float def = 1.0f / std::sqrt(96.0f);
  const auto gain = random_vec(H, 0.5f, 20.0f, 410);
  auto dscale = random_vec(H, -1, 1, 411);
  for (int64_t h = 0; h < H; h += 3) dscale[h] *= 1e4f;  // a different addition order would show
  const auto grad0 = random_vec(H, -2, 2, 412);
  DeviceBuffer d_gain = up(gain), d_dscale = up(dscale);
  for (int mode = 0; mode < 3; ++mode) {  // no gain (1/sqrt(D)), per-head gain, shared gain
    const bool shared = mode == 2;
    std::vector<float> out(H);
    cpu().attention_scales(out.data(), mode == 0 ? nullptr : gain.data(), H, shared, def);
    DeviceBuffer d_out = poisoned<float>(H);
    gpu().attention_scales(f(d_out), mode == 0 ? nullptr : f(d_gain), H, shared, def);
    EXPECT_TRUE(identical(get<float>(d_out, H), out)) << "mode " << mode;
  }
  for (const bool shared : {false, true}) {
    const int64_t G = shared ? 1 : H;
    std::vector<float> grad(grad0.begin(), grad0.begin() + G);
    cpu().scale_grad_accumulate(grad.data(), dscale.data(), H, shared);
    DeviceBuffer d_grad = poisoned<float>(G + 1);  // one guard element stays poisoned
    ctx().copy_to_device(d_grad.data(), grad0.data(), G * sizeof(float));
    gpu().scale_grad_accumulate(f(d_grad), f(d_dscale), H, shared);
    const auto got = get<float>(d_grad, G + 1);
    EXPECT_TRUE(identical(std::vector<float>(got.begin(), got.begin() + G), grad)) << shared;
    EXPECT_TRUE(std::isnan(got[G])) << "wrote past the gradient, shared " << shared;
  }
}

// ---- rope.h ----

// q inside packed qkv rows (row_stride 3HD + 4): out of place (the other columns of y keep their
// poison) and in place, forward and backward; two host tables of equal dims but different theta
// in turn, so a device copy cached by address alone, or reused for the wrong table, fails.
TEST_F(ExecContextTest, RopeMatchesCpuInStridedRowsForEachHostTable) {
  const int64_t B = 2, T = 19, H = 3, D = 16, HD = H * D, stride = 3 * HD + 4;
  const auto table_a = std::make_unique<kernels::RopeTable>(kernels::make_rope_table(32, D, 1e4));
  const auto table_b = std::make_unique<kernels::RopeTable>(kernels::make_rope_table(32, D, 50.0));
  const auto x = random_vec(B * T * stride, -2, 2, 420);
  DeviceBuffer d_x = up(x);
  for (int rep = 0; rep < 2; ++rep) {  // the second pass runs from the cached device tables
    for (const kernels::RopeTable* table : {table_a.get(), table_b.get()}) {
      SCOPED_TRACE(std::string(table == table_a.get() ? "theta 1e4" : "theta 50") + " rep " +
                   std::to_string(rep));
      std::vector<float> y(x.size(), 0.0f), dx(x.size(), 0.0f);  // the GPU's are poisoned
      cpu().rope_forward(*table, y.data(), x.data(), B, T, H, D, stride);
      cpu().rope_backward(*table, dx.data(), x.data(), B, T, H, D, stride);
      DeviceBuffer d_y = poisoned<float>(x.size()), d_dx = poisoned<float>(x.size());
      gpu().rope_forward(*table, f(d_y), f(d_x), B, T, H, D, stride);
      gpu().rope_backward(*table, f(d_dx), f(d_x), B, T, H, D, stride);
      EXPECT_TRUE(view_matches(get<float>(d_y, x.size()), y, B * T, HD, stride, 0, 1e-6))
          << "forward";
      EXPECT_TRUE(view_matches(get<float>(d_dx, x.size()), dx, B * T, HD, stride, 0, 1e-6))
          << "backward";
      // In place: y == x; the columns outside q keep x's values.
      std::vector<float> yi = x;
      cpu().rope_forward(*table, yi.data(), yi.data(), B, T, H, D, stride);
      DeviceBuffer d_yi = up(x);
      gpu().rope_forward(*table, f(d_yi), f(d_yi), B, T, H, D, stride);
      EXPECT_TRUE(matches(get<float>(d_yi, x.size()), yi, 1e-6)) << "in place";
    }
  }
}

// ---- embedding.h ----

TEST_F(ExecContextTest, EmbeddingsMatchCpuWithOutOfShardTokens) {
  // This rank holds vocab rows [100, 150); tokens span [80, 170), so some fall in other shards
  // (zero rows forward, no gradient), and repeat (the backward's sums per row).
  const int64_t N = 64, C = 40, v_begin = 100, V_local = 50, B = 4, T = 16;
  std::mt19937 gen(430);
  std::uniform_int_distribution<int32_t> tok(80, 169);
  std::vector<int32_t> tokens(N);
  for (auto& t : tokens) t = tok(gen);
  ASSERT_TRUE(std::any_of(tokens.begin(), tokens.end(), [&](int32_t t) { return t < v_begin; }));
  ASSERT_TRUE(
      std::any_of(tokens.begin(), tokens.end(), [&](int32_t t) { return t >= v_begin + V_local; }));
  const auto wte = random_vec(V_local * C, -1, 1, 431), wpe = random_vec(T * C, -1, 1, 432);
  const auto dout = random_vec(N * C, -1, 1, 433), dwte0 = random_vec(V_local * C, -1, 1, 434);
  const auto dwpe0 = random_vec(T * C, -1, 1, 435);
  std::vector<float> out(N * C), dwte = dwte0, dwpe = dwpe0;
  cpu().embedding_forward(out.data(), tokens.data(), N, wte.data(), v_begin, V_local, C);
  std::vector<float> out_pos = out;
  cpu().position_forward(out_pos.data(), wpe.data(), B, T, C);  // +=
  cpu().embedding_backward(dwte.data(), dout.data(), tokens.data(), N, v_begin, V_local, C);
  cpu().position_backward(dwpe.data(), dout.data(), B, T, C);

  DeviceBuffer d_tokens = up(tokens), d_wte = up(wte), d_wpe = up(wpe), d_dout = up(dout);
  DeviceBuffer d_out = poisoned<float>(N * C), d_dwte = up(dwte0), d_dwpe = up(dwpe0);
  gpu().embedding_forward(f(d_out), d_tokens.as<int32_t>(), N, f(d_wte), v_begin, V_local, C);
  EXPECT_TRUE(identical(get<float>(d_out, N * C), out)) << "embedding_forward";  // copies
  gpu().position_forward(f(d_out), f(d_wpe), B, T, C);
  EXPECT_TRUE(identical(get<float>(d_out, N * C), out_pos)) << "position_forward";
  // Both backwards sum in the CPU's order (cuda/ops.h): bitwise equal.
  gpu().embedding_backward(f(d_dwte), f(d_dout), d_tokens.as<int32_t>(), N, v_begin, V_local, C);
  gpu().position_backward(f(d_dwpe), f(d_dout), B, T, C);
  EXPECT_TRUE(identical(get<float>(d_dwte, dwte.size()), dwte)) << "embedding_backward";
  EXPECT_TRUE(identical(get<float>(d_dwpe, dwpe.size()), dwpe)) << "position_backward";
}

// ---- cross_entropy.h ----

// A vocab shard [v_begin, v_begin + V_local) whose last columns are padding (v_valid < V_local),
// targets partly in other shards. Each phase from the same inputs on both sides; bounds as
// ops_test.cc's cross-entropy test (sum-exp sums v_valid terms).
TEST_F(ExecContextTest, CrossEntropyPhasesMatchCpuWithPaddingColumns) {
  const int64_t N = 41, V_local = 333, v_valid = 300, v_begin = 900;
  const float grad_scale = 1.0f / N, z_coef = 1e-4f;
  auto logits = random_vec(N * V_local, -4, 4, 440);
  for (int64_t n = 0; n < N; n += 7) logits[n * V_local + n] += 12.0f;  // some peaked rows
  for (int64_t n = 0; n < N; ++n) {  // padding holds the largest values: excluding it matters
    for (int64_t c = v_valid; c < V_local; ++c) logits[n * V_local + c] = 30.0f + c % 3;
  }
  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) {
    targets[n] = static_cast<int32_t>(n % 5 == 0 ? n * 13 : v_begin + (n * 37) % v_valid);
  }
  std::vector<float> mx(N), se(N), tl(N), lse(N), dlogits(N * V_local);
  double sums[3];
  cpu().xent_row_max(logits.data(), N, V_local, v_valid, mx.data());
  cpu().xent_row_sumexp(logits.data(), mx.data(), N, V_local, v_valid, se.data());
  cpu().xent_target_logit(logits.data(), targets.data(), N, V_local, v_begin, tl.data());
  cpu().xent_finish(mx.data(), se.data(), tl.data(), N, lse.data(), sums);
  cpu().xent_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V_local,
                      v_valid, v_begin, grad_scale, z_coef);

  DeviceBuffer d_logits = up(logits), d_targets = up(targets);
  DeviceBuffer d_mx = poisoned<float>(N), d_se = poisoned<float>(N), d_tl = poisoned<float>(N);
  gpu().xent_row_max(f(d_logits), N, V_local, v_valid, f(d_mx));
  gpu().xent_target_logit(f(d_logits), d_targets.as<int32_t>(), N, V_local, v_begin, f(d_tl));
  EXPECT_TRUE(identical(get<float>(d_mx, N), mx)) << "row_max";
  EXPECT_TRUE(identical(get<float>(d_tl, N), tl)) << "target_logit";
  DeviceBuffer d_cpu_mx = up(mx);
  gpu().xent_row_sumexp(f(d_logits), f(d_cpu_mx), N, V_local, v_valid, f(d_se));
  EXPECT_TRUE(matches(get<float>(d_se, N), se, f32_rtol(v_valid))) << "row_sumexp";
  // The fused form is the two calls, bitwise (the GPU's own max feeds its sum-exp in both).
  DeviceBuffer d_se2 = poisoned<float>(N);
  gpu().xent_row_sumexp(f(d_logits), f(d_mx), N, V_local, v_valid, f(d_se2));
  DeviceBuffer d_mx3 = poisoned<float>(N), d_se3 = poisoned<float>(N);
  gpu().xent_row_max_sumexp(f(d_logits), N, V_local, v_valid, f(d_mx3), f(d_se3));
  EXPECT_TRUE(identical(get<float>(d_mx3, N), mx)) << "row_max_sumexp max";
  EXPECT_TRUE(identical(get<float>(d_se3, N), get<float>(d_se2, N))) << "row_max_sumexp sum-exp";

  // The finish from the CPU's statistics: the same per-row double formula, sums in another
  // order (double rounding only). sums are device doubles.
  DeviceBuffer d_cpu_se = up(se), d_cpu_tl = up(tl), d_lse = poisoned<float>(N);
  DeviceBuffer d_sums = poisoned<double>(3);
  gpu().xent_finish(f(d_cpu_mx), f(d_cpu_se), f(d_cpu_tl), N, f(d_lse), d_sums.as<double>());
  EXPECT_TRUE(matches(get<float>(d_lse, N), lse, f32_rtol(1))) << "lse";
  const auto g_sums = get<double>(d_sums, 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(g_sums[i], sums[i], 1e-12 * std::abs(sums[i])) << "sum " << i;
  }

  DeviceBuffer d_cpu_lse = up(lse), d_dlogits = poisoned<float>(N * V_local);
  gpu().xent_backward(f(d_dlogits), f(d_logits), f(d_cpu_lse), d_targets.as<int32_t>(), N, V_local,
                      v_valid, v_begin, grad_scale, z_coef);
  const auto g_dlogits = get<float>(d_dlogits, dlogits.size());
  EXPECT_TRUE(matches(g_dlogits, dlogits, f32_rtol(v_valid))) << "backward";

  // The fused pass, in place as the GPT runs it: the separate calls' statistics and gradient,
  // bitwise (the separate backward from the GPU's own statistics and finish).
  DeviceBuffer d_sep_mx = poisoned<float>(N), d_sep_se = poisoned<float>(N);
  DeviceBuffer d_sep_lse = poisoned<float>(N), d_sep_d = poisoned<float>(N * V_local);
  DeviceBuffer d_sums2 = poisoned<double>(3);
  gpu().xent_row_max_sumexp(f(d_logits), N, V_local, v_valid, f(d_sep_mx), f(d_sep_se));
  gpu().xent_finish(f(d_sep_mx), f(d_sep_se), f(d_cpu_tl), N, f(d_sep_lse), d_sums2.as<double>());
  gpu().xent_backward(f(d_sep_d), f(d_logits), f(d_sep_lse), d_targets.as<int32_t>(), N, V_local,
                      v_valid, v_begin, grad_scale, z_coef);
  DeviceBuffer d_inplace = up(logits), d_f_mx = poisoned<float>(N), d_f_se = poisoned<float>(N);
  gpu().xent_fused(f(d_inplace), f(d_inplace), d_targets.as<int32_t>(), N, V_local, v_valid,
                   v_begin, grad_scale, z_coef, f(d_f_mx), f(d_f_se));
  EXPECT_TRUE(identical(get<float>(d_f_mx, N), get<float>(d_sep_mx, N))) << "fused row max";
  EXPECT_TRUE(identical(get<float>(d_f_se, N), get<float>(d_sep_se, N))) << "fused sum-exp";
  EXPECT_TRUE(identical(get<float>(d_inplace, N * V_local), get<float>(d_sep_d, N * V_local)))
      << "fused gradient";
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = v_valid; c < V_local; ++c) {
      ASSERT_EQ(g_dlogits[n * V_local + c], 0.0f) << "padding column " << c << " of row " << n;
    }
  }
}

// ---- adamw.h ----

TEST_F(ExecContextTest, AdamWMatchesCpu) {
  const int64_t n = 10007;
  const auto p0 = random_vec(n, -1, 1, 450), g = random_vec(n, -2, 2, 451);
  const auto m0 = random_vec(n, -0.1f, 0.1f, 452), v0 = random_vec(n, 1e-4f, 1e-2f, 453);
  const kernels::AdamWStep step{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, 3};
  std::vector<float> p = p0, m = m0, v = v0;
  cpu().adamw_update(p.data(), g.data(), m.data(), v.data(), n, step);
  DeviceBuffer d_p = up(p0), d_g = up(g), d_m = up(m0), d_v = up(v0);
  gpu().adamw_update(f(d_p), f(d_g), f(d_m), f(d_v), n, step);
  // Element-wise in the CPU's expression order: FMA contraction and sqrt/div rounding only.
  EXPECT_TRUE(matches(get<float>(d_p, n), p, 1e-6)) << "param";
  EXPECT_TRUE(matches(get<float>(d_m, n), m, 1e-6)) << "m";
  EXPECT_TRUE(matches(get<float>(d_v, n), v, 1e-6)) << "v";
}

// ---- the context itself ----

TEST_F(ExecContextTest, DescribesItsDeviceAndSynchronizes) {
  EXPECT_EQ(gpu().device(), Device::kCuda);
  EXPECT_EQ(gpu().threads(), 1);
  const std::string d = gpu().describe();
  EXPECT_EQ(d.rfind("CUDA 0: ", 0), 0u) << d;
  EXPECT_GT(d.size(), std::string("CUDA 0: ").size()) << d;  // the device's name follows
  // synchronize() after enqueued work returns without error (that it waits cannot be observed
  // from here: the download below waits on the stream by itself).
  const auto a = random_vec(1000, -1, 1, 460);
  DeviceBuffer d_a = up(a), d_out = poisoned<float>(1000);
  gpu().add(f(d_out), f(d_a), f(d_a), 1000);
  gpu().synchronize();
  std::vector<float> twice(1000);
  for (size_t i = 0; i < a.size(); ++i) twice[i] = a[i] + a[i];
  EXPECT_TRUE(identical(get<float>(d_out, 1000), twice));
}

// Registers the factory for one test and restores the registry after it.
class ExecContextFactoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    had_factory_ = kernels::has_exec_factory(Device::kCuda);
    cuda::register_cuda_exec_factory();
  }
  void TearDown() override {
    if (!had_factory_) kernels::set_exec_factory(Device::kCuda, nullptr);
  }

 private:
  bool had_factory_ = false;
};

// Needs no GPU: registering works anywhere, and the device count is the runtime's (0 here
// without a GPU, so AUTO falls back to the CPU and asking for CUDA is a config error).
TEST_F(ExecContextFactoryTest, RegistersWithTheRuntimeDeviceCount) {
  EXPECT_TRUE(kernels::has_exec_factory(Device::kCuda));
  EXPECT_EQ(kernels::exec_device_count(Device::kCuda), cuda::device_count());
  if (cuda::device_count() == 0) {
    EXPECT_EQ(kernels::resolve_device("AUTO"), Device::kCpu);
    try {
      kernels::make_exec(Device::kCuda, 0);
      ADD_FAILURE() << "make_exec(CUDA) without a GPU did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    }
  } else {
    EXPECT_EQ(kernels::resolve_device("AUTO"), Device::kCuda);
  }
}

TEST_F(ExecContextFactoryTest, MakeExecGivesACudaContextWhoseTensorsLiveOnTheGpu) {
  if (cuda::device_count() == 0) {
    GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
  }
  std::unique_ptr<ExecContext> exec = kernels::make_exec(Device::kCuda, 0);
  ASSERT_NE(exec, nullptr);
  EXPECT_EQ(exec->device(), Device::kCuda);
  auto* cuda_exec = dynamic_cast<cuda::CudaExec*>(exec.get());
  ASSERT_NE(cuda_exec, nullptr) << "the factory did not make a CudaExec";
  // A device index past the machine's GPUs is a config error naming it.
  EXPECT_THROW(kernels::make_exec(Device::kCuda, cuda::device_count()), Error);
  // Device::kCuda tensors come from this context's allocator (its Context is the registered
  // memory backend) and its kernels run on them.
  const int64_t n = 4099;
  const int64_t before = cuda_exec->context().allocator().stats().bytes_in_use;
  Tensor a = Tensor::zeros({n}, DType::kF32, Device::kCuda);
  Tensor b = Tensor::zeros({n}, DType::kF32, Device::kCuda);
  Tensor out = Tensor::zeros({n}, DType::kF32, Device::kCuda);
  EXPECT_GE(cuda_exec->context().allocator().stats().bytes_in_use,
            before + 3 * n * static_cast<int64_t>(sizeof(float)));
  EXPECT_EQ(out.device(), Device::kCuda);
  const auto ha = random_vec(n, -1, 1, 470), hb = random_vec(n, -1, 1, 471);
  a.copy_from_host(0, n, ha.data());
  b.copy_from_host(0, n, hb.data());
  exec->add(out.f32(), a.f32(), b.f32(), n);
  std::vector<float> got(n), ref(n);
  out.copy_to_host(0, n, got.data());
  kernels::cpu_exec().add(ref.data(), ha.data(), hb.data(), n);
  EXPECT_TRUE(identical(got, ref));
}

}  // namespace
}  // namespace keel::gpu_test
