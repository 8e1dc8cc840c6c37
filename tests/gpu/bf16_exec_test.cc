// The BF16 precision of the CUDA execution context (Note [cuda-exec-bf16]): matrix products and
// attention round their fp32 inputs to bf16 and accumulate in fp32. Reference: the CPU context
// on the same inputs rounded to bf16 on the host, so the only differences left are the order of
// the fp32 sums (bf16_in_f32_out_rtol) and, for attention, the bf16 rounding of the output and of
// the probabilities inside the fused kernel (kBf16Rtol element-wise; gradients of q, k and the
// scale by relative norm, 2e-2, because the softmax backward's row term comes from the rounded
// output: Note in cuda/attention.h). Then one whole GPT step in BF16 against the CPU's fp32
// step: loss within 1e-2 relative, gradient arena within 5e-2 relative norm. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "framework/config/config.h"
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

TEST_F(Bf16ExecTest, LinearBackwardAccumulatesFp32Gradients) {
  const int64_t N = 80, IC = 256, OC = 160;
  const auto x = random_vec(N * IC, -1.0f, 1.0f, 4), w = random_vec(OC * IC, -0.5f, 0.5f, 5);
  const auto g = random_vec(N * OC, -1.0f, 1.0f, 6);
  const auto dx0 = random_vec(N * IC, -0.2f, 0.2f, 7), dw0 = random_vec(OC * IC, -0.2f, 0.2f, 8);
  const auto db0 = random_vec(OC, -0.2f, 0.2f, 9);
  Tensor tx = dev(x), tw = dev(w), tg = dev(g), tdx = dev(dx0), tdw = dev(dw0), tdb = dev(db0);
  gpu().linear_backward(tdx.f32(), /*accumulate_dinp=*/true, tdw.f32(), tdb.f32(), tg.f32(),
                        tx.f32(), tw.f32(), N, IC, OC);
  auto dx = dx0, dw = dw0, db = db0;
  const auto xr = bf16_rounded(x), wr = bf16_rounded(w), gr = bf16_rounded(g);
  cpu().linear_backward(dx.data(), true, dw.data(), nullptr, gr.data(), xr.data(), wr.data(), N, IC,
                        OC);
  // The bias gradient sums the unrounded fp32 dout.
  cpu().linear_backward(nullptr, false, nullptr, db.data(), g.data(), x.data(), w.data(), N, IC,
                        OC);
  EXPECT_TRUE(matches(host(tdx), dx, bf16_in_f32_out_rtol(OC))) << "dinp";
  EXPECT_TRUE(matches(host(tdw), dw, bf16_in_f32_out_rtol(N))) << "dweight";
  EXPECT_TRUE(matches(host(tdb), db, f32_rtol(N))) << "dbias";
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
      std::vector<float> r;
      for (int64_t row = 0; row < BT; ++row) {
        const float* p = v.data() + row * 3 * HD + which * HD;
        r.insert(r.end(), p, p + HD);
      }
      return r;
    };
    for (const float x : g) ASSERT_FALSE(std::isnan(x)) << "an unwritten gradient element";
    EXPECT_LT(rel_norm_err(part(g, 0), part(dqkv, 0)), 2e-2) << "dq";
    EXPECT_LT(rel_norm_err(part(g, 1), part(dqkv, 1)), 2e-2) << "dk";
    EXPECT_TRUE(matches(part(g, 2), part(dqkv, 2), kBf16Rtol)) << "dv";
    EXPECT_LT(rel_norm_err(host(tds), ds), 2e-2) << "dscale";
  }
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
  EXPECT_NEAR(b.ce, a.ce, 1e-2 * a.ce);
  EXPECT_NEAR(b.log_z, a.log_z, 1e-2 * std::abs(a.log_z) + 1e-3);
  EXPECT_NEAR(b.max_attn_logit, a.max_attn_logit, 2e-2 * a.max_attn_logit);
  on_cpu.backward(1.0f);
  on_gpu.backward(1.0f);
  EXPECT_LT(rel_norm_err(host(on_gpu.params().grads()), host(on_cpu.params().grads())), 5e-2);
}

}  // namespace
}  // namespace keel::gpu_test
