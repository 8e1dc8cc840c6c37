// keel-ckpt export's tensor plan: the GPT-2 check, the keel -> GPT-2 name and layout map, and the
// values of each exported tensor. See export.h and checkpoints/EXPORT.md.
#include "checkpoints/export.h"

#include <google/protobuf/descriptor.h>

#include <set>

#include "checkpoints/checkpoint.h"
#include "framework/error.h"
#include "layers/context.h"
#include "layers/norm.h"

namespace keel {

namespace {

// Every field of config::Model, by what it does to the function the model computes. A field
// missing here makes gpt2_mismatch name it, so a new model field cannot slip into a GPT-2 export
// unexamined.
const std::set<std::string>& known_model_fields() {
  static const std::set<std::string> fields = {
      // GPT2Config expresses any value of these.
      "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff", "max_positions",
      // Initialisation only.
      "init_std",
      // Checked below.
      "qk_norm", "qk_norm_scope", "tie_embeddings", "norm"};
  return fields;
}

// Parameters keel stores with padded vocabulary rows (Note [export vocab rows]).
bool vocab_padded(const std::string& name) { return name == "wte" || name == "lm_head.weight"; }

const ckpt::TensorRecord* find_param(const ckpt::Manifest& m, const std::string& name) {
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.kind() == ckpt::PARAM && t.name() == name) return &t;
  }
  return nullptr;
}

Shape shape_of(const ckpt::TensorRecord& t) { return Shape(t.shape().begin(), t.shape().end()); }

// A parameter whose rows are vocabulary: [Vp, C] with Vp >= V. Returns the exported [V, C].
Shape vocab_shape(const ckpt::TensorRecord& t, int64_t V, const std::string& where) {
  const Shape s = shape_of(t);
  KEEL_CHECK(s.size() == 2 && s[0] >= V, kData, where, ": tensor ", t.name(), " has shape ",
             shape_str(s), ", not [>= model.vocab_size=", V, ", d_model]");
  return {V, s[1]};
}

ExportPlan keel_plan(const ckpt::Manifest& m, int64_t V, const std::string& where) {
  ExportPlan plan;
  plan.naming = ExportNaming::kKeel;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.kind() != ckpt::PARAM) continue;
    if (vocab_padded(t.name())) {
      plan.tensors.push_back({t.name(), vocab_shape(t, V, where), t.name(), ExportOp::kVocabRows});
    } else {
      plan.tensors.push_back({t.name(), shape_of(t), t.name(), ExportOp::kCopy});
    }
  }
  return plan;
}

ExportPlan gpt2_plan(const ckpt::Manifest& m, const ModelDims& d, const std::string& where) {
  ExportPlan plan;
  plan.naming = ExportNaming::kGpt2;
  plan.gpt2 = {.vocab_size = d.V,
               .n_positions = d.P,
               .n_embd = d.C,
               .n_layer = d.L,
               .n_head = d.H,
               .n_inner = d.F,
               // kernels::gelu_scalar: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), which is
               // transformers' NewGELUActivation.
               .activation_function = "gelu_new",
               .layer_norm_epsilon = kBlockNormEps};
  // keel source -> (GPT-2 name, the source's expected shape, op, exported shape).
  struct Entry {
    std::string source, name;
    Shape source_shape, shape;
    ExportOp op;
  };
  const int64_t C = d.C, F = d.F, HD = d.H * d.D;
  std::vector<Entry> entries;
  entries.push_back({"wpe", "transformer.wpe.weight", {d.P, C}, {d.P, C}, ExportOp::kCopy});
  auto norm = [&](const std::string& keel, const std::string& hf) {
    entries.push_back({keel + ".weight", hf + ".weight", {C}, {C}, ExportOp::kCopy});
    entries.push_back({keel + ".bias", hf + ".bias", {C}, {C}, ExportOp::kCopy});
  };
  for (int64_t l = 0; l < d.L; ++l) {
    const std::string k = "blocks." + std::to_string(l), h = "transformer.h." + std::to_string(l);
    norm(k + ".ln1", h + ".ln_1");
    // qkv.weight [3, H, D, C] is the [out, in] matrix [3 H D, C] whose rows are q of every head,
    // then k, then v, head-major: exactly GPT-2's c_attn output columns (split into q, k, v,
    // then each into heads of D), once transposed to Conv1D's [in, out].
    entries.push_back({k + ".attn.qkv.weight",
                       h + ".attn.c_attn.weight",
                       {3, d.H, d.D, C},
                       {C, 3 * HD},
                       ExportOp::kTranspose});
    entries.push_back(
        {k + ".attn.qkv.bias", h + ".attn.c_attn.bias", {3, d.H, d.D}, {3 * HD}, ExportOp::kCopy});
    // proj.weight [C, H D]: its input columns are the heads concatenated, as GPT-2 merges them.
    entries.push_back({k + ".attn.proj.weight",
                       h + ".attn.c_proj.weight",
                       {C, HD},
                       {HD, C},
                       ExportOp::kTranspose});
    entries.push_back({k + ".attn.proj.bias", h + ".attn.c_proj.bias", {C}, {C}, ExportOp::kCopy});
    norm(k + ".ln2", h + ".ln_2");
    entries.push_back(
        {k + ".mlp.fc.weight", h + ".mlp.c_fc.weight", {F, C}, {C, F}, ExportOp::kTranspose});
    entries.push_back({k + ".mlp.fc.bias", h + ".mlp.c_fc.bias", {F}, {F}, ExportOp::kCopy});
    entries.push_back(
        {k + ".mlp.proj.weight", h + ".mlp.c_proj.weight", {C, F}, {F, C}, ExportOp::kTranspose});
    entries.push_back({k + ".mlp.proj.bias", h + ".mlp.c_proj.bias", {C}, {C}, ExportOp::kCopy});
  }
  norm("ln_f", "transformer.ln_f");

  // wte first, as GPT-2 lists it; the LM head is tied to it (no tensor of its own).
  const ckpt::TensorRecord* wte = find_param(m, "wte");
  KEEL_CHECK(wte, kData, where, ": tensor wte (param) is not in the checkpoint");
  const Shape wte_shape = vocab_shape(*wte, d.V, where);
  KEEL_CHECK(wte_shape[1] == C, kData, where, ": tensor wte has shape ", shape_str(shape_of(*wte)),
             ", not [>= ", d.V, ", model.d_model=", C, "]");
  plan.tensors.push_back({"transformer.wte.weight", wte_shape, "wte", ExportOp::kVocabRows});
  std::set<std::string> used = {"wte"};
  for (const Entry& e : entries) {
    const ckpt::TensorRecord* t = find_param(m, e.source);
    KEEL_CHECK(t, kData, where, ": tensor ", e.source,
               " (param) is not in the checkpoint, though its config has it");
    KEEL_CHECK(shape_of(*t) == e.source_shape, kData, where, ": tensor ", e.source, " has shape ",
               shape_str(shape_of(*t)), " in the checkpoint but ", shape_str(e.source_shape),
               " in its config");
    plan.tensors.push_back({e.name, e.shape, e.source, e.op});
    used.insert(e.source);
  }
  for (const ckpt::TensorRecord& t : m.tensors()) {
    KEEL_CHECK(t.kind() != ckpt::PARAM || used.count(t.name()), kData, where, ": tensor ", t.name(),
               " (param) has no place in a GPT-2-shaped model of its config");
  }
  return plan;
}

}  // namespace

std::string gpt2_mismatch(const config::Model& m) {
  std::vector<std::string> why;
  if (m.qk_norm() != config::NONE) {
    why.push_back("model.qk_norm=" + config::QkNorm_Name(m.qk_norm()) + " (GPT-2 has no QK-norm)");
  }
  if (m.norm() != config::LAYERNORM) {
    why.push_back("model.norm=" + config::NormKind_Name(m.norm()) + " (GPT-2 uses LayerNorm)");
  }
  if (!m.tie_embeddings()) {
    why.push_back("model.tie_embeddings=false (GPT-2 ties the LM head to the token embedding)");
  }
  const google::protobuf::Descriptor* desc = config::Model::descriptor();
  for (int i = 0; i < desc->field_count(); ++i) {
    const std::string name(desc->field(i)->name());
    if (!known_model_fields().count(name)) {
      why.push_back("model." + name + " (a field keel-ckpt export does not know)");
    }
  }
  std::string out;
  for (const std::string& w : why) out += (out.empty() ? "" : "; ") + w;
  return out;
}

ExportPlan plan_export(const std::string& dir, const ckpt::Manifest& m) {
  const std::string where = dir + "/manifest.pb";
  const ModelDims d = ModelDims::from(m.config().model(), 1, Topology{});
  const std::string why = gpt2_mismatch(m.config().model());
  if (!why.empty()) {
    ExportPlan plan = keel_plan(m, d.V, where);
    plan.not_gpt2 = why;
    return plan;
  }
  return gpt2_plan(m, d, where);
}

std::vector<float> export_values(const std::string& dir, const ckpt::Manifest& m,
                                 const ExportTensor& t) {
  std::vector<float> src = read_logical_tensor(dir, m, t.source, ckpt::PARAM);
  const int64_t n = shape_numel(t.shape);
  switch (t.op) {
    case ExportOp::kCopy:
      KEEL_ASSERT(static_cast<int64_t>(src.size()) == n);
      return src;
    case ExportOp::kVocabRows:
      KEEL_ASSERT(static_cast<int64_t>(src.size()) >= n);
      src.resize(static_cast<size_t>(n));
      return src;
    case ExportOp::kTranspose: {
      KEEL_ASSERT(t.shape.size() == 2 && static_cast<int64_t>(src.size()) == n);
      const int64_t rows = t.shape[1], cols = t.shape[0];  // of the source matrix
      std::vector<float> out(static_cast<size_t>(n));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = src[r * cols + c];
      }
      return out;
    }
  }
  KEEL_FAIL(kInternal, "unknown export op");
}

}  // namespace keel
