// Whole-model parity with the float64 PyTorch reference (tests/reference/make_fixtures.py), as
// llm.c's test_gpt2 does: load the reference weights into keel's GPT, run one forward and backward
// on the fixed batch, and match loss, z-loss, logits and every parameter gradient.
// Tolerance: 1e-5 relative, measured per tensor as ||keel - ref|| / ||ref|| (element-wise relative
// error is meaningless for entries that are zero in theory, e.g. a bias added to every key; those
// tensors, with ||ref|| ~ 1e-17, are compared with an absolute bound of 1e-7 instead).
// The fixtures cover the GPT-2 block under every QK-norm mode and scope, and the modern blocks:
// RoPE under every QK-norm mode and scope, SwiGLU and GEGLU, bias-free layers, norms after each
// sublayer (POST_SUBLAYER), OLMo 2- and Qwen3-shaped models, and grouped-query and multi-query
// attention (model.n_kv_heads, Note [gqa layouts] in layers/attention.h) with model.head_dim apart
// from d_model / n_heads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "layers/gpt.h"
#include "tests/reference/fixture.h"

namespace keel {
namespace {

const std::string kFixtureDir = std::string(KEEL_SOURCE_DIR) + "/tests/reference/";

const std::vector<std::string> kFixtures = {
    // GPT-2 block: learned positions, GELU MLP, biases, pre-norm.
    "qk_none", "qk_rms_head_shared", "qk_rms_head", "qk_rms_projection", "qk_layer_head_shared",
    "qk_layer_head", "qk_layer_projection", "qk_l2_head_shared", "qk_l2_head", "qk_l2_projection",
    // RoPE under every QK-norm mode and scope (with the MLP kind, bias, placement and theta
    // varying from case to case).
    "rope_qk_none", "rope_qk_rms_head_shared", "rope_qk_rms_head", "rope_qk_rms_projection",
    "rope_qk_layer_head_shared", "rope_qk_layer_head", "rope_qk_layer_projection",
    "rope_qk_l2_head_shared", "rope_qk_l2_head", "rope_qk_l2_projection",
    // Gated MLPs, bias-free layers and POST_SUBLAYER norms with learned positions.
    "mlp_swiglu", "mlp_swiglu_nobias", "mlp_geglu", "mlp_geglu_nobias", "gelu_nobias",
    "post_sublayer", "post_sublayer_swiglu",
    // Whole modern models.
    "olmo2", "qwen3",
    // 4 query heads on 2 k/v heads (gqa_) or 1 (mqa_) in the Qwen3 and OLMo 2 blocks (RMS
    // QK-norm HEAD_SHARED and PROJECTION, RoPE); head_dim 8 at d_model 24 (GQA, per-head gains);
    // head_dim 4 at d_model 26 with every bias and LAYER QK-norm (MQA); L2 with a scale per
    // query head (GQA).
    "gqa_qwen3", "mqa_qwen3", "gqa_olmo2", "mqa_olmo2", "gqa_head_dim", "mqa_head_dim_bias",
    "gqa_l2_head"};

// Entries of a fixture that are not parameters; every other entry X must come with grad/X.
const std::set<std::string> kNonParams = {"config",  "rope_theta", "z_loss",       "tokens",
                                          "targets", "loss",       "z_loss_value", "logits"};

double rel_err(const float* a, const std::vector<double>& ref, double* ref_norm) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  *ref_norm = std::sqrt(den);
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// The model configuration the fixture's config record and rope_theta entry describe. Every
// field is set: a KeelConfig built here does not pass through load_config's defaults (proto3
// would leave `bias` false and the enums UNSPECIFIED).
config::KeelConfig fixture_config(const testing::Fixture& fx) {
  // V C H F L T P B qk_norm scope norm tie position mlp bias norm_placement n_kv_heads head_dim
  const auto& c = fx.at("config").i32;
  config::KeelConfig cfg;
  if (c.size() != 18u) {
    ADD_FAILURE() << "config record has " << c.size() << " entries, want 18";
    return cfg;
  }
  auto* m = cfg.mutable_model();
  m->set_vocab_size(c[0]);
  m->set_d_model(c[1]);
  m->set_n_heads(c[2]);
  m->set_d_ff(c[3]);
  m->set_n_layers(c[4]);
  m->set_seq_len(c[5]);
  m->set_max_positions(c[6]);
  m->set_qk_norm(static_cast<config::QkNorm>(c[8]));
  m->set_qk_norm_scope(static_cast<config::QkNormScope>(c[9]));
  m->set_norm(static_cast<config::NormKind>(c[10]));
  m->set_tie_embeddings(c[11] != 0);
  m->set_position(static_cast<config::Position>(c[12]));
  m->set_mlp(static_cast<config::MlpKind>(c[13]));
  m->set_bias(c[14] != 0);
  m->set_norm_placement(static_cast<config::NormPlacement>(c[15]));
  m->set_n_kv_heads(c[16]);  // 0: n_heads
  m->set_head_dim(c[17]);    // 0: d_model / n_heads
  m->set_rope_theta(fx.at("rope_theta").values.at(0));
  m->set_init_std(0.02f);
  cfg.mutable_loss()->set_z_loss(fx.at("z_loss").values.at(0));
  return cfg;
}

class ParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityTest, MatchesPyTorch) {
  const testing::Fixture fx = testing::Fixture::load(kFixtureDir + GetParam() + ".bin");
  const config::KeelConfig cfg = fixture_config(fx);
  ASSERT_TRUE(cfg.has_model());
  const auto& c = fx.at("config").i32;
  const int64_t B = c[7], T = c[5], V = c[0];

  std::unique_ptr<Communicator> tp_comm, dp_comm;
  Topology topo = Topology::single(tp_comm, dp_comm);
  GPT model(cfg, topo, B);
  ParamStore& ps = model.params();

  // The two parameter sets must be equal: a parameter keel lacks or has in excess fails here,
  // by name, before any number is compared.
  std::set<std::string> ref_params, keel_params;
  for (const auto& name : fx.names()) {
    if (name.rfind("grad/", 0) == 0) {
      ref_params.insert(name.substr(5));
    } else if (!kNonParams.count(name)) {
      EXPECT_TRUE(fx.has("grad/" + name)) << "fixture entry " << name << " has no gradient";
    }
  }
  for (int id = 0; id < ps.size(); ++id) keel_params.insert(ps.info(id).spec.name);
  for (const auto& name : ref_params) {
    EXPECT_TRUE(keel_params.count(name)) << "keel lacks the reference's parameter " << name;
  }
  for (const auto& name : keel_params) {
    EXPECT_TRUE(ref_params.count(name)) << "keel has a parameter the reference lacks: " << name;
  }
  ASSERT_EQ(keel_params, ref_params) << "keel and the reference disagree on the parameters";
  ASSERT_EQ(static_cast<size_t>(ps.size()), keel_params.size()) << "duplicate parameter names";
  for (int id = 0; id < ps.size(); ++id) {
    const std::string& name = ps.info(id).spec.name;
    const auto& e = fx.at(name);
    ASSERT_EQ(e.dims, ps.info(id).spec.logical) << name;
    ASSERT_EQ(static_cast<int64_t>(e.f32.size()), ps.info(id).numel()) << name;
    std::copy(e.f32.begin(), e.f32.end(), ps.param(id));
  }

  const LossStats st = model.forward(fx.at("tokens").i32.data(), fx.at("targets").i32.data(), B);
  const double ref_ce = fx.at("loss").values[0], ref_z = fx.at("z_loss_value").values[0];
  EXPECT_NEAR(st.ce, ref_ce, 1e-5 * std::abs(ref_ce));
  EXPECT_NEAR(st.z_loss, ref_z, 1e-5 * std::abs(ref_z));
  double norm = 0.0;
  const auto& ref_logits = fx.at("logits").values;
  ASSERT_EQ(static_cast<int64_t>(ref_logits.size()), B * T * V);
  const double logits_err = rel_err(model.logits().f32(), ref_logits, &norm);
  EXPECT_LT(logits_err, 1e-5) << "logits";

  ps.zero_grads();
  model.backward(1.0f);
  double worst_grad = 0.0;
  std::string worst_name = "-";
  for (int id = 0; id < ps.size(); ++id) {
    const std::string& name = ps.info(id).spec.name;
    const auto& ref = fx.at("grad/" + name).values;
    ASSERT_EQ(static_cast<int64_t>(ref.size()), ps.info(id).numel()) << name;
    const double err = rel_err(ps.grad(id), ref, &norm);
    if (norm < 1e-10) {
      double mx = 0.0;
      for (int64_t i = 0; i < ps.info(id).numel(); ++i) {
        mx = std::max(mx, std::abs(static_cast<double>(ps.grad(id)[i])));
      }
      EXPECT_LT(mx, 1e-7) << "gradient of " << name << " should vanish";
    } else {
      // 1e-5 relative, or 1e-9 absolute in norm for a gradient that is a near-cancelling sum (a
      // per-head scale under POST_SUBLAYER norms: |ref| 3.2e-5): float32 rounds each of its terms,
      // so its error scales with the terms, not with what is left of their sum.
      EXPECT_LT(err, std::max(1e-5, 1e-9 / norm))
          << "gradient of " << name << " (|ref| = " << norm << ")";
      if (err > worst_grad) {
        worst_grad = err;
        worst_name = name;
      }
    }
  }
  std::printf(
      "[ %s ] %d parameters; relative error: ce %.1e, z-loss %.1e, logits %.1e, worst "
      "gradient %.1e (%s)\n",
      GetParam().c_str(), ps.size(), std::abs(st.ce - ref_ce) / std::abs(ref_ce),
      std::abs(st.z_loss - ref_z) / std::abs(ref_z), logits_err, worst_grad, worst_name.c_str());
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, ParityTest, ::testing::ValuesIn(kFixtures),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// Every fixture the generator writes is run above: a new case cannot be left out silently.
TEST(ParityFixtures, EveryFixtureIsRun) {
  std::set<std::string> on_disk;
  for (const auto& entry : std::filesystem::directory_iterator(kFixtureDir)) {
    if (entry.path().extension() == ".bin") on_disk.insert(entry.path().stem().string());
  }
  const std::set<std::string> listed(kFixtures.begin(), kFixtures.end());
  EXPECT_EQ(listed.size(), kFixtures.size()) << "a fixture is listed twice";
  EXPECT_EQ(on_disk, listed) << "tests/reference/*.bin and kFixtures differ";
}

}  // namespace
}  // namespace keel
