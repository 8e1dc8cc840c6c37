// Block and final norms (LayerNorm with gain and, when model.bias, bias; or RMSNorm with gain),
// replicated under TP. Owns its saved statistics.
#pragma once

#include <string>

#include "framework/kernels/norm.h"
#include "layers/context.h"
#include "layers/params.h"

namespace keel {

// Epsilon of the block and final norms, added to the variance (LayerNorm) or the mean square
// (RMSNorm) inside the square root. keel-ckpt export writes it as GPT-2's layer_norm_epsilon.
inline constexpr float kBlockNormEps = 1e-5f;

class Norm {
 public:
  Norm(const std::string& prefix, ParamStore& ps, const LayerContext& ctx);
  // share: another norm whose saved statistics this one reuses (Note [recompute] in layers/gpt.h).
  void allocate(const LayerContext& ctx, const Norm* share = nullptr);
  // y[BT, C] (=): fp32, or bf16 under BF16 on a GPU when only matrix products read it
  // (Note [act-dtype]).
  void forward(const float* x, kernels::ActOut y, int64_t B);
  // dx[BT, C] += norm backward of dy (the residual stream's gradient accumulates).
  void backward(const float* x, const float* dy, float* dx, bool accumulate, int64_t B);

 private:
  kernels::NormShape shape(int64_t B) const;
  ParamStore& ps_;
  const LayerContext& ctx_;
  int w_, b_ = -1;  // b_: LayerNorm with model.bias only
  kernels::NormOp op_;
  Tensor mean_, rstd_;
};

}  // namespace keel
