// QK-norm's purpose, tested on a whole tiny GPT: multiplying the q and k projection rows of every
// block by 1000 leaves the largest attention logit within the analytic bound set by the learned
// QK-norm parameters (and nearly unchanged), while without QK-norm it grows 1e6-fold
// (kProjScale^2).
//
// Bounds. Let Cg be the normalised group size (D for HEAD_SHARED / HEAD, H D for PROJECTION).
// The normalised vector of a group has |x_hat| <= sqrt(Cg) for RMS and LayerNorm (equality at
// eps = 0) and |x_hat| <= 1 for L2. Head h's slice of it is no longer than the whole, so
//   RMS:   |logit| <= (max|g_q| sqrt(Cg)) (max|g_k| sqrt(Cg)) / sqrt(D)
//   LAYER: |logit| <= (max|g_q| sqrt(Cg) + |b_q|) (max|g_k| sqrt(Cg) + |b_k|) / sqrt(D)
//   L2:    |logit| <= max |qk_scale|
// (For the head scopes the first is max|g|^2 sqrt(D). For PROJECTION one head may carry the whole
// projection's norm, hence Cg = H D there, not D.) The gains and biases are randomised first so
// the bound depends on learned values rather than on the init constants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "framework/config/keel.pb.h"
#include "layers/gpt.h"

namespace keel {
namespace {

constexpr int64_t kB = 2;
constexpr float kProjScale = 1000.0f;

struct QkCase {
  config::QkNorm qk;
  config::QkNormScope scope;
  const char* name;
};

// gtest prints a parameter by name rather than as bytes.
void PrintTo(const QkCase& c, std::ostream* os) { *os << c.name; }

config::KeelConfig tiny_config(const QkCase& c) {
  config::KeelConfig cfg;
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(64);
  m->set_seq_len(16);
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(4);
  m->set_d_ff(64);
  m->set_qk_norm(c.qk);
  m->set_qk_norm_scope(c.scope);
  m->set_tie_embeddings(true);
  m->set_norm(config::LAYERNORM);
  m->set_max_positions(0);
  m->set_init_std(0.02f);
  m->set_bias(true);
  cfg.mutable_loss()->set_z_loss(1e-4);
  return cfg;
}

class QkNormBound : public ::testing::TestWithParam<QkCase> {};

float max_abs(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}
double l2_norm(const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

TEST_P(QkNormBound, ScaledProjectionsKeepLogitsBounded) {
  const QkCase c = GetParam();
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  const Topology topo = Topology::single(tp_holder, dp_holder);
  GPT model(tiny_config(c), topo, kB);
  model.init(1234);
  ParamStore& ps = model.params();
  const ModelDims& d = model.dims();

  // Randomise the QK-norm parameters (gains around 1, biases around 0, L2 scales around g0).
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> gain(0.5f, 1.8f), bias(-0.3f, 0.3f), l2s(0.5f, 1.5f);
  for (int64_t l = 0; l < d.L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".attn.";
    for (const char* name : {"q_norm.weight", "k_norm.weight"}) {
      const int id = ps.find(p + name);
      if (id < 0) continue;
      for (int64_t i = 0; i < ps.info(id).numel(); ++i) ps.param(id)[i] = gain(rng);
    }
    for (const char* name : {"q_norm.bias", "k_norm.bias"}) {
      const int id = ps.find(p + name);
      if (id < 0) continue;
      for (int64_t i = 0; i < ps.info(id).numel(); ++i) ps.param(id)[i] = bias(rng);
    }
    const int s = ps.find(p + "qk_scale");
    if (s >= 0) {
      for (int64_t i = 0; i < ps.info(s).numel(); ++i) ps.param(s)[i] *= l2s(rng);
    }
  }

  // The analytic bound over all layers and heads.
  const double Cg = c.scope == config::PROJECTION ? static_cast<double>(d.H * d.D) : d.D;
  double bound = 0.0;
  for (int64_t l = 0; l < d.L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".attn.";
    auto norm_of = [&](const std::string& name, bool max_abs_norm) -> double {
      const int id = ps.find(p + name);
      if (id < 0) return 0.0;
      const int64_t n = ps.info(id).numel();
      return max_abs_norm ? max_abs(ps.param(id), n) : l2_norm(ps.param(id), n);
    };
    double layer_bound = 0.0;
    switch (c.qk) {
      case config::RMS:
      case config::LAYER: {
        const double rq =
            norm_of("q_norm.weight", true) * std::sqrt(Cg) + norm_of("q_norm.bias", false);
        const double rk =
            norm_of("k_norm.weight", true) * std::sqrt(Cg) + norm_of("k_norm.bias", false);
        layer_bound = rq * rk / std::sqrt(static_cast<double>(d.D));
        break;
      }
      case config::L2:
        layer_bound = norm_of("qk_scale", true);
        break;
      default:
        layer_bound = INFINITY;
    }
    bound = std::max(bound, layer_bound);
  }

  std::mt19937 tok_rng(99);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.V - 1));
  std::vector<int32_t> tokens(kB * d.T), targets(kB * d.T);
  for (auto& t : tokens) t = tok(tok_rng);
  for (auto& t : targets) t = tok(tok_rng);

  const LossStats base = model.forward(tokens.data(), targets.data(), kB);
  ASSERT_GT(base.max_attn_logit, 0.0f);

  // Multiply the q and k rows of every QKV projection: logical [3, H, D, C], index 0 = q, 1 = k,
  // i.e. the first 2 H D C floats of the (tp = 1) local tensor. The bias is zero at init, so
  // the raw q and k are scaled exactly by kProjScale.
  for (int64_t l = 0; l < d.L; ++l) {
    const int id = ps.find("blocks." + std::to_string(l) + ".attn.qkv.weight");
    ASSERT_GE(id, 0);
    ASSERT_EQ(ps.info(id).numel(), 3 * d.H * d.D * d.C);
    float* w = ps.param(id);
    for (int64_t i = 0; i < 2 * d.H * d.D * d.C; ++i) w[i] *= kProjScale;
    const int b = ps.find("blocks." + std::to_string(l) + ".attn.qkv.bias");
    ASSERT_EQ(max_abs(ps.param(b), ps.info(b).numel()), 0.0f);
  }
  const LossStats scaled = model.forward(tokens.data(), targets.data(), kB);
  ASSERT_TRUE(std::isfinite(scaled.ce));
  std::printf("[qk] %-22s unscaled %.4g  scaled %.4g  bound %.4g\n", c.name, base.max_attn_logit,
              scaled.max_attn_logit, bound);

  if (c.qk == config::NONE) {
    // q.k scales by exactly kProjScale^2 = 1e6 in the first block, whose input is unchanged
    // (later blocks see its now near one-hot attention output instead). The largest logit sits
    // in the first block both times here, so the growth is 1e6 up to float rounding (measured
    // 999999.76-fold); 1e-4 leaves a wide margin for summation order and BLAS.
    const double ratio = static_cast<double>(scaled.max_attn_logit) / base.max_attn_logit;
    std::printf("[qk] none: largest logit grew %.9g-fold\n", ratio);
    EXPECT_NEAR(ratio, 1e6, 1e-4 * 1e6);
  } else {
    EXPECT_LE(scaled.max_attn_logit, bound * (1 + 1e-5));
    EXPECT_LE(base.max_attn_logit, bound * (1 + 1e-5));
    // Normalisation removes the scale up to eps (eps / mean(q^2) ~ 1e-3 at this init).
    EXPECT_NEAR(scaled.max_attn_logit, base.max_attn_logit, 1e-2 * base.max_attn_logit);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, QkNormBound,
    ::testing::Values(QkCase{config::NONE, config::HEAD_SHARED, "none"},
                      QkCase{config::RMS, config::HEAD_SHARED, "rms_head_shared"},
                      QkCase{config::RMS, config::HEAD, "rms_head"},
                      QkCase{config::RMS, config::PROJECTION, "rms_projection"},
                      QkCase{config::LAYER, config::HEAD_SHARED, "layer_head_shared"},
                      QkCase{config::LAYER, config::HEAD, "layer_head"},
                      QkCase{config::LAYER, config::PROJECTION, "layer_projection"},
                      QkCase{config::L2, config::HEAD_SHARED, "l2_head_shared"},
                      QkCase{config::L2, config::HEAD, "l2_head"},
                      QkCase{config::L2, config::PROJECTION, "l2_projection"}),
    [](const ::testing::TestParamInfo<QkCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace keel
