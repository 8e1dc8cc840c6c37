// Causal self-attention with QK-norm (NONE, RMS, LAYER, L2; scopes HEAD_SHARED, HEAD, PROJECTION).
// The QKV projection is column-parallel by whole heads: its logical weight is [3, H, D, C] sharded
// on H, so a rank holds q, k and v of heads [r H/tp, (r+1) H/tp) and runs QK-norm locally.
// The output projection [C, H D] is row-parallel (sharded on its input dimension).
// position == ROPE rotates q and k after QK-norm, per local head (whole heads: no communication).
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
  void qk_scales(float* out) const;  // [Hl] logit scale per local head
  kernels::NormShape qk_norm_shape(int64_t B) const;

  ParamStore& ps_;
  const LayerContext& ctx_;
  int qkv_w_, qkv_b_ = -1, proj_w_, proj_b_ = -1;  // biases: -1 when model.bias is false
  int q_norm_w_ = -1, q_norm_b_ = -1, k_norm_w_ = -1, k_norm_b_ = -1, qk_scale_ = -1;
  // activations
  // [BT, 3 Hl D] projection output: q, k raw (rotated in place with ROPE and QK-norm NONE), v
  Tensor qkv_;
  // [2, BT, Hl D] QK-normalised (then rotated, ROPE) q, then k (rows of the forward's B T each);
  // unused for NONE. bf16 under BF16 on a GPU (Note [act-dtype]).
  Tensor qk_;
  Tensor q_mean_, q_rstd_, k_mean_, k_rstd_;  // [BT * groups]
  Tensor q_stats_, k_stats_;  // [BT, 2] PROJECTION scope: row statistics reduced over TP
  // What attention's backward reads: the CPU's probabilities [B, Hl, T, T], a fused GPU kernel's
  // log-sum-exp [B, Hl, T] (ExecContext::attention_saved_elems).
  Tensor saved_;
  Tensor att_;     // [BT, Hl D]
  Tensor scales_;  // [Hl]
};

}  // namespace keel
