// MLP forward/backward, GELU or gated (SwiGLU, GEGLU).
#include "layers/mlp.h"

#include <cmath>

namespace keel {

Mlp::Mlp(const std::string& prefix, ParamStore& ps, const LayerContext& ctx) : ps_(ps), ctx_(ctx) {
  const ModelDims& d = ctx.dims;
  gated_ = d.gated_mlp();
  if (d.mlp == config::GEGLU) act_ = kernels::GluAct::kGelu;
  const float resid_std = d.init_std / std::sqrt(2.0f * static_cast<float>(d.L));
  fc_w_ = ps.add({prefix + ".fc.weight", {d.F, d.C}, 0, ParamInit::kNormal, d.init_std, true});
  if (d.bias) fc_b_ = ps.add({prefix + ".fc.bias", {d.F}, 0, ParamInit::kConstant, 0.0f});
  if (gated_) {
    gate_w_ =
        ps.add({prefix + ".gate.weight", {d.F, d.C}, 0, ParamInit::kNormal, d.init_std, true});
    if (d.bias) gate_b_ = ps.add({prefix + ".gate.bias", {d.F}, 0, ParamInit::kConstant, 0.0f});
  }
  proj_w_ = ps.add({prefix + ".proj.weight", {d.C, d.F}, 1, ParamInit::kNormal, resid_std, true});
  if (d.bias) proj_b_ = ps.add({prefix + ".proj.bias", {d.C}, -1, ParamInit::kConstant, 0.0f});
}

void Mlp::allocate(const LayerContext& ctx, const Mlp* share) {
  if (share != nullptr) {
    h_ = share->h_;
    a_ = share->a_;
    g_ = share->g_;
    return;
  }
  // Note [act-dtype]: GELU's pre-activation (the up projection's output), which only GELU's
  // forward and backward read, in bf16 under BF16; the gated units' stay fp32.
  h_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl}, gated_ ? DType::kF32 : ctx.exec->act_dtype());
  if (gated_) a_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl});
  // Note [act-dtype]: only the down projection reads the activated hidden.
  g_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl}, ctx.exec->act_dtype());
}

void Mlp::forward(kernels::ActIn x_rows, kernels::ActOut y, int64_t B) {
  const ModelDims& d = ctx_.dims;
  const int64_t BT = B * d.T, n = d.rows(B) * d.C;
  Profiler* prof = ctx_.profiler;
  // Note [tp regions]: the column-parallel up (and gate) projections enter the region, the
  // row-parallel down projection leaves it.
  const TpRegion region = ctx_.region();
  const kernels::ActIn x = region.enter(x_rows, ctx_.scratch->sp_x.f32(), n);
  {
    ProfileScope p(prof, "matmul.mlp_fc");
    ctx_.exec->linear_forward(kernels::act(h_), x, ps_.param(fc_w_), ps_.param_or_null(fc_b_), BT,
                              d.C, d.Fl);
    if (gated_) {
      ctx_.exec->linear_forward(a_.f32(), x, ps_.param(gate_w_), ps_.param_or_null(gate_b_), BT,
                                d.C, d.Fl);
    }
  }
  if (gated_) {
    ProfileScope p(prof, "glu");
    ctx_.exec->glu_forward(act_, kernels::act(g_), a_.f32(), h_.f32(), BT * d.Fl);
  } else {
    ProfileScope p(prof, "gelu");
    ctx_.exec->gelu_forward(kernels::act(g_), kernels::act(h_), BT * d.Fl);
  }
  const kernels::ActOut part = region.partial(y, ctx_.scratch->sp_part.f32());
  {
    ProfileScope p(prof, "matmul.mlp_proj");
    // Row-parallel: partial sums over this rank's d_ff columns; the bias is added once.
    const float* bias = d.tp_rank == 0 ? ps_.param_or_null(proj_b_) : nullptr;
    ctx_.exec->linear_forward(part, kernels::act(g_), ps_.param(proj_w_), bias, BT, d.Fl, d.C);
  }
  region.exit(part, y, n);
}

void Mlp::backward(kernels::ActIn x_rows, const float* dy_rows, float* dx, int64_t B) {
  const ModelDims& d = ctx_.dims;
  const int64_t BT = B * d.T, n = d.rows(B) * d.C;
  Scratch& sc = *ctx_.scratch;
  // Note [act-dtype]: the activated hidden's gradient, in bf16 under BF16 for GELU (which reads it
  // with the bf16 pre-activation), fp32 for the gated units.
  const kernels::ActOut dh = kernels::act(sc.dh);
  Profiler* prof = ctx_.profiler;
  // Note [tp regions]: the output gradient and (under SP, gathered again rather than kept) the
  // input on every row.
  const TpRegion region = ctx_.region();
  const float* dy = region.exit_backward(dy_rows, sc.sp_dy.f32(), n);
  const kernels::ActIn x = region.enter(x_rows, sc.sp_x.f32(), n);
  {
    ProfileScope p(prof, "matmul.mlp_proj");
    ctx_.exec->linear_backward(dh, false, ps_.grad(proj_w_), ps_.grad_or_null(proj_b_), dy,
                               kernels::act(g_), ps_.param(proj_w_), BT, d.Fl, d.C);
  }
  // Note [act-dtype]: the hidden gradients, which only the up (and gate) projections' backward
  // reads, go where the activated hidden was (nothing reads g_ after the down projection's
  // backward) and into the gate's scratch; the projections' bias gradients are summed in fp32.
  const kernels::ActOut dup = kernels::act(g_);
  const kernels::ActOut dgate = gated_ ? kernels::act(sc.dgate) : kernels::ActOut(nullptr);
  if (gated_) {
    ProfileScope p(prof, "glu");
    ctx_.exec->glu_backward(act_, dgate, dup, ps_.grad_or_null(gate_b_), ps_.grad_or_null(fc_b_),
                            sc.dh.f32(), a_.f32(), h_.f32(), BT, d.Fl);
  } else {
    ProfileScope p(prof, "gelu");
    ctx_.exec->gelu_backward(dup, ps_.grad_or_null(fc_b_), kernels::act(h_), dh, BT, d.Fl);
  }
  // Column-parallel input: each rank's dx is a partial sum. On the bf16 TP wire the up projection
  // writes it in bf16 for the all-reduce, then widened into dx (Note [bf16 wire]); a gated MLP's
  // two projections accumulate it in fp32.
  const bool bf16_dx = d.tp_bf16_act && !gated_;
  const kernels::ActOut dxo =
      region.partial(bf16_dx ? kernels::act(sc.tp_bf16) : kernels::ActOut(dx), sc.sp_part.f32());
  {
    ProfileScope p(prof, "matmul.mlp_fc");
    ctx_.exec->linear_backward(dxo, false, ps_.grad(fc_w_), nullptr, dup, x, ps_.param(fc_w_), BT,
                               d.C, d.Fl);
    if (gated_) {
      // Both projections read x: their input gradients add up before the one sum over TP.
      ctx_.exec->linear_backward(dxo, true, ps_.grad(gate_w_), nullptr, dgate, x,
                                 ps_.param(gate_w_), BT, d.C, d.Fl);
    }
  }
  region.enter_backward(dxo, dx, n);
}

}  // namespace keel
