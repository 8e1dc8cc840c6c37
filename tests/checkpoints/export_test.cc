// checkpoints/export: which models are GPT-2-shaped (every model field classified; each field
// GPT-2 cannot express named on its own), the GPT-2 plan's names, shapes, ops and config for a
// small model whose vocabulary a TP layout padded, the keel plan's names with the padding dropped,
// and a checkpoint whose parameters do not match its config (missing, stray, misshapen, too few
// vocabulary rows) refused with the manifest and the tensor named. The exported values, the file
// and transformers' logits: tests/launch/ckpt_export_test.
#include "checkpoints/export.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "layers/gpt.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;

constexpr int kVocab = 300, kPadded = 384;  // 300 rows padded to a multiple of 64 x 2

config::KeelConfig tiny(config::QkNorm qk = config::NONE) {
  config::KeelConfig cfg = default_config();
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(kVocab);
  m->set_d_model(32);
  m->set_n_heads(4);
  m->set_n_layers(2);
  m->set_d_ff(48);
  m->set_seq_len(16);
  m->set_max_positions(24);
  m->set_qk_norm(qk);
  return cfg;
}

// The PARAM (and ADAM_M) records a TP2 writer of `cfg` lists: its parameters with the vocabulary
// padded to kPadded rows.
ckpt::Manifest manifest_of(const config::KeelConfig& cfg) {
  config::KeelConfig padded = cfg;
  padded.mutable_model()->set_vocab_size(kPadded);
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  GPT model(padded, topo, 1);
  ckpt::Manifest m;
  *m.mutable_config() = cfg;
  for (int id = 0; id < model.params().size(); ++id) {
    for (ckpt::TensorKind kind : {ckpt::PARAM, ckpt::ADAM_M}) {
      ckpt::TensorRecord* t = m.add_tensors();
      t->set_name(model.params().info(id).spec.name);
      t->set_kind(kind);
      for (int64_t d : model.params().info(id).spec.logical) t->add_shape(d);
    }
  }
  return m;
}

ckpt::TensorRecord* param(ckpt::Manifest& m, const std::string& name) {
  for (ckpt::TensorRecord& t : *m.mutable_tensors()) {
    if (t.name() == name && t.kind() == ckpt::PARAM) return &t;
  }
  return nullptr;
}

TEST(ExportGpt2Check, EveryModelFieldIsClassified) {
  // The defaults but without QK-norm are GPT-2-shaped; a model field added to keel.proto and not
  // classified in export.cc would be named here.
  EXPECT_EQ(gpt2_mismatch(tiny().model()), "");
}

TEST(ExportGpt2Check, EachFieldGpt2CannotExpressIsNamed) {
  for (config::QkNorm qk : {config::RMS, config::LAYER, config::L2}) {
    EXPECT_EQ(gpt2_mismatch(tiny(qk).model()),
              "model.qk_norm=" + config::QkNorm_Name(qk) + " (GPT-2 has no QK-norm)");
  }
  config::KeelConfig rms = tiny();
  rms.mutable_model()->set_norm(config::RMSNORM);
  EXPECT_EQ(gpt2_mismatch(rms.model()), "model.norm=RMSNORM (GPT-2 uses LayerNorm)");
  config::KeelConfig untied = tiny();
  untied.mutable_model()->set_tie_embeddings(false);
  EXPECT_EQ(gpt2_mismatch(untied.model()),
            "model.tie_embeddings=false (GPT-2 ties the LM head to the token embedding)");
}

TEST(ExportPlan, Gpt2NamesShapesAndConfig) {
  const ExportPlan plan = plan_export("ck", manifest_of(tiny()));
  ASSERT_EQ(plan.naming, ExportNaming::kGpt2);
  EXPECT_EQ(plan.not_gpt2, "");
  ASSERT_EQ(plan.tensors.size(), 2u + 12u * 2u + 2u);  // no lm_head: tied
  auto expect = [&](size_t i, const std::string& name, const Shape& shape,
                    const std::string& source, ExportOp op) {
    EXPECT_EQ(plan.tensors[i].name, name) << i;
    EXPECT_EQ(plan.tensors[i].shape, shape) << name;
    EXPECT_EQ(plan.tensors[i].source, source) << name;
    EXPECT_EQ(plan.tensors[i].op, op) << name;
  };
  expect(0, "transformer.wte.weight", {kVocab, 32}, "wte", ExportOp::kVocabRows);
  expect(1, "transformer.wpe.weight", {24, 32}, "wpe", ExportOp::kCopy);
  expect(2, "transformer.h.0.ln_1.weight", {32}, "blocks.0.ln1.weight", ExportOp::kCopy);
  expect(3, "transformer.h.0.ln_1.bias", {32}, "blocks.0.ln1.bias", ExportOp::kCopy);
  expect(4, "transformer.h.0.attn.c_attn.weight", {32, 96}, "blocks.0.attn.qkv.weight",
         ExportOp::kTranspose);
  expect(5, "transformer.h.0.attn.c_attn.bias", {96}, "blocks.0.attn.qkv.bias", ExportOp::kCopy);
  expect(6, "transformer.h.0.attn.c_proj.weight", {32, 32}, "blocks.0.attn.proj.weight",
         ExportOp::kTranspose);
  expect(10, "transformer.h.0.mlp.c_fc.weight", {32, 48}, "blocks.0.mlp.fc.weight",
         ExportOp::kTranspose);
  expect(12, "transformer.h.0.mlp.c_proj.weight", {48, 32}, "blocks.0.mlp.proj.weight",
         ExportOp::kTranspose);
  expect(26, "transformer.ln_f.weight", {32}, "ln_f.weight", ExportOp::kCopy);
  const Gpt2Config& g = plan.gpt2;
  EXPECT_EQ(g.vocab_size, kVocab);
  EXPECT_EQ(g.n_positions, 24);
  EXPECT_EQ(g.n_embd, 32);
  EXPECT_EQ(g.n_layer, 2);
  EXPECT_EQ(g.n_head, 4);
  EXPECT_EQ(g.n_inner, 48);
  EXPECT_EQ(g.activation_function, "gelu_new");
  EXPECT_EQ(g.layer_norm_epsilon, 1e-5f);
  // d_ff = 0 and max_positions = 0 take keel's defaults: 4 d_model and seq_len.
  config::KeelConfig defaults = tiny();
  defaults.mutable_model()->set_d_ff(0);
  defaults.mutable_model()->set_max_positions(0);
  const ExportPlan d = plan_export("ck", manifest_of(defaults));
  EXPECT_EQ(d.gpt2.n_inner, 128);
  EXPECT_EQ(d.gpt2.n_positions, 16);
}

TEST(ExportPlan, OtherModelsKeepKeelNamesWithoutThePadding) {
  config::KeelConfig cfg = tiny(config::RMS);
  cfg.mutable_model()->set_tie_embeddings(false);
  const ckpt::Manifest m = manifest_of(cfg);
  const ExportPlan plan = plan_export("ck", m);
  ASSERT_EQ(plan.naming, ExportNaming::kKeel);
  EXPECT_EQ(plan.not_gpt2,
            "model.qk_norm=RMS (GPT-2 has no QK-norm); model.tie_embeddings=false (GPT-2 ties "
            "the LM head to the token embedding)");
  std::vector<std::string> names;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.kind() == ckpt::PARAM) names.push_back(t.name());
  }
  ASSERT_EQ(plan.tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const ExportTensor& t = plan.tensors[i];
    EXPECT_EQ(t.name, names[i]);
    EXPECT_EQ(t.source, names[i]);
    const bool vocab = t.name == "wte" || t.name == "lm_head.weight";
    EXPECT_EQ(t.op, vocab ? ExportOp::kVocabRows : ExportOp::kCopy) << t.name;
    if (vocab) {
      EXPECT_EQ(t.shape, (Shape{kVocab, 32})) << t.name;
    }
  }
  EXPECT_EQ(plan.tensors.back().name, "lm_head.weight");
}

TEST(ExportPlan, ParametersThatDoNotMatchTheConfigAreRefused) {
  ckpt::Manifest missing = manifest_of(tiny());
  param(missing, "blocks.1.mlp.fc.bias")->set_name("blocks.1.mlp.fc.gain");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", missing); }),
            "ck/manifest.pb: tensor blocks.1.mlp.fc.bias (param) is not in the checkpoint, though "
            "its config has it");

  ckpt::Manifest stray = manifest_of(tiny());
  ckpt::TensorRecord* extra = stray.add_tensors();
  extra->set_name("blocks.0.attn.q_norm.weight");
  extra->set_kind(ckpt::PARAM);
  extra->add_shape(8);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", stray); }),
            "ck/manifest.pb: tensor blocks.0.attn.q_norm.weight (param) has no place in a "
            "GPT-2-shaped model of its config");

  ckpt::Manifest misshapen = manifest_of(tiny());
  param(misshapen, "blocks.0.attn.proj.weight")->set_shape(1, 16);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", misshapen); }),
            "ck/manifest.pb: tensor blocks.0.attn.proj.weight has shape [32, 16] in the "
            "checkpoint but [32, 32] in its config");

  ckpt::Manifest short_vocab = manifest_of(tiny(config::RMS));
  param(short_vocab, "wte")->set_shape(0, 256);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", short_vocab); }),
            "ck/manifest.pb: tensor wte has shape [256, 32], not [>= model.vocab_size=300, "
            "d_model]");
}

}  // namespace
}  // namespace keel
