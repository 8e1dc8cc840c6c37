// Whole-model parity with the float64 PyTorch reference (tests/reference/make_fixtures.py), as
// llm.c's test_gpt2 does: load the reference weights into keel's GPT, run one forward and backward
// on the fixed batch, and match loss, z-loss, logits and every parameter gradient.
// Tolerance: 1e-5 relative, measured per tensor as ||keel - ref|| / ||ref|| (element-wise relative
// error is meaningless for entries that are zero in theory, e.g. a bias added to every key; those
// tensors, with ||ref|| ~ 1e-17, are compared with an absolute bound of 1e-7 instead).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "layers/gpt.h"
#include "tests/reference/fixture.h"

namespace keel {
namespace {

double rel_err(const float* a, const std::vector<double>& ref, double* ref_norm) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  *ref_norm = std::sqrt(den);
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

class ParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityTest, MatchesPyTorch) {
  const std::string path = std::string(KEEL_SOURCE_DIR) + "/tests/reference/" + GetParam() + ".bin";
  const testing::Fixture fx = testing::Fixture::load(path);
  const auto& c = fx.at("config").i32;  // V C H F L T P B qk_norm scope norm tie
  ASSERT_EQ(c.size(), 12u);
  config::KeelConfig cfg;
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
  m->set_init_std(0.02f);
  cfg.mutable_loss()->set_z_loss(fx.at("z_loss").values[0]);
  const int64_t B = c[7], T = c[5], V = c[0];

  std::unique_ptr<Communicator> tp_comm, dp_comm;
  Topology topo = Topology::single(tp_comm, dp_comm);
  GPT model(cfg, topo, B);
  ParamStore& ps = model.params();
  int n_fixture_params = 0;
  for (const auto& name : fx.names()) {
    if (name.rfind("grad/", 0) == 0) ++n_fixture_params;
  }
  ASSERT_EQ(ps.size(), n_fixture_params) << "keel and the reference disagree on the parameters";
  for (int id = 0; id < ps.size(); ++id) {
    const std::string& name = ps.info(id).spec.name;
    ASSERT_TRUE(fx.has(name)) << "reference lacks " << name;
    const auto& e = fx.at(name);
    ASSERT_EQ(e.dims, ps.info(id).spec.logical) << name;
    std::copy(e.f32.begin(), e.f32.end(), ps.param(id));
  }

  const LossStats st = model.forward(fx.at("tokens").i32.data(), fx.at("targets").i32.data(), B);
  const double ref_ce = fx.at("loss").values[0], ref_z = fx.at("z_loss_value").values[0];
  EXPECT_NEAR(st.ce, ref_ce, 1e-5 * std::abs(ref_ce));
  EXPECT_NEAR(st.z_loss, ref_z, 1e-5 * std::abs(ref_z));
  double norm = 0.0;
  const auto& ref_logits = fx.at("logits").values;
  ASSERT_EQ(static_cast<int64_t>(ref_logits.size()), B * T * V);
  EXPECT_LT(rel_err(model.logits(), ref_logits, &norm), 1e-5) << "logits";

  ps.zero_grads();
  model.backward(1.0f);
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
      EXPECT_LT(err, 1e-5) << "gradient of " << name << " (|ref| = " << norm << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllQkNormModes, ParityTest,
                         ::testing::Values("qk_none", "qk_rms_head_shared", "qk_rms_head",
                                           "qk_rms_projection", "qk_layer_head_shared",
                                           "qk_layer_head", "qk_layer_projection",
                                           "qk_l2_head_shared", "qk_l2_head", "qk_l2_projection"));

}  // namespace
}  // namespace keel
