// The BF16 precision of the CUDA execution context (Note [cuda-exec-bf16]): matrix products and
// attention round their fp32 inputs to bf16 and accumulate in fp32. Reference: the CPU context
// on the same inputs rounded to bf16 on the host, so the only differences left are the order of
// the fp32 sums (bf16_in_f32_out_rtol) and, for attention, the bf16 rounding of the output and of
// the probabilities inside the fused kernel (kBf16Rtol element-wise; gradients of q, k and the
// scale by relative norm, 2e-2, because the softmax backward's row term comes from the rounded
// output: Note in cuda/attention.h). Activations stored in bf16 (Note [act-dtype]): the GEMM's
// bf16 output and bf16 operands, the loss phases on bf16 logits, and the producers' bf16 outputs
// (norms, GELU, GLU, attention) bitwise equal to their fp32 outputs rounded. Then one whole GPT
// step in BF16 against the CPU's fp32 step: loss within 1e-2 relative, gradient arena within 5e-2
// relative norm. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/exec_context.h"
#include "framework/tensor.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using kernels::AttentionShape;
using kernels::ExecContext;
using kernels::Precision;

double rel_norm_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// A bf16 device tensor holding `host` rounded to bf16; one of n bf16 NaNs.
Tensor dev_bf16(const std::vector<float>& host) {
  Tensor t = Tensor::zeros({static_cast<int64_t>(host.size())}, DType::kBF16, Device::kCuda);
  const std::vector<Bf16> bits = to_bf16(host);
  t.copy_from_host(0, t.numel(), bits.data());
  return t;
}
Tensor poisoned_bf16(int64_t n) {
  return dev_bf16(std::vector<float>(static_cast<size_t>(n), std::nanf("")));
}
std::vector<float> host_bf16(const Tensor& t) {
  std::vector<Bf16> bits(static_cast<size_t>(t.numel()));
  t.copy_to_host(0, t.numel(), bits.data());
  return from_bf16(bits);
}

// Columns [which * cols, (which + 1) * cols) of `rows` rows of stride ld, as dense rows.
std::vector<float> column_block(const std::vector<float>& v, int64_t rows, int64_t ld, int which,
                                int64_t cols) {
  std::vector<float> r;
  for (int64_t row = 0; row < rows; ++row) {
    const float* p = v.data() + row * ld + which * cols;
    r.insert(r.end(), p, p + cols);
  }
  return r;
}

class Bf16ExecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
    }
    exec_ = std::make_unique<cuda::CudaExec>(0);
    exec_->set_precision(Precision::kBf16);
  }
  ExecContext& gpu() { return *exec_; }
  ExecContext& cpu() { return kernels::cpu_exec(); }

  // A device tensor holding `host`; a poisoned (NaN) one of n floats.
  Tensor dev(const std::vector<float>& host) {
    Tensor t = Tensor::zeros({static_cast<int64_t>(host.size())}, DType::kF32, Device::kCuda);
    t.copy_from_host(0, t.numel(), host.data());
    return t;
  }
  Tensor poisoned(int64_t n) {
    return dev(std::vector<float>(static_cast<size_t>(n), std::nanf("")));
  }
  static std::vector<float> host(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    t.copy_to_host(0, t.numel(), v.data());
    return v;
  }

  std::unique_ptr<cuda::CudaExec> exec_;
};

TEST_F(Bf16ExecTest, LinearForwardRoundsInputsAccumulatesInFp32) {
  const int64_t N = 96, IC = 320, OC = 192;
  const auto x = random_vec(N * IC, -1.0f, 1.0f, 1), w = random_vec(OC * IC, -0.5f, 0.5f, 2);
  const auto b = random_vec(OC, -0.3f, 0.3f, 3);
  Tensor dx = dev(x), dw = dev(w), db = dev(b), dout = poisoned(N * OC);
  gpu().linear_forward(dout.f32(), dx.f32(), dw.f32(), db.f32(), N, IC, OC);
  std::vector<float> ref(N * OC);
  const auto xr = bf16_rounded(x), wr = bf16_rounded(w);
  cpu().linear_forward(ref.data(), xr.data(), wr.data(), b.data(), N, IC, OC);
  EXPECT_TRUE(matches(host(dout), ref, bf16_in_f32_out_rtol(IC)));
}

// fp32 operands are rounded to bf16; bf16 ones (Note [act-dtype]) are those roundings already:
// the same gradients either way. The bias gradient sums dout as stored (fp32 or bf16).
TEST_F(Bf16ExecTest, LinearBackwardAccumulatesFp32Gradients) {
  const int64_t N = 80, IC = 256, OC = 160;
  const auto x = random_vec(N * IC, -1.0f, 1.0f, 4), w = random_vec(OC * IC, -0.5f, 0.5f, 5);
  const auto g = random_vec(N * OC, -1.0f, 1.0f, 6);
  const auto dx0 = random_vec(N * IC, -0.2f, 0.2f, 7), dw0 = random_vec(OC * IC, -0.2f, 0.2f, 8);
  const auto db0 = random_vec(OC, -0.2f, 0.2f, 9);
  const auto xr = bf16_rounded(x), wr = bf16_rounded(w), gr = bf16_rounded(g);
  for (const bool bf16_operands : {false, true}) {
    SCOPED_TRACE(bf16_operands ? "bf16 dout and inp" : "fp32 dout and inp");
    Tensor tx = bf16_operands ? dev_bf16(x) : dev(x), tg = bf16_operands ? dev_bf16(g) : dev(g);
    Tensor tw = dev(w), tdx = dev(dx0), tdw = dev(dw0), tdb = dev(db0);
    gpu().linear_backward(tdx.f32(), /*accumulate_dinp=*/true, tdw.f32(), tdb.f32(),
                          kernels::act(tg), kernels::act(tx), tw.f32(), N, IC, OC);
    auto dx = dx0, dw = dw0, db = db0;
    cpu().linear_backward(dx.data(), true, dw.data(), nullptr, gr.data(), xr.data(), wr.data(), N,
                          IC, OC);
    cpu().linear_backward(nullptr, false, nullptr, db.data(), bf16_operands ? gr.data() : g.data(),
                          x.data(), w.data(), N, IC, OC);
    EXPECT_TRUE(matches(host(tdx), dx, bf16_in_f32_out_rtol(OC))) << "dinp";
    EXPECT_TRUE(matches(host(tdw), dw, bf16_in_f32_out_rtol(N))) << "dweight";
    EXPECT_TRUE(matches(host(tdb), db, f32_rtol(N))) << "dbias";
  }
}

TEST_F(Bf16ExecTest, AttentionOnPackedQkvMatchesCpuOnRoundedInputs) {
  for (const int64_t D : {int64_t{32}, int64_t{64}}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const int64_t B = 2, T = 48, H = 3, HD = H * D, BT = B * T;
    // q, k, v packed in rows of 3 HD, as the QKV projection writes them; out rows of HD.
    const auto qkv = random_vec(BT * 3 * HD, -1.0f, 1.0f, 10 + static_cast<uint32_t>(D));
    const auto scale = random_vec(H, 0.1f, 0.3f, 11);
    const AttentionShape s{B, T, H, D, 3 * HD, 3 * HD, 3 * HD, HD, 0};
    Tensor tqkv = dev(qkv), tscale = dev(scale), tout = poisoned(BT * HD);
    Tensor tsaved = poisoned(gpu().attention_saved_elems(s)), tmax = poisoned(1);
    const float* q = tqkv.f32();
    gpu().attention_forward(s, tout.f32(), tsaved.f32(), q, q + HD, q + 2 * HD, tscale.f32(),
                            tmax.f32());
    const auto qr = bf16_rounded(qkv);
    std::vector<float> out(BT * HD), saved(cpu().attention_saved_elems(s)), mx(1);
    cpu().attention_forward(s, out.data(), saved.data(), qr.data(), qr.data() + HD,
                            qr.data() + 2 * HD, scale.data(), mx.data());
    EXPECT_TRUE(matches(host(tout), out, kBf16Rtol)) << "out";
    EXPECT_TRUE(matches(host(tmax), mx, bf16_in_f32_out_rtol(D))) << "max |logit|";

    // Backward: dq, dk, dv into a packed dqkv, dscale accumulating onto a prefilled value.
    const auto dout = random_vec(BT * HD, -1.0f, 1.0f, 12);
    const auto ds0 = random_vec(H, -0.1f, 0.1f, 13);
    Tensor tdout = dev(dout), tdqkv = poisoned(BT * 3 * HD), tds = dev(ds0);
    Tensor tws = poisoned(std::max<int64_t>(1, gpu().attention_workspace_elems(s)));
    float* dq = tdqkv.f32();
    gpu().attention_backward(s, dq, dq + HD, dq + 2 * HD, tds.f32(), tdout.f32(), tout.f32(),
                             tsaved.f32(), q, q + HD, q + 2 * HD, tscale.f32(), tws.f32());
    const auto doutr = bf16_rounded(dout);
    std::vector<float> dqkv(BT * 3 * HD), ds = ds0;
    AttentionShape sc = s;
    sc.threads = 1;
    std::vector<float> ws(cpu().attention_workspace_elems(sc));
    cpu().attention_backward(sc, dqkv.data(), dqkv.data() + HD, dqkv.data() + 2 * HD, ds.data(),
                             doutr.data(), out.data(), saved.data(), qr.data(), qr.data() + HD,
                             qr.data() + 2 * HD, scale.data(), ws.data());
    const auto g = host(tdqkv);
    auto part = [&](const std::vector<float>& v, int which) {
      return column_block(v, BT, 3 * HD, which, HD);
    };
    for (const float x : g) ASSERT_FALSE(std::isnan(x)) << "an unwritten gradient element";
    EXPECT_LT(rel_norm_err(part(g, 0), part(dqkv, 0)), 2e-2) << "dq";
    EXPECT_LT(rel_norm_err(part(g, 1), part(dqkv, 1)), 2e-2) << "dk";
    EXPECT_TRUE(matches(part(g, 2), part(dqkv, 2), kBf16Rtol)) << "dv";
    EXPECT_LT(rel_norm_err(host(tds), ds), 2e-2) << "dscale";
  }
}

// ---- Note [act-dtype]: activations stored in bf16 (the LM head's logits) ----

// The GEMM writes bf16 from its fp32 accumulators: one bf16 rounding of the CPU's fp32 product of
// the rounded inputs. Inputs fp32 (staged) or already bf16; with and without a bias.
TEST_F(Bf16ExecTest, LinearForwardWritesBf16Activations) {
  const int64_t N = 96, IC = 320, OC = 200;
  const auto x = random_vec(N * IC, -1.0f, 1.0f, 11), w = random_vec(OC * IC, -0.5f, 0.5f, 12);
  const auto b = random_vec(OC, -0.3f, 0.3f, 13);
  const auto xr = bf16_rounded(x), wr = bf16_rounded(w), br = bf16_rounded(b);
  Tensor tx = dev(x), txb = dev_bf16(x), tw = dev(w), tb = dev(b);
  for (const bool bias : {false, true}) {
    for (const bool inp_bf16 : {false, true}) {
      Tensor out = poisoned_bf16(N * OC);
      gpu().linear_forward(kernels::act(out), kernels::act(inp_bf16 ? txb : tx), tw.f32(),
                           bias ? tb.f32() : nullptr, N, IC, OC);
      std::vector<float> ref(N * OC);
      cpu().linear_forward(ref.data(), xr.data(), wr.data(), bias ? br.data() : nullptr, N, IC, OC);
      EXPECT_TRUE(matches(host_bf16(out), ref, kBf16Rtol))
          << "bias " << bias << ", bf16 input " << inp_bf16;
    }
  }
}

// A bf16 input gradient (attention's output gradient) is the bf16 rounding of the fp32 one: the
// GEMM rounds its fp32 accumulators once, as the staging of an fp32 dinp did. The weight and bias
// gradients are the fp32 path's, bitwise. Accumulating into bf16 is refused.
TEST_F(Bf16ExecTest, LinearBackwardWritesABf16InputGradient) {
  const int64_t N = 96, IC = 160, OC = 200;
  const auto x = random_vec(N * IC, -1.0f, 1.0f, 31), w = random_vec(OC * IC, -0.5f, 0.5f, 32);
  const auto dy = random_vec(N * OC, -1.0f, 1.0f, 33), g0 = random_vec(OC * IC, -0.1f, 0.1f, 34);
  const auto b0 = random_vec(OC, -0.1f, 0.1f, 35);
  Tensor tx = dev_bf16(x), tw = dev(w), tdy = dev(dy);
  Tensor dxf = poisoned(N * IC), dxb = poisoned_bf16(N * IC);
  Tensor gwf = dev(g0), gwb = dev(g0), gbf = dev(b0), gbb = dev(b0);
  gpu().linear_backward(dxf.f32(), false, gwf.f32(), gbf.f32(), tdy.f32(), kernels::act(tx),
                        tw.f32(), N, IC, OC);
  gpu().linear_backward(kernels::act(dxb), false, gwb.f32(), gbb.f32(), tdy.f32(), kernels::act(tx),
                        tw.f32(), N, IC, OC);
  EXPECT_TRUE(identical(host_bf16(dxb), bf16_rounded(host(dxf)))) << "dinp";
  EXPECT_TRUE(identical(host(gwb), host(gwf))) << "dweight";
  EXPECT_TRUE(identical(host(gbb), host(gbf))) << "dbias";
  EXPECT_THROW(gpu().linear_backward(kernels::act(dxb), true, nullptr, nullptr, tdy.f32(),
                                     kernels::act(tx), tw.f32(), N, IC, OC),
               Error);
}

// The loss phases on bf16 logits compute in fp32: the CPU's statistics of the rounded logits to
// fp32 accuracy; the gradient, written in place as the GPT does, one bf16 rounding of the CPU's.
TEST_F(Bf16ExecTest, CrossEntropyOnBf16Logits) {
  const int64_t N = 48, V_local = 300, v_valid = 290, v_begin = 256;
  auto logits = random_vec(N * V_local, -4, 4, 20);
  for (int64_t n = 0; n < N; n += 5) logits[n * V_local + n] += 12.0f;  // some peaked rows
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = v_valid; c < V_local; ++c) logits[n * V_local + c] = 30.0f + c % 3;  // padding
  }
  std::vector<int32_t> targets(N);
  for (int64_t n = 0; n < N; ++n) {
    // Most targets in this shard [v_begin, v_begin + v_valid), some in another rank's.
    targets[n] = static_cast<int32_t>(n % 7 == 3 ? 7 * n : v_begin + (n * 37) % v_valid);
  }
  const float grad_scale = 1.0f / static_cast<float>(N), z_coef = 1e-3f;
  const auto lr = bf16_rounded(logits);
  std::vector<float> mx(N), se(N), tl(N), lse(N), dlogits(N * V_local);
  std::vector<double> sums(3);
  cpu().xent_row_max(lr.data(), N, V_local, v_valid, mx.data());
  cpu().xent_row_sumexp(lr.data(), mx.data(), N, V_local, v_valid, se.data());
  cpu().xent_target_logit(lr.data(), targets.data(), N, V_local, v_begin, tl.data());
  cpu().xent_finish(mx.data(), se.data(), tl.data(), N, lse.data(), sums.data());
  cpu().xent_backward(dlogits.data(), lr.data(), lse.data(), targets.data(), N, V_local, v_valid,
                      v_begin, grad_scale, z_coef);

  Tensor tl_logits = dev_bf16(logits), t_mx = poisoned(N), t_se = poisoned(N), t_tl = poisoned(N);
  Tensor t_targets = Tensor::zeros({N}, DType::kI32, Device::kCuda);
  t_targets.copy_from_host(0, N, targets.data());
  Tensor t_sums = Tensor::zeros({3}, DType::kF64, Device::kCuda);
  const kernels::ActOut l = kernels::act(tl_logits);
  gpu().xent_row_max(l, N, V_local, v_valid, t_mx.f32());
  gpu().xent_row_sumexp(l, t_mx.f32(), N, V_local, v_valid, t_se.f32());
  gpu().xent_target_logit(l, t_targets.i32(), N, V_local, v_begin, t_tl.f32());
  EXPECT_TRUE(matches(host(t_mx), mx, f32_rtol(V_local))) << "row max";
  EXPECT_TRUE(matches(host(t_se), se, f32_rtol(V_local))) << "sum-exp";
  EXPECT_TRUE(matches(host(t_tl), tl, 0.0)) << "target logit (a widened bf16: exact)";
  Tensor t_mx2 = poisoned(N), t_se2 = poisoned(N);
  gpu().xent_row_max_sumexp(l, N, V_local, v_valid, t_mx2.f32(), t_se2.f32());
  EXPECT_TRUE(identical(host(t_mx2), host(t_mx))) << "fused row max";
  EXPECT_TRUE(identical(host(t_se2), host(t_se))) << "fused sum-exp";
  // The loss gradient in the same pass, in place on a copy of the bf16 logits.
  Tensor t_fused = dev_bf16(logits), t_mx3 = poisoned(N), t_se3 = poisoned(N);
  const kernels::ActOut lf = kernels::act(t_fused);
  gpu().xent_fused(lf, lf, t_targets.i32(), N, V_local, v_valid, v_begin, grad_scale, z_coef,
                   t_mx3.f32(), t_se3.f32());
  EXPECT_TRUE(identical(host(t_mx3), host(t_mx))) << "xent_fused row max";
  EXPECT_TRUE(identical(host(t_se3), host(t_se))) << "xent_fused sum-exp";
  gpu().xent_finish(t_mx.f32(), t_se.f32(), t_tl.f32(), N, t_se.f32(), t_sums.f64());
  gpu().xent_backward(l, l, t_se.f32(), t_targets.i32(), N, V_local, v_valid, v_begin, grad_scale,
                      z_coef);
  EXPECT_TRUE(matches(host(t_se), lse, f32_rtol(V_local))) << "log-sum-exp";
  EXPECT_TRUE(matches(host_bf16(tl_logits), dlogits, kBf16Rtol)) << "dlogits";
  EXPECT_TRUE(identical(host_bf16(t_fused), host_bf16(tl_logits))) << "xent_fused dlogits";
}

// A producer that writes bf16 (Note [act-dtype]) writes exactly the rounding of its fp32 output,
// which is what the matrix product (or attention) that reads it staged before: storing it in bf16
// changes no result. Norms (LayerNorm with bias, RMSNorm; also from split statistics), RoPE, GELU
// and both GLUs, and the backward of GELU and the GLUs with their bias sums (which sum the fp32
// values: the same bias gradients either way), bitwise.
TEST_F(Bf16ExecTest, Bf16OutputsAreTheRoundedFp32Outputs) {
  const int64_t N = 40, C = 96, n = N * C;
  const auto x = random_vec(n, -2.0f, 2.0f, 23), up = random_vec(n, -2.0f, 2.0f, 24);
  const auto w = random_vec(C, 0.5f, 1.5f, 25), b = random_vec(C, -0.2f, 0.2f, 26);
  Tensor tx = dev(x), tup = dev(up), tw = dev(w), tb = dev(b);
  Tensor mean = poisoned(N), rstd = poisoned(N);
  const kernels::NormShape ns{N, 1, C, C, C, C};
  for (const kernels::NormOp op : {kernels::NormOp::kLayer, kernels::NormOp::kRms}) {
    Tensor f = poisoned(n), h = poisoned_bf16(n);
    const float* bias = op == kernels::NormOp::kLayer ? tb.f32() : nullptr;
    gpu().norm_forward(op, ns, f.f32(), tx.f32(), tw.f32(), bias, mean.f32(), rstd.f32(), 1e-5f);
    gpu().norm_forward(op, ns, kernels::act(h), tx.f32(), tw.f32(), bias, mean.f32(), rstd.f32(),
                       1e-5f);
    EXPECT_TRUE(identical(host_bf16(h), bf16_rounded(host(f)))) << "norm " << static_cast<int>(op);
  }
  // The split form (PROJECTION-scope QK-norm under TP) from all-reduced statistics.
  Tensor stats = poisoned(2 * N);
  gpu().norm_partial_stats(ns, tx.f32(), stats.f32());
  for (const kernels::NormOp op : {kernels::NormOp::kLayer, kernels::NormOp::kRms}) {
    Tensor f = poisoned(n), h = poisoned_bf16(n);
    gpu().norm_forward_from_stats(op, ns, C, stats.f32(), f.f32(), tx.f32(), tw.f32(), tb.f32(),
                                  mean.f32(), rstd.f32(), 1e-5f);
    gpu().norm_forward_from_stats(op, ns, C, stats.f32(), kernels::act(h), tx.f32(), tw.f32(),
                                  tb.f32(), mean.f32(), rstd.f32(), 1e-5f);
    EXPECT_TRUE(identical(host_bf16(h), bf16_rounded(host(f))))
        << "norm from stats " << static_cast<int>(op);
  }
  {
    // RoPE out of place into bf16: N rows = 4 sequences of 10 positions, 3 heads of 32.
    const kernels::RopeTable table = kernels::make_rope_table(16, 32, 10000.0);
    Tensor f = poisoned(n), h = poisoned_bf16(n);
    gpu().rope_forward(table, f.f32(), tx.f32(), 4, 10, 3, 32, C);
    gpu().rope_forward(table, kernels::act(h), tx.f32(), 4, 10, 3, 32, C);
    EXPECT_TRUE(identical(host_bf16(h), bf16_rounded(host(f)))) << "rope";
  }
  Tensor f = poisoned(n), h = poisoned_bf16(n);
  gpu().gelu_forward(f.f32(), tx.f32(), n);
  gpu().gelu_forward(kernels::act(h), tx.f32(), n);
  EXPECT_TRUE(identical(host_bf16(h), bf16_rounded(host(f)))) << "gelu";
  for (const kernels::GluAct a : {kernels::GluAct::kSilu, kernels::GluAct::kGelu}) {
    Tensor gf = poisoned(n), gh = poisoned_bf16(n);
    gpu().glu_forward(a, gf.f32(), tx.f32(), tup.f32(), n);
    gpu().glu_forward(a, kernels::act(gh), tx.f32(), tup.f32(), n);
    EXPECT_TRUE(identical(host_bf16(gh), bf16_rounded(host(gf)))) << "glu " << static_cast<int>(a);
  }
  // Backward: dout from x, the pre-activations from up (and x for the GLUs' up input).
  const auto bias0 = random_vec(C, -1.0f, 1.0f, 30);
  {
    Tensor df = poisoned(n), dh = poisoned_bf16(n), bf = dev(bias0), bh = dev(bias0);
    gpu().gelu_backward(df.f32(), bf.f32(), tup.f32(), tx.f32(), N, C);
    gpu().gelu_backward(kernels::act(dh), bh.f32(), tup.f32(), tx.f32(), N, C);
    EXPECT_TRUE(identical(host_bf16(dh), bf16_rounded(host(df)))) << "gelu_backward";
    EXPECT_TRUE(identical(host(bh), host(bf))) << "gelu_backward dbias";
  }
  for (const kernels::GluAct a : {kernels::GluAct::kSilu, kernels::GluAct::kGelu}) {
    Tensor dgf = poisoned(n), duf = poisoned(n), dgh = poisoned_bf16(n), duh = poisoned_bf16(n);
    Tensor gbf = dev(bias0), ubf = dev(bias0), gbh = dev(bias0), ubh = dev(bias0);
    gpu().glu_backward(a, dgf.f32(), duf.f32(), gbf.f32(), ubf.f32(), tx.f32(), tup.f32(), tx.f32(),
                       N, C);
    gpu().glu_backward(a, kernels::act(dgh), kernels::act(duh), gbh.f32(), ubh.f32(), tx.f32(),
                       tup.f32(), tx.f32(), N, C);
    EXPECT_TRUE(identical(host_bf16(dgh), bf16_rounded(host(dgf)))) << "glu dgate";
    EXPECT_TRUE(identical(host_bf16(duh), bf16_rounded(host(duf)))) << "glu dup";
    EXPECT_TRUE(identical(host(gbh), host(gbf))) << "glu dgate_bias";
    EXPECT_TRUE(identical(host(ubh), host(ubf))) << "glu dup_bias";
  }
}

// Attention on bf16 operands: dense bf16 q and k (the QK-normalised ones a layer stores) and a
// bf16 output. The fp32 path rounds q and k to the same bf16 values and its output is a widened
// bf16, so both paths give the same output, maximum and gradients, bitwise, and gradients written
// in bf16 are those roundings.
TEST_F(Bf16ExecTest, AttentionOnBf16OperandsMatchesTheFp32Ones) {
  const int64_t B = 2, T = 32, H = 2, D = 32, HD = H * D, BT = B * T;
  const auto qkv = random_vec(BT * 3 * HD, -1.0f, 1.0f, 27);
  const auto scale = random_vec(H, 0.1f, 0.3f, 28);
  const auto dout = random_vec(BT * HD, -1.0f, 1.0f, 29);
  // Column block `which` (0 q, 1 k, 2 v) of rows of 3 HD, as dense rows of HD.
  auto part = [&](const std::vector<float>& v, int which) {
    return column_block(v, BT, 3 * HD, which, HD);
  };
  const AttentionShape sf{B, T, H, D, 3 * HD, 3 * HD, 3 * HD, HD, 0};
  const AttentionShape sb{B, T, H, D, HD, HD, 3 * HD, HD, 0};
  Tensor tqkv = dev(qkv), tscale = dev(scale), tdout = dev(dout);
  Tensor qb = dev_bf16(part(qkv, 0)), kb = dev_bf16(part(qkv, 1));
  const float* q = tqkv.f32();
  Tensor of = poisoned(BT * HD), ob = poisoned_bf16(BT * HD);
  Tensor saved_f = poisoned(gpu().attention_saved_elems(sf));
  Tensor saved_b = poisoned(gpu().attention_saved_elems(sb));
  Tensor mf = poisoned(1), mb = poisoned(1);
  gpu().attention_forward(sf, of.f32(), saved_f.f32(), q, q + HD, q + 2 * HD, tscale.f32(),
                          mf.f32());
  gpu().attention_forward(sb, kernels::act(ob), saved_b.f32(), kernels::act(qb), kernels::act(kb),
                          q + 2 * HD, tscale.f32(), mb.f32());
  EXPECT_TRUE(identical(host_bf16(ob), host(of))) << "out";
  EXPECT_TRUE(identical(host(mb), host(mf))) << "max |logit|";
  EXPECT_TRUE(identical(host(saved_b), host(saved_f))) << "log-sum-exp";
  Tensor ws = poisoned(std::max<int64_t>(1, gpu().attention_workspace_elems(sf)));
  Tensor gf = poisoned(BT * 3 * HD), gv = poisoned(BT * 3 * HD);
  Tensor gq = poisoned(BT * HD), gk = poisoned(BT * HD);
  float* dq = gf.f32();
  gpu().attention_backward(sf, dq, dq + HD, dq + 2 * HD, nullptr, tdout.f32(), of.f32(),
                           saved_f.f32(), q, q + HD, q + 2 * HD, tscale.f32(), ws.f32());
  gpu().attention_backward(sb, gq.f32(), gk.f32(), gv.f32() + 2 * HD, nullptr, tdout.f32(),
                           kernels::act(ob), saved_b.f32(), kernels::act(qb), kernels::act(kb),
                           q + 2 * HD, tscale.f32(), ws.f32());
  const auto g = host(gf);
  EXPECT_TRUE(identical(host(gq), part(g, 0))) << "dq";
  EXPECT_TRUE(identical(host(gk), part(g, 1))) << "dk";
  EXPECT_TRUE(identical(part(host(gv), 2), part(g, 2))) << "dv";
  // A bf16 dout (the output projection's backward writes it so) is what the staging rounded.
  Tensor doutb = dev_bf16(dout), hq = poisoned(BT * HD), hk = poisoned(BT * HD);
  Tensor hv = poisoned(BT * 3 * HD);
  gpu().attention_backward(sb, hq.f32(), hk.f32(), hv.f32() + 2 * HD, nullptr, kernels::act(doutb),
                           kernels::act(ob), saved_b.f32(), kernels::act(qb), kernels::act(kb),
                           q + 2 * HD, tscale.f32(), ws.f32());
  EXPECT_TRUE(identical(host(hq), part(g, 0))) << "dq, bf16 dout";
  EXPECT_TRUE(identical(host(hk), part(g, 1))) << "dk, bf16 dout";
  EXPECT_TRUE(identical(part(host(hv), 2), part(g, 2))) << "dv, bf16 dout";
  // Note [act-dtype]: gradients stored in bf16 (the QKV projection's, and dq, dk for a QK-norm's
  // backward) are the bf16 values the fp32 ones are widened from: copied into rows of 3 HD for
  // packed fp32 q, k, v; written where they are for dense bf16 q, k (dv copied).
  Tensor bp = poisoned_bf16(BT * 3 * HD);
  const kernels::ActOut b3 = kernels::act(bp);
  gpu().attention_backward(sf, b3, b3.at(HD), b3.at(2 * HD), nullptr, tdout.f32(), of.f32(),
                           saved_f.f32(), q, q + HD, q + 2 * HD, tscale.f32(), ws.f32());
  EXPECT_TRUE(identical(host_bf16(bp), g)) << "bf16 dq, dk, dv in rows of 3 HD";
  Tensor bq = poisoned_bf16(BT * HD), bk = poisoned_bf16(BT * HD), bv = poisoned_bf16(BT * 3 * HD);
  gpu().attention_backward(sb, kernels::act(bq), kernels::act(bk), kernels::act(bv).at(2 * HD),
                           nullptr, tdout.f32(), kernels::act(ob), saved_b.f32(), kernels::act(qb),
                           kernels::act(kb), q + 2 * HD, tscale.f32(), ws.f32());
  EXPECT_TRUE(identical(host_bf16(bq), part(g, 0))) << "bf16 dq in place";
  EXPECT_TRUE(identical(host_bf16(bk), part(g, 1))) << "bf16 dk in place";
  EXPECT_TRUE(identical(part(host_bf16(bv), 2), part(g, 2))) << "bf16 dv copied";
  // bf16 q, k, v read where they are inside packed rows of 3 HD (the QKV projection's bf16 output,
  // Note [act-dtype]), and their gradients written there: the same output, maximum, log-sum-exp
  // and gradients.
  Tensor pb = dev_bf16(qkv), op = poisoned_bf16(BT * HD), mp = poisoned(1);
  Tensor saved_p = poisoned(gpu().attention_saved_elems(sf)), gp = poisoned_bf16(BT * 3 * HD);
  const kernels::ActOut p3 = kernels::act(pb), gp3 = kernels::act(gp);
  gpu().attention_forward(sf, kernels::act(op), saved_p.f32(), p3, p3.at(HD), p3.at(2 * HD),
                          tscale.f32(), mp.f32());
  EXPECT_TRUE(identical(host_bf16(op), host(of))) << "out, packed bf16 q, k, v";
  EXPECT_TRUE(identical(host(mp), host(mf))) << "max |logit|, packed bf16 q, k, v";
  EXPECT_TRUE(identical(host(saved_p), host(saved_f))) << "log-sum-exp, packed bf16 q, k, v";
  gpu().attention_backward(sf, gp3, gp3.at(HD), gp3.at(2 * HD), nullptr, tdout.f32(),
                           kernels::act(op), saved_p.f32(), p3, p3.at(HD), p3.at(2 * HD),
                           tscale.f32(), ws.f32());
  EXPECT_TRUE(identical(host_bf16(gp), g)) << "dq, dk, dv, packed bf16 q, k, v";
  // A strided bf16 out is refused (the kernels write dense rows), and a bf16 q whose row stride is
  // below its H * D.
  AttentionShape strided = sb;
  strided.ldo = 2 * HD;
  EXPECT_THROW(gpu().attention_forward(strided, kernels::act(ob), saved_b.f32(), kernels::act(qb),
                                       kernels::act(kb), q + 2 * HD, tscale.f32(), mb.f32()),
               Error);
  strided = sb;
  strided.ldq = HD - 1;
  EXPECT_THROW(gpu().attention_forward(strided, kernels::act(ob), saved_b.f32(), kernels::act(qb),
                                       kernels::act(kb), q + 2 * HD, tscale.f32(), mb.f32()),
               Error);
}

// Note [act-dtype]: GELU on the MLP's bf16 pre-activation and bf16 hidden gradient widens each
// element exactly: the forward's output and the backward's gradient are the fp32 method's on the
// widened values, rounded, bit for bit, and the fused bias gradient (fp32 column sums before the
// rounding) equals it bit for bit. Mixed input dtypes are refused.
TEST_F(Bf16ExecTest, GeluOnBf16PreActivationIsTheFp32OneOnWidenedValues) {
  for (const int64_t C : {int64_t{96}, int64_t{93}}) {  // packs of 4 columns, and one at a time
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t N = 67;
    const auto h = random_vec(N * C, -3.0f, 3.0f, 61), g = random_vec(N * C, -1.0f, 1.0f, 62);
    const auto db0 = random_vec(C, -0.1f, 0.1f, 63);
    Tensor hb = dev_bf16(h), gb = dev_bf16(g), hr = dev(bf16_rounded(h)), gr = dev(bf16_rounded(g));
    Tensor yb = poisoned_bf16(N * C), yf = poisoned(N * C);
    gpu().gelu_forward(kernels::act(yb), kernels::act(hb), N * C);
    gpu().gelu_forward(yf.f32(), hr.f32(), N * C);
    EXPECT_TRUE(identical(host_bf16(yb), bf16_rounded(host(yf)))) << "forward";
    Tensor db = poisoned_bf16(N * C), df = poisoned(N * C), bb = dev(db0), bf = dev(db0);
    gpu().gelu_backward(kernels::act(db), bb.f32(), kernels::act(hb), kernels::act(gb), N, C);
    gpu().gelu_backward(df.f32(), bf.f32(), hr.f32(), gr.f32(), N, C);
    EXPECT_TRUE(identical(host_bf16(db), bf16_rounded(host(df)))) << "backward";
    EXPECT_TRUE(identical(host(bb), host(bf))) << "bias gradient";
    EXPECT_THROW(gpu().gelu_backward(kernels::act(db), nullptr, kernels::act(hb), gr.f32(), N, C),
                 Error);
    EXPECT_THROW(gpu().gelu_forward(yf.f32(), kernels::act(hb), N * C), Error);
  }
}

// Note [act-dtype]: QK-norm on the QKV projection's bf16 output and bf16 gradients. A bf16 input
// (x, rows of 3 HD) or dout is widened exactly and a bf16 output (dinp) is the fp32 result rounded
// once, so each call equals the fp32 method on the widened values, rounded: bit for bit, for the
// whole form and the split (TP) forms, with mean, rstd, the statistics and the gain and bias
// gradients unchanged bit for bit. A bf16 dinp cannot accumulate. RoPE in place on bf16 rows is
// likewise the fp32 rotation of the widened values, rounded, forward and backward.
TEST_F(Bf16ExecTest, QkNormAndRopeOnBf16AreTheFp32OnesRounded) {
  const int64_t N = 48, H = 2, D = 32, HD = H * D, ld_in = 3 * HD;
  const auto x = random_vec(N * ld_in, -2.0f, 2.0f, 51), dy = random_vec(N * HD, -1.0f, 1.0f, 52);
  const auto w = random_vec(HD, 0.5f, 1.5f, 53), b = random_vec(HD, -0.2f, 0.2f, 54);
  Tensor tw = dev(w), tb = dev(b), tdy = dev(dy), tdyr = dev(bf16_rounded(dy)), tdyb = dev_bf16(dy);
  Tensor txf = dev(x), txr = dev(bf16_rounded(x)), txb = dev_bf16(x);
  auto rows = [&](const std::vector<float>& v) { return column_block(v, N, ld_in, 0, HD); };
  for (const bool bf16_x : {false, true}) {
    // The input as the method reads it, and the fp32 input of the reference.
    const kernels::ActIn xin = bf16_x ? kernels::ActIn(kernels::act(txb)) : txf.f32();
    const float* xref = bf16_x ? txr.f32() : txf.f32();
    for (const kernels::NormOp op : {kernels::NormOp::kRms, kernels::NormOp::kLayer}) {
      for (const bool shared : {true, false}) {
        SCOPED_TRACE(std::string(bf16_x ? "bf16 x, " : "fp32 x, ") +
                     (op == kernels::NormOp::kRms ? "RMS" : "Layer") +
                     (shared ? ", shared gain" : ", per-head gain"));
        kernels::NormShape s;
        s.N = N;
        s.G = H;
        s.Cg = D;
        s.ld_in = ld_in;
        s.ld_out = HD;
        s.w_group_stride = shared ? 0 : D;
        const bool layer = op == kernels::NormOp::kLayer;
        const float* bias = layer ? tb.f32() : nullptr;
        Tensor y = poisoned(N * HD), mean = poisoned(N * H), rstd = poisoned(N * H);
        gpu().norm_forward(op, s, y.f32(), xref, tw.f32(), bias, layer ? mean.f32() : nullptr,
                           rstd.f32(), 1e-5f);
        Tensor yb = poisoned_bf16(N * HD), mb = poisoned(N * H), rb = poisoned(N * H);
        gpu().norm_forward(op, s, kernels::act(yb), xin, tw.f32(), bias, layer ? mb.f32() : nullptr,
                           rb.f32(), 1e-5f);
        EXPECT_TRUE(identical(host_bf16(yb), bf16_rounded(host(y)))) << "forward";
        EXPECT_TRUE(identical(host(rb), host(rstd))) << "rstd";
        if (layer) {
          EXPECT_TRUE(identical(host(mb), host(mean))) << "mean";
        }
        // The split forward (PROJECTION scope): statistics, then the output from them.
        Tensor st = poisoned(2 * N * H), stb = poisoned(2 * N * H);
        gpu().norm_partial_stats(s, xref, st.f32());
        gpu().norm_partial_stats(s, xin, stb.f32());
        EXPECT_TRUE(identical(host(stb), host(st))) << "partial statistics";
        Tensor ys = poisoned(N * HD), ysb = poisoned_bf16(N * HD), rs = poisoned(N * H);
        gpu().norm_forward_from_stats(op, s, D, st.f32(), ys.f32(), xref, tw.f32(), bias, nullptr,
                                      rs.f32(), 1e-5f);
        gpu().norm_forward_from_stats(op, s, D, st.f32(), kernels::act(ysb), xin, tw.f32(), bias,
                                      nullptr, rs.f32(), 1e-5f);
        EXPECT_TRUE(identical(host_bf16(ysb), bf16_rounded(host(ys)))) << "forward from stats";
        const float* mu = layer ? mean.f32() : nullptr;
        for (const bool bf16_dout : {true, false}) {
          SCOPED_TRACE(bf16_dout ? "bf16 dout" : "fp32 dout");
          const kernels::ActIn g = bf16_dout ? kernels::ActIn(kernels::act(tdyb)) : tdy.f32();
          const float* gref = bf16_dout ? tdyr.f32() : tdy.f32();
          const int64_t wn = shared ? D : HD;
          Tensor rx = poisoned(N * ld_in), rw = dev(std::vector<float>(wn, 0.25f));
          Tensor rbias = dev(std::vector<float>(wn, -0.5f));
          gpu().norm_backward(op, s, rx.f32(), false, rw.f32(), rbias.f32(), gref, xref, tw.f32(),
                              mu, rstd.f32());
          Tensor bx = poisoned_bf16(N * ld_in), bw = dev(std::vector<float>(wn, 0.25f));
          Tensor bbias = dev(std::vector<float>(wn, -0.5f));
          gpu().norm_backward(op, s, kernels::act(bx), false, bw.f32(), bbias.f32(), g, xin,
                              tw.f32(), mu, rstd.f32());
          EXPECT_TRUE(identical(rows(host_bf16(bx)), bf16_rounded(rows(host(rx))))) << "dinp";
          EXPECT_TRUE(identical(host(bw), host(rw))) << "dweight";
          EXPECT_TRUE(identical(host(bbias), host(rbias))) << "dbias";
          // The split backward: partials, then dinp from them.
          Tensor pr = poisoned(2 * N * H), pb = poisoned(2 * N * H);
          gpu().norm_backward_partials(s, gref, xref, tw.f32(), mu, rstd.f32(), pr.f32());
          gpu().norm_backward_partials(s, g, xin, tw.f32(), mu, rstd.f32(), pb.f32());
          EXPECT_TRUE(identical(host(pb), host(pr))) << "partials";
          Tensor sx = poisoned(N * ld_in), sxb = poisoned_bf16(N * ld_in);
          gpu().norm_backward_from_partials(op, s, D, pr.f32(), sx.f32(), false, nullptr, nullptr,
                                            gref, xref, tw.f32(), mu, rstd.f32());
          gpu().norm_backward_from_partials(op, s, D, pr.f32(), kernels::act(sxb), false, nullptr,
                                            nullptr, g, xin, tw.f32(), mu, rstd.f32());
          EXPECT_TRUE(identical(rows(host_bf16(sxb)), bf16_rounded(rows(host(sx)))))
              << "dinp from partials";
          EXPECT_THROW(gpu().norm_backward(op, s, kernels::act(bx), /*accumulate=*/true, nullptr,
                                           nullptr, g, xin, tw.f32(), mu, rstd.f32()),
                       Error);
        }
      }
    }
  }
  // RoPE in place on bf16 rows of 3 HD (q's 2 heads and k's, as without QK-norm).
  const int64_t B = 2, T = 24;
  const auto table = std::make_unique<kernels::RopeTable>(kernels::make_rope_table(T, D, 1e4));
  const auto r = random_vec(B * T * ld_in, -1.0f, 1.0f, 55);
  for (const bool forward : {true, false}) {
    SCOPED_TRACE(forward ? "rope_forward" : "rope_backward");
    Tensor rf = dev(bf16_rounded(r)), rb = dev_bf16(r);
    if (forward) {
      gpu().rope_forward(*table, rf.f32(), rf.f32(), B, T, 2 * H, D, ld_in);
      gpu().rope_forward(*table, kernels::act(rb), kernels::act(rb), B, T, 2 * H, D, ld_in);
    } else {
      gpu().rope_backward(*table, rf.f32(), rf.f32(), B, T, 2 * H, D, ld_in);
      gpu().rope_backward(*table, kernels::act(rb), kernels::act(rb), B, T, 2 * H, D, ld_in);
    }
    EXPECT_TRUE(identical(host_bf16(rb), bf16_rounded(host(rf)))) << "in place";
  }
  Tensor rf = dev(r), rb = dev_bf16(r);
  EXPECT_THROW(gpu().rope_backward(*table, rf.f32(), kernels::act(rb), B, T, 2 * H, D, ld_in),
               Error);
  EXPECT_THROW(gpu().rope_forward(*table, rf.f32(), kernels::act(rb), B, T, 2 * H, D, ld_in),
               Error);
}

// bf16 memory where a method takes fp32 is a programming error, named, never a misread.
// Note [bf16 wire]: the residual add reads a row-parallel output stored in bf16, and copy_to_f32
// widens a bf16 input gradient, both exactly: bit for bit the CPU's fp32 add of the widened values
// and the widened values themselves, over 100003 elements (the flat cast's rows of 8192 and a
// partial one). copy_to_f32 of fp32 memory copies it; the CPU refuses bf16 memory.
TEST_F(Bf16ExecTest, AddAndCopyWidenBf16Exactly) {
  const int64_t n = 100003;
  const auto a = random_vec(n, -3.0f, 3.0f, 41), b = random_vec(n, -3.0f, 3.0f, 42);
  const auto br = bf16_rounded(b);
  Tensor ta = dev(a), tb = dev_bf16(b), sum = poisoned(n), wide = poisoned(n), copy = poisoned(n);
  gpu().add(sum.f32(), ta.f32(), kernels::act(tb), n);
  gpu().copy_to_f32(wide.f32(), kernels::act(tb), n);
  gpu().copy_to_f32(copy.f32(), ta.f32(), n);
  std::vector<float> ref(n);
  cpu().add(ref.data(), a.data(), br.data(), n);
  EXPECT_TRUE(identical(host(sum), ref)) << "add with a bf16 operand";
  EXPECT_TRUE(identical(host(wide), br)) << "copy_to_f32 of bf16";
  EXPECT_TRUE(identical(host(copy), a)) << "copy_to_f32 of fp32";
  gpu().copy_to_f32(ta.f32(), ta.f32(), n);  // onto itself: nothing to do
  EXPECT_TRUE(identical(host(ta), a)) << "copy_to_f32 in place";
  std::vector<Bf16> bits(4);
  std::vector<float> out(4), x(4);
  try {
    cpu().add(out.data(), x.data(), kernels::ActIn(bits.data(), DType::kBF16), 4);
    ADD_FAILURE() << "bf16 operand accepted by the CPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add: b is bf16"), std::string::npos) << e.what();
  }
}

TEST_F(Bf16ExecTest, Bf16ActivationsOnlyUnderBf16) {
  Tensor out = poisoned_bf16(16 * 8), x = dev(random_vec(16 * 4, -1, 1, 21));
  Tensor w = dev(random_vec(8 * 4, -1, 1, 22));
  cuda::CudaExec fp32_exec(0);
  ASSERT_EQ(fp32_exec.act_dtype(), DType::kF32);
  ASSERT_EQ(gpu().act_dtype(), DType::kBF16);
  try {
    fp32_exec.linear_forward(kernels::act(out), x.f32(), w.f32(), nullptr, 16, 4, 8);
    ADD_FAILURE() << "bf16 output accepted under FP32";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("linear_forward: out is bf16"), std::string::npos)
        << e.what();
  }
  std::vector<Bf16> host_bits(16 * 8);
  std::vector<float> host_x(16 * 4), host_w(8 * 4);
  try {
    cpu().linear_forward(kernels::ActOut(host_bits.data(), DType::kBF16), host_x.data(),
                         host_w.data(), nullptr, 16, 4, 8);
    ADD_FAILURE() << "bf16 output accepted by the CPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("linear_forward: out is bf16"), std::string::npos)
        << e.what();
  }
  // The GLU backward's two outputs share one dtype.
  Tensor d32 = poisoned(16 * 8);
  EXPECT_THROW(gpu().glu_backward(kernels::GluAct::kSilu, kernels::act(out), d32.f32(), nullptr,
                                  nullptr, d32.f32(), d32.f32(), d32.f32(), 16, 8),
               Error);
}

// One training step of a small GPT: the GPU in BF16 against the CPU in FP32, same seed and batch.
TEST_F(Bf16ExecTest, WholeStepMatchesCpuToBf16Tolerance) {
  config::KeelConfig cfg = default_config();
  auto* m = cfg.mutable_model();
  m->set_vocab_size(256);
  m->set_seq_len(64);
  m->set_d_model(128);
  m->set_n_layers(2);
  m->set_n_heads(4);
  m->set_qk_norm(config::RMS);
  m->set_position(config::ROPE);
  m->set_mlp(config::SWIGLU);
  cfg.mutable_loss()->set_z_loss(1e-4);
  const int64_t B = 4;
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  const Topology topo = Topology::single(tp_holder, dp_holder);  // one process: TP = DP = 1
  GPT on_cpu(cfg, topo, B, cpu());
  GPT on_gpu(cfg, topo, B, gpu());
  on_cpu.init(7);
  on_gpu.init(7);
  std::vector<int32_t> tokens(B * 64), targets(B * 64);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 37 + i / 5) % 256);
    targets[i] = static_cast<int32_t>((i * 11 + 3) % 256);
  }
  const LossStats a = on_cpu.forward(tokens.data(), targets.data(), B);
  const LossStats b = on_gpu.forward(tokens.data(), targets.data(), B);
  std::printf("BF16 step vs the CPU's FP32: ce %.8f vs %.8f (rel %.2e), log_z rel %.2e\n", b.ce,
              a.ce, std::abs(b.ce - a.ce) / a.ce, std::abs(b.log_z - a.log_z) / std::abs(a.log_z));
  EXPECT_NEAR(b.ce, a.ce, 1e-2 * a.ce);
  // Note [act-dtype]: the GPU's logits are bf16; a row reads back as floats.
  EXPECT_EQ(on_gpu.logits().dtype(), DType::kBF16);
  EXPECT_EQ(on_cpu.logits().dtype(), DType::kF32);
  for (const int64_t row : {int64_t{0}, int64_t{B * 64 - 1}}) {
    EXPECT_TRUE(matches(on_gpu.logits_row(row), on_cpu.logits_row(row), 5e-2)) << "row " << row;
  }
  EXPECT_NEAR(b.log_z, a.log_z, 1e-2 * std::abs(a.log_z) + 1e-3);
  EXPECT_NEAR(b.max_attn_logit, a.max_attn_logit, 2e-2 * a.max_attn_logit);
  on_cpu.backward(1.0f);
  on_gpu.backward(1.0f);
  EXPECT_LT(rel_norm_err(host(on_gpu.params().grads()), host(on_cpu.params().grads())), 5e-2);
}

}  // namespace
}  // namespace keel::gpu_test
