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
  mean_ = ctx.zeros({ctx.dims.rows(ctx.dims.B)});
  rstd_ = ctx.zeros({ctx.dims.rows(ctx.dims.B)});
}

kernels::NormShape Norm::shape(int64_t B) const {
  const int64_t C = ctx_.dims.C;
  return kernels::NormShape{ctx_.dims.rows(B), 1, C, C, C, C};
}

void Norm::forward(const float* x, kernels::ActOut y, int64_t B) {
  ProfileScope p(ctx_.profiler, "norm");
  ctx_.exec->norm_forward(op_, shape(B), y, x, ps_.param(w_), ps_.param_or_null(b_), mean_.f32(),
                          rstd_.f32(), kBlockNormEps);
}

void Norm::backward(const float* x, const float* dy, float* dx, bool accumulate, int64_t B) {
  const ModelDims& d = ctx_.dims;
  if (!d.sp) {
    ProfileScope p(ctx_.profiler, "norm");
    ctx_.exec->norm_backward(op_, shape(B), dx, accumulate, ps_.grad(w_), ps_.grad_or_null(b_), dy,
                             x, ps_.param(w_), mean_.f32(), rstd_.f32());
    return;
  }
  // Note [sequence parallel]: this rank's rows give partial weight (and bias) gradients. They are
  // summed over TP apart from the accumulated gradients (which hold earlier micro-batches' sums),
  // then added to them, so every TP rank holds the same gradient, as without SP.
  Tensor& part = ctx_.scratch->sp_norm;
  float* dw = part.f32();
  float* db = b_ >= 0 ? dw + d.C : nullptr;
  {
    ProfileScope p(ctx_.profiler, "norm");
    part.zero_();
    ctx_.exec->norm_backward(op_, shape(B), dx, accumulate, dw, db, dy, x, ps_.param(w_),
                             mean_.f32(), rstd_.f32());
  }
  {
    ProfileScope p(ctx_.profiler, "tp.all_reduce");
    ctx_.topo->tp_tensors().all_reduce(dw, db != nullptr ? 2 * d.C : d.C, ReduceOp::kSum);
  }
  ctx_.exec->add_inplace(ps_.grad(w_), dw, d.C);
  if (db != nullptr) ctx_.exec->add_inplace(ps_.grad(b_), db, d.C);
}

}  // namespace keel
