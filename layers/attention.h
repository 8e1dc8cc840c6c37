// Causal self-attention with QK-norm (NONE, RMS, LAYER, L2; scopes HEAD_SHARED, HEAD, PROJECTION).
// The QKV projection is column-parallel by whole heads: its logical weight is [3, H, D, C] sharded
// on H, so a rank holds q, k and v of heads [r H/tp, (r+1) H/tp) and runs QK-norm locally.
// The output projection [C, H D] is row-parallel (sharded on its input dimension).
// position == ROPE rotates q and k after QK-norm, per local head (whole heads: no communication).
//
// Note [gqa layouts]: with model.n_kv_heads = Hkv below H (grouped-query; 1: multi-query) the
// projection is two parameters, q.weight [H, D, C] sharded on H and kv.weight [2, Hkv, D, C]
// (k heads, then v heads); q_norm gains stay [H, D] and k_norm gains are [Hkv, D]. When tp divides
// Hkv, kv.weight shards on Hkv with the query heads: rank r holds groups [r Hkv/tp, (r+1) Hkv/tp)
// whole. When Hkv divides tp (tp > Hkv), every rank holds every k/v head (kv.weight, its bias and
// k_norm gains replicated) and projects them all, and its query heads, which lie in one group,
// read the one they use; a rank's backward reaches only that head, so those gradients are TP
// partial sums all-reduced over TP like a shared gain's (the ranks of other groups add zeros).
// Megatron instead keeps one copy per rank and reduces over the ranks sharing it: less memory and
// traffic, the same sums. The projection output (qkv_) is then q [BT, Hl D] followed by k, v
// [BT, 2 Hkvl D]. Hkv = H (or 0) keeps the single qkv.weight [3, H, D, C] and its row layout.
// bias == false drops qkv.bias, proj.bias and LAYER QK-norm's q_norm.bias / k_norm.bias.
#pragma once

#include <string>

#include "framework/kernels/norm.h"
#include "layers/context.h"
#include "layers/params.h"

namespace keel {

class Attention {
 public:
  Attention(const std::string& prefix, ParamStore& ps, const LayerContext& ctx);
  // share: another attention layer whose saved activations this one reuses (Note [recompute] in
  // layers/gpt.h).
  void allocate(const LayerContext& ctx, const Attention* share = nullptr);
  // y (=) from x (the block's normalised input): this rank's rows of the stream, [rows(B), C]
  // (all B T rows without sequence parallelism); the layer enters and leaves the TP region
  // itself (Note [tp regions] in parallel/tp_regions.h). *max_logit (=, memory of the execution
  // context's device) the largest |scaled logit| of this layer.
  // x: fp32, or bf16 under BF16 on a GPU (Note [act-dtype]); only the qkv projection reads it.
  // y: fp32, or bf16 with ModelDims::tp_bf16_act (the output projection writes it, the TP
  // all-reduce sums it in bf16).
  void forward(kernels::ActIn x, kernels::ActOut y, int64_t B, float* max_logit);
  // dx (=) from dy, rows as in forward; parameter gradients +=.
  void backward(kernels::ActIn x, const float* dy, float* dx, int64_t B);

 private:
  // Where q, k and v (or their gradients) lie in a buffer of qkv_'s layout for B sequences.
  struct QkvView {
    kernels::ActOut q, k, v;
    int64_t ldq, ldkv;
  };
  QkvView qkv_view(kernels::ActOut base, int64_t B) const;
  void qk_scales(float* out) const;  // [Hl] logit scale per local head
  // heads: Hl (q) or Hkvl (k); ld_in: the raw projection's row stride.
  kernels::NormShape qk_norm_shape(int64_t B, int64_t heads, int64_t ld_in) const;

  ParamStore& ps_;
  const LayerContext& ctx_;
  // Multi-head: qkv.weight/bias; grouped-query: q.weight/bias (qkv_w_, qkv_b_) and kv.weight/bias.
  // Biases are -1 when model.bias is false.
  int qkv_w_, qkv_b_ = -1, kv_w_ = -1, kv_b_ = -1, proj_w_, proj_b_ = -1;
  int q_norm_w_ = -1, q_norm_b_ = -1, k_norm_w_ = -1, k_norm_b_ = -1, qk_scale_ = -1;
  // activations
  // Projection output: q, k raw (rotated in place with ROPE and QK-norm NONE), v. Multi-head:
  // [BT, 3 Hl D] rows of q, k, v; grouped-query: [BT, Hl D] of q, then [BT, 2 Hkvl D] of k, v.
  Tensor qkv_;
  // QK-normalised (then rotated, ROPE) q [BT, Hl D], then k [BT, Hkvl D] (rows of the forward's
  // B T each); unused for NONE. bf16 under BF16 on a GPU (Note [act-dtype]).
  Tensor qk_;
  Tensor q_mean_, q_rstd_, k_mean_, k_rstd_;  // [BT * groups] (groups: heads, or 1)
  Tensor q_stats_, k_stats_;  // [BT, 2] PROJECTION scope: row statistics reduced over TP
  // What attention's backward reads: the CPU's probabilities [B, Hl, T, T], a fused GPU kernel's
  // log-sum-exp [B, Hl, T] (ExecContext::attention_saved_elems).
  Tensor saved_;
  Tensor att_;     // [BT, Hl D]
  Tensor scales_;  // [Hl]
};

}  // namespace keel
