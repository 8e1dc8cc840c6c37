// What `keel-ckpt export` writes: every parameter of a checkpoint as one whole f32 tensor, under
// keel's own names and layouts, or, when the model is GPT-2-shaped, under Hugging Face GPT-2's
// names and layouts so that transformers' GPT2LMHeadModel computes the same logits (see
// checkpoints/EXPORT.md). This file decides names, shapes and values; the command serialises
// them (safetensors, config.json) in launch/keel_ckpt_main.cc.
//
// Note [export vocab rows]: the token embedding (and an untied LM head) is stored with the
// vocabulary padded to Vp rows for the TP layout that wrote it (Note [vocab padding] in
// layers/gpt.cc). Rows >= model.vocab_size are never looked up (tokens < vocab_size) and never
// predicted (their logits are left out of the loss), so they are not vocabulary: export keeps the
// first vocab_size rows only, and the result does not depend on the writer's TP size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoints/manifest.pb.h"
#include "framework/config/keel.pb.h"
#include "framework/tensor.h"

namespace keel {

enum class ExportNaming {
  kKeel,  // keel's logical names and layouts (layers/*.cc); any model
  kGpt2,  // Hugging Face GPT2LMHeadModel's names and layouts; GPT-2-shaped models only
};

// How an exported tensor is made from a checkpoint parameter.
enum class ExportOp {
  kCopy,       // the stored elements in order, under `shape` (same count; may flatten)
  kVocabRows,  // the first shape[0] rows (Note [export vocab rows])
  kTranspose,  // the source as a matrix [rows, last dim] -> [last dim, rows] (keel's linear
               // weights are [out, in]; GPT-2's Conv1D weights are [in, out])
};

struct ExportTensor {
  std::string name;    // its name in the exported file
  Shape shape;         // its shape there
  std::string source;  // the checkpoint's parameter (kind PARAM) it is made from
  ExportOp op = ExportOp::kCopy;
};

// The fields of Hugging Face's GPT2Config that keel's model sets; everything else GPT2LMHeadModel
// needs is fixed (see checkpoints/EXPORT.md).
struct Gpt2Config {
  int64_t vocab_size = 0;   // model.vocab_size (padding dropped)
  int64_t n_positions = 0;  // model.max_positions, or seq_len when 0
  int64_t n_embd = 0;
  int64_t n_layer = 0;
  int64_t n_head = 0;
  int64_t n_inner = 0;              // model.d_ff, or 4 d_model when 0
  std::string activation_function;  // keel's GELU is the tanh form: "gelu_new"
  float layer_norm_epsilon = 0.0f;  // keel's block and final norms' epsilon
};

struct ExportPlan {
  ExportNaming naming = ExportNaming::kKeel;
  // kKeel: why the model is not GPT-2-shaped, naming each model field that keeps it so
  // ("model.qk_norm=RMS (GPT-2 has no QK-norm); ...").
  std::string not_gpt2;
  std::vector<ExportTensor> tensors;  // in the checkpoint's registration order
  Gpt2Config gpt2;                    // kGpt2 only
};

// Why `m` is not GPT-2-shaped: every model field whose value GPT-2 cannot express, joined by
// "; ", and every model field this exporter does not know (a field added to keel.proto since
// counts as a difference until it is classified here). Empty: GPT-2-shaped.
std::string gpt2_mismatch(const config::Model& m);

// The tensors to export from the checkpoint in `dir` with manifest `m`. Throws kData naming the
// manifest and the tensor when the checkpoint's parameters do not match its own config (a missing
// parameter, a stray one, a shape other than the model's).
ExportPlan plan_export(const std::string& dir, const ckpt::Manifest& m);

// The values of `t` (row-major, t.shape), assembled from the checkpoint in `dir` and checked
// against the slices' checksums. Throws kData as read_logical_tensor.
std::vector<float> export_values(const std::string& dir, const ckpt::Manifest& m,
                                 const ExportTensor& t);

}  // namespace keel
