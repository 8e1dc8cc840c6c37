// Block/final norm wrapper over the grouped norm kernel (one group per token row).
#include "layers/norm.h"

namespace keel {

Norm::Norm(const std::string& prefix, ParamStore& ps, const LayerContext& ctx)
    : ps_(ps), ctx_(ctx) {
  const ModelDims& d = ctx.dims;
  w_ = ps.add({prefix + ".weight", {d.C}, -1, ParamInit::kConstant, 1.0f});
  if (d.norm == config::LAYERNORM) {
    // model.bias false: a LayerNorm with gain only (it still subtracts the mean).
    if (d.bias) b_ = ps.add({prefix + ".bias", {d.C}, -1, ParamInit::kConstant, 0.0f});
    op_ = kernels::NormOp::kLayer;
  } else {
    op_ = kernels::NormOp::kRms;
  }
}

void Norm::allocate(const LayerContext& ctx, const Norm* share) {
  if (share != nullptr) {
    mean_ = share->mean_;
    rstd_ = share->rstd_;
    return;
  }
  mean_ = ctx.zeros({ctx.dims.BT()});
  rstd_ = ctx.zeros({ctx.dims.BT()});
}

kernels::NormShape Norm::shape(int64_t B) const {
  const int64_t C = ctx_.dims.C;
  return kernels::NormShape{B * ctx_.dims.T, 1, C, C, C, C};
}

void Norm::forward(const float* x, kernels::ActOut y, int64_t B) {
  ProfileScope p(ctx_.profiler, "norm");
  ctx_.exec->norm_forward(op_, shape(B), y, x, ps_.param(w_), ps_.param_or_null(b_), mean_.f32(),
                          rstd_.f32(), kBlockNormEps);
}

void Norm::backward(const float* x, const float* dy, float* dx, bool accumulate, int64_t B) {
  ProfileScope p(ctx_.profiler, "norm");
  ctx_.exec->norm_backward(op_, shape(B), dx, accumulate, ps_.grad(w_), ps_.grad_or_null(b_), dy, x,
                           ps_.param(w_), mean_.f32(), rstd_.f32());
}

}  // namespace keel
