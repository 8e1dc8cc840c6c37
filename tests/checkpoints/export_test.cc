// checkpoints/export: which Hugging Face architecture a model is (every model field classified
// for GPT-2, OLMo 2, Qwen3 and Llama; each field an architecture cannot express named on its own;
// at most one architecture matches), each plan's names, shapes, ops and config values for a small
// model whose vocabulary a TP layout padded (with grouped-query and multi-query attention and a
// head width apart from d_model / n_heads, and n_kv_heads = n_heads giving multi-head attention's
// plan), the keel plan's names with the padding dropped, and
// a checkpoint whose parameters do not match its config (missing, stray, misshapen, too few
// vocabulary rows) refused with the manifest and the tensor named. The parameter lists come from
// keel's own model (GPT's registrations), so a renamed parameter fails here. The exported values,
// the file and the logits: tests/launch/ckpt_export_test. The safetensors header: written for a
// plan and read back, its exact text, and every malformed header the reader refuses (the fuzzer's
// round trip: tests/fuzz/safetensors_fuzz.cc).
#include "checkpoints/export.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "framework/config/config.h"
#include "layers/gpt.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;

constexpr int kVocab = 300, kPadded = 384;  // 300 rows padded to a multiple of 64 x 2

config::KeelConfig tiny() {
  config::KeelConfig cfg = default_config();
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(kVocab);
  m->set_d_model(32);
  m->set_n_heads(4);
  m->set_n_layers(2);
  m->set_d_ff(48);
  m->set_seq_len(16);
  m->set_max_positions(24);
  return cfg;
}

// GPT-2's block: learned positions, LayerNorm, GELU, biases, pre-norm, tied, no QK-norm.
config::KeelConfig gpt2() {
  config::KeelConfig cfg = tiny();
  cfg.mutable_model()->set_qk_norm(config::NONE);
  return cfg;
}

// OLMo 2: RoPE, RMSNorm after each sublayer, RMS QK-norm over the projection, SwiGLU, no bias.
config::KeelConfig olmo2() {
  config::KeelConfig cfg = tiny();
  config::Model* m = cfg.mutable_model();
  m->set_qk_norm(config::RMS);
  m->set_qk_norm_scope(config::PROJECTION);
  m->set_norm(config::RMSNORM);
  m->set_position(config::ROPE);
  m->set_rope_theta(500000);
  m->set_mlp(config::SWIGLU);
  m->set_bias(false);
  m->set_norm_placement(config::POST_SUBLAYER);
  m->set_tie_embeddings(false);
  return cfg;
}

// Qwen3: as OLMo 2 but pre-norm, one QK-norm gain per head dimension shared by all heads, tied.
config::KeelConfig qwen3() {
  config::KeelConfig cfg = olmo2();
  config::Model* m = cfg.mutable_model();
  m->set_qk_norm_scope(config::HEAD_SHARED);
  m->set_norm_placement(config::PRE);
  m->set_rope_theta(1000000);
  m->set_tie_embeddings(true);
  return cfg;
}

// Llama: Qwen3's block without QK-norm (pre-norm RMSNorm, RoPE, SwiGLU, no bias), untied.
config::KeelConfig llama() {
  config::KeelConfig cfg = qwen3();
  config::Model* m = cfg.mutable_model();
  m->set_qk_norm(config::NONE);
  m->set_rope_theta(500000);
  m->set_tie_embeddings(false);
  return cfg;
}

// `cfg` with `kv_heads` k/v heads of width `head_dim` (0: d_model / n_heads).
config::KeelConfig with_heads(config::KeelConfig cfg, int kv_heads, int head_dim) {
  cfg.mutable_model()->set_n_kv_heads(kv_heads);
  cfg.mutable_model()->set_head_dim(head_dim);
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

// Expects plan.tensors[i] to be `name`, `shape`, made from `source` by `op` (from `row_begin`).
void expect_tensor(const ExportPlan& plan, size_t i, const std::string& name, const Shape& shape,
                   const std::string& source, ExportOp op, int64_t row_begin = 0) {
  ASSERT_LT(i, plan.tensors.size()) << name;
  const ExportTensor& t = plan.tensors[i];
  EXPECT_EQ(t.name, name) << i;
  EXPECT_EQ(t.shape, shape) << name;
  EXPECT_EQ(t.source, source) << name;
  EXPECT_EQ(t.op, op) << name;
  EXPECT_EQ(t.row_begin, row_begin) << name;
}

TEST(ExportArchCheck, EveryModelFieldIsClassifiedForEveryArchitecture) {
  // A model field added to keel.proto and not classified in export.cc is named for every
  // architecture, so none of these could be empty.
  EXPECT_EQ(arch_mismatch(ExportNaming::kGpt2, gpt2().model()), "");
  EXPECT_EQ(arch_mismatch(ExportNaming::kOlmo2, olmo2().model()), "");
  EXPECT_EQ(arch_mismatch(ExportNaming::kQwen3, qwen3().model()), "");
  EXPECT_EQ(arch_mismatch(ExportNaming::kLlama, llama().model()), "");
}

TEST(ExportArchCheck, AtMostOneArchitectureMatchesAndTheOthersSayWhy) {
  EXPECT_EQ(arch_mismatch(ExportNaming::kOlmo2, gpt2().model()),
            "model.qk_norm=NONE (OLMo 2 RMS-normalises q and k); model.qk_norm_scope=HEAD_SHARED "
            "(OLMo 2 normalises q and k over the whole projection, all heads at once); "
            "model.norm=LAYERNORM (OLMo 2 uses RMSNorm); model.position=LEARNED (OLMo 2 uses "
            "rotary positions); model.mlp=GELU (OLMo 2's MLP is SwiGLU); model.bias=true (OLMo 2 "
            "has no biases); model.norm_placement=PRE (OLMo 2 normalises each sublayer's output)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kGpt2, olmo2().model()),
            "model.qk_norm=RMS (GPT-2 has no QK-norm); model.tie_embeddings=false (GPT-2 ties the "
            "LM head to the token embedding); model.norm=RMSNORM (GPT-2 uses LayerNorm); "
            "model.position=ROPE (GPT-2 learns absolute positions); model.mlp=SWIGLU (GPT-2's MLP "
            "is GELU); model.bias=false (GPT-2 has biases in every linear layer and norm); "
            "model.norm_placement=POST_SUBLAYER (GPT-2 normalises each sublayer's input)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kQwen3, olmo2().model()),
            "model.qk_norm_scope=PROJECTION (Qwen3 normalises each head with one gain shared by "
            "all heads); model.norm_placement=POST_SUBLAYER (Qwen3 normalises each sublayer's "
            "input)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kOlmo2, qwen3().model()),
            "model.qk_norm_scope=HEAD_SHARED (OLMo 2 normalises q and k over the whole "
            "projection, all heads at once); model.norm_placement=PRE (OLMo 2 normalises each "
            "sublayer's output)");
  // Llama is Qwen3 without QK-norm: they differ in that field alone, both ways.
  EXPECT_EQ(arch_mismatch(ExportNaming::kLlama, qwen3().model()),
            "model.qk_norm=RMS (Llama has no QK-norm)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kQwen3, llama().model()),
            "model.qk_norm=NONE (Qwen3 RMS-normalises q and k)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kLlama, olmo2().model()),
            "model.qk_norm=RMS (Llama has no QK-norm); model.norm_placement=POST_SUBLAYER (Llama "
            "normalises each sublayer's input)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kLlama, gpt2().model()),
            "model.norm=LAYERNORM (Llama uses RMSNorm); model.position=LEARNED (Llama uses rotary "
            "positions); model.mlp=GELU (Llama's MLP is SwiGLU); model.bias=true (Llama has no "
            "biases)");
  EXPECT_EQ(arch_mismatch(ExportNaming::kGpt2, llama().model()),
            "model.tie_embeddings=false (GPT-2 ties the LM head to the token embedding); "
            "model.norm=RMSNORM (GPT-2 uses LayerNorm); model.position=ROPE (GPT-2 learns "
            "absolute positions); model.mlp=SWIGLU (GPT-2's MLP is GELU); model.bias=false (GPT-2 "
            "has biases in every linear layer and norm)");
  for (const config::KeelConfig& cfg :
       {gpt2(), olmo2(), qwen3(), llama(), with_heads(qwen3(), 2, 12), with_heads(llama(), 1, 0),
        with_heads(olmo2(), 2, 0), with_heads(gpt2(), 4, 8)}) {
    int matches = 0;
    for (ExportNaming arch : kHfArchitectures) matches += arch_mismatch(arch, cfg.model()).empty();
    EXPECT_EQ(matches, 1) << cfg.model().DebugString();
  }
}

// One field changed from an architecture's own model: exactly that field is named.
struct OneField {
  ExportNaming arch;
  std::function<void(config::Model&)> set;
  std::string why;  // empty: the architecture expresses the new value too
};

TEST(ExportArchCheck, EachFieldAnArchitectureCannotExpressIsNamedOnItsOwn) {
  using M = config::Model;
  const ExportNaming G = ExportNaming::kGpt2, O = ExportNaming::kOlmo2, Q = ExportNaming::kQwen3,
                     L = ExportNaming::kLlama;
  const std::vector<OneField> cases = {
      {G, [](M& m) { m.set_qk_norm(config::RMS); }, "model.qk_norm=RMS (GPT-2 has no QK-norm)"},
      {G, [](M& m) { m.set_qk_norm(config::L2); }, "model.qk_norm=L2 (GPT-2 has no QK-norm)"},
      {G, [](M& m) { m.set_norm(config::RMSNORM); }, "model.norm=RMSNORM (GPT-2 uses LayerNorm)"},
      {G, [](M& m) { m.set_tie_embeddings(false); },
       "model.tie_embeddings=false (GPT-2 ties the LM head to the token embedding)"},
      {G, [](M& m) { m.set_position(config::ROPE); },
       "model.position=ROPE (GPT-2 learns absolute positions)"},
      {G, [](M& m) { m.set_mlp(config::GEGLU); }, "model.mlp=GEGLU (GPT-2's MLP is GELU)"},
      {G, [](M& m) { m.set_bias(false); },
       "model.bias=false (GPT-2 has biases in every linear layer and norm)"},
      {G, [](M& m) { m.set_norm_placement(config::POST_SUBLAYER); },
       "model.norm_placement=POST_SUBLAYER (GPT-2 normalises each sublayer's input)"},
      // Meaningless for GPT-2 (no QK-norm, no RoPE), or in its config.
      {G, [](M& m) { m.set_qk_norm_scope(config::PROJECTION); }, ""},
      {G, [](M& m) { m.set_rope_theta(123); }, ""},
      {G, [](M& m) { m.set_d_ff(64); }, ""},
      {G, [](M& m) { m.set_init_std(0.5f); }, ""},
      {G, [](M& m) { m.set_n_kv_heads(2); },
       "model.n_kv_heads=2 (GPT-2 has multi-head attention: every head has its own k and v)"},
      {G, [](M& m) { m.set_head_dim(16); },
       "model.head_dim=16 (GPT-2's head width is d_model / n_heads)"},
      // n_heads k/v heads of d_model / n_heads are multi-head attention's defaults.
      {G, [](M& m) { m.set_n_kv_heads(4); }, ""},
      {G, [](M& m) { m.set_head_dim(8); }, ""},

      {O, [](M& m) { m.set_qk_norm(config::LAYER); },
       "model.qk_norm=LAYER (OLMo 2 RMS-normalises q and k)"},
      {O, [](M& m) { m.set_qk_norm_scope(config::HEAD); },
       "model.qk_norm_scope=HEAD (OLMo 2 normalises q and k over the whole projection, all "
       "heads at once)"},
      {O, [](M& m) { m.set_norm(config::LAYERNORM); },
       "model.norm=LAYERNORM (OLMo 2 uses RMSNorm)"},
      {O, [](M& m) { m.set_position(config::LEARNED); },
       "model.position=LEARNED (OLMo 2 uses rotary positions)"},
      {O, [](M& m) { m.set_mlp(config::GEGLU); }, "model.mlp=GEGLU (OLMo 2's MLP is SwiGLU)"},
      {O, [](M& m) { m.set_bias(true); }, "model.bias=true (OLMo 2 has no biases)"},
      {O, [](M& m) { m.set_norm_placement(config::PRE); },
       "model.norm_placement=PRE (OLMo 2 normalises each sublayer's output)"},
      {O, [](M& m) { m.set_tie_embeddings(true); }, ""},
      {O, [](M& m) { m.set_rope_theta(10000); }, ""},
      {O, [](M& m) { m.set_max_positions(4096); }, ""},
      {O, [](M& m) { m.set_n_kv_heads(1); }, ""},
      {O, [](M& m) { m.set_head_dim(16); },
       "model.head_dim=16 (OLMo 2's head width is d_model / n_heads)"},
      {O, [](M& m) { m.set_head_dim(8); }, ""},

      {Q, [](M& m) { m.set_qk_norm(config::NONE); },
       "model.qk_norm=NONE (Qwen3 RMS-normalises q and k)"},
      {Q, [](M& m) { m.set_qk_norm_scope(config::HEAD); },
       "model.qk_norm_scope=HEAD (Qwen3 normalises each head with one gain shared by all heads)"},
      {Q, [](M& m) { m.set_norm(config::LAYERNORM); }, "model.norm=LAYERNORM (Qwen3 uses RMSNorm)"},
      {Q, [](M& m) { m.set_position(config::LEARNED); },
       "model.position=LEARNED (Qwen3 uses rotary positions)"},
      {Q, [](M& m) { m.set_mlp(config::GELU); }, "model.mlp=GELU (Qwen3's MLP is SwiGLU)"},
      {Q, [](M& m) { m.set_bias(true); }, "model.bias=true (Qwen3 has no biases)"},
      {Q, [](M& m) { m.set_norm_placement(config::POST_SUBLAYER); },
       "model.norm_placement=POST_SUBLAYER (Qwen3 normalises each sublayer's input)"},
      {Q, [](M& m) { m.set_tie_embeddings(false); }, ""},
      {Q, [](M& m) { m.set_n_heads(8); }, ""},
      {Q, [](M& m) { m.set_n_kv_heads(2); }, ""},
      {Q, [](M& m) { m.set_head_dim(128); }, ""},

      {L, [](M& m) { m.set_qk_norm(config::RMS); }, "model.qk_norm=RMS (Llama has no QK-norm)"},
      {L, [](M& m) { m.set_qk_norm(config::L2); }, "model.qk_norm=L2 (Llama has no QK-norm)"},
      {L, [](M& m) { m.set_norm(config::LAYERNORM); }, "model.norm=LAYERNORM (Llama uses RMSNorm)"},
      {L, [](M& m) { m.set_position(config::LEARNED); },
       "model.position=LEARNED (Llama uses rotary positions)"},
      {L, [](M& m) { m.set_mlp(config::GEGLU); }, "model.mlp=GEGLU (Llama's MLP is SwiGLU)"},
      {L, [](M& m) { m.set_bias(true); }, "model.bias=true (Llama has no biases)"},
      {L, [](M& m) { m.set_norm_placement(config::POST_SUBLAYER); },
       "model.norm_placement=POST_SUBLAYER (Llama normalises each sublayer's input)"},
      // Meaningless without QK-norm, or in LlamaConfig.
      {L, [](M& m) { m.set_qk_norm_scope(config::PROJECTION); }, ""},
      {L, [](M& m) { m.set_tie_embeddings(true); }, ""},
      {L, [](M& m) { m.set_n_kv_heads(1); }, ""},
      {L, [](M& m) { m.set_head_dim(64); }, ""},
      {L, [](M& m) { m.set_rope_theta(10000); }, ""},
      {L, [](M& m) { m.set_d_ff(128); }, ""},
  };
  for (const OneField& c : cases) {
    config::KeelConfig cfg = c.arch == G   ? gpt2()
                             : c.arch == O ? olmo2()
                             : c.arch == Q ? qwen3()
                                           : llama();
    c.set(*cfg.mutable_model());
    EXPECT_EQ(arch_mismatch(c.arch, cfg.model()), c.why) << naming_title(c.arch);
  }
}

TEST(ExportPlan, Gpt2NamesShapesAndConfig) {
  const ExportPlan plan = plan_export("ck", manifest_of(gpt2()));
  ASSERT_EQ(plan.naming, ExportNaming::kGpt2);
  EXPECT_TRUE(plan.mismatches.empty());
  ASSERT_EQ(plan.tensors.size(), 2u + 12u * 2u + 2u);  // no lm_head: tied
  expect_tensor(plan, 0, "transformer.wte.weight", {kVocab, 32}, "wte", ExportOp::kRows);
  expect_tensor(plan, 1, "transformer.wpe.weight", {24, 32}, "wpe", ExportOp::kCopy);
  expect_tensor(plan, 2, "transformer.h.0.ln_1.weight", {32}, "blocks.0.ln1.weight",
                ExportOp::kCopy);
  expect_tensor(plan, 3, "transformer.h.0.ln_1.bias", {32}, "blocks.0.ln1.bias", ExportOp::kCopy);
  expect_tensor(plan, 4, "transformer.h.0.attn.c_attn.weight", {32, 96}, "blocks.0.attn.qkv.weight",
                ExportOp::kTranspose);
  expect_tensor(plan, 5, "transformer.h.0.attn.c_attn.bias", {96}, "blocks.0.attn.qkv.bias",
                ExportOp::kCopy);
  expect_tensor(plan, 6, "transformer.h.0.attn.c_proj.weight", {32, 32},
                "blocks.0.attn.proj.weight", ExportOp::kTranspose);
  expect_tensor(plan, 10, "transformer.h.0.mlp.c_fc.weight", {32, 48}, "blocks.0.mlp.fc.weight",
                ExportOp::kTranspose);
  expect_tensor(plan, 12, "transformer.h.0.mlp.c_proj.weight", {48, 32}, "blocks.0.mlp.proj.weight",
                ExportOp::kTranspose);
  expect_tensor(plan, 26, "transformer.ln_f.weight", {32}, "ln_f.weight", ExportOp::kCopy);
  const HfConfig& g = plan.hf;
  EXPECT_EQ(g.vocab_size, kVocab);
  EXPECT_EQ(g.max_positions, 24);
  EXPECT_EQ(g.hidden_size, 32);
  EXPECT_EQ(g.num_layers, 2);
  EXPECT_EQ(g.num_heads, 4);
  EXPECT_EQ(g.intermediate_size, 48);
  EXPECT_EQ(g.activation, "gelu_new");
  EXPECT_EQ(g.norm_eps, 1e-5f);
  EXPECT_TRUE(g.tie_word_embeddings);
  // d_ff = 0 and max_positions = 0 take keel's defaults: 4 d_model and seq_len.
  config::KeelConfig defaults = gpt2();
  defaults.mutable_model()->set_d_ff(0);
  defaults.mutable_model()->set_max_positions(0);
  const ExportPlan d = plan_export("ck", manifest_of(defaults));
  EXPECT_EQ(d.hf.intermediate_size, 128);
  EXPECT_EQ(d.hf.max_positions, 16);
}

TEST(ExportPlan, Olmo2NamesShapesAndConfig) {
  const ExportPlan plan = plan_export("ck", manifest_of(olmo2()));
  ASSERT_EQ(plan.naming, ExportNaming::kOlmo2);
  // embed_tokens, 11 per layer, the final norm, the untied LM head.
  ASSERT_EQ(plan.tensors.size(), 1u + 11u * 2u + 2u);
  expect_tensor(plan, 0, "model.embed_tokens.weight", {kVocab, 32}, "wte", ExportOp::kRows);
  // q, k and v are rows [0, 32), [32, 64), [64, 96) of qkv [3, H, D, C] seen as [96, 32].
  expect_tensor(plan, 1, "model.layers.0.self_attn.q_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 0);
  expect_tensor(plan, 2, "model.layers.0.self_attn.k_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 32);
  expect_tensor(plan, 3, "model.layers.0.self_attn.v_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 64);
  expect_tensor(plan, 4, "model.layers.0.self_attn.o_proj.weight", {32, 32},
                "blocks.0.attn.proj.weight", ExportOp::kCopy);
  // PROJECTION gains [H, D] = [4, 8] flatten to OLMo 2's [H D].
  expect_tensor(plan, 5, "model.layers.0.self_attn.q_norm.weight", {32},
                "blocks.0.attn.q_norm.weight", ExportOp::kCopy);
  expect_tensor(plan, 6, "model.layers.0.self_attn.k_norm.weight", {32},
                "blocks.0.attn.k_norm.weight", ExportOp::kCopy);
  expect_tensor(plan, 7, "model.layers.0.mlp.gate_proj.weight", {48, 32},
                "blocks.0.mlp.gate.weight", ExportOp::kCopy);
  expect_tensor(plan, 8, "model.layers.0.mlp.up_proj.weight", {48, 32}, "blocks.0.mlp.fc.weight",
                ExportOp::kCopy);
  expect_tensor(plan, 9, "model.layers.0.mlp.down_proj.weight", {32, 48},
                "blocks.0.mlp.proj.weight", ExportOp::kCopy);
  expect_tensor(plan, 10, "model.layers.0.post_attention_layernorm.weight", {32},
                "blocks.0.ln1.weight", ExportOp::kCopy);
  expect_tensor(plan, 11, "model.layers.0.post_feedforward_layernorm.weight", {32},
                "blocks.0.ln2.weight", ExportOp::kCopy);
  expect_tensor(plan, 12, "model.layers.1.self_attn.q_proj.weight", {32, 32},
                "blocks.1.attn.qkv.weight", ExportOp::kRows, 0);
  expect_tensor(plan, 23, "model.norm.weight", {32}, "ln_f.weight", ExportOp::kCopy);
  expect_tensor(plan, 24, "lm_head.weight", {kVocab, 32}, "lm_head.weight", ExportOp::kRows);
  const HfConfig& c = plan.hf;
  EXPECT_EQ(c.vocab_size, kVocab);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.max_positions, 24);
  EXPECT_EQ(c.activation, "silu");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.initializer_range, 0.02f);

  // Tied: no lm_head tensor, and the config says so.
  config::KeelConfig tied = olmo2();
  tied.mutable_model()->set_tie_embeddings(true);
  const ExportPlan t = plan_export("ck", manifest_of(tied));
  ASSERT_EQ(t.naming, ExportNaming::kOlmo2);
  EXPECT_EQ(t.tensors.size(), plan.tensors.size() - 1);
  EXPECT_EQ(t.tensors.back().name, "model.norm.weight");
  EXPECT_TRUE(t.hf.tie_word_embeddings);
}

TEST(ExportPlan, Qwen3NamesShapesAndConfig) {
  const ExportPlan plan = plan_export("ck", manifest_of(qwen3()));
  ASSERT_EQ(plan.naming, ExportNaming::kQwen3);
  ASSERT_EQ(plan.tensors.size(), 1u + 11u * 2u + 1u);  // tied: no lm_head
  expect_tensor(plan, 0, "model.embed_tokens.weight", {kVocab, 32}, "wte", ExportOp::kRows);
  expect_tensor(plan, 3, "model.layers.0.self_attn.v_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 64);
  // HEAD_SHARED: one [D] gain for every head, Qwen3's per-head q_norm over head_dim.
  expect_tensor(plan, 5, "model.layers.0.self_attn.q_norm.weight", {8},
                "blocks.0.attn.q_norm.weight", ExportOp::kCopy);
  expect_tensor(plan, 6, "model.layers.0.self_attn.k_norm.weight", {8},
                "blocks.0.attn.k_norm.weight", ExportOp::kCopy);
  // Pre-norm: ln1 before attention, ln2 before the MLP.
  expect_tensor(plan, 10, "model.layers.0.input_layernorm.weight", {32}, "blocks.0.ln1.weight",
                ExportOp::kCopy);
  expect_tensor(plan, 11, "model.layers.0.post_attention_layernorm.weight", {32},
                "blocks.0.ln2.weight", ExportOp::kCopy);
  expect_tensor(plan, 23, "model.norm.weight", {32}, "ln_f.weight", ExportOp::kCopy);
  EXPECT_EQ(plan.hf.head_dim, 8);
  EXPECT_EQ(plan.hf.rope_theta, 1000000.0);
  EXPECT_TRUE(plan.hf.tie_word_embeddings);

  config::KeelConfig untied = qwen3();
  untied.mutable_model()->set_tie_embeddings(false);
  const ExportPlan u = plan_export("ck", manifest_of(untied));
  ASSERT_EQ(u.naming, ExportNaming::kQwen3);
  expect_tensor(u, 24, "lm_head.weight", {kVocab, 32}, "lm_head.weight", ExportOp::kRows);
  EXPECT_FALSE(u.hf.tie_word_embeddings);
}

TEST(ExportPlan, LlamaNamesShapesAndConfig) {
  const ExportPlan plan = plan_export("ck", manifest_of(llama()));
  ASSERT_EQ(plan.naming, ExportNaming::kLlama);
  EXPECT_TRUE(plan.mismatches.empty());
  // embed_tokens, 9 per layer (no QK-norm gains), the final norm, the untied LM head.
  ASSERT_EQ(plan.tensors.size(), 1u + 9u * 2u + 2u);
  expect_tensor(plan, 0, "model.embed_tokens.weight", {kVocab, 32}, "wte", ExportOp::kRows);
  expect_tensor(plan, 1, "model.layers.0.self_attn.q_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 0);
  expect_tensor(plan, 2, "model.layers.0.self_attn.k_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 32);
  expect_tensor(plan, 3, "model.layers.0.self_attn.v_proj.weight", {32, 32},
                "blocks.0.attn.qkv.weight", ExportOp::kRows, 64);
  expect_tensor(plan, 4, "model.layers.0.self_attn.o_proj.weight", {32, 32},
                "blocks.0.attn.proj.weight", ExportOp::kCopy);
  expect_tensor(plan, 5, "model.layers.0.mlp.gate_proj.weight", {48, 32},
                "blocks.0.mlp.gate.weight", ExportOp::kCopy);
  expect_tensor(plan, 6, "model.layers.0.mlp.up_proj.weight", {48, 32}, "blocks.0.mlp.fc.weight",
                ExportOp::kCopy);
  expect_tensor(plan, 7, "model.layers.0.mlp.down_proj.weight", {32, 48},
                "blocks.0.mlp.proj.weight", ExportOp::kCopy);
  // Pre-norm, as Qwen3.
  expect_tensor(plan, 8, "model.layers.0.input_layernorm.weight", {32}, "blocks.0.ln1.weight",
                ExportOp::kCopy);
  expect_tensor(plan, 9, "model.layers.0.post_attention_layernorm.weight", {32},
                "blocks.0.ln2.weight", ExportOp::kCopy);
  expect_tensor(plan, 10, "model.layers.1.self_attn.q_proj.weight", {32, 32},
                "blocks.1.attn.qkv.weight", ExportOp::kRows, 0);
  expect_tensor(plan, 19, "model.norm.weight", {32}, "ln_f.weight", ExportOp::kCopy);
  expect_tensor(plan, 20, "lm_head.weight", {kVocab, 32}, "lm_head.weight", ExportOp::kRows);
  const HfConfig& c = plan.hf;
  EXPECT_EQ(c.vocab_size, kVocab);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.max_positions, 24);
  EXPECT_EQ(c.activation, "silu");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_word_embeddings);

  config::KeelConfig tied = llama();
  tied.mutable_model()->set_tie_embeddings(true);
  const ExportPlan t = plan_export("ck", manifest_of(tied));
  ASSERT_EQ(t.naming, ExportNaming::kLlama);
  EXPECT_EQ(t.tensors.size(), plan.tensors.size() - 1);
  EXPECT_EQ(t.tensors.back().name, "model.norm.weight");
  EXPECT_TRUE(t.hf.tie_word_embeddings);
}

// Grouped-query attention: q_proj is q.weight [H, D, C], k_proj and v_proj the two halves of
// kv.weight [2, Hkv, D, C]; every head width is H D or Hkv D (not d_model), and OLMo 2's k_norm
// covers the narrower k projection.
TEST(ExportPlan, GroupedQueryAttentionAndHeadDimShapes) {
  // Llama, 2 k/v heads of 12 (d_model 32, 4 heads): q 48 rows, k and v 24 each, o_proj [32, 48].
  const ExportPlan l = plan_export("ck", manifest_of(with_heads(llama(), 2, 12)));
  ASSERT_EQ(l.naming, ExportNaming::kLlama);
  ASSERT_EQ(l.tensors.size(), 1u + 9u * 2u + 2u);
  expect_tensor(l, 1, "model.layers.0.self_attn.q_proj.weight", {48, 32}, "blocks.0.attn.q.weight",
                ExportOp::kCopy);
  expect_tensor(l, 2, "model.layers.0.self_attn.k_proj.weight", {24, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 0);
  expect_tensor(l, 3, "model.layers.0.self_attn.v_proj.weight", {24, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 24);
  expect_tensor(l, 4, "model.layers.0.self_attn.o_proj.weight", {32, 48},
                "blocks.0.attn.proj.weight", ExportOp::kCopy);
  expect_tensor(l, 12, "model.layers.1.self_attn.v_proj.weight", {24, 32},
                "blocks.1.attn.kv.weight", ExportOp::kRows, 24);
  EXPECT_EQ(l.hf.num_heads, 4);
  EXPECT_EQ(l.hf.num_kv_heads, 2);
  EXPECT_EQ(l.hf.head_dim, 12);
  EXPECT_EQ(l.hf.hidden_size, 32);

  // Qwen3, 2 k/v heads of 12: the [D] QK-norm gains are [12] for q and k alike.
  const ExportPlan q = plan_export("ck", manifest_of(with_heads(qwen3(), 2, 12)));
  ASSERT_EQ(q.naming, ExportNaming::kQwen3);
  ASSERT_EQ(q.tensors.size(), 1u + 11u * 2u + 1u);
  expect_tensor(q, 1, "model.layers.0.self_attn.q_proj.weight", {48, 32}, "blocks.0.attn.q.weight",
                ExportOp::kCopy);
  expect_tensor(q, 2, "model.layers.0.self_attn.k_proj.weight", {24, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 0);
  expect_tensor(q, 3, "model.layers.0.self_attn.v_proj.weight", {24, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 24);
  expect_tensor(q, 4, "model.layers.0.self_attn.o_proj.weight", {32, 48},
                "blocks.0.attn.proj.weight", ExportOp::kCopy);
  expect_tensor(q, 5, "model.layers.0.self_attn.q_norm.weight", {12}, "blocks.0.attn.q_norm.weight",
                ExportOp::kCopy);
  expect_tensor(q, 6, "model.layers.0.self_attn.k_norm.weight", {12}, "blocks.0.attn.k_norm.weight",
                ExportOp::kCopy);
  EXPECT_EQ(q.hf.num_kv_heads, 2);
  EXPECT_EQ(q.hf.head_dim, 12);

  // OLMo 2, multi-query: k and v one head of 8; k_norm's PROJECTION gains [1, 8] are its [8].
  const ExportPlan o = plan_export("ck", manifest_of(with_heads(olmo2(), 1, 0)));
  ASSERT_EQ(o.naming, ExportNaming::kOlmo2);
  ASSERT_EQ(o.tensors.size(), 1u + 11u * 2u + 2u);
  expect_tensor(o, 1, "model.layers.0.self_attn.q_proj.weight", {32, 32}, "blocks.0.attn.q.weight",
                ExportOp::kCopy);
  expect_tensor(o, 2, "model.layers.0.self_attn.k_proj.weight", {8, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 0);
  expect_tensor(o, 3, "model.layers.0.self_attn.v_proj.weight", {8, 32}, "blocks.0.attn.kv.weight",
                ExportOp::kRows, 8);
  expect_tensor(o, 5, "model.layers.0.self_attn.q_norm.weight", {32}, "blocks.0.attn.q_norm.weight",
                ExportOp::kCopy);
  expect_tensor(o, 6, "model.layers.0.self_attn.k_norm.weight", {8}, "blocks.0.attn.k_norm.weight",
                ExportOp::kCopy);
  EXPECT_EQ(o.hf.num_heads, 4);
  EXPECT_EQ(o.hf.num_kv_heads, 1);
  EXPECT_EQ(o.hf.head_dim, 8);

  // A kv.weight of the wrong k/v head count is refused, naming the tensor and both shapes.
  ckpt::Manifest wrong = manifest_of(with_heads(llama(), 2, 12));
  param(wrong, "blocks.1.attn.kv.weight")->set_shape(1, 4);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", wrong); }),
            "ck/manifest.pb: tensor blocks.1.attn.kv.weight has shape [2, 4, 12, 32] in the "
            "checkpoint but [2, 2, 12, 32] in its config");
}

// n_kv_heads = n_heads and head_dim = d_model / n_heads are multi-head attention: the plan is
// the one of n_kv_heads = head_dim = 0, tensor for tensor, and config.json says the same.
TEST(ExportPlan, KvHeadsEqualToHeadsKeepMultiHeadAttentionsPlan) {
  for (const config::KeelConfig& cfg : {gpt2(), olmo2(), qwen3(), llama()}) {
    const ExportPlan base = plan_export("ck", manifest_of(cfg));
    const ExportPlan same = plan_export("ck", manifest_of(with_heads(cfg, 4, 8)));
    ASSERT_NE(base.naming, ExportNaming::kKeel) << cfg.model().DebugString();
    EXPECT_EQ(same.naming, base.naming);
    ASSERT_EQ(same.tensors.size(), base.tensors.size());
    for (size_t i = 0; i < base.tensors.size(); ++i) {
      const ExportTensor &a = base.tensors[i], &b = same.tensors[i];
      EXPECT_EQ(std::tie(a.name, a.shape, a.source, a.op, a.row_begin),
                std::tie(b.name, b.shape, b.source, b.op, b.row_begin))
          << a.name;
    }
    EXPECT_EQ(same.hf.num_kv_heads, 4);
    EXPECT_EQ(same.hf.head_dim, 8);
    EXPECT_EQ(base.hf.num_kv_heads, 4);
    EXPECT_EQ(base.hf.head_dim, 8);
  }
}

TEST(ExportPlan, OtherModelsKeepKeelNamesWithoutThePaddingAndSayWhyForEachArchitecture) {
  // The Gemma 3-style block: GEGLU is none of the three.
  config::KeelConfig cfg = qwen3();
  cfg.mutable_model()->set_mlp(config::GEGLU);
  const ckpt::Manifest m = manifest_of(cfg);
  const ExportPlan plan = plan_export("ck", m);
  ASSERT_EQ(plan.naming, ExportNaming::kKeel);
  ASSERT_EQ(plan.mismatches.size(), 4u);
  EXPECT_EQ(plan.mismatches[0].first, ExportNaming::kGpt2);
  EXPECT_EQ(plan.mismatches[1].first, ExportNaming::kOlmo2);
  EXPECT_EQ(plan.mismatches[2].first, ExportNaming::kQwen3);
  EXPECT_EQ(plan.mismatches[2].second, "model.mlp=GEGLU (Qwen3's MLP is SwiGLU)");
  EXPECT_EQ(plan.mismatches[3].first, ExportNaming::kLlama);
  EXPECT_EQ(plan.mismatches[3].second,
            "model.qk_norm=RMS (Llama has no QK-norm); model.mlp=GEGLU (Llama's MLP is SwiGLU)");
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
    EXPECT_EQ(t.op, vocab ? ExportOp::kRows : ExportOp::kCopy) << t.name;
    if (vocab) {
      EXPECT_EQ(t.shape, (Shape{kVocab, 32})) << t.name;
    }
  }
  // The gated MLP's gate is there, biases and the position table are not.
  auto has = [&](const std::string& n) {
    return std::find(names.begin(), names.end(), n) != names.end();
  };
  EXPECT_TRUE(has("blocks.0.mlp.gate.weight"));
  EXPECT_FALSE(has("wpe"));
  EXPECT_FALSE(has("blocks.0.attn.qkv.bias"));
  EXPECT_FALSE(has("blocks.0.ln1.bias"));

  // An untied GPT-2-like model: its head comes last, cut to the vocabulary.
  config::KeelConfig untied = gpt2();
  untied.mutable_model()->set_tie_embeddings(false);
  const ExportPlan u = plan_export("ck", manifest_of(untied));
  ASSERT_EQ(u.naming, ExportNaming::kKeel);
  EXPECT_EQ(u.mismatches[0].second,
            "model.tie_embeddings=false (GPT-2 ties the LM head to the token embedding)");
  EXPECT_EQ(u.tensors.back().name, "lm_head.weight");
  EXPECT_EQ(u.tensors.back().shape, (Shape{kVocab, 32}));
}

TEST(ExportPlan, ParametersThatDoNotMatchTheConfigAreRefused) {
  ckpt::Manifest missing = manifest_of(gpt2());
  param(missing, "blocks.1.mlp.fc.bias")->set_name("blocks.1.mlp.fc.gain");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", missing); }),
            "ck/manifest.pb: tensor blocks.1.mlp.fc.bias (param) is not in the checkpoint, though "
            "its config has it");

  ckpt::Manifest stray = manifest_of(gpt2());
  ckpt::TensorRecord* extra = stray.add_tensors();
  extra->set_name("blocks.0.attn.q_norm.weight");
  extra->set_kind(ckpt::PARAM);
  extra->add_shape(8);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", stray); }),
            "ck/manifest.pb: tensor blocks.0.attn.q_norm.weight (param) has no place in the "
            "GPT-2 model of its config");

  ckpt::Manifest misshapen = manifest_of(gpt2());
  param(misshapen, "blocks.0.attn.proj.weight")->set_shape(1, 16);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", misshapen); }),
            "ck/manifest.pb: tensor blocks.0.attn.proj.weight has shape [32, 16] in the "
            "checkpoint but [32, 32] in its config");

  ckpt::Manifest short_vocab = manifest_of(qwen3());
  param(short_vocab, "wte")->set_shape(0, 256);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", short_vocab); }),
            "ck/manifest.pb: tensor wte has shape [256, 32], not [>= model.vocab_size=300, "
            "d_model]");

  // OLMo 2: a gate that is not there, a bias that should not be, a Qwen3-shaped QK gain.
  ckpt::Manifest no_gate = manifest_of(olmo2());
  param(no_gate, "blocks.0.mlp.gate.weight")->set_name("blocks.0.mlp.gate_proj.weight");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", no_gate); }),
            "ck/manifest.pb: tensor blocks.0.mlp.gate.weight (param) is not in the checkpoint, "
            "though its config has it");
  ckpt::Manifest biased = manifest_of(olmo2());
  ckpt::TensorRecord* bias = biased.add_tensors();
  bias->set_name("blocks.1.attn.proj.bias");
  bias->set_kind(ckpt::PARAM);
  bias->add_shape(32);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", biased); }),
            "ck/manifest.pb: tensor blocks.1.attn.proj.bias (param) has no place in the OLMo 2 "
            "model of its config");
  ckpt::Manifest shared_gain = manifest_of(olmo2());
  param(shared_gain, "blocks.0.attn.k_norm.weight")->clear_shape();
  param(shared_gain, "blocks.0.attn.k_norm.weight")->add_shape(8);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", shared_gain); }),
            "ck/manifest.pb: tensor blocks.0.attn.k_norm.weight has shape [8] in the checkpoint "
            "but [4, 8] in its config");
  ckpt::Manifest short_head = manifest_of(olmo2());
  param(short_head, "lm_head.weight")->set_shape(1, 16);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { plan_export("ck", short_head); }),
            "ck/manifest.pb: tensor lm_head.weight has shape [384, 16], not [>= 300, "
            "model.d_model=32]");
}

// ---- safetensors header
// --------------------------------------------------------------------------

ExportPlan plan_of(const std::vector<std::pair<std::string, Shape>>& tensors) {
  ExportPlan plan;
  for (const auto& [name, shape] : tensors) {
    ExportTensor t;
    t.name = name;
    t.shape = shape;
    plan.tensors.push_back(t);
  }
  return plan;
}

// A whole file: the header's length, the header, `data_bytes` bytes of data.
std::string file_of(const std::string& header, int64_t data_bytes) {
  const uint64_t n = header.size();
  std::string file(8, '\0');
  std::memcpy(file.data(), &n, 8);
  return file + header + std::string(static_cast<size_t>(data_bytes), '\0');
}

TEST(Safetensors, HeaderIsTheFormatsJsonPaddedToEightBytes) {
  const std::string h =
      encode_safetensors_header(plan_of({{"w", {2}}, {"b", {}}}), {{"format", "pt"}});
  EXPECT_EQ(h,
            "{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\",\"shape\":[2],"
            "\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[8,"
            "12]}}" +
                std::string(6, ' '));
  EXPECT_EQ(h.size() % 8, 0u);
}

TEST(Safetensors, HeaderRoundTrips) {
  const ExportPlan plan = plan_of({{"wte", {300, 32}},
                                   {"h.0.ln_1.weight", {32}},
                                   {"empty", {0, 7}},
                                   {"scalar", {}},
                                   {"wpe", {24, 32}}});
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"keel.step", "20"}};
  const std::string header = encode_safetensors_header(plan, metadata);
  const int64_t data = (300 * 32 + 32 + 0 + 1 + 24 * 32) * 4;
  const std::string file = file_of(header, data);
  const SafetensorsHeader h = decode_safetensors_header(file, file.size(), "m.safetensors");
  EXPECT_EQ(h.header_bytes, static_cast<int64_t>(header.size()));
  EXPECT_EQ(h.data_bytes, data);
  EXPECT_EQ(h.metadata, metadata);
  ASSERT_EQ(h.tensors.size(), plan.tensors.size());
  int64_t offset = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const int64_t bytes = shape_numel(plan.tensors[i].shape) * 4;
    EXPECT_EQ(h.tensors[i], (SafetensorsTensor{plan.tensors[i].name, "F32", plan.tensors[i].shape,
                                               offset, offset + bytes}));
    offset += bytes;
  }
  // The header alone (no file size) reads the same.
  EXPECT_EQ(decode_safetensors_header(file.substr(0, 8 + header.size()), std::nullopt, "m").tensors,
            h.tensors);
}

TEST(Safetensors, MetadataThatIsNotUtf8IsWrittenAsReplacementCharacters) {
  // keel.source is a path; Linux paths are bytes. JSON holds text only.
  const std::string header =
      encode_safetensors_header(plan_of({{"w", {1}}}), {{"keel.source", "/runs/\xff\xfe/ck"}});
  const std::string file = file_of(header, 4);
  EXPECT_EQ(decode_safetensors_header(file, file.size(), "m").metadata.at("keel.source"),
            "/runs/\xEF\xBF\xBD\xEF\xBF\xBD/ck");
}

TEST(Safetensors, PlanNamingATensorTwiceOrTheMetadataIsAnInternalError) {
  EXPECT_NE(error_of(ErrorKind::kInternal,
                     [&] {
                       encode_safetensors_header(plan_of({{"w", {1}}, {"w", {2}}}), {});
                     })
                .find("'w' is reserved, given twice or not UTF-8"),
            std::string::npos);
  error_of(ErrorKind::kInternal, [&] {
    encode_safetensors_header(plan_of({{"__metadata__", {1}}}), {});
  });
  error_of(ErrorKind::kInternal, [&] { encode_safetensors_header(plan_of({{"\xff", {1}}}), {}); });
}

TEST(Safetensors, MalformedHeadersAreDataErrorsNamingTheFileAndReason) {
  const auto refused = [](const std::string& file, std::optional<int64_t> size = std::nullopt) {
    return error_of(ErrorKind::kData, [&] {
      decode_safetensors_header(file, size.value_or(static_cast<int64_t>(file.size())), "m.st");
    });
  };
  const auto with_header = [](const std::string& json, int64_t data = 0) {
    return file_of(json, data);
  };
  const std::string t = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  EXPECT_EQ(decode_safetensors_header(with_header("{" + t + "}", 8), 16 + t.size() + 2, "m.st")
                .tensors.size(),
            1u);
  EXPECT_EQ(refused("1234"),
            "m.st: 4 bytes, shorter than a safetensors file's 8-byte header length");
  std::string huge(8, '\xff');
  EXPECT_EQ(refused(huge),
            "m.st: header length 18446744073709551615 is more than the 100000000 bytes a "
            "safetensors header may have");
  EXPECT_EQ(refused(with_header("{}").substr(0, 9)),
            "m.st: header length 2 runs past the end of the file (1 bytes after the length)");
  EXPECT_EQ(refused(with_header(" {}")), "m.st: the header does not begin with '{'");
  EXPECT_EQ(refused(with_header("{\"a\":")),
            "m.st: the header is not JSON: parse error at line 1, column 6: syntax error while "
            "parsing value - unexpected end of input; expected '[', '{', or a literal");
  EXPECT_EQ(refused(with_header("{" + t + "," + t + "}", 8)),
            "m.st: the header gives the key 't' twice");
  EXPECT_EQ(refused(with_header(
                R"({"t":{"dtype":"F32","dtype":"F32","shape":[],"data_offsets":[0,4]}})", 4)),
            "m.st: the header gives the key 'dtype' twice");
  EXPECT_EQ(refused(with_header("{\"t\":1}")),
            "m.st: tensor 't': not an object of dtype, shape and data_offsets");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F31","shape":[],"data_offsets":[0,4]}})", 4)),
            "m.st: tensor 't': unknown dtype 'F31'");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F32","shape":[],"offsets":[0,4]}})", 4)),
            "m.st: tensor 't': unknown key 'offsets' (expected dtype, shape, data_offsets)");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F32","shape":[]}})")),
            "m.st: tensor 't': no data_offsets");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)),
            "m.st: tensor 't': shape holds -1, not a non-negative integer");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4)),
            "m.st: tensor 't': shape holds 1.5, not a non-negative integer");
  EXPECT_EQ(
      refused(with_header(
          R"({"t":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4)),
      "m.st: tensor 't': shape [4294967296,4294967296] is more than 2^62 bytes");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})")),
            "m.st: tensor 't': data_offsets [8,0] is not [begin, end) with 0 <= begin <= end");
  EXPECT_EQ(refused(with_header(R"({"t":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8)),
            "m.st: tensor 't': data_offsets [0,8] hold 8 bytes, but BF16 [2] is 4");
  EXPECT_EQ(refused(with_header(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                                3)),
            "m.st: tensor 'b' starts at byte 1 of the data, but the tensors before it end at 2 "
            "(overlap)");
  EXPECT_EQ(refused(with_header(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3)),
            "m.st: tensor 'a' starts at byte 1 of the data, but the tensors before it end at 0 "
            "(a hole)");
  EXPECT_EQ(refused(with_header("{" + t + "}", 9)),
            "m.st: 9 bytes of data after the header, but its tensors hold 8 (trailing bytes)");
  EXPECT_EQ(refused(with_header("{" + t + "}", 7)),
            "m.st: 7 bytes of data after the header, but its tensors hold 8 (truncated)");
  EXPECT_EQ(refused(with_header(R"({"__metadata__":{"step":20}})")),
            "m.st: __metadata__ 'step' is not a string");
  EXPECT_EQ(refused(with_header("{\"t\\n\":1}")),
            "m.st: tensor 't?': not an object of dtype, shape and data_offsets");
}

}  // namespace
}  // namespace keel
