// keel-ckpt export's tensor plan: which Hugging Face architecture a model is (every model field
// classified for each), the keel -> GPT-2 / OLMo 2 / Qwen3 / Llama name and layout maps, and the
// values of each exported tensor. See export.h and checkpoints/EXPORT.md.
#include "checkpoints/export.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoints/checkpoint.h"
#include "framework/error.h"
#include "layers/context.h"
#include "layers/norm.h"

namespace keel {

namespace {

constexpr size_t kArchCount = std::size(kHfArchitectures);

size_t arch_index(ExportNaming arch) {
  for (size_t i = 0; i < kArchCount; ++i) {
    if (kHfArchitectures[i] == arch) return i;
  }
  KEEL_FAIL(kInternal, "not a Hugging Face architecture: ", naming_id(arch));
}

// What one model field's value means for one architecture: either the architecture expresses any
// value (its config.json carries it, or it only changes initialisation, or it means nothing given
// the other fields the architecture needs), or it needs one value, with what the architecture
// has instead.
struct FieldRule {
  std::string needs;  // empty: any value; else the value as text format writes it ("RMS", "true")
  std::string why;    // what the architecture has, for the message

  static FieldRule any() { return {}; }
};

// Every field of config::Model, for GPT-2, OLMo 2, Qwen3 and Llama (kHfArchitectures' order). A
// field missing here makes arch_mismatch name it for every architecture, so a new model field
// cannot slip into a Hugging Face export unexamined.
const std::map<std::string, std::array<FieldRule, kArchCount>>& field_rules() {
  const FieldRule any = FieldRule::any();
  static const std::map<std::string, std::array<FieldRule, kArchCount>> rules = {
      // Each config.json expresses any value of these.
      {"vocab_size", {any, any, any, any}},
      {"seq_len", {any, any, any, any}},
      {"d_model", {any, any, any, any}},
      {"n_layers", {any, any, any, any}},
      {"n_heads", {any, any, any, any}},
      // k/v heads (n_heads is compared as 0): num_key_value_heads, which GPT2Config lacks.
      {"n_kv_heads",
       {{{"0", "GPT-2 has multi-head attention: every head has its own k and v"}, any, any, any}}},
      // Head width (d_model / n_heads is compared as 0): Qwen3Config and LlamaConfig take
      // head_dim; GPT2Config and Olmo2Config derive it from the width.
      {"head_dim",
       {{{"0", "GPT-2's head width is d_model / n_heads"},
         {"0", "OLMo 2's head width is d_model / n_heads"},
         any,
         any}}},
      {"d_ff", {any, any, any, any}},
      {"max_positions", {any, any, any, any}},
      // Initialisation only.
      {"init_std", {any, any, any, any}},
      {"qk_norm",
       {{{"NONE", "GPT-2 has no QK-norm"},
         {"RMS", "OLMo 2 RMS-normalises q and k"},
         {"RMS", "Qwen3 RMS-normalises q and k"},
         {"NONE", "Llama has no QK-norm"}}}},
      // GPT-2 and Llama: meaningless without QK-norm, which they need.
      {"qk_norm_scope",
       {{any,
         {"PROJECTION", "OLMo 2 normalises q and k over the whole projection, all heads at once"},
         {"HEAD_SHARED", "Qwen3 normalises each head with one gain shared by all heads"},
         any}}},
      // OLMo 2, Qwen3 and Llama: tie_word_embeddings.
      {"tie_embeddings",
       {{{"true", "GPT-2 ties the LM head to the token embedding"}, any, any, any}}},
      {"norm",
       {{{"LAYERNORM", "GPT-2 uses LayerNorm"},
         {"RMSNORM", "OLMo 2 uses RMSNorm"},
         {"RMSNORM", "Qwen3 uses RMSNorm"},
         {"RMSNORM", "Llama uses RMSNorm"}}}},
      {"position",
       {{{"LEARNED", "GPT-2 learns absolute positions"},
         {"ROPE", "OLMo 2 uses rotary positions"},
         {"ROPE", "Qwen3 uses rotary positions"},
         {"ROPE", "Llama uses rotary positions"}}}},
      // GPT-2: meaningless with learned positions; the others: rope_theta.
      {"rope_theta", {any, any, any, any}},
      {"mlp",
       {{{"GELU", "GPT-2's MLP is GELU"},
         {"SWIGLU", "OLMo 2's MLP is SwiGLU"},
         {"SWIGLU", "Qwen3's MLP is SwiGLU"},
         {"SWIGLU", "Llama's MLP is SwiGLU"}}}},
      {"bias",
       {{{"true", "GPT-2 has biases in every linear layer and norm"},
         {"false", "OLMo 2 has no biases"},
         {"false", "Qwen3 has no biases"},
         {"false", "Llama has no biases"}}}},
      {"norm_placement",
       {{{"PRE", "GPT-2 normalises each sublayer's input"},
         {"POST_SUBLAYER", "OLMo 2 normalises each sublayer's output"},
         {"PRE", "Qwen3 normalises each sublayer's input"},
         {"PRE", "Llama normalises each sublayer's input"}}}},
  };
  return rules;
}

// A scalar model field's value as text format writes it.
std::string field_text(const config::Model& m, const google::protobuf::FieldDescriptor* f) {
  const google::protobuf::Reflection* r = m.GetReflection();
  using FD = google::protobuf::FieldDescriptor;
  switch (f->cpp_type()) {
    case FD::CPPTYPE_ENUM:
      return std::string(r->GetEnum(m, f)->name());
    case FD::CPPTYPE_BOOL:
      return r->GetBool(m, f) ? "true" : "false";
    case FD::CPPTYPE_INT32:
      return std::to_string(r->GetInt32(m, f));
    case FD::CPPTYPE_INT64:
      return std::to_string(r->GetInt64(m, f));
    case FD::CPPTYPE_FLOAT:
      return std::to_string(r->GetFloat(m, f));
    case FD::CPPTYPE_DOUBLE:
      return std::to_string(r->GetDouble(m, f));
    default:
      KEEL_FAIL(kInternal, "model.", f->name(), ": a field kind keel-ckpt export cannot compare");
  }
}

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

// Parameters keel stores with padded vocabulary rows (Note [export vocab rows]).
bool vocab_padded(const std::string& name) { return name == "wte" || name == "lm_head.weight"; }

ExportPlan keel_plan(const ckpt::Manifest& m, int64_t V, const std::string& where) {
  ExportPlan plan;
  plan.naming = ExportNaming::kKeel;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.kind() != ckpt::PARAM) continue;
    if (vocab_padded(t.name())) {
      plan.tensors.push_back({t.name(), vocab_shape(t, V, where), t.name(), ExportOp::kRows});
    } else {
      plan.tensors.push_back({t.name(), shape_of(t), t.name(), ExportOp::kCopy});
    }
  }
  return plan;
}

// One exported tensor of a Hugging Face plan, with the shape its keel source must have.
struct Entry {
  std::string source, name;
  Shape source_shape, shape;
  ExportOp op;
  int64_t row_begin = 0;
};

// The plan's tensors: `vocab` entries take the first V rows of a [>= V, C] source; every source
// must exist with its expected shape, and every parameter of the checkpoint must be used.
void add_entries(ExportPlan& plan, const std::vector<Entry>& entries, const ckpt::Manifest& m,
                 const ModelDims& d, const std::string& where) {
  std::set<std::string> used;
  for (const Entry& e : entries) {
    const ckpt::TensorRecord* t = find_param(m, e.source);
    KEEL_CHECK(t, kData, where, ": tensor ", e.source,
               " (param) is not in the checkpoint, though its config has it");
    if (vocab_padded(e.source)) {
      const Shape shape = vocab_shape(*t, d.V, where);
      KEEL_CHECK(shape[1] == d.C, kData, where, ": tensor ", e.source, " has shape ",
                 shape_str(shape_of(*t)), ", not [>= ", d.V, ", model.d_model=", d.C, "]");
    } else {
      KEEL_CHECK(shape_of(*t) == e.source_shape, kData, where, ": tensor ", e.source, " has shape ",
                 shape_str(shape_of(*t)), " in the checkpoint but ", shape_str(e.source_shape),
                 " in its config");
    }
    plan.tensors.push_back({e.name, e.shape, e.source, e.op, e.row_begin});
    used.insert(e.source);
  }
  for (const ckpt::TensorRecord& t : m.tensors()) {
    KEEL_CHECK(t.kind() != ckpt::PARAM || used.count(t.name()), kData, where, ": tensor ", t.name(),
               " (param) has no place in the ", naming_title(plan.naming), " model of its config");
  }
}

HfConfig hf_config(const ModelDims& d, const char* activation) {
  return {.vocab_size = d.V,
          .max_positions = d.P,
          .hidden_size = d.C,
          .num_layers = d.L,
          .num_heads = d.H,
          .num_kv_heads = d.Hkv,
          .head_dim = d.D,
          .intermediate_size = d.F,
          .activation = activation,
          .norm_eps = kBlockNormEps,
          .rope_theta = d.rope_theta,
          .tie_word_embeddings = d.tied,
          .initializer_range = d.init_std};
}

ExportPlan gpt2_plan(const ckpt::Manifest& m, const ModelDims& d, const std::string& where) {
  ExportPlan plan;
  plan.naming = ExportNaming::kGpt2;
  // kernels::gelu_scalar: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), which is
  // transformers' NewGELUActivation ("gelu_new").
  plan.hf = hf_config(d, "gelu_new");
  const int64_t C = d.C, F = d.F, HD = d.H * d.D;
  // wte first, as GPT-2 lists it; the LM head is tied to it (no tensor of its own).
  std::vector<Entry> entries;
  entries.push_back({"wte", "transformer.wte.weight", {}, {d.V, C}, ExportOp::kRows});
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
  add_entries(plan, entries, m, d, where);
  return plan;
}

// OLMo 2, Qwen3 and Llama share Llama's names; they differ in where the block norms sit and in the
// QK-norm gains (OLMo 2: over the projection; Qwen3: per head; Llama: none). All three use
// nn.Linear's [out, in], keel's layout, so nothing is transposed. RoPE needs no reordering of q's
// or k's rows: keel rotates (x[i], x[i + D/2]) within each head (Note [rope-convention] in
// framework/kernels/rope.h), as their rotate_half does.
ExportPlan llama_like_plan(ExportNaming arch, const ckpt::Manifest& m, const ModelDims& d,
                           const std::string& where) {
  ExportPlan plan;
  plan.naming = arch;
  plan.hf = hf_config(d, "silu");
  const bool olmo2 = arch == ExportNaming::kOlmo2;
  const bool qk_norm = arch != ExportNaming::kLlama;
  // Widths: C the residual stream, HD q's and the attention output's, KD k's and v's.
  const int64_t C = d.C, F = d.F, HD = d.H * d.D, KD = d.Hkv * d.D;
  std::vector<Entry> entries;
  entries.push_back({"wte", "model.embed_tokens.weight", {}, {d.V, C}, ExportOp::kRows});
  // OLMo 2 normalises the whole q and the whole k projection: keel's PROJECTION gains [H, D] and
  // [Hkv, D] are its [H D] and [Hkv D] gains, heads in order. Qwen3 normalises each head with one
  // [D] gain: keel's HEAD_SHARED gain, the same for q and k.
  const Shape q_gain = olmo2 ? Shape{d.H, d.D} : Shape{d.D};
  const Shape k_gain = olmo2 ? Shape{d.Hkv, d.D} : Shape{d.D};
  const Shape q_gain_hf = olmo2 ? Shape{HD} : Shape{d.D};
  const Shape k_gain_hf = olmo2 ? Shape{KD} : Shape{d.D};
  for (int64_t l = 0; l < d.L; ++l) {
    const std::string k = "blocks." + std::to_string(l);
    const std::string h = "model.layers." + std::to_string(l);
    if (!d.gqa()) {
      // qkv.weight [3, H, D, C] viewed as [3 H D, C]: rows [0, HD) are q (heads in order, D rows
      // each, as q_proj's output is split into heads), then k, then v.
      const char* qkv_names[] = {".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                 ".self_attn.v_proj.weight"};
      for (int64_t i = 0; i < 3; ++i) {
        entries.push_back({k + ".attn.qkv.weight",
                           h + qkv_names[i],
                           {3, d.H, d.D, C},
                           {HD, C},
                           ExportOp::kRows,
                           i * HD});
      }
    } else {
      // Grouped-query (Note [gqa layouts] in layers/attention.h): q.weight [H, D, C] is q_proj;
      // kv.weight [2, Hkv, D, C] viewed as [2 Hkv D, C] is k_proj's rows, then v_proj's, k/v
      // heads in order as the architectures split them (query head j reads k/v head
      // j / (H / Hkv) in both, transformers' repeat_kv).
      entries.push_back({k + ".attn.q.weight",
                         h + ".self_attn.q_proj.weight",
                         {d.H, d.D, C},
                         {HD, C},
                         ExportOp::kCopy});
      entries.push_back({k + ".attn.kv.weight",
                         h + ".self_attn.k_proj.weight",
                         {2, d.Hkv, d.D, C},
                         {KD, C},
                         ExportOp::kRows,
                         0});
      entries.push_back({k + ".attn.kv.weight",
                         h + ".self_attn.v_proj.weight",
                         {2, d.Hkv, d.D, C},
                         {KD, C},
                         ExportOp::kRows,
                         KD});
    }
    entries.push_back({k + ".attn.proj.weight",
                       h + ".self_attn.o_proj.weight",
                       {C, HD},
                       {C, HD},
                       ExportOp::kCopy});
    if (qk_norm) {
      entries.push_back({k + ".attn.q_norm.weight", h + ".self_attn.q_norm.weight", q_gain,
                         q_gain_hf, ExportOp::kCopy});
      entries.push_back({k + ".attn.k_norm.weight", h + ".self_attn.k_norm.weight", k_gain,
                         k_gain_hf, ExportOp::kCopy});
    }
    // keel's mlp.gate is gate_proj (through the activation), mlp.fc is up_proj, mlp.proj down_proj.
    entries.push_back(
        {k + ".mlp.gate.weight", h + ".mlp.gate_proj.weight", {F, C}, {F, C}, ExportOp::kCopy});
    entries.push_back(
        {k + ".mlp.fc.weight", h + ".mlp.up_proj.weight", {F, C}, {F, C}, ExportOp::kCopy});
    entries.push_back(
        {k + ".mlp.proj.weight", h + ".mlp.down_proj.weight", {C, F}, {C, F}, ExportOp::kCopy});
    // keel's ln1 and ln2 are the attention and MLP sublayers' norms wherever they sit: before
    // the sublayer (Qwen3 and Llama: input_layernorm, post_attention_layernorm, the norm between
    // attention and MLP) or after it (OLMo 2: post_attention_layernorm,
    // post_feedforward_layernorm).
    const std::string ln1 = olmo2 ? ".post_attention_layernorm" : ".input_layernorm";
    const std::string ln2 = olmo2 ? ".post_feedforward_layernorm" : ".post_attention_layernorm";
    entries.push_back({k + ".ln1.weight", h + ln1 + ".weight", {C}, {C}, ExportOp::kCopy});
    entries.push_back({k + ".ln2.weight", h + ln2 + ".weight", {C}, {C}, ExportOp::kCopy});
  }
  entries.push_back({"ln_f.weight", "model.norm.weight", {C}, {C}, ExportOp::kCopy});
  // Tied: no tensor of its own, as save_pretrained writes it (tie_word_embeddings in config.json).
  if (!d.tied)
    entries.push_back({"lm_head.weight", "lm_head.weight", {}, {d.V, C}, ExportOp::kRows});
  add_entries(plan, entries, m, d, where);
  return plan;
}

}  // namespace

const char* naming_id(ExportNaming n) {
  switch (n) {
    case ExportNaming::kKeel:
      return "keel";
    case ExportNaming::kGpt2:
      return "gpt2";
    case ExportNaming::kOlmo2:
      return "olmo2";
    case ExportNaming::kQwen3:
      return "qwen3";
    case ExportNaming::kLlama:
      return "llama";
  }
  return "?";
}

const char* naming_title(ExportNaming n) {
  switch (n) {
    case ExportNaming::kKeel:
      return "keel";
    case ExportNaming::kGpt2:
      return "GPT-2";
    case ExportNaming::kOlmo2:
      return "OLMo 2";
    case ExportNaming::kQwen3:
      return "Qwen3";
    case ExportNaming::kLlama:
      return "Llama";
  }
  return "?";
}

std::string arch_mismatch(ExportNaming arch, const config::Model& model) {
  const size_t a = arch_index(arch);
  // n_kv_heads = n_heads and head_dim = d_model / n_heads build the model their 0 builds (the same
  // parameters, the same checkpoint), so they are compared as 0.
  config::Model m = model;
  if (m.n_kv_heads() == m.n_heads()) m.set_n_kv_heads(0);
  if (m.n_heads() > 0 && m.head_dim() * m.n_heads() == m.d_model()) m.set_head_dim(0);
  std::string out;
  auto add = [&](const std::string& why) { out += (out.empty() ? "" : "; ") + why; };
  const google::protobuf::Descriptor* desc = config::Model::descriptor();
  for (int i = 0; i < desc->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = desc->field(i);
    const std::string name(f->name());
    const auto it = field_rules().find(name);
    if (it == field_rules().end()) {
      add("model." + name + " (a field keel-ckpt export does not know)");
      continue;
    }
    const FieldRule& rule = it->second[a];
    if (rule.needs.empty()) continue;
    const std::string value = field_text(m, f);
    if (value != rule.needs) add("model." + name + "=" + value + " (" + rule.why + ")");
  }
  return out;
}

ExportPlan plan_export(const std::string& dir, const ckpt::Manifest& m) {
  const std::string where = dir + "/manifest.pb";
  const ModelDims d = ModelDims::from(m.config().model(), 1, Topology{});
  std::vector<std::pair<ExportNaming, std::string>> mismatches;
  for (ExportNaming arch : kHfArchitectures) {
    const std::string why = arch_mismatch(arch, m.config().model());
    if (!why.empty()) {
      mismatches.emplace_back(arch, why);
      continue;
    }
    return arch == ExportNaming::kGpt2 ? gpt2_plan(m, d, where)
                                       : llama_like_plan(arch, m, d, where);
  }
  ExportPlan plan = keel_plan(m, d.V, where);
  plan.mismatches = std::move(mismatches);
  return plan;
}

std::vector<float> export_values(const std::string& dir, const ckpt::Manifest& m,
                                 const ExportTensor& t) {
  std::vector<float> src = read_logical_tensor(dir, m, t.source, ckpt::PARAM);
  const int64_t n = shape_numel(t.shape);
  switch (t.op) {
    case ExportOp::kCopy:
      KEEL_ASSERT(static_cast<int64_t>(src.size()) == n);
      return src;
    case ExportOp::kRows: {
      KEEL_ASSERT(t.shape.size() == 2);
      const int64_t begin = t.row_begin * t.shape[1];
      KEEL_ASSERT(begin >= 0 && static_cast<int64_t>(src.size()) >= begin + n);
      return std::vector<float>(src.begin() + begin, src.begin() + begin + n);
    }
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

// ---- safetensors
// ---------------------------------------------------------------------------------

namespace {

constexpr const char* kMetadataKey = "__metadata__";

// Bytes per element of a safetensors dtype; 0 for a name the format does not have.
int64_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// Whether JSON can hold `s` as it is (it is UTF-8).
bool json_text(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// `s` for a one-line message: control characters as '?', clipped (clip_echo).
std::string echo(std::string s) {
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  std::string out = "'";  // += rather than an operator+ chain: GCC 12 warns falsely on that
  out += clip_echo(s);
  out += '\'';
  return out;
}

// A JSON number that is a non-negative integer within int64, or -1.
int64_t count_of(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? -1
                                                                          : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return std::max<int64_t>(-1, v.get<int64_t>());
  return -1;
}

// nlohmann's message without its "[json.exception...] " tag and the "; last read: ..." echo of
// the input (which may run long).
std::string json_reason(const std::string& what) {
  std::string r = what;
  if (!r.empty() && r[0] == '[') {
    const size_t close = r.find("] ");
    if (close != std::string::npos) r = r.substr(close + 2);
  }
  const size_t echo_at = r.find("; last read");
  if (echo_at != std::string::npos) r = r.substr(0, echo_at);
  for (char& c : r) {
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  }
  return r;
}

SafetensorsTensor tensor_entry(const std::string& name, const nlohmann::json& v,
                               const std::string& path) {
  const std::string where = path + ": tensor " + echo(name);
  KEEL_CHECK(v.is_object(), kData, where, ": not an object of dtype, shape and data_offsets");
  for (const auto& [key, value] : v.items()) {
    (void)value;
    KEEL_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", kData, where,
               ": unknown key ", echo(key), " (expected dtype, shape, data_offsets)");
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    KEEL_CHECK(v.contains(key), kData, where, ": no ", key);
  }
  SafetensorsTensor t;
  t.name = name;
  const nlohmann::json& dtype = v["dtype"];
  KEEL_CHECK(dtype.is_string(), kData, where, ": dtype is not a string");
  t.dtype = dtype.get<std::string>();
  const int64_t elem = dtype_bytes(t.dtype);
  KEEL_CHECK(elem > 0, kData, where, ": unknown dtype ", echo(t.dtype));
  const nlohmann::json& shape = v["shape"];
  KEEL_CHECK(shape.is_array(), kData, where, ": shape is not a list");
  // Elements and bytes stay below 2^62: no product or sum below overflows.
  constexpr int64_t kMaxBytes = int64_t{1} << 62;
  int64_t bytes = elem;
  for (const nlohmann::json& d : shape) {
    const int64_t dim = count_of(d);
    KEEL_CHECK(dim >= 0, kData, where, ": shape holds ", clip_echo(d.dump()),
               ", not a non-negative integer");
    KEEL_CHECK(dim == 0 || bytes <= kMaxBytes / dim, kData, where, ": shape ",
               clip_echo(shape.dump()), " is more than 2^62 bytes");
    bytes *= dim;
    t.shape.push_back(dim);
  }
  const nlohmann::json& offsets = v["data_offsets"];
  KEEL_CHECK(offsets.is_array() && offsets.size() == 2, kData, where,
             ": data_offsets is not a list of two offsets");
  t.begin = count_of(offsets[0]);
  t.end = count_of(offsets[1]);
  KEEL_CHECK(t.begin >= 0 && t.end >= t.begin, kData, where, ": data_offsets ",
             clip_echo(offsets.dump()), " is not [begin, end) with 0 <= begin <= end");
  KEEL_CHECK(t.end - t.begin == bytes, kData, where, ": data_offsets ", clip_echo(offsets.dump()),
             " hold ", t.end - t.begin, " bytes, but ", t.dtype, " ", clip_echo(shape.dump()),
             " is ", bytes);
  return t;
}

}  // namespace

std::string encode_safetensors_header(const ExportPlan& plan,
                                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h;
  for (const auto& [key, value] : metadata) {
    (void)value;
    KEEL_CHECK(json_text(key), kInternal, "safetensors metadata key ", echo(key), " is not UTF-8");
  }
  h[kMetadataKey] = metadata;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const ExportTensor& t : plan.tensors) {
    KEEL_CHECK(t.name != kMetadataKey && names.insert(t.name).second && json_text(t.name),
               kInternal, "export plan: tensor name ", echo(t.name),
               " is reserved, given twice or not UTF-8");
    const int64_t bytes = shape_numel(t.shape) * static_cast<int64_t>(sizeof(float));
    h[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string s = h.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  s.append((8 - s.size() % 8) % 8, ' ');
  return s;
}

SafetensorsHeader decode_safetensors_header(std::string_view head,
                                            std::optional<int64_t> file_bytes,
                                            const std::string& path) {
  const int64_t size = file_bytes.value_or(static_cast<int64_t>(head.size()));
  KEEL_CHECK(head.size() >= 8 && size >= 8, kData, path, ": ", size,
             " bytes, shorter than a safetensors file's 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, head.data(), 8);  // little-endian, as this host
  KEEL_CHECK(n <= static_cast<uint64_t>(kMaxSafetensorsHeaderBytes), kData, path,
             ": header length ", n, " is more than the ", kMaxSafetensorsHeaderBytes,
             " bytes a safetensors header may have");
  SafetensorsHeader out;
  out.header_bytes = static_cast<int64_t>(n);
  KEEL_CHECK(8 + out.header_bytes <= size, kData, path, ": header length ", n,
             " runs past the end of the file (", size - 8, " bytes after the length)");
  KEEL_CHECK(8 + out.header_bytes <= static_cast<int64_t>(head.size()), kData, path, ": only ",
             head.size(), " bytes read of the ", 8 + out.header_bytes, " the header needs");
  const std::string_view text = head.substr(8, static_cast<size_t>(n));
  KEEL_CHECK(!text.empty() && text[0] == '{', kData, path, ": the header does not begin with '{'");

  // nlohmann keeps the last of keys given twice: a callback sees every key of every object.
  std::vector<std::set<std::string>> keys;  // one set per object being parsed
  std::string twice;
  const nlohmann::json::parser_callback_t on_event = [&](int, nlohmann::json::parse_event_t event,
                                                         nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == E::key && !keys.empty() && twice.empty() &&
               !keys.back().insert(parsed.get<std::string>()).second) {
      twice = parsed.get<std::string>();
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end(), on_event);
  } catch (const nlohmann::json::exception& e) {
    KEEL_FAIL(kData, path, ": the header is not JSON: ", json_reason(e.what()));
  }
  KEEL_CHECK(twice.empty(), kData, path, ": the header gives the key ", echo(twice), " twice");
  KEEL_CHECK(j.is_object(), kData, path, ": the header is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key == kMetadataKey) {
      KEEL_CHECK(value.is_object(), kData, path, ": ", kMetadataKey, " is not an object");
      for (const auto& [k, v] : value.items()) {
        KEEL_CHECK(v.is_string(), kData, path, ": ", kMetadataKey, " ", echo(k),
                   " is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    out.tensors.push_back(tensor_entry(key, value, path));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  for (const SafetensorsTensor& t : out.tensors) {
    KEEL_CHECK(t.begin == out.data_bytes, kData, path, ": tensor ", echo(t.name),
               " starts at byte ", t.begin, " of the data, but the tensors before it end at ",
               out.data_bytes, t.begin < out.data_bytes ? " (overlap)" : " (a hole)");
    out.data_bytes = t.end;
  }
  if (file_bytes) {
    const int64_t data = *file_bytes - 8 - out.header_bytes;
    KEEL_CHECK(data == out.data_bytes, kData, path, ": ", data,
               " bytes of data after the header, but its tensors hold ", out.data_bytes,
               data < out.data_bytes ? " (truncated)" : " (trailing bytes)");
  }
  return out;
}

}  // namespace keel
