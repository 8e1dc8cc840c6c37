// What `keel-ckpt export` writes: every parameter of a checkpoint as one whole f32 tensor, under
// the names and layouts of the Hugging Face architecture the model matches exactly (GPT-2,
// OLMo 2, Qwen3 or Llama), so that transformers computes the same logits, or under keel's own names
// when none matches (see checkpoints/EXPORT.md). This file decides names, shapes, values and the
// config.json values, and reads and writes the safetensors header; the command writes the files
// (safetensors, config.json) in launch/keel_ckpt_main.cc.
//
// Note [export vocab rows]: the token embedding (and an untied LM head) is stored with the
// vocabulary padded to Vp rows for the TP layout that wrote it (Note [vocab padding] in
// layers/gpt.cc). Rows >= model.vocab_size are never looked up (tokens < vocab_size) and never
// predicted (their logits are left out of the loss), so they are not vocabulary: export keeps the
// first vocab_size rows only, and the result does not depend on the writer's TP size.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoints/manifest.pb.h"
#include "framework/config/keel.pb.h"
#include "framework/tensor.h"

namespace keel {

enum class ExportNaming {
  kKeel,   // keel's logical names and layouts (layers/*.cc); any model
  kGpt2,   // Hugging Face GPT2LMHeadModel
  kOlmo2,  // Hugging Face Olmo2ForCausalLM
  kQwen3,  // Hugging Face Qwen3ForCausalLM
  kLlama,  // Hugging Face LlamaForCausalLM
};

// The Hugging Face architectures export can write, in the order it reports on them. There is no
// flag to choose: at most one matches a model. GPT-2 needs learned positions and the others RoPE;
// OLMo 2 normalises each sublayer's output where Qwen3 and Llama normalise its input; Qwen3
// RMS-normalises q and k per head where Llama has no QK-norm.
inline constexpr ExportNaming kHfArchitectures[] = {ExportNaming::kGpt2, ExportNaming::kOlmo2,
                                                    ExportNaming::kQwen3, ExportNaming::kLlama};

// "keel", "gpt2", "olmo2", "qwen3", "llama": the safetensors metadata `keel.naming` and, for the
// Hugging Face architectures, config.json's model_type.
const char* naming_id(ExportNaming n);
// "keel", "GPT-2", "OLMo 2", "Qwen3", "Llama": for messages.
const char* naming_title(ExportNaming n);

// How an exported tensor is made from a checkpoint parameter.
enum class ExportOp {
  kCopy,       // the stored elements in order, under `shape` (same count; may flatten)
  kRows,       // rows [row_begin, row_begin + shape[0]) of the source viewed as a matrix
               // [elements / shape[1], shape[1]]: the vocabulary rows (Note [export vocab rows]),
               // q, k or v out of the fused qkv weight, or k or v out of grouped-query
               // attention's kv weight
  kTranspose,  // the source as a matrix [rows, last dim] -> [last dim, rows] (keel's linear
               // weights are [out, in]; GPT-2's Conv1D weights are [in, out])
};

struct ExportTensor {
  std::string name;    // its name in the exported file
  Shape shape;         // its shape there
  std::string source;  // the checkpoint's parameter (kind PARAM) it is made from
  ExportOp op = ExportOp::kCopy;
  int64_t row_begin = 0;  // kRows only
};

// The values of a Hugging Face config.json that come from keel's model; the keys each
// architecture fixes are written by keel-ckpt (checkpoints/EXPORT.md lists them all).
struct HfConfig {
  int64_t vocab_size = 0;         // model.vocab_size (padding dropped)
  int64_t max_positions = 0;      // model.max_positions, or seq_len when 0
  int64_t hidden_size = 0;        // model.d_model
  int64_t num_layers = 0;         // model.n_layers
  int64_t num_heads = 0;          // model.n_heads
  int64_t num_kv_heads = 0;       // model.n_kv_heads, or n_heads when 0
  int64_t head_dim = 0;           // model.head_dim, or d_model / n_heads when 0
  int64_t intermediate_size = 0;  // model.d_ff (4 d_model when 0 in an unvalidated GELU config)
  std::string activation;         // GPT-2: "gelu_new" (tanh GELU); the others: "silu"
  float norm_eps = 0.0f;          // every norm's epsilon (kBlockNormEps)
  double rope_theta = 0.0;        // model.rope_theta (all but GPT-2)
  bool tie_word_embeddings = true;
  float initializer_range = 0.0f;  // model.init_std; initialisation only
};

struct ExportPlan {
  ExportNaming naming = ExportNaming::kKeel;
  // kKeel: for each of kHfArchitectures in order, why the model is not it (arch_mismatch).
  std::vector<std::pair<ExportNaming, std::string>> mismatches;
  std::vector<ExportTensor> tensors;  // Hugging Face names: wte first, then layer by layer;
                                      // keel names: the checkpoint's registration order
  HfConfig hf;                        // Hugging Face namings only
};

// Why `m` is not the Hugging Face architecture `arch` (not kKeel): every model field whose value
// `arch` cannot express ("model.qk_norm=RMS (GPT-2 has no QK-norm)"), joined by "; ", and every
// model field this exporter does not know (a field added to keel.proto since counts as a
// difference for every architecture until export.cc classifies it). Empty: `m` is `arch`.
// model.n_kv_heads = n_heads and model.head_dim = d_model / n_heads are compared as 0, their
// default: the same model, parameters and checkpoint.
std::string arch_mismatch(ExportNaming arch, const config::Model& m);

// The tensors to export from the checkpoint in `dir` with manifest `m`: the matching Hugging Face
// architecture's, else keel's. Throws kData naming the manifest and the tensor when the
// checkpoint's parameters do not match its own config (a missing parameter, a stray one, a shape
// other than the model's).
ExportPlan plan_export(const std::string& dir, const ckpt::Manifest& m);

// The values of `t` (row-major, t.shape), assembled from the checkpoint in `dir` and checked
// against the slices' checksums. Throws kData as read_logical_tensor.
std::vector<float> export_values(const std::string& dir, const ckpt::Manifest& m,
                                 const ExportTensor& t);

// ---- safetensors
// --------------------------------------------------------------------------------- The format
// (github.com/huggingface/safetensors, "Format"): a u64 little-endian N, then N bytes of JSON
// header, then the data. The header maps each tensor's name to {"dtype", "shape", "data_offsets":
// [begin, end)} (byte offsets into the data, back to back, no holes), plus an optional
// "__metadata__" object of string values; it begins with '{' and may be padded with spaces.

// The header (without the length N in front) for `plan`'s tensors, F32, back to back in plan
// order, and `metadata`, padded with spaces to a multiple of 8 bytes so the data is aligned.
// A byte sequence that is not UTF-8 in a name or metadata value (a checkpoint path on Linux may
// hold one) is written as U+FFFD: JSON holds text only. Throws kInternal for a plan that names a
// tensor twice or "__metadata__".
std::string encode_safetensors_header(const ExportPlan& plan,
                                      const std::map<std::string, std::string>& metadata);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...: the format's names of fixed-width types
  Shape shape;
  int64_t begin = 0, end = 0;  // byte offsets into the data
  bool operator==(const SafetensorsTensor&) const = default;
};

struct SafetensorsHeader {
  int64_t header_bytes = 0;  // N
  int64_t data_bytes = 0;    // the data's length: the last tensor's end
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensor> tensors;  // in data order
};

// The largest header accepted (the safetensors library's own limit): a header's length is read
// from the file, and is untrusted.
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Reads the header of the safetensors file `path` from its first bytes `head` (at least 8 + N of
// them; more are ignored). With `file_bytes`, the file's size must be 8 + N + the data's length.
// Throws kData naming `path` and the reason: a length past the file or the limit, a header that
// is not JSON, does not begin with '{' or is not an object, a name given twice, an unknown dtype
// or key, a shape that is not a list of non-negative integers, offsets whose length is not the
// shape's bytes, or tensors that overlap, leave holes or do not start at 0.
SafetensorsHeader decode_safetensors_header(std::string_view head,
                                            std::optional<int64_t> file_bytes,
                                            const std::string& path);

}  // namespace keel
